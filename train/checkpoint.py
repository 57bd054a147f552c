"""Checkpoints as state_dicts and plain values only; saved atomically, loaded with ``weights_only=True``."""

from __future__ import annotations

import errno
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from train.compat import load_state
from train.errors import UserError, atomic_path


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> None:
    """``torch.save`` to a temporary file, fsync, rename: readers never see a half-written checkpoint.

    Raises:
        UserError: the write failed (disk full, permissions); the temporary file is removed and any
            earlier checkpoint at ``path`` is left as it was.
    """
    try:
        with atomic_path(path) as tmp:
            torch.save(state, tmp)
    except OSError as exc:
        hint = ("the disk is full: free space or set train.output_dir to a disk with room" if exc.errno == errno.ENOSPC
                else "check the directory's permissions or set train.output_dir")
        raise UserError(f"cannot write checkpoint {path} ({exc.strerror or exc}); {hint}; "
                        "earlier checkpoints are intact") from None
    except RuntimeError as exc:  # torch's zip writer reports a failed write(2), e.g. ENOSPC, as RuntimeError
        if "write" not in str(exc):
            raise
        raise UserError(f"cannot write checkpoint {path} ({str(exc).splitlines()[0]}); is the disk full? "
                        "Free space or set train.output_dir; earlier checkpoints are intact") from None


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint`.

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
        raise UserError(f"checkpoint {p} is corrupt or truncated ({exc.__class__.__name__}); use an earlier checkpoint") from None
