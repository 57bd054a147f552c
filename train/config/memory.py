"""The ``memory`` section: trading step time for memory."""

from __future__ import annotations

from dataclasses import dataclass

from train.errors import Frozen, check_fields


@dataclass
class MemoryConfig(Frozen):
    """Levers that lower a run's peak memory at a cost in step time (docs/scale-out.md, "Memory")."""

    checkpoint_blocks: bool = False
    """Activation checkpointing per transformer block (``torch.utils.checkpoint``, non-reentrant): each block keeps
    only its input for the backward pass, and its forward runs a second time in the backward to rebuild what it
    dropped. The activations held for backward shrink from every block's intermediates to one tensor per block
    ([B, S, H] each) plus the block being recomputed; the price is one extra forward per block — roughly +30% step
    time. Dropout masks are recomputed identically (the RNG state is restored), so losses and gradients are those of
    the run without it. Use it where memory, not speed, limits the run: it would run out of memory, or a larger batch
    / token budget / model only fits with it. The built-in encoder and ``python:`` models: every block
    ``train.parallel.fsdp.transformer_blocks`` finds; Hugging Face models: transformers' own
    ``gradient_checkpointing`` (``use_reentrant=False``); under ``dist.strategy=fsdp`` applied before sharding.
    ``make optimize`` proposes it only where memory is the constraint (docs/optimize.md)."""

    def __post_init__(self) -> None:
        check_fields(self, "memory")
