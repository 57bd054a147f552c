"""Version differences between the image's torch (2.1.0) and the current local torch, in one place."""

from __future__ import annotations

import functools
import sys
import types
import warnings
from collections.abc import Callable
from typing import Any, Optional

import torch


def torch_version() -> tuple[int, int]:
    """(major, minor) of the running torch."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def hf_attn_implementation() -> str:
    """The attention transformers models get: ``sdpa``, or ``eager`` on torch 2.1.0, where transformers refuses SDPA
    (it needs torch >= 2.1.1)."""
    parts = torch.__version__.split("+")[0].split(".")[:3]
    patch = int("".join(ch for ch in parts[2] if ch.isdigit()) or 0) if len(parts) > 2 else 0
    return "eager" if (*torch_version(), patch) < (2, 1, 1) else "sdpa"


def autocast_enabled(device_type: str) -> bool:
    """Whether autocast is on for ``device_type`` here: ``torch.is_autocast_enabled(device_type)`` (torch ≥ 2.4);
    before, ``is_autocast_cpu_enabled()`` for the CPU and ``is_autocast_enabled()`` (CUDA only) otherwise."""
    if torch_version() >= (2, 4):
        return bool(torch.is_autocast_enabled(device_type))
    return bool(torch.is_autocast_cpu_enabled() if device_type == "cpu" else torch.is_autocast_enabled())


def is_compiling() -> bool:
    """True while ``torch.compile`` traces the calling code: ``torch.compiler.is_compiling`` (torch >= 2.3) or
    ``torch._dynamo.is_compiling`` (2.1)."""
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and hasattr(compiler, "is_compiling"):
        return bool(compiler.is_compiling())
    import torch._dynamo as dynamo

    return bool(dynamo.is_compiling())


def make_grad_scaler(device_type: str, enabled: bool = True) -> Any:
    """A GradScaler for ``device_type``: ``torch.amp.GradScaler`` (torch ≥ 2.3) or ``torch.cuda.amp.GradScaler``
    (2.1)."""
    amp_scaler = getattr(torch.amp, "GradScaler", None)
    if amp_scaler is not None:
        return amp_scaler(device_type, enabled=enabled)
    if device_type != "cuda":
        raise RuntimeError(f"torch {torch.__version__} has a GradScaler for CUDA only")
    return torch.cuda.amp.GradScaler(enabled=enabled)


def load_state(path: str, map_location: Any = "cpu") -> Any:
    """``torch.load`` restricted to tensors and plain containers (``weights_only=True``, available since 1.13); torch
    2.1's own "TypedStorage is deprecated" warning, raised inside its loader, silenced (one-line error messages)."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
        return torch.load(path, map_location=map_location, weights_only=True)


def event_self_device_us(event: Any) -> float:
    """A profiler FunctionEvent's self device time in µs: ``self_device_time_total`` (torch ≥ 2.4) or
    ``self_cuda_time_total`` (2.1)."""
    value = getattr(event, "self_device_time_total", None)
    if value is None:
        value = getattr(event, "self_cuda_time_total", 0)
    return float(value or 0)


def event_device_total_us(event: Any) -> float:
    """A profiler FunctionEvent's device time including children, µs (``device_time_total`` or 2.1's
    ``cuda_time_total``)."""
    value = getattr(event, "device_time_total", None)
    if value is None:
        value = getattr(event, "cuda_time_total", 0)
    return float(value or 0)


def fused_adamw_supported(device: Any) -> bool:
    """Whether ``torch.optim.AdamW(fused=True)`` accepts parameters on ``device``.

    torch 2.0–2.3: CUDA only; torch ≥ 2.4: CUDA and CPU (and others). Probed by constructing one,
    since the check lives in the constructor in every version.
    """
    try:
        torch.optim.AdamW([torch.zeros(1, device=device, requires_grad=True)], fused=True)
    except (RuntimeError, ValueError, TypeError):
        return False
    return True


def foreach_norm(tensors: list) -> list:
    """L2 norm of each tensor: ``torch._foreach_norm`` (fused; private API present in 2.1 and 2.13), else a loop."""
    fn = getattr(torch, "_foreach_norm", None)
    if fn is not None:
        return list(fn(tensors))
    return [t.norm() for t in tensors]
# --- torch.compile / dynamo (train/compiling/session.py) -------------------------------------------------
# torch 2.1 and 2.13 both keep dynamo's counters in ``torch._dynamo.utils.counters`` (a
# defaultdict of Counters) and ``guard_failures`` (code object → reason strings). The recompile
# limit is ``config.cache_size_limit`` in 2.1 and ``config.recompile_limit`` (``cache_size_limit``
# kept as an alias) in 2.13. The persistent FX-graph cache is opt-in in 2.1
# (``inductor.config.fx_graph_cache``) and on by default later; AOTAutograd's cache exists only in
# newer versions. The warning when the limit is hit comes from the ``torch._dynamo.convert_frame``
# logger in both, starting "torch._dynamo hit config.".

RECOMPILE_LIMIT_LOGGER = "torch._dynamo.convert_frame"
RECOMPILE_LIMIT_MESSAGE = "torch._dynamo hit config."


def dynamo_supported() -> tuple[bool, str]:
    """(True, "") when torch.compile can run here, else (False, why)."""
    try:
        from torch._dynamo.eval_frame import is_dynamo_supported
    except Exception as exc:  # pragma: no cover - very old or stripped builds
        return False, f"torch._dynamo is not importable ({exc.__class__.__name__})"
    if not is_dynamo_supported():
        return False, f"torch.compile is not supported on this Python/platform with torch {torch.__version__}"
    return True, ""


def _dynamo_config() -> Any:
    import torch._dynamo.config as cfg

    return cfg


def recompile_limit() -> int:
    """dynamo's per-code-object limit on compiled variants (default 8)."""
    cfg = _dynamo_config()
    return int(getattr(cfg, "recompile_limit", getattr(cfg, "cache_size_limit", 8)))


def set_recompile_limit(limit: int) -> None:
    """Set the per-code-object limit (and raise the accumulated limit to at least ``limit``)."""
    cfg = _dynamo_config()
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    setattr(cfg, name, int(limit))
    for acc in ("accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(cfg, acc):
            setattr(cfg, acc, max(int(getattr(cfg, acc)), int(limit)))
            break


def compiled_graph_count() -> int:
    """Graphs dynamo has compiled in this process so far (``counters["stats"]["unique_graphs"]``)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compile_cache_counts() -> Optional[dict[str, int]]:
    """Persistent-cache hits and misses so far: FX-graph cache (+ AOTAutograd cache where it exists).

    None when this torch keeps no such counters (the hit/miss is then unknown).
    """
    from torch._dynamo.utils import counters

    inductor, aot = counters["inductor"], counters["aot_autograd"]
    hits = inductor["fxgraph_cache_hit"] + aot["autograd_cache_hit"]
    misses = inductor["fxgraph_cache_miss"] + aot["autograd_cache_miss"]
    if not hasattr(_inductor_config(), "fx_graph_cache"):
        return None
    return {"hits": int(hits), "misses": int(misses)}


def _inductor_config() -> Any:
    import torch._inductor.config as cfg

    return cfg


def enable_persistent_graph_cache() -> None:
    """Turn on inductor's on-disk FX-graph cache (opt-in in torch 2.1, default later)."""
    cfg = _inductor_config()
    if hasattr(cfg, "fx_graph_cache"):
        cfg.fx_graph_cache = True


def refresh_inductor_cache_dir() -> None:
    """Make inductor re-read ``TORCHINDUCTOR_CACHE_DIR`` (torch 2.1 memoises ``cache_dir()``; 2.13 reads it each
    call)."""
    try:
        from torch._inductor import codecache
    except Exception:  # pragma: no cover
        return
    fn = getattr(codecache, "cache_dir", None)
    if fn is not None and hasattr(fn, "cache_clear"):
        fn.cache_clear()


def guard_failure_snapshot() -> dict[Any, int]:
    """How many guard-failure reasons dynamo has recorded per code object so far."""
    from torch._dynamo.utils import guard_failures

    return {code: len(reasons) for code, reasons in guard_failures.items()}


def guard_failures_since(snapshot: dict[Any, int]) -> list[str]:
    """Guard-failure reasons recorded after ``snapshot`` (first line of each, compile id kept)."""
    from torch._dynamo.utils import guard_failures

    out = []
    for code, reasons in guard_failures.items():
        for reason in reasons[snapshot.get(code, 0):]:
            out.append(str(reason).strip().splitlines()[0])
    return out


def enable_guard_failure_reporting() -> None:
    """Make dynamo record guard-failure reasons in ``guard_failures`` (default on in 2.13, off in 2.1)."""
    cfg = _dynamo_config()
    if hasattr(cfg, "report_guard_failures"):
        cfg.report_guard_failures = True


# --- callables passed into compiled code (train/compiling/session.py CompiledForward) -----------------------
# The model takes its encoder-block context as a callable argument (``policy.blocks_autocast``, a bound
# method of a plain object). Dynamo before torch 2.4 cannot call a bound method of a non-Module object
# that arrives as an argument (it is a ``UserDefinedObjectVariable``; pytorch/pytorch#123399 added this
# in 2.4): it graph-breaks at ``with blocks_context():`` and hands the returned context manager to the
# resume function as ``___stack0``, guarded by its id (``___check_obj_id``). That object is new on every
# call and its death invalidates the compiled code, so torch 2.1 recompiles ``<resume in forward>`` on
# every call ("triggered by the following guard failure: ___guarded_code.valid") until the recompile
# limit sends it to eager. A plain function that calls the method is traced (inlined) in every version.

BOUND_METHOD_ARGS_TRACEABLE = torch_version() >= (2, 4)


def traceable_callable(fn: Any, cache: dict) -> Any:
    """``fn`` as something dynamo can call inside the graph.

    On torch < 2.4 a bound method of a non-Module object becomes a plain function calling it; the one
    made for a given (object, method) is kept in ``cache`` (with the object, so its id stays unique) and
    reused, so dynamo's guard on the function's identity holds from call to call. Anything else, and
    everything on torch ≥ 2.4, is returned as is.
    """
    if BOUND_METHOD_ARGS_TRACEABLE or not isinstance(fn, types.MethodType) or isinstance(fn.__self__, torch.nn.Module):
        return fn
    obj, func = fn.__self__, fn.__func__
    key = (id(obj), func)
    hit = cache.get(key)
    if hit is None or hit[0] is not obj:
        hit = cache[key] = (obj, _call_bound(obj, func))
    return hit[1]


def _call_bound(obj: Any, func: Callable) -> Callable:
    def call(*args: Any, **kwargs: Any) -> Any:
        return func(obj, *args, **kwargs)

    call.__name__ = call.__qualname__ = getattr(func, "__name__", "call")
    return call


# --- FlexAttention (packed rows with model.packed_attention=flex; train/data/attention.py) ---------------------------
# torch 2.1 has no torch.nn.attention.flex_attention (added in 2.5). torch 2.13 has it on CPU for the forward only:
# ``flex_attention`` raises NotImplementedError("FlexAttention does not support backward on CPU") for inputs that
# require grad, eager or under torch.compile alike; eager (no compile) it runs an unfused path that materialises
# the scores and warns. Whether it runs is probed once per (device type, backward) with a tiny call.

FLEX_MIN_VERSION = (2, 5)


@functools.cache
def flex_attention_functions(device_type: str = "cpu",
                             backward: bool = True) -> tuple[Optional[tuple[Callable, Callable]], str]:
    """``((flex_attention, create_block_mask), "")`` where FlexAttention runs on ``device_type`` (its backward too when
    ``backward``), else ``(None, why)`` in one clause, e.g. "torch 2.1.0 has no FlexAttention (needs ≥ 2.5)". Probed
    once per (device type, backward) with a tiny call."""
    version = torch.__version__.split("+")[0]
    if torch_version() < FLEX_MIN_VERSION:
        return None, f"torch {version} has no FlexAttention (needs ≥ {'.'.join(map(str, FLEX_MIN_VERSION))})"
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except Exception as exc:  # pragma: no cover - a stripped build
        return None, f"torch {version}: torch.nn.attention.flex_attention is not importable ({exc.__class__.__name__})"
    try:
        q = torch.zeros(1, 1, 16, 16, device=device_type, requires_grad=backward)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the eager (unfused) path's warning
            out = flex_attention(q, q, q)
            if backward:
                out.sum().backward()
    except NotImplementedError as exc:
        what = "backward" if backward and "backward" in str(exc) else "support"
        return None, f"torch {version} has no FlexAttention {what} on {device_type}"
    except Exception as exc:
        return None, (f"torch {version}: FlexAttention failed on {device_type} "
                      f"({exc.__class__.__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})")
    return (flex_attention, create_block_mask), ""


# --- FSDP2 (dist.strategy=fsdp; train/parallel/fsdp.py) ---------------------------------------------------------------
# ``fully_shard`` and ``MixedPrecisionPolicy`` are public in ``torch.distributed.fsdp`` from torch 2.6 (2.4–2.5 kept
# them in the private ``torch.distributed._composable.fsdp``, not supported here); torch 2.1 has no FSDP2 at all.
# ``set_force_sum_reduction_for_comms`` is newer still: gloo's averaging reduce-scatter returned gradients scaled by
# the world size under FSDP2 (pytorch/pytorch#162338); forcing sum makes FSDP2 divide itself. Where the method is
# missing nothing is forced: the parity test (tests/test_fsdp.py) is what shows a given torch right or wrong.

FSDP2_MIN_VERSION = (2, 6)


def fsdp2_api() -> tuple[Optional[tuple[Callable, Any, Callable, type]], str]:
    """``((fully_shard, MixedPrecisionPolicy, init_device_mesh, FSDPModule), "")`` where FSDP2 is public, else
    ``(None, why)``
    in one clause (e.g. "torch 2.1.0 has no FSDP2 (fully_shard needs torch ≥ 2.6)")."""
    version = torch.__version__.split("+")[0]
    if torch_version() < FSDP2_MIN_VERSION:
        return None, f"torch {version} has no FSDP2 (fully_shard needs torch ≥ {'.'.join(map(str, FSDP2_MIN_VERSION))})"
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    return (fully_shard, MixedPrecisionPolicy, init_device_mesh, FSDPModule), ""


def force_sum_reduction(module: torch.nn.Module) -> bool:
    """Make an FSDP2 module's gradient reductions plain sums followed by FSDP2's own division by the world size
    (``set_force_sum_reduction_for_comms``, its own parameter group only); False where this torch lacks it."""
    setter = getattr(module, "set_force_sum_reduction_for_comms", None)
    if setter is None:
        return False
    setter(True)
    return True


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``DTensor`` (FSDP2's sharded parameters, gradients, optimizer state; public from 2.5). No
    DTensor exists before its module is imported, so an unimported module answers False at no cost."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return dtensor is not None and isinstance(t, dtensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (its storage: in-place ops change the DTensor), else ``t``."""
    return t.to_local() if is_dtensor(t) else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole tensor (a collective: every rank calls it, in the same order), else ``t``."""
    return t.full_tensor() if is_dtensor(t) else t


def shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``full`` (every rank holds the same values) split as the DTensor ``like`` is: same mesh and placements, this
    rank's part only (no communication). ``full`` itself when ``like`` is no DTensor."""
    if not is_dtensor(like):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.to(like.device), like.device_mesh, like.placements, src_data_rank=None)
