"""Fault tolerance: periodic full-state checkpoints, exact resume, and the loop's per-step hook.

A checkpoint (``runs/<id>/checkpoints/step-00000120.pt``, the last ``train.keep_checkpoints`` kept; the final one
is ``runs/<id>/checkpoint.pt``) holds state_dicts, tensors and plain values only (``weights_only=True`` reads it):

* ``model`` (an adapter run: the adapter alone, its base named by ``spec.base_fingerprint``), ``optimizer``,
  ``scheduler``, ``grad_scaler`` (None without fp16), ``step``, ``epoch``, ``batches_in_epoch`` (the sampler
  position), ``evals``, ``final_train_loss``, ``total_steps``;
* ``ranks[r]``: rank r's RNG states (Python, NumPy, torch CPU, CUDA), its open logging window and counters;
* ``world_size``, ``spec``, ``label_names``, ``data_fingerprint``, ``tokenizer_fingerprint``, ``precision`` (the
  resolved mode, its reason and source), ``config``, ``format``, ``special_tokens`` (the BOS / EOS / pad ids, for
  ``python -m train export``): what the resume checks against (a resumed run continues in the checkpoint's
  precision, with the checkpoint's tokenizer).

Resuming restores all of it and the RNG states last, right before the next step, so on CPU a
resumed run's parameters and losses equal an uninterrupted run's bit for bit (tested).
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

import torch
import yaml

from train.callbacks import Callback
from train.checkpoint import load_checkpoint, rng_state, save_checkpoint, set_rng_state
from train.errors import UserError, atomic_temps, atomic_write_text, describe_temps
from train.models.adapter import has_adapter, model_state
from train.models.export import special_tokens
from train.parallel.fsdp import is_sharded
from train.parallel.process_group import DistContext, agreed, any_rank, gather_to_main
from train.parallel.sharded_checkpoint import SUFFIX, is_sharded_checkpoint, read_meta, save_sharded

FORMAT = 1
CHECKPOINT_DIR = "checkpoints"


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINT_DIR / f"step-{step:08d}.pt"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Periodic checkpoints of ``run_dir``, oldest first: ``step-*.pt`` files and (``dist.strategy=fsdp``) complete
    ``step-*.dcp`` directories; temporary files and directories of an interrupted write are ignored."""
    d = run_dir / CHECKPOINT_DIR
    if not d.is_dir():
        return []
    found = [*d.glob("step-*.pt"), *filter(is_sharded_checkpoint, d.glob(f"step-*{SUFFIX}"))]
    return sorted(found, key=lambda p: int(p.stem.split("-")[1]))


def prune_checkpoints(run_dir: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` periodic checkpoints, and temporary files left by a killed write."""
    for old in [*list_checkpoints(run_dir)[:-keep], *(run_dir / CHECKPOINT_DIR).glob(".step-*.tmp")]:
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


def full_state(trainer, model: torch.nn.Module, bundle, cfg, ctx: DistContext,
               tensors: bool = True) -> Optional[dict[str, Any]]:
    """Everything needed to continue (a collective: every rank calls it); the dict on rank 0, else None.
    ``tensors=False``: without ``model`` and ``optimizer`` (a sharded checkpoint writes those itself)."""
    ranks = gather_to_main({"rng": rng_state(), **trainer.rank_state_dict()}, ctx)
    shared = trainer.state_dict(whole_optimizer=tensors)
    weights = {"model": model_state(model)} if tensors else {}  # FSDP2 gathers shards: on every rank
    if not ctx.is_main:
        return None
    return {"format": FORMAT, **shared, **weights, "ranks": ranks,
            "world_size": ctx.world_size, "spec": asdict(model.spec), "label_names": list(bundle.corpus.label_names),
            "data_fingerprint": bundle.data_fingerprint, "tokenizer_fingerprint": bundle.tokenizer_info["fingerprint"],
            "precision": trainer.policy.state(), "config": cfg.to_dict(), "torch": str(torch.__version__),
            "special_tokens": special_tokens(bundle)}


def write_state(path: Path, state: Optional[dict], ctx: DistContext, keep: Optional[int] = None) -> None:
    """Rank 0 writes ``state`` atomically (and prunes to ``keep``); a write error stops every rank with one message."""

    def write() -> None:
        if ctx.is_main:
            save_checkpoint(path, state)
            if keep is not None:
                prune_checkpoints(path.parent.parent, keep)

    agreed(write, ctx)


class Checkpointer(Callback):
    """A loop callback (``on_step_end``): periodic checkpoints, and a checkpoint then stop after a signal
    (``shutdown``: the run's :class:`~train.shutdown.ShutdownRequest`).

    Under DDP the stop flag is OR-ed over ranks every step (one tiny CPU all-reduce), so all ranks
    stop after the same step even when the signal reaches them at different moments.
    """

    def __init__(self, run_dir: Path, cfg, trainer, model: torch.nn.Module, bundle, ctx: DistContext,
                 shutdown=None) -> None:
        self.run_dir, self.cfg, self.trainer, self.model, self.bundle, self.ctx = (
            run_dir, cfg, trainer, model, bundle, ctx)
        self.shutdown = shutdown
        self.last_path: Optional[Path] = None

    def on_step_end(self, step: int, step_ms: float) -> bool:
        stop = any_rank(self.shutdown is not None and self.shutdown.requested, self.ctx)
        if step >= self.trainer.total_steps:
            return False  # the last step: finish normally (final checkpoint and report)
        every = self.cfg.train.checkpoint_every
        if stop or (every and step % every == 0):
            self.save(step)
        return stop

    def save(self, step: int) -> Path:
        path = checkpoint_path(self.run_dir, step)
        if writes_sharded(self.model):  # each rank writes its shards (train/parallel/sharded_checkpoint.py)
            path = path.with_suffix(SUFFIX)
            meta = full_state(self.trainer, self.model, self.bundle, self.cfg, self.ctx, tensors=False)
            save_sharded(path, self.model, self.trainer.optimizer, meta, self.ctx)
            agreed(lambda: prune_checkpoints(self.run_dir, self.cfg.train.keep_checkpoints) if self.ctx.is_main
                   else None, self.ctx)
        else:
            state = full_state(self.trainer, self.model, self.bundle, self.cfg, self.ctx)
            write_state(path, state, self.ctx, keep=self.cfg.train.keep_checkpoints)
        self.last_path = path
        return path


def writes_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model``'s periodic checkpoints are sharded (DCP): its parameters are FSDP2 shards and it is not an
    adapter run (an adapter is small: gathered into one file, as its frozen base is rebuilt from its source)."""
    return is_sharded(model) and not has_adapter(model)


FINAL = "checkpoint.pt"


def resume_candidates(run_dir: Path) -> list[Path]:
    """``run_dir``'s checkpoints a resume may start from, newest first: the periodic ones and the final
    ``checkpoint.pt`` (a finished run's last state), ordered by modification time (``checkpoint.pt`` first on a tie;
    a run resumed with a higher ``train.max_steps`` writes periodic checkpoints after it)."""
    found = list_checkpoints(run_dir)
    final = run_dir / FINAL
    if final.is_file() and (not found or final.stat().st_mtime >= found[-1].stat().st_mtime):
        return [final, *reversed(found)]
    return [*reversed(found), *([final] if final.is_file() else [])]


def find_resume_checkpoint(target: str) -> tuple[Path, Path]:
    """(run_dir, checkpoint) for ``--resume``: a run directory (its newest checkpoint, :func:`resume_candidates`)
    or a checkpoint file.

    Raises:
        UserError: no such run, no checkpoint in it, or no config.yaml.
    """
    p = Path(target)
    if p.is_file() or is_sharded_checkpoint(p):
        run_dir = p.parent.parent if p.parent.name == CHECKPOINT_DIR else p.parent
        return run_dir, p
    if not p.is_dir():
        raise UserError(f"--resume {target}: no such run directory or checkpoint file "
                        "(runs are under train.output_dir, e.g. runs/<id>)")
    found = resume_candidates(p)
    if not found:
        raise UserError(_no_checkpoint(target, p))
    if not (p / "config.yaml").is_file():
        raise UserError(f"--resume {target}: {p / 'config.yaml'} is missing; cannot rebuild the run's config")
    return p, found[0]


def _no_checkpoint(target: str, run_dir: Path) -> str:
    """Why ``--resume target`` (``run_dir``, with no checkpoint) has nothing to resume, and what to do. A run that
    started (``config.yaml``) and holds no checkpoint was stopped before its first one was complete (a kill during
    that write leaves its temporary file, the checkpoint's full size, which ``--overwrite`` removes).

    Raises:
        UserError: the run is still being written (its writer lock is held): its first checkpoint may be on the way.
    """
    if not (run_dir / "config.yaml").is_file():
        return (f"--resume {target}: no checkpoint in {run_dir / CHECKPOINT_DIR} (periodic checkpoints need "
                "train.checkpoint_every; a finished run's final state is checkpoint.pt)")
    from train.tools.run_lock import lock_holder

    if (pid := lock_holder(run_dir)) is not None:
        raise UserError(f"--resume {target}: the run is still being written (pid {pid}) and has no checkpoint yet; "
                        "wait for its first checkpoint (train.checkpoint_every) or for it to finish")
    temps = atomic_temps(run_dir)
    left = f"; the unfinished write left {describe_temps(temps, run_dir)}" if temps else ""
    removes = ", which removes " + ("that temporary file" if len(temps) == 1 else "those temporary files")
    try:
        train = (yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8")) or {})["train"]
        every, steps = train.get("checkpoint_every"), train.get("max_steps")
    except (OSError, yaml.YAMLError, KeyError, TypeError, AttributeError):
        every, steps = 1, None
    hint = ""
    if not every or (steps and every >= steps):  # no periodic checkpoint: the only one is the last step's
        hint = (f"; with train.checkpoint_every={every if every else 'null'} the run's only checkpoint is its last "
                "step's: set a smaller train.checkpoint_every so a killed run can resume")
    return (f"--resume {target}: no complete checkpoint was written before the run was killed or crashed, so there "
            f"is nothing to resume{left}; start it again with python -m train train --config "
            f"{run_dir / 'config.yaml'} --overwrite{removes if temps else ''}{hint}")


def load_resume(target: str, say=print) -> tuple[Path, dict[str, Any]]:
    """(checkpoint, state) for ``--resume target``. A run directory's newest checkpoint that cannot be read (truncated,
    corrupt) is skipped for the next one, with one line naming it (``say``); a checkpoint file given by name is not.

    Raises:
        UserError: as :func:`find_resume_checkpoint`, or no readable checkpoint (the newest one's error).
    """
    _, first = find_resume_checkpoint(target)
    found = [first] if first == Path(target) else resume_candidates(Path(target))
    for i, path in enumerate(found):
        try:
            return path, read_resume_state(path)
        except UserError as exc:
            if i + 1 == len(found):
                raise
            say(f"resume: skipped {path}: {exc}; trying {found[i + 1]}", file=sys.stderr, flush=True)
    raise AssertionError("unreachable")


def read_resume_state(path: Path) -> dict[str, Any]:
    """Load ``path`` (weights_only) and check it is a resumable checkpoint of this format.

    Raises:
        UserError: corrupt/truncated/pickled-object checkpoint, or another format.
    """
    state = read_meta(path) if path.is_dir() else load_checkpoint(path)
    if not isinstance(state, dict) or state.get("format") != FORMAT or "ranks" not in state:
        raise UserError(f"checkpoint {path} is not a resumable checkpoint of this version (format {FORMAT}); "
                        "start a new run")
    return state


def check_resume_state(state: dict[str, Any], path: Path, ctx: DistContext, bundle, spec,
                       tokenizer_path: Optional[str] = None) -> dict[str, Any]:
    """Check that ``state`` (from :func:`read_resume_state`) fits this run; returns it. ``tokenizer_path``: the run's
    ``data.tokenizer_path`` (a refusal names it, not the prepared-data cache's copy the bundle may read).

    Raises:
        UserError: another world size, another model shape (e.g. ``data.max_len`` above the checkpoint's
            position table), other labels, other training data, or another tokenizer (token ids would mean
            other tokens).
    """
    where = f"checkpoint {path}"
    if state["world_size"] != ctx.world_size:
        raise UserError(f"{where} was written by {state['world_size']} processes, this run has {ctx.world_size}; "
                        f"resume with the same NPROC x NNODES (the data order depends on it)")
    if state["label_names"] != list(bundle.corpus.label_names):
        raise UserError(f"{where}: trained on other labels ({len(state['label_names'])} classes, this data has "
                        f"{bundle.num_classes}); resume with the same data")
    if state["data_fingerprint"] != bundle.data_fingerprint:
        raise UserError(f"{where}: trained on other data (fingerprint {state['data_fingerprint']}, this data's is "
                        f"{bundle.data_fingerprint}); resume with the same data.source and split settings")
    have_tok = bundle.tokenizer_info["fingerprint"]
    if state.get("tokenizer_fingerprint") not in (None, have_tok):
        run_dir = path.parent.parent if path.parent.name == CHECKPOINT_DIR else path.parent
        own = run_dir / "tokenizer.json"
        fix = f"data.tokenizer_path={own}" if own.is_file() else "data.tokenizer_path=<the run's tokenizer.json>"
        named = f"{tokenizer_path}, data.tokenizer_path" if tokenizer_path else bundle.tokenizer_info.get("path")
        raise UserError(f"{where}: trained with tokenizer {state['tokenizer_fingerprint']} but this run's tokenizer is "
                        f"{have_tok} ({named}); resume with the run's own tokenizer, {fix}, or start a new run")
    want = asdict(spec)
    for key, have in state["spec"].items():
        if want.get(key) != have:
            if key == "base_fingerprint":
                raise UserError(f"{where}: its adapter was trained on another base (content {have}, model.source="
                                f"{spec.source} gives {want[key]}); resume on the same base weights")
            if key == "max_len":
                raise UserError(f"{where}: its position table holds {have} positions but data.max_len={want[key]}; "
                                f"set data.max_len={have}")
            gives = f"this config gives {want[key]}" if key in want else "this config's model has no such setting"
            raise UserError(f"{where}: model {key}={have} but {gives}; resume with the run's own config")
    return state


def complete_run(state: dict[str, Any], cfg, run_dir: Path) -> Optional[dict[str, Any]]:
    """For a resume: ``run_dir``'s report.json (plus ``_why``, the one line to say) when the run is complete — the
    checkpoint is at its last step, report.json says ``"status": "completed"`` and the requested run is no longer
    (``train.max_steps`` / ``train.epochs`` as the checkpoint's) — else None (then the resume trains, or runs the
    final evaluation that a signal interrupted)."""
    saved = (state.get("config") or {}).get("train", {})
    same_length = all(saved.get(k, getattr(cfg.train, k)) == getattr(cfg.train, k) for k in ("max_steps", "epochs"))
    if state["step"] < state["total_steps"] or not same_length:
        return None
    try:
        report = json.loads((run_dir / "report.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(report, dict) or report.get("status") != "completed":
        return None
    return {**report, "_why": f"the run is complete (step {state['step']} of {state['total_steps']}, report.json "
                              "status completed); nothing to train (raise train.max_steps to train longer)"}


def restore_rng(state: dict[str, Any], ctx: DistContext) -> None:
    """This rank's RNG states from ``state``; call right before the loop so nothing draws from them in between."""
    set_rng_state(state["ranks"][ctx.rank]["rng"])


def truncate_metrics(path: Path, step: int) -> None:
    """Drop metrics.jsonl records after ``step`` (logged after the checkpoint, before the interruption), atomically."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut by kill -9
            continue
        if record.get("step", 0) <= step:
            keep.append(line)
    atomic_write_text(path, "".join(line + "\n" for line in keep))
