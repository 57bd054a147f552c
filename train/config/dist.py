"""The ``dist`` section: how a torchrun job spreads the model over its ranks."""

from __future__ import annotations

from dataclasses import dataclass

from train.errors import Frozen, allowed, check_fields


@dataclass
class DistConfig(Frozen):
    """How a torchrun job (``make train NPROC=N``) spreads the model over its ranks (docs/scale-out.md)."""

    strategy: str = allowed("ddp", choices=("ddp", "fsdp"))
    """``ddp``: every rank holds the whole model, gradients all-reduced (``DistributedDataParallel``). ``fsdp``:
    parameters, gradients and optimizer state sharded over the ranks by PyTorch's FSDP2 (``fully_shard`` per
    transformer block, then the root; train/parallel/fsdp.py), torch >= 2.6. A single-process run ignores it."""

    def __post_init__(self) -> None:
        check_fields(self, "dist")
