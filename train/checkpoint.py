"""Checkpoints as state_dicts and plain values only; saved atomically, loaded with ``weights_only=True``; and the
one RNG snapshot (:func:`rng_state` / :func:`set_rng_state`): every generator a training step draws from (Python,
NumPy, torch CPU, every CUDA device) as tensors, lists and plain values, so the same snapshot serves a checkpoint,
warm-up's bit-exact restore, and benchmarks that give each configuration its own dropout stream."""

from __future__ import annotations

import errno
import pickle
import random
import shutil
import zipfile
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from train.compat import load_state
from train.errors import UserError, atomic_path
from train.shutdown import pause_point


def state_nbytes(state: Any) -> int:
    """Bytes of tensor data in a (nested) state dict: a lower bound on its ``torch.save`` size."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_nbytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_nbytes(v) for v in state)
    return 0


def _disk_full(path: Path, needed: int) -> bool:
    try:
        return shutil.disk_usage(path.parent).free < needed
    except OSError:
        return False


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> None:
    """``torch.save`` to a temporary file, fsync, rename: readers never see a half-written checkpoint.

    A full disk is recognised however it shows: checked before writing (free space below the state's tensor bytes
    plus 1 MiB), as ``OSError(ENOSPC)``, or as the ``RuntimeError`` torch's zip writer raises after a short write
    (``unexpected pos …`` on torch 2.13, no errno), confirmed by the free space once the partial file is removed.

    Raises:
        UserError: the write failed (disk full, permissions); the temporary file is removed and any
            earlier checkpoint at ``path`` is left as it was.
    """
    path = Path(path)
    needed = state_nbytes(state) + 2**20
    full = (f"cannot write checkpoint {path} (No space left on device: {needed / 2**20:.1f} MiB needed); the disk is "
            "full: free space or set train.output_dir to a disk with room; earlier checkpoints are intact")
    path.parent.mkdir(parents=True, exist_ok=True)
    if _disk_full(path, needed):
        raise UserError(full)
    try:
        with atomic_path(path) as tmp:
            torch.save(state, tmp)
            pause_point(f"checkpoint write {path.name}")  # a test hook: kill -9 here leaves the temporary file
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise UserError(full) from None
        raise UserError(f"cannot write checkpoint {path} ({exc.strerror or exc}); check the directory's permissions "
                        "or set train.output_dir; earlier checkpoints are intact") from None
    except RuntimeError as exc:  # torch's zip writer reports a failed write(2) as RuntimeError, errno lost
        if _disk_full(path, needed):
            raise UserError(full) from None
        if "write" not in str(exc) and "unexpected pos" not in str(exc):
            raise
        raise UserError(f"cannot write checkpoint {path} ({str(exc).splitlines()[0]}); is the disk full? "
                        "Free space or set train.output_dir; earlier checkpoints are intact") from None


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` (a sharded one: train/parallel/sharded_checkpoint.py's
    ``load_whole``).

    Raises:
        UserError: missing, truncated/corrupt, or containing pickled objects other than tensors and
            plain containers (refused by ``weights_only=True``).
    """
    p = Path(path)
    if not p.is_file():
        raise UserError(f"checkpoint {p} does not exist")
    try:
        return load_state(str(p))
    except pickle.UnpicklingError as exc:
        raise UserError(f"checkpoint {p} holds objects other than tensors and plain values; refusing to unpickle "
                        f"them (weights_only=True): {str(exc).splitlines()[0]}") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError) as exc:
        raise UserError(f"checkpoint {p} is corrupt or truncated ({exc.__class__.__name__}); "
                        "use an earlier checkpoint") from None


def rng_state() -> dict[str, Any]:
    """This process's RNG states as tensors, lists and plain values (safe for ``weights_only=True``)."""
    version, mt, gauss = random.getstate()  # (3, 625 ints, None | float)
    kind, keys, pos, has_gauss, cached = np.random.get_state()  # ('MT19937', uint32[624], int, int, float)
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    return {"python": {"version": version, "state": list(mt), "gauss_next": gauss},
            "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
            "torch": torch.get_rng_state(), "cuda": list(cuda)}


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# The keys of an optimizer's param group that say which kernels run it, not what it computes: a checkpoint written
# by one implementation (fused AdamW on torch 2.13's CPU, single-tensor on torch 2.1) must load into another.
IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")


def implementation(group: dict) -> str:
    """A param group's AdamW implementation: ``fused``, ``foreach`` or ``single-tensor`` (torch's default chooser
    picks foreach for a ``None`` on CUDA and single-tensor on CPU; ``None`` is shown as ``default``)."""
    if group.get("fused"):
        return "fused"
    return {True: "foreach", False: "single-tensor"}.get(group.get("foreach"), "default")


def optimizer_state_for(optimizer: Any, saved: dict) -> tuple[dict, Optional[str]]:
    """``saved`` (an ``optimizer.state_dict()`` from a checkpoint) with each param group's implementation keys set to
    ``optimizer``'s own, so ``optimizer.load_state_dict`` keeps the current run's kernels and places the ``step``
    tensors as they need (a fused kernel asserts on a non-fused group's state, and the other way round). Returns
    (state, note): ``note`` names both implementations when they differ (the run continues; its steps are not
    bit-identical to the checkpoint's implementation), else None."""
    groups, mine = saved["param_groups"], optimizer.param_groups
    if len(groups) != len(mine):
        return saved, None  # load_state_dict raises its own error on a different parameter layout
    before = {implementation(g) for g in groups}
    adapted = [{**g, **{k: m[k] for k in IMPLEMENTATION_KEYS if k in m}} for g, m in zip(groups, mine)]
    after = {implementation(g) for g in adapted}
    note = None
    if before != after:
        note = (f"the checkpoint's AdamW ran {'/'.join(sorted(before))}, this run uses {'/'.join(sorted(after))}: "
                "the state is carried over; the kernels differ, so the steps are not bit-identical to an uninterrupted "
                "run's")
    return {**saved, "param_groups": adapted}, note
