"""One RNG snapshot for the whole project: every generator a training step draws from (Python, NumPy, torch
CPU, every CUDA device), as tensors, lists and plain values, so the same snapshot serves a checkpoint
(``torch.load(weights_only=True)`` reads it), warm-up's bit-exact restore, and benchmarks that give each
configuration its own dropout stream."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


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
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
