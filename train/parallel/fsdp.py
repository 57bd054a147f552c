"""``dist.strategy=fsdp``: PyTorch's FSDP2 (``fully_shard``) over the job's ranks, and the state checkpoints keep.

Sharding: each transformer block (the model's largest ``nn.ModuleList`` of one module class: a Hugging Face decoder's
``layers``, the built-in encoder's ``layers``) becomes one FSDP2 unit, then the root (embeddings, final norm, head),
over a 1-D device mesh of all ranks (CUDA → NCCL, CPU → Gloo; the process group is process_group.py's). Every
parameter becomes a ``DTensor`` sharded on dimension 0 (uneven sizes: the last rank's shard is shorter); a unit's
weights are all-gathered for its forward and backward and freed after, its gradients reduce-scattered. The optimizer,
built after sharding, holds state for this rank's shards only.

Checkpoints keep today's single-file format (train/resume.py): every DTensor is gathered to a whole CPU tensor, one
at a time on every rank (rank 0 keeps and writes them), so a DDP run can resume as fsdp and back, at the same world
size, and export reads the full weights. Loading shards the whole tensors as the live ones are
(:func:`load_optimizer_state`); the model's weights are loaded before sharding (train/setup.py ``before_wrap``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Optional

import torch
from torch import nn

from train.compat import force_sum_reduction, fsdp2_api, full_tensor, is_dtensor, shard_like
from train.errors import UserError

HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
UNSHARDABLE_CLIPS = ("per-layer-std", "agc")  # statistics over a whole gradient, which no rank holds


def check_fsdp(cfg: Any) -> None:
    """Refuse ``dist.strategy=fsdp`` where it cannot run, and ``dist.offload`` without it (no-op for ``ddp`` and
    ``auto``, which picks fsdp only where it can run: train/parallel/strategy.py).

    Raises:
        UserError: one line: ``dist.offload=true`` with ``ddp`` or ``auto``; this torch has no FSDP2 (torch 2.1: the
            pinned ``torch21`` and ``cpu`` images); a clipping method that needs whole gradients.
    """
    if cfg.dist.offload and cfg.dist.strategy != "fsdp":
        raise UserError(f"dist.offload=true: CPU offload is FSDP2's, and dist.strategy={cfg.dist.strategy} "
                        f"{'keeps every rank whole' if cfg.dist.strategy == 'ddp' else 'may pick ddp'}; "
                        "set dist.strategy=fsdp, or dist.offload=false")
    if cfg.dist.strategy != "fsdp":
        return
    _fsdp2()
    if cfg.clip.method in UNSHARDABLE_CLIPS:
        raise UserError(f"dist.strategy=fsdp: clip.method={cfg.clip.method} needs each gradient whole, and FSDP2 "
                        "leaves each rank a shard; use clip.method=global-norm (or none), or dist.strategy=ddp")


def _fsdp2() -> tuple:
    api, why = fsdp2_api()
    if api is None:
        raise UserError(f"dist.strategy=fsdp: {why}; use the torch2x stack, or dist.strategy=ddp")
    return api


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks FSDP2 shards one by one: the children of ``model``'s largest (by parameter count)
    ``nn.ModuleList`` whose children share one class; empty when it has none (then only the root is sharded)."""
    best: list[nn.Module] = []
    size = 0
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) and len({type(m) for m in module}) == 1:
            n = sum(p.numel() for p in module.parameters())
            if n > size:
                best, size = list(module), n
    return best


def shard_model(model: nn.Module, world_size: int, device: torch.device, mode: str,
                offload: bool = False) -> nn.Module:
    """Shard ``model`` in place with FSDP2 (each of :func:`transformer_blocks`, then the root) over all
    ``world_size`` ranks of the initialised process group; returns ``model`` (its class now also an ``FSDPModule``).

    ``mode`` is the precision policy's (``fp32``, ``bf16``, ``fp16``): in a half mode each block gathers its
    parameters in that dtype for compute, its inputs cast to it, and reduces gradients in fp32
    (``MixedPrecisionPolicy``); the root (embeddings, final norm, head) keeps fp32 parameters, as the precision
    policy keeps them (the built-in encoder's final LayerNorm and pooling run in fp32 and refuse half weights);
    fp32 has no policy. Reductions are plain
    sums then a division by the world size (:func:`~train.compat.force_sum_reduction`), so gradients are the mean
    over ranks, as DDP's. ``offload`` (``dist.offload``): FSDP2's ``CPUOffloadPolicy``, the shards (parameters,
    gradients, so the optimizer's state too) kept in host memory, pinned where ``device`` is an accelerator (pinning
    needs one: on a CPU device the policy runs unpinned and moves nothing). Build the optimizer after this: it must
    hold the sharded parameters.

    Raises:
        UserError: this torch has no FSDP2.
    """
    fully_shard, mixed_precision, init_device_mesh, _ = _fsdp2()
    with torch.no_grad():  # rank 0's weights everywhere, as DDP starts: each rank keeps its shard of them
        for tensor in model.state_dict().values():
            torch.distributed.broadcast(tensor, src=0)
    mesh = init_device_mesh(device.type, (world_size,))
    kwargs: dict[str, Any] = {"mesh": mesh}
    half = {"mp_policy": mixed_precision(param_dtype=HALF[mode], reduce_dtype=torch.float32)} if mode in HALF else {}
    if offload:
        from torch.distributed.fsdp import CPUOffloadPolicy  # public beside fully_shard (the _fsdp2() check above)

        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type != "cpu")
    units = [*transformer_blocks(model), model]
    for unit in units:
        fully_shard(unit, **kwargs, **(half if unit is not model else {}))
    for unit in units:
        force_sum_reduction(unit)
    return model


def reshard(model: nn.Module) -> None:
    """Free the whole weights a forward without a backward (an evaluation) leaves gathered: FSDP2 keeps the root's
    after its forward, for the backward that usually follows, so until the next step ``model.parameters()`` would
    be the root's whole tensors instead of shards."""
    fsdp_module = _fsdp2()[3]
    for module in model.modules():
        if isinstance(module, fsdp_module):
            module.reshard()


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are FSDP2 shards (DTensors)."""
    return any(is_dtensor(p) for p in model.parameters())


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every DTensor gathered whole onto the CPU (a collective under FSDP2: every rank
    calls it); the plain state dict (tensors shared with the model) when nothing is sharded. A tensor under two
    names (tied embeddings) is gathered once and kept shared, as ``torch.save`` stores an unsharded model's."""
    state = model.state_dict(keep_vars=True)  # the parameters themselves: a tied one is one object
    if not any(is_dtensor(v) for v in state.values()):
        return model.state_dict()
    whole: dict[int, torch.Tensor] = {}
    for v in state.values():
        if id(v) not in whole:
            whole[id(v)] = full_tensor(v.detach()).cpu() if is_dtensor(v) else v.detach().cpu()
    return {k: whole[id(v)] for k, v in state.items()}


def full_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with every DTensor state (AdamW's moments) gathered whole onto the CPU: the format
    of an unsharded run's optimizer (parameters numbered in order), so either strategy can load it. A collective
    under FSDP2 (every rank calls it); the plain state dict when nothing is sharded."""
    saved = optimizer.state_dict()
    state = saved["state"]
    if not any(is_dtensor(v) for st in state.values() for v in st.values()):
        return saved
    whole = {i: {k: full_tensor(v).cpu() if is_dtensor(v) else v for k, v in st.items()} for i, st in state.items()}
    return {**saved, "state": whole}


def load_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """Load a :func:`full_optimizer_state` (or an unsharded run's) into ``optimizer``: each whole tensor shaped like
    its sharded parameter becomes this rank's shard of it (no communication), the rest (``step``) as saved."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state: dict[Any, Any] = {}
    for i, st in saved["state"].items():
        p: Optional[torch.Tensor] = params[int(i)] if int(i) < len(params) else None
        state[i] = {k: shard_like(v, p) if p is not None and torch.is_tensor(v) and v.shape == p.shape and v.dim()
                    else v for k, v in st.items()}
    optimizer.load_state_dict({**saved, "state": state})


EXHAUSTED = "exhausted"
"""What :func:`lockstep` yields to a rank whose shard is done while another's is not."""


def lockstep(batches: Iterable[dict], ctx: Any, stop: Callable[[], bool]) -> Iterator[Any]:
    """``batches`` in step with the other ranks, for an evaluation of a sharded model: every forward all-gathers
    weights, so every rank must run as many as the rank with the most batches. Yields each batch, then
    :data:`EXHAUSTED` (run :func:`idle_forward`) until no rank has one left; ``None`` (then stop) as soon as
    ``stop()`` is true on any rank. One tiny CPU all-reduce (the control group) per batch."""
    it = iter(batches)
    while True:
        batch = next(it, None)
        flags = torch.tensor([batch is not None, bool(stop())], dtype=torch.int32)
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, group=ctx.control_group)
        if flags[1]:
            yield None
            return
        if not flags[0]:
            return
        yield batch if batch is not None else EXHAUSTED


def idle_forward(model: nn.Module, blocks_context: Callable, device: torch.device) -> None:
    """A forward on one token, output discarded: a rank's share of the other ranks' all-gathers (:func:`lockstep`)."""
    one = torch.ones(1, 1, dtype=torch.long, device=device)
    model(one, one.bool(), blocks_context)
