"""``optimize-grid``'s combinations: every value the crossable levers declare for the grid (levers.py), crossed
(:func:`grid_points`), each named (:func:`name_of`), and the combination each grows from as the search would try it
(:func:`twin_of`: the grid's quality reference); the levers left out, and why (:data:`LEFT_OUT`)."""

from __future__ import annotations

import itertools
from typing import Any, Optional

from train.config import RunConfig
from train.optimize.levers import (
    BATCHING,
    FIXED_BATCH,
    FUSED_ADAMW,
    GRID_BUDGET_FACTORS,
    precisions_on,
)
from train.optimize.model_levers import FAST_DROPOUT

LEFT_OUT = {"workers": "a DataLoader process pool per arm: forked from a process holding every arm, each worker "
                       "grew to ~7 GB and the 24 GiB machine ran out of memory (measured); the search A/Bs it alone",
            "threads": "torch's thread count is process-wide (and every core is in use by default)",
            "compile": "one compilation per arm and shape (minutes on a CPU)",
            "allocator": "process-wide, CUDA only"}
"""Levers that cannot be crossed in one process interleaved with the others, and why (grid.json says so)."""


def grid_points(base: RunConfig, native_bf16: bool, supports_packing: bool, fused: bool, cuda: bool = False,
                workers: int = 0) -> list[dict[str, Any]]:
    """Every combination of the crossable levers' grid values, as overrides on ``base``: precision × batching (the
    fixed-batch starts, then each batching value × each token budget) × fast dropout × fused AdamW (``fused``: where
    torch has it) × DataLoader workers (``workers`` > 0: crossed too, 0 and that many — a process pool per arm: mind
    the memory)."""
    budget = base.batching.batch_size * base.data.max_len
    batching: list[dict[str, Any]] = [
        {"batching.method": method, "batching.pad_to": "bound", "batching.max_tokens": None} for method in FIXED_BATCH]
    for value, (settings, _removed) in BATCHING.items():
        if value == "packed" and not supports_packing:
            continue
        for tokens in [None] + [int(budget * f) for f in GRID_BUDGET_FACTORS]:
            batching.append({"batching.method": settings["batching.method"],
                             "batching.pad_to": settings.get("batching.pad_to", "bound"),
                             "batching.max_tokens": tokens})
    out = []
    for p, b, drop, fz, nw in itertools.product(precisions_on("cuda" if cuda else "cpu", native_bf16 or cuda),
                                                batching, FAST_DROPOUT, FUSED_ADAMW if fused else FUSED_ADAMW[:1],
                                                (0, workers) if workers else (0,)):
        out.append({"train.precision": p, **b, "model.fast_dropout": drop, "optim.fused": fz, "data.num_workers": nw})
    return out


def name_of(point: dict[str, Any]) -> str:
    b = point["batching.max_tokens"]
    method = point["batching.method"] + ("+batch-max" if point.get("batching.pad_to") == "batch-max" else "")
    return (f"{point['train.precision']}/{method}/{'batch' if b is None else b}/"
            f"drop-{'fast' if point['model.fast_dropout'] == 'true' else 'nn'}/"
            f"{'fused' if point['optim.fused'] else 'adamw'}/w{point['data.num_workers']}")


def twin_of(named: dict[str, dict[str, Any]], name: str) -> Optional[str]:
    """The combination ``name`` is grown from, as the search would try it: with a token budget, the same at the
    config's batch size; packed rows (no budget), the same in fitted buckets; None for any other (or a twin the grid
    does not hold: the reference is then the config as given)."""
    point = named[name]
    if name == "baseline" or "train.precision" not in point:
        return None
    if point.get("batching.max_tokens") is not None:
        twin = {**point, "batching.max_tokens": None}
    elif point.get("batching.method") == "packed":
        twin = {**point, "batching.method": "optimal", "batching.pad_to": "bound"}
    else:
        return None
    n = name_of(twin)
    return n if n in named and n != name else None
