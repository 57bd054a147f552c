"""Checkpoints as state_dicts and plain values only; saved atomically, loaded with ``weights_only=True``."""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from train.compat import load_state
from train.errors import UserError, atomic_path


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> None:
    """``torch.save`` to a temporary file, fsync, rename: readers never see a half-written checkpoint."""
    with atomic_path(path) as tmp:
        torch.save(state, tmp)


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
