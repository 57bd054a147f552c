"""``dist.strategy=auto``: ddp or fsdp from whether the model's training state fits one device.

The rule (decided once, by rank 0, in the resolve phase; docs/scale-out.md): the training state is
``4 × parameters + 12 × trainable parameters`` bytes — fp32 weights (4 bytes each), and for each trainable weight its
fp32 gradient (4) and AdamW's two fp32 moments (8): 16 bytes a parameter, fewer where an adapter freezes the base.
It fits where it takes at most :data:`HEADROOM` of the device's memory, the rest left for activations, the
batch, the allocator's slack and the CUDA context. Fits → ``ddp`` (no sharding cost). Does not fit → ``fsdp``,
where it can run: this torch has FSDP2 (torch ≥ 2.6) and the clipping method works on shards; else ``ddp``, with
why. A single process has no ranks to shard over: nothing is decided (``dist.strategy`` is ignored there).

The inputs are plain arguments (:func:`choose_strategy`), so a test forces any case; :func:`device_memory_bytes`
reads the hardware.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

import torch

from train.compat import fsdp2_api
from train.parallel.fsdp import UNSHARDABLE_CLIPS

HEADROOM = 0.5
"""The fraction of a device's memory the training state may take; the rest is left for activations."""
WEIGHT_BYTES, TRAINABLE_EXTRA_BYTES = 4, 12  # fp32 weight; its fp32 gradient + AdamW's exp_avg and exp_avg_sq


@dataclass(frozen=True)
class StrategyDecision:
    """What ``dist.strategy=auto`` chose (``ddp``/``fsdp``; None for a single process), why, and from what."""

    chosen: Optional[str]
    reason: str
    state_bytes: int
    device_bytes: Optional[int]

    def as_report(self) -> dict[str, Any]:
        """report.json's ``dist.auto``: requested, chosen, reason, state and device bytes, the headroom rule."""
        return {"requested": "auto", "chosen": self.chosen, "reason": self.reason, "state_bytes": self.state_bytes,
                "device_bytes": self.device_bytes, "headroom": HEADROOM}


def training_state_bytes(params: int, trainable: int) -> int:
    """Bytes of fp32 weights (all ``params``) + gradients and AdamW moments (the ``trainable`` ones)."""
    return WEIGHT_BYTES * params + TRAINABLE_EXTRA_BYTES * trainable


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def choose_strategy(params: int, trainable: int, device_bytes: Optional[int], world_size: int, fsdp2_missing: str = "",
                    clip_method: str = "global-norm") -> StrategyDecision:
    """The rule of the module docstring. ``params``/``trainable``: parameter counts (elements); ``device_bytes``: one
    device's memory in bytes (None: unknown, then ddp); ``world_size``: ranks in the job; ``fsdp2_missing``: why
    this torch has no FSDP2 ("" where it has it: :func:`train.compat.fsdp2_api`); ``clip_method``: ``clip.method``.
    Raises nothing."""
    state = training_state_bytes(params, trainable)
    if world_size <= 1:
        return StrategyDecision(None, "a single process: no ranks to shard over (dist.strategy is ignored)", state,
                                device_bytes)
    if trainable == params:
        what = f"training state {_size(state)} (16 bytes a parameter, {params / 1e6:.1f}M parameters)"
    else:
        what = (f"training state {_size(state)} (4 bytes a weight, 12 more a trainable one: {params / 1e6:.1f}M "
                f"parameters, {trainable / 1e6:.1f}M trainable)")
    if device_bytes is None:
        return StrategyDecision("ddp", f"{what}; this device's memory is unknown: ddp", state, None)
    budget = f"{HEADROOM:g} of the device's {_size(device_bytes)}"
    if state <= HEADROOM * device_bytes:
        return StrategyDecision("ddp", f"{what} fits {budget}: ddp (every rank whole, no sharding cost)", state,
                                device_bytes)
    if fsdp2_missing:
        return StrategyDecision("ddp", f"{what} would not fit {budget}, but {fsdp2_missing}: ddp (the torch2x stack "
                                "shards it)", state, device_bytes)
    if clip_method in UNSHARDABLE_CLIPS:
        return StrategyDecision("ddp", f"{what} would not fit {budget}, but clip.method={clip_method} needs whole "
                                "gradients: ddp (clip.method=global-norm lets fsdp shard it)", state, device_bytes)
    return StrategyDecision("fsdp", f"{what} would not fit {budget}: fsdp, {_size(state / world_size)} a rank over "
                            f"{world_size} ranks", state, device_bytes)


def device_memory_bytes(device: torch.device, local_ranks: Optional[int] = None) -> Optional[int]:
    """One rank's share of memory in bytes: a CUDA device's total memory; on a CPU the host's RAM divided by the
    ranks on this host (``local_ranks``, default torchrun's ``LOCAL_WORLD_SIZE``), which all hold their state there;
    None for another device type or where the host does not say."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    if device.type != "cpu":
        return None
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # no sysconf names (not POSIX)
        return None
    ranks = local_ranks or int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return int(ram // max(ranks, 1))


def decide_strategy(model: torch.nn.Module, device: torch.device, world_size: int, clip_method: str) -> dict[str, Any]:
    """:func:`choose_strategy` for ``model`` (its parameters counted once each, trainable = ``requires_grad``) on
    ``device`` (:func:`device_memory_bytes`) over ``world_size`` ranks; its :meth:`~StrategyDecision.as_report`."""
    params = list(model.parameters())
    total, trainable = sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)
    return choose_strategy(total, trainable, device_memory_bytes(device), world_size, fsdp2_api()[1],
                           clip_method).as_report()
