"""The files a training run writes besides its checkpoints, metrics and report: ``config.yaml``, the tokenizer's
copy, and at the end the model in the Hugging Face format (``runs/<id>/model/``: train/models/export.py)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch

from train.config import dump_config
from train.data import DataBundle
from train.errors import UserError, atomic_write_text
from train.parallel.process_group import DistContext
from train.resolve import Resolved


def say_data(bundle: DataBundle, data_s: float, say: Callable[..., None]) -> None:
    """The data line of a run's console (``data_s``: seconds spent preparing it), and a causal LM's pad = EOS line."""
    b, classes = bundle, "" if bundle.task == "causal-lm" else f"{bundle.num_classes} classes, "
    say(f"data: {b.corpus.name}, {len(b.splits['train'])} train / {len(b.splits['validation'])} val / "
        f"{len(b.splits['test'])} test, {classes}vocab {b.vocab_size} "
        f"(tokenizer {b.tokenizer_info['source']}, prepared data {b.cache.get('cache', 'off')}), {data_s:.1f}s",
        flush=True)
    roles = b.tokenizer_info.get("roles") or {}
    if roles.get("pad_is_eos"):  # in report.json's data.tokenizer.roles too, but padding with EOS is worth seeing
        say(f"tokenizer: pad = EOS (id {roles['eos_id']}): the tokenizer has no pad token of its own "
            f"({roles.get('read_from') or 'its roles'}); padded positions are masked out of attention and loss, each "
            "sample's own EOS is still trained", flush=True)


def write_run_files(resolved: Resolved, run_dir: Path, ctx: DistContext) -> None:
    """``config.yaml`` (the resolved config; ``--resume`` replays it) and the run's tokenizer copy (what ``--resume``
    needs if caches are cleared; ``data.tokenizer.run_copy`` names it): before a fresh run's first step, after a
    resumed run's."""
    if not ctx.is_main:
        return
    atomic_write_text(run_dir / "config.yaml", dump_config(resolved.cfg))
    info = resolved.bundle.tokenizer_info
    src = Path(info.get("path") or "")
    if src.is_file():
        atomic_write_text(run_dir / "tokenizer.json", src.read_text(encoding="utf-8"))
        info["run_copy"] = str(run_dir / "tokenizer.json")


def export_at_end(model: torch.nn.Module, run_dir: Path, bundle: Any, say: Callable[..., None],
                  report: Optional[dict] = None) -> Optional[dict]:
    """``runs/<id>/model/`` for a model from transformers (rank 0, after the final checkpoint of a completed run):
    report.json's ``export`` block, or None for the built-in encoder and ``python:`` models (nothing in the
    ecosystem's format to write) and for an interrupted run. An adapter run exports from its final checkpoint
    (train/run/export.py): the base is rebuilt in fp32 as its fingerprint names it, not taken from the live
    model, whose frozen base a bf16 run holds rounded to bf16; so does an FSDP2-sharded run (its rank 0 holds shards
    only). A failed export is one line on stderr and ``{"error": …}``: the trained state is in checkpoint.pt, and
    ``python -m train export`` can write it again. ``report``: the run's report.json (not yet on disk), for the
    model card; a report of an interrupted run exports nothing."""
    if getattr(model, "kind", None) != "hf" or (report or {}).get("status") == "interrupted":
        return None
    from train.models.adapter import has_adapter
    from train.models.export import export_model, special_tokens
    from train.parallel.fsdp import is_sharded
    from train.run.export import export_run

    try:
        block = export_run(str(run_dir), report=report) if has_adapter(model) or is_sharded(model) else \
            export_model(model, run_dir / "model", run_dir / "tokenizer.json", special_tokens(bundle), report=report)
    except Exception as exc:  # noqa: BLE001 - the run is trained and checkpointed: its report must still be written
        why = str(exc) if isinstance(exc, (UserError, OSError)) else f"{type(exc).__name__}: {exc}"
        print(f"warning: the model was not exported ({why.splitlines()[0] if why else type(exc).__name__}); python -m "
              f"train export {run_dir} writes it from checkpoint.pt", file=sys.stderr, flush=True)
        return {"error": why}
    say(f"model: {block['path']} ({block['format']}: {', '.join(block['files'][:4])}"
        f"{', …' if len(block['files']) > 4 else ''})", flush=True)
    return block
