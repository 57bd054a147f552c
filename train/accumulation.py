"""One optimizer step over one or more micro-batches, with one loss normalisation.

The loss of a step is the sum of the per-target losses over every micro-batch on every rank, divided by the global
number of targets (a causal LM's trained tokens, a classifier's samples): the objective of one process on the whole
global batch, whatever the ranks and micro-batches hold. The global count is all-reduced once per step, before the
first backward (torchtitan's global token normalisation; the HF Trainer's ``num_items_in_batch`` fix of 2024 for
gradient accumulation). The task's loss stays a mean over the micro-batch's own targets; micro-batch ``i`` with
``c_i`` targets is weighted ``c_i · W / G`` (``W`` ranks, ``G`` targets in all), because DDP and FSDP2 average
gradients over the ranks. One process with one micro-batch keeps the plain mean (weight 1, nothing multiplied).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Optional

import torch

from train.parallel.process_group import DistContext, all_reduce_sum

IGNORE_INDEX = -100
"""The label of a position or row that is not trained (both tasks' collators use it)."""


def target_count(labels: torch.Tensor) -> torch.Tensor:
    """The number of trained targets in ``labels`` (a causal LM's ``[B, T]`` shifted targets, a classifier's ``[N]``
    class ids): int64 0-d tensor on ``labels``' device, no host sync."""
    return (labels != IGNORE_INDEX).sum()


def loss_weights(counts: list[torch.Tensor], ctx: DistContext) -> Optional[list[torch.Tensor]]:
    """Each micro-batch's loss weight ``c_i · W / G`` (fp32 0-d tensors) from their target counts ``c_i`` on this
    rank, ``G`` their sum over every rank (one all-reduce; a step without targets anywhere counts as one); None for
    one micro-batch in one process (weight 1: the task's mean as it is)."""
    if len(counts) == 1 and not ctx.enabled:
        return None
    local = torch.stack(counts).sum().to(torch.float32)
    total = all_reduce_sum(local.clone(), ctx)
    scale = ctx.world_size / total.clamp_min(1.0)
    return [c.to(torch.float32) * scale for c in counts]


def sync_owner(*modules: object) -> Optional[torch.nn.Module]:
    """The module that exchanges gradients between ranks among ``modules`` (the step's forward, what it wraps —
    a compiled forward keeps its module as ``.model`` —, the plain model): a DDP wrapper (``no_sync``) or an
    FSDP2-sharded module (``set_requires_gradient_sync``); None in one process."""
    for m in modules:
        for candidate in (m, getattr(m, "model", None)):
            if hasattr(candidate, "no_sync") or hasattr(candidate, "set_requires_gradient_sync"):
                return candidate
    return None


@contextlib.contextmanager
def gradient_sync(model: Optional[torch.nn.Module], enabled: bool) -> Iterator[None]:
    """Around a micro-batch's forward and backward: with ``enabled`` false, the ranks do not exchange its gradients
    (they accumulate locally until the step's last micro-batch): DDP's ``no_sync``, FSDP2's
    ``set_requires_gradient_sync(False)`` (``model``: :func:`sync_owner`'s; None: one process, nothing to skip)."""
    if enabled or model is None:
        yield
    elif hasattr(model, "no_sync"):  # DistributedDataParallel
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):  # an FSDP2-sharded module
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
