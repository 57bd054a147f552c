"""The ``dist`` section: how a torchrun job spreads the model over its ranks."""

from __future__ import annotations

from dataclasses import dataclass

from train.errors import Frozen, allowed, check_fields


@dataclass
class DistConfig(Frozen):
    """How a torchrun job (``make train NPROC=N``) spreads the model over its ranks (docs/scale-out.md)."""

    strategy: str = allowed("ddp", choices=("ddp", "fsdp", "auto"))
    """``ddp``: every rank holds the whole model, gradients all-reduced (``DistributedDataParallel``). ``fsdp``:
    parameters, gradients and optimizer state sharded over the ranks by PyTorch's FSDP2 (``fully_shard`` per
    transformer block, then the root; train/parallel/fsdp.py), torch >= 2.6. ``auto``: fsdp where the training
    state (16 bytes a parameter) would not fit half of one device's memory and fsdp can run, else ddp
    (train/parallel/strategy.py; the decisions block says which and why). A single-process run ignores it."""

    offload: bool = False
    """With ``strategy=fsdp``: FSDP2's ``CPUOffloadPolicy``: parameters, gradients and optimizer state stay in host
    memory (pinned on an accelerator), each unit's parameters copied to the device for its forward and backward, its
    gradients back; the optimizer step runs on the CPU. On a CPU device nothing moves (the state is already in
    host memory). Refused with ``ddp`` and ``auto``."""

    def __post_init__(self) -> None:
        check_fields(self, "dist")
