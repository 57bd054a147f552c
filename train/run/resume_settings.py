"""What a ``--resume`` may change: the checkpoint's resolved config against the requested one — settings baked into
the checkpoint refused in one line, the others applied and listed (train/resume.py holds the checkpoint itself)."""

from __future__ import annotations

from typing import Any, Optional

from train.errors import UserError

FIXED_SECTIONS = ("data", "batching", "model", "optim")
"""Sections whose settings are baked into the checkpoint (data order, model shape, optimizer/scheduler state)."""
MAY_CHANGE = {"data.cache_dir", "data.cache_prepared", "data.num_workers", "data.max_eval_samples", "optim.fused",
              "optim.clip_norm"}
"""Keys of those sections that a resume applies (where the data is cached and read, the evaluation bound, AdamW's
kernel, and ``clip_norm``, an alias of ``clip.max_norm``)."""
CHECKED_BY_CONTENT = {"data.source", "data.wordnet_dir", "data.tokenizer_path", "data.max_len", "train.precision"}
"""Keys checked by what they produce, not their text (data and tokenizer fingerprints, the model's position table,
the checkpoint's precision): a moved file with the same content resumes."""
MOVED_FILES = {"data.source": "the same data", "data.wordnet_dir": "the same data",
               "data.tokenizer_path": "the same tokenizer"}
"""Of those, the files: another path to the same content is applied and listed with what was checked."""
FIXED_KEYS = {"train.seed", "train.grad_accum"}  # grad_accum: the global batch of every later step
NOT_SETTINGS = {"train.run_id", "train.output_dir", "train.overwrite", "train.resume_apply"}
APPLICABLE = ("optim.lr",)
"""Fixed keys that ``train.resume_apply`` applies for real (:func:`apply_lr`)."""


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and not prefix:
            out.update(_flat(v, f"{k}."))
        else:
            out[f"{prefix}{k}"] = list(v) if isinstance(v, tuple) else v
    return out


def resume_changes(saved: dict, cfg, where: str) -> list[str]:
    """Compare the checkpoint's resolved config (``saved``, ``RunConfig.to_dict()``) with the run's (``cfg``): returns
    the changes that apply, ``"key old → new"`` each (a key the checkpoint does not have is not compared; a moved file,
    :data:`MOVED_FILES`, with what its content must match).

    Raises:
        UserError: a setting that cannot change mid-run differs (data, model, tokenizer, batching, the optimizer's
            hyper-parameters, ``train.seed``), one line listing each key with both values, unless it is in
            ``train.resume_apply`` (:data:`APPLICABLE`).
    """
    old, new = _flat(saved or {}), _flat(cfg.to_dict())
    apply = cfg.train.resume_apply
    refused, applied = [], []
    for key in sorted(old.keys() & new.keys()):
        if old[key] == new[key] or key in NOT_SETTINGS:
            continue
        change = f"{key} {old[key]!r} → {new[key]!r}"
        if key in CHECKED_BY_CONTENT:  # another content is refused after this, by the fingerprints
            applied += [f"{change} ({MOVED_FILES[key]})"] if key in MOVED_FILES else []
            continue
        fixed = key in FIXED_KEYS or (key.split(".")[0] in FIXED_SECTIONS and key not in MAY_CHANGE)
        if fixed and key != apply:
            refused.append(change)
        else:
            applied.append(change + (" (written into the optimizer and scheduler)" if key == apply else
                                     " (the learning rate follows the schedule of the new length from this step)"
                                     if key in ("train.max_steps", "train.epochs") else ""))
    if refused:
        how = "".join(f" (or train.resume_apply={k} to apply it)" for k in APPLICABLE
                      if any(c.startswith(k + " ") for c in refused))
        raise UserError(f"{where}: these settings cannot change mid-run (checkpoint → requested): "
                        f"{', '.join(refused)}; resume with the checkpoint's values{how}, or start a new run")
    return applied


def follow_schedule(trainer, saved_total: Optional[int], lr: Optional[float]) -> None:
    """After ``trainer.load_state_dict``: ``lr`` given (``train.resume_apply=optim.lr``), the new peak learning rate
    (:func:`apply_lr`); else, where the run's length changed (``train.max_steps``: ``saved_total`` → the trainer's
    ``total_steps``), the learning rate of this step on the new schedule, so the next step trains at it — the
    checkpoint's optimizer holds the old schedule's (0 at its end)."""
    if lr is not None:
        apply_lr(trainer, lr)
    elif saved_total is not None and saved_total != trainer.total_steps:
        apply_lr(trainer, trainer.scheduler.base_lrs[0])


def apply_lr(trainer, lr: float) -> None:
    """Make ``lr`` (the peak learning rate) the run's own after ``trainer.load_state_dict``: every param group's
    ``initial_lr`` and current ``lr`` (``lr`` × the schedule's factor at this step) and the scheduler's ``base_lrs``."""
    sched = trainer.scheduler
    for i, group in enumerate(trainer.optimizer.param_groups):
        group["initial_lr"] = lr
        group["lr"] = lr * sched.lr_lambdas[i](sched.last_epoch)
    sched.base_lrs = [lr] * len(trainer.optimizer.param_groups)
    sched._last_lr = [g["lr"] for g in trainer.optimizer.param_groups]
