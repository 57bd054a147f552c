"""torch.distributed for runs launched by ``torchrun``: set-up, tear-down, reductions, agreement on errors.

``torchrun`` (``torch.distributed.run``) starts one process per device and sets ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``; :func:`init_distributed` reads
them through ``init_process_group`` (``env://``). Backend: NCCL for CUDA, Gloo for CPU. A plain
``python -m train`` (no ``WORLD_SIZE``) gets a single-process :class:`DistContext` and every helper
here becomes a no-op, so the single-process path never touches ``torch.distributed``.

Control messages (the stop flag after a signal, error agreement) go over a Gloo group on the CPU,
so with NCCL they cost no device synchronisation.
"""

from __future__ import annotations

import getpass
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional, TypeVar

import torch
import torch.distributed as dist

from train.errors import RankFailed, UserError

T = TypeVar("T")


@dataclass
class DistContext:
    """This process's place in the job. ``world_size == 1``: not distributed."""

    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    backend: Optional[str] = None
    control_group: Any = None  # Gloo group for CPU-side control messages (None = the default group)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the only rank that writes files and prints."""
        return self.rank == 0


def env_ranks() -> tuple[int, int, int]:
    """(world_size, rank, local_rank) from the variables torchrun sets; (1, 0, 0) without them.

    Raises:
        UserError: the variables are present but inconsistent.
    """
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", str(rank)))
    except ValueError:
        raise UserError("WORLD_SIZE, RANK and LOCAL_RANK must be integers (launch with torchrun)") from None
    if world < 1 or not 0 <= rank < world:
        raise UserError(f"RANK={rank} is not in [0, WORLD_SIZE={world}) (launch with torchrun)")
    return world, rank, local


def compile_cache_dirs(rank: int, environ: Optional[dict] = None) -> dict[str, str]:
    """Per-rank ``TORCHINDUCTOR_CACHE_DIR`` / ``TRITON_CACHE_DIR`` values, ``<base>/rank<N>``.

    Inductor's own cache writes are atomic (``write_atomic``: temp file + rename) and its compile
    steps take file locks, so one shared directory is process-safe; Triton's cache and third-party
    kernels are not all as careful, so each rank gets its own directory below the base (the user's
    ``TORCHINDUCTOR_CACHE_DIR`` or inductor's default ``<tmp>/torchinductor_<user>``). A cache warmed
    by a single-process run is therefore warmed again per rank.
    """
    env = os.environ if environ is None else environ
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (some containers)
        user = str(os.getuid())
    base = env.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")
    inductor = os.path.join(base, f"rank{rank}")
    return {"TORCHINDUCTOR_CACHE_DIR": inductor, "TRITON_CACHE_DIR": os.path.join(inductor, "triton")}


def init_distributed(device: torch.device, timeout_s: float = 1800,
                     host_collectives: bool = False) -> tuple[DistContext, torch.device]:
    """Join the process group torchrun described; return the context and this rank's device.

    NCCL for a CUDA device (each rank uses ``cuda:LOCAL_RANK``), Gloo for CPU. ``host_collectives``
    (``dist.offload``): with NCCL, Gloo beside it in the default group (``cuda:nccl,cpu:gloo``) for
    collectives on host tensors — offloaded gradients' norm, offloaded shards gathered for a checkpoint.
    Also points the compile caches at a per-rank directory (see :func:`compile_cache_dirs`).

    Raises:
        UserError: inconsistent torchrun variables, or CUDA with fewer devices than local ranks.
    """
    world, rank, local = env_ranks()
    if world == 1:
        return DistContext(), device
    if device.type == "cuda":
        if local >= torch.cuda.device_count():
            raise UserError(f"LOCAL_RANK={local} but only {torch.cuda.device_count()} CUDA devices are visible; "
                            "lower NPROC to the number of GPUs per node")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    os.environ.update(compile_cache_dirs(rank))
    if not dist.is_initialized():
        both = host_collectives and backend == "nccl"
        dist.init_process_group(backend="cuda:nccl,cpu:gloo" if both else backend,
                                timeout=timedelta(seconds=timeout_s))
    control = dist.new_group(backend="gloo") if backend == "nccl" else None
    return DistContext(world, rank, local, backend, control), device


def teardown(ctx: DistContext) -> None:
    """Leave the process group (idempotent)."""
    if ctx.enabled and dist.is_initialized():
        dist.destroy_process_group()


def wrap_model(model: torch.nn.Module, ctx: DistContext, device: torch.device, strategy: str = "ddp",
               mode: str = "fp32", offload: bool = False) -> torch.nn.Module:
    """What a training step calls: ``DistributedDataParallel`` around ``model`` (rank 0's weights are broadcast), or
    for ``strategy="fsdp"`` ``model`` itself sharded in place by FSDP2 (train/parallel/fsdp.py; ``mode``: the precision
    policy's, for its mixed precision; ``offload``: its shards kept in host memory; rank 0's weights are broadcast
    first, as DDP's); the model itself when single-process.

    Raises:
        UserError: ``fsdp`` on a torch without FSDP2.
    """
    if not ctx.enabled:
        return model
    if strategy == "fsdp":
        from train.parallel.fsdp import shard_model

        return shard_model(model, ctx.world_size, device, mode, offload)
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def all_reduce_sum(t: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """Sum ``t`` over ranks in place (no-op single-process); returns ``t``."""
    if ctx.enabled:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def any_rank(flag: bool, ctx: DistContext) -> bool:
    """True when ``flag`` is true on any rank (a CPU all-reduce over the control group)."""
    if not ctx.enabled:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctx.control_group)
    return bool(t.item())


def broadcast_from_main(obj: T, ctx: DistContext) -> T:
    """Rank 0's ``obj`` on every rank (``obj`` itself single-process)."""
    if not ctx.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=ctx.control_group)
    return box[0]


def gather_to_main(obj: Any, ctx: DistContext) -> Optional[list]:
    """Every rank's ``obj`` as a list on rank 0 (None elsewhere); ``[obj]`` single-process."""
    if not ctx.enabled:
        return [obj]
    out: Optional[list] = [None] * ctx.world_size if ctx.is_main else None
    dist.gather_object(obj, out, dst=0, group=ctx.control_group)
    return out


def agreed(fn: Callable[[], T], ctx: DistContext) -> T:
    """Run ``fn`` on every rank and agree on its failure: a :class:`UserError` on any rank is raised on all (printed
    once, by rank 0); any other exception is raised again on its own rank (its traceback) and as
    :class:`~train.errors.RankFailed` naming that rank and the error on every other one.

    Without this, a rank that stops leaves the others in the next collective: an opaque "connection closed" error
    once its process has exited, or a wait for the process group's timeout (30 minutes by default) while it lives.
    """
    err: Optional[tuple[str, str]] = None  # ("user" | "other", message)
    failure: Optional[BaseException] = None
    result: Any = None
    try:
        result = fn()
    except UserError as exc:
        if not ctx.enabled:
            raise
        err = ("user", str(exc))
    except Exception as exc:  # noqa: BLE001 - shared with the other ranks, then raised again as it was
        if not ctx.enabled:
            raise
        err, failure = ("other", f"{type(exc).__name__}: {exc}"), exc
    if ctx.enabled:
        errors: list = [None] * ctx.world_size
        dist.all_gather_object(errors, err, group=ctx.control_group)
        other = next(((r, e[1]) for r, e in enumerate(errors) if e and e[0] == "other"), None)
        if failure is not None:
            raise failure
        if other is not None:
            raise RankFailed(f"rank {other[0]} failed: {other[1]} (its traceback is in its output); rank "
                             f"{ctx.rank} stops with it")
        user = next((e[1] for e in errors if e), None)
        if user:
            agreed_error = UserError(user)
            agreed_error.every_rank = True  # every rank raises it: the command line prints it on rank 0 only
            raise agreed_error
    return result
