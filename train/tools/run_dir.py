"""The run directory: a unique run id, and the directory made for a run — refused when it holds an earlier run
(unless resumed or overwritten), locked for one writer, and cleaned of what a killed run left."""

from __future__ import annotations

import secrets
import shutil
import time
from pathlib import Path
from typing import Optional

from train.config import RunConfig
from train.errors import UserError, describe_temps, remove_atomic_temps
from train.tools.run_lock import LOCK_FILE, lock_run_dir, unlock_run_dir

__all__ = ["RUN_OUTPUTS", "make_run_dir", "new_run_id", "unlock_run_dir"]  # unlock_run_dir: releases what this makes

def new_run_id(prefix: str = "") -> str:
    """``<prefix><UTC yyyymmdd-HHMMSS>-<4 random hex>``: unique without coordination between processes."""
    return f"{prefix}{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(2)}"


RUN_OUTPUTS = ("report.json", "metrics.jsonl", "checkpoint.pt", "checkpoints", "buckets.json")
"""What a run directory's earlier run leaves that ``train.overwrite=true`` removes (a new run would mix with it)."""


def make_run_dir(cfg: RunConfig, prefix: str = "", resume: bool = False,
                 continue_flag: Optional[str] = None) -> Path:
    """Create ``<train.output_dir>/<train.run_id>`` and return it.

    Without ``train.run_id`` a new id (:func:`new_run_id`) is created exclusively (a directory that exists
    already is never shared: another id is drawn); the directory's name is the run id (the caller's config is not
    edited: ``start_run`` and ``run_training`` make the resolved config with it). An explicit
    ``train.run_id`` is created exclusively too: a directory that exists and is not empty is used only to
    continue it (``resume=True``) or with ``train.overwrite=true``, which removes the earlier run's
    :data:`RUN_OUTPUTS` first. ``continue_flag``: how the calling command continues a run in its directory
    (``--resume`` for ``python -m train train``; None: it cannot, so a refusal offers only another ``--run-id`` or
    ``--overwrite``). A directory taken over (resume, overwrite) loses the temporary files of atomic writes that a
    killed run left (:func:`~train.errors.remove_atomic_temps`).

    Raises:
        UserError: the directory exists (and neither resume nor overwrite), or it cannot be created or written; a
            ``train.run_id`` that is not one plain directory name (``/``, ``..``, a leading dot: it would write
            outside ``train.output_dir`` or hide the run).
    """
    out = Path(cfg.train.output_dir)
    rid = cfg.train.run_id
    if rid and (rid in (".", "..") or rid.startswith(".") or "/" in rid or "\\" in rid or "\0" in rid):
        raise UserError(f"train.run_id={rid!r} is not a plain directory name (no '/', no '..', no leading '.'): a run "
                        f"lives in {out}/<run_id>; pick a name such as 'exp-1', or set train.output_dir for another "
                        "place")
    try:
        if cfg.train.run_id:
            run_dir = out / cfg.train.run_id
            run_dir.parent.mkdir(parents=True, exist_ok=True)
            try:
                run_dir.mkdir()
                lock_run_dir(run_dir)
            except FileExistsError:
                lock_run_dir(run_dir)  # before looking inside: a second writer is refused, never interleaved
                try:
                    _reuse(run_dir, cfg, resume, continue_flag)
                except UserError:
                    unlock_run_dir(run_dir)
                    raise
                _remove_leftovers(run_dir)
        else:
            out.mkdir(parents=True, exist_ok=True)
            while True:
                run_dir = out / new_run_id(prefix)
                try:
                    run_dir.mkdir()
                    lock_run_dir(run_dir)
                    break
                except FileExistsError:
                    continue
        probe = run_dir / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise UserError(f"cannot write the run directory {out / (cfg.train.run_id or '')} ({exc.strerror}); "
                        "set train.output_dir to a writable place") from None
    return run_dir


def _remove_leftovers(run_dir: Path) -> None:
    """Remove the temporary files a killed run's atomic writes left in ``run_dir`` (a checkpoint's can be hundreds
    of MB), saying so in one line. Called with the run's writer lock held: no live writer owns them."""
    removed = remove_atomic_temps(run_dir)
    if removed:
        print(f"notice: removed {len(removed)} temporary file(s) of an interrupted write from {run_dir}: "
              f"{describe_temps(removed, run_dir)}", flush=True)


def _reuse(run_dir: Path, cfg: RunConfig, resume: bool, continue_flag: Optional[str] = None) -> None:
    """An explicit run directory that exists: continue it (resume), replace its run (overwrite), or refuse (naming
    only what the command can do: ``continue_flag``, see :func:`make_run_dir`)."""
    held = sorted(p.name for p in run_dir.iterdir() if p.name != LOCK_FILE) if run_dir.is_dir() else []
    if resume or not held:
        return
    if not cfg.train.overwrite:
        shown = ", ".join(held[:4]) + (", …" if len(held) > 4 else "")
        cont = f"continue it with {continue_flag} {run_dir}, " if continue_flag else ""
        raise UserError(f"run directory {run_dir} exists already ({shown}); choose another --run-id "
                        f"(train.run_id), {cont}or replace its run with --overwrite (train.overwrite=true)")
    for name in RUN_OUTPUTS:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
