"""``python -m train export RUN_DIR [--checkpoint FILE] [--merged] [--out DIR]``: a run directory's model (its final
``checkpoint.pt``, or any middle checkpoint) written in the Hugging Face format (train/models/export.py)."""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any, Optional

from train.errors import UserError
from train.models.export import check_target, export_model, model_from_checkpoint
from train.parallel.sharded_checkpoint import is_sharded_checkpoint, load_any
from train.resume import FINAL, list_checkpoints


def export_run(run_dir: str, checkpoint: Optional[str] = None, merged: bool = False,
               out: Optional[str] = None, dtype: Optional[str] = None, report: Optional[dict] = None) -> dict[str, Any]:
    """Export ``run_dir``'s model to ``out`` (default ``<run_dir>/model``; ``<run_dir>/model-merged`` with
    ``merged``) in ``dtype`` (``fp32`` | ``bf16`` | ``fp16``; None: the base's own). ``report``: the run's
    report.json for the model card (None: read from ``run_dir``). Returns the export block
    (train.models.export.export_model).

    Raises:
        UserError: no such directory, no complete checkpoint (the final one missing and none given: the periodic
            ones are listed), a checkpoint that is not a Hugging Face model's, ``merged`` without an adapter.
    """
    d = Path(run_dir)
    if not d.is_dir():
        raise UserError(f"export: {d} is not a run directory (runs/<id>/ written by python -m train train)")
    path = Path(checkpoint) if checkpoint else d / FINAL
    have = [str(p) for p in ([d / FINAL] if (d / FINAL).is_file() else []) + list_checkpoints(d)[::-1]]
    sharded = is_sharded_checkpoint(path)
    if checkpoint and not (path.is_file() or sharded):
        what = "is a directory, not a checkpoint (a sharded one holds trainer.pt and .metadata)" if path.is_dir() else \
            "does not exist"
        hint = f"this run's checkpoints: {', '.join(have[:3])}" if have else f"{d} has no checkpoint yet"
        raise UserError(f"export: --checkpoint {path} {what}; {hint}")
    if not (path.is_file() or sharded):
        hint = f"pass --checkpoint with one of {', '.join(have[:3])}" if have else \
            "the run has no checkpoint yet: let it finish, or resume it (python -m train train --resume " + str(d) + ")"
        raise UserError(f"export: {path} does not exist (no complete checkpoint); {hint}")
    if not sharded and not zipfile.is_zipfile(path):
        raise UserError(f"export: {path} is not a checkpoint (not a file written by torch.save); use the run's "
                        "checkpoint.pt, checkpoints/step-*.pt or (dist.strategy=fsdp) checkpoints/step-*.dcp")
    tokenizer = d / "tokenizer.json"
    if not tokenizer.is_file():
        raise UserError(f"export: {tokenizer} is missing (every run writes its tokenizer there): the exported model "
                        "would have no tokenizer; copy the run's tokenizer back (data.tokenizer.run_copy in "
                        "report.json names it) and export again")
    target = Path(out) if out else d / ("model-merged" if merged else "model")
    check_target(target)  # before anything is loaded: a refusal costs nothing
    state = load_any(path)
    if not isinstance(state, dict) or "spec" not in state or "model" not in state:
        raise UserError(f"export: {path} is not a complete checkpoint of this project (no model or spec); use the "
                        "run's checkpoint.pt or checkpoints/step-*.pt")
    model = model_from_checkpoint(state, f"export: {path}")
    if merged and getattr(model, "peft_model", None) is None:
        raise UserError(f"export --merged: {path} is a full fine-tuning run (no model.adapter): there is nothing to "
                        "merge; run without --merged")
    ids = state.get("special_tokens") or _ids_from_config(model)
    if report is None and (d / "report.json").is_file():
        import json

        report = json.loads((d / "report.json").read_text(encoding="utf-8"))
    return export_model(model, target, tokenizer, ids, merged=merged, dtype=dtype, report=report)


def _ids_from_config(model: Any) -> dict[str, Optional[int]]:
    """A checkpoint without ``special_tokens`` (written before they were recorded): the ids in the model's config."""
    c = model.inner.config
    return {k: getattr(c, k.replace("_id", "_token_id"), None) for k in ("bos_id", "eos_id", "pad_id")}
