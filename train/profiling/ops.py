"""Per-op records from a torch.profiler capture, and the arithmetic behind their intensity.

:func:`collect_ops` groups the profiler's ``FunctionEvent``s by (name, input shapes, input dtypes)
the way ``key_averages(group_by_input_shape=True)`` does, but keeps the dtypes (torch ≥ 2.4 records
them; on older torch they are unknown and the run's compute dtype is assumed).

Arithmetic intensity = FLOPs ÷ bytes moved (Williams, Waterman & Patterson 2009, "Roofline").
FLOPs come from the profiler (``with_flops=True``: matmuls, convolutions, add/mul) or, for ops it has
no formula for, from :data:`ELEMENTWISE_FLOPS` (FLOPs per output element, an estimate) and from the
analytic attention count for fused attention kernels. Bytes moved = every tensor input read once +
the output written once (output shape inferred from the inputs: matmul rules, reductions, or
the largest input for elementwise ops): the minimum traffic, ignoring caches, as the roofline
model does. Ops with no FLOP formula and no table entry get ``intensity=None``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from train.compat import event_self_device_us

DTYPE_BYTES = {"float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "int": 4,
               "short int": 2, "bool": 1, "unsigned char": 1, "signed char": 1, "c10::Float8_e4m3fn": 1,
               "c10::Float8_e5m2": 1}
"""Bytes per element for the dtype strings torch.profiler records (``FunctionEvent.input_dtypes``)."""

FLOAT_DTYPES = ("float", "double", "c10::Half", "c10::BFloat16")

ELEMENTWISE_FLOPS: dict[str, float] = {
    # FLOPs per output element; estimates for ops without a profiler formula (0 = pure data movement).
    "aten::add": 1, "aten::add_": 1, "aten::sub": 1, "aten::sub_": 1, "aten::mul": 1, "aten::mul_": 1,
    "aten::div": 1, "aten::div_": 1, "aten::sqrt": 1, "aten::rsqrt": 1, "aten::neg": 1, "aten::where": 1,
    "aten::clamp_min": 1, "aten::clamp": 2, "aten::masked_fill": 1, "aten::masked_fill_": 1,
    "aten::lerp_": 3, "aten::addcmul_": 3, "aten::addcdiv_": 3, "aten::threshold_backward": 1,
    "aten::gelu": 8, "aten::gelu_backward": 12, "aten::tanh": 4, "aten::exp": 4,
    "aten::native_dropout": 2, "aten::native_dropout_backward": 2, "aten::bernoulli_": 2,
    "aten::_softmax": 5, "aten::_softmax_backward_data": 3, "aten::_log_softmax": 5,
    "aten::_log_softmax_backward_data": 3, "aten::native_layer_norm": 8, "aten::native_layer_norm_backward": 12,
    "aten::sum": 1, "aten::mean": 1, "aten::norm": 2, "aten::linalg_vector_norm": 2,
    "aten::copy_": 0, "aten::clone": 0, "aten::cat": 0, "aten::stack": 0, "aten::index_select": 0,
    "aten::embedding_dense_backward": 1, "aten::fill_": 0, "aten::zero_": 0, "aten::contiguous": 0,
    "aten::_to_copy": 0, "aten::index": 0, "aten::index_put_": 0, "aten::_foreach_add_": 1, "aten::_foreach_mul_": 1,
}
REDUCTIONS = ("aten::sum", "aten::mean", "aten::norm", "aten::linalg_vector_norm", "aten::all", "aten::any",
              "aten::max")
MATMULS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::matmul", "aten::linear")
FUSED_ATTENTION = ("aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
                   "aten::_scaled_dot_product_cudnn_attention", "aten::_flash_attention_forward",
                   "aten::_efficient_attention_forward", "aten::_scaled_dot_product_flash_attention_for_cpu")


@dataclass
class OpRecord:
    """One (op, input shapes, input dtypes) group over the captured steps. Times in µs."""

    name: str
    input_shapes: list
    input_dtypes: Optional[list]
    calls: int = 0
    self_cpu_us: float = 0.0
    cpu_total_us: float = 0.0
    self_device_us: float = 0.0
    profiler_flops: int = 0
    extra: dict = field(default_factory=dict)

    def self_us(self, device_type: str) -> float:
        """The time the table ranks by: self device time on CUDA, self CPU time on CPU."""
        return self.self_device_us if device_type == "cuda" else self.self_cpu_us


def numel(shape: Sequence[int]) -> int:
    return math.prod(int(d) for d in shape) if shape else 1


def _tensor_inputs(shapes: Sequence, dtypes: Optional[Sequence], default_bytes: int) -> list[tuple[list, int]]:
    """(shape, bytes per element) for each input that is a tensor (dtype known) or has a non-empty shape."""
    out = []
    for i, shape in enumerate(shapes):
        dt = dtypes[i] if dtypes is not None and i < len(dtypes) else None
        if dt is not None and dt in DTYPE_BYTES:
            out.append((list(shape) if isinstance(shape, (list, tuple)) else [], DTYPE_BYTES[dt]))
        elif dt is None and isinstance(shape, (list, tuple)) and shape and all(isinstance(d, int) for d in shape):
            out.append((list(shape), default_bytes))
    return out


def matmul_dims(name: str, shapes: Sequence) -> Optional[tuple[int, int, int, int]]:
    """(batch, m, k, n) of a matmul-family op from its input shapes, or None when they do not fit.

    mm: [m,k]·[k,n]; addmm: bias, [m,k]·[k,n]; bmm: [b,m,k]·[b,k,n]; baddbmm: C, [b,m,k]·[b,k,n];
    linear: x[..., k]·W[n, k]ᵀ; matmul: [..., m, k]·[..., k, n].
    """
    try:
        if name == "aten::mm":
            (m, k), (_, n) = shapes[0], shapes[1]
            return 1, m, k, n
        if name == "aten::addmm":
            (m, k), (_, n) = shapes[1], shapes[2]
            return 1, m, k, n
        if name == "aten::bmm":
            (b, m, k), (_, _, n) = shapes[0], shapes[1]
            return b, m, k, n
        if name == "aten::baddbmm":
            (b, m, k), (_, _, n) = shapes[1], shapes[2]
            return b, m, k, n
        if name == "aten::linear":
            x, w = shapes[0], shapes[1]
            return 1, numel(x[:-1]), x[-1], w[0]
        if name == "aten::matmul":
            a, b = shapes[0], shapes[1]
            return numel(a[:-2]), a[-2], a[-1], b[-1]
    except (ValueError, IndexError, TypeError):
        return None
    return None


def bytes_moved(name: str, shapes: Sequence, dtypes: Optional[Sequence], default_bytes: int = 4) -> Optional[int]:
    """Minimum bytes an op moves: its tensor inputs read once + its output written once (see module doc)."""
    inputs = _tensor_inputs(shapes, dtypes, default_bytes)
    if not inputs:
        return None
    read = sum(numel(s) * b for s, b in inputs)
    dims = matmul_dims(name, shapes)
    out_b = max(b for _, b in inputs)
    if dims is not None:
        batch, m, _, n = dims
        write = batch * m * n * out_b
    elif name in REDUCTIONS:
        write = out_b  # a reduced output is tiny next to its input
    elif name in FUSED_ATTENTION:
        write = numel(inputs[0][0]) * inputs[0][1]  # output has the query's shape
    else:
        s, b = max(inputs, key=lambda t: numel(t[0]) * t[1])
        write = numel(s) * b
    return int(read + write)


def estimated_flops(name: str, shapes: Sequence, dtypes: Optional[Sequence],
                    default_bytes: int = 4) -> tuple[Optional[float], str]:
    """(FLOPs, source) for an op the profiler gave no FLOPs: matmul 2·b·m·k·n, fused attention
    4·B·h·Sq·Sk·d (forward; ×2 for backward), or :data:`ELEMENTWISE_FLOPS` × output elements."""
    dims = matmul_dims(name, shapes)
    if dims is not None:
        b, m, k, n = dims
        return 2.0 * b * m * k * n, "matmul 2·m·k·n"
    base = name.removesuffix("_backward")
    if base in FUSED_ATTENTION:
        try:
            (bq, h, sq, d), (_, _, sk, _) = shapes[0], shapes[1]  # q [B, h, Sq, d], k [B, h, Sk, d]
        except (ValueError, IndexError, TypeError):
            return None, "unknown"
        f = 4.0 * bq * h * sq * sk * d
        return (2 * f if name.endswith("_backward") else f), "attention 4·B·h·Sq·Sk·d"
    per = ELEMENTWISE_FLOPS.get(name)
    if per is None:
        return None, "unknown"
    inputs = _tensor_inputs(shapes, dtypes, default_bytes)
    if not inputs:
        return None, "unknown"
    if name in REDUCTIONS:
        return float(per * numel(inputs[0][0])), "elementwise estimate"
    return float(per * max(numel(s) for s, _ in inputs)), "elementwise estimate"


def is_annotation(name: str) -> bool:
    """Ranges that are not ops: profiler steps, our stage ranges, optimizer annotations."""
    return name.startswith(("ProfilerStep", "train/", "Optimizer.", "## ", "[memory]",
                            "autograd::engine::evaluate_function"))


def collect_ops(events: Iterable[Any]) -> list[OpRecord]:
    """Group profiler ``FunctionEvent``s (CPU-side ops) into :class:`OpRecord`s.

    Device kernels are folded into their launching op by torch (``self_device_time_total``);
    ranges (see :func:`is_annotation`) are left out.
    """
    groups: dict[tuple, OpRecord] = {}
    for e in events:
        if is_annotation(e.name) or getattr(e, "is_user_annotation", False):
            continue
        dev = getattr(e, "device_type", None)
        if dev is not None and "CPU" not in str(dev):
            continue  # kernel events are children of CPU ops; their time is in self_device_us
        shapes = [list(s) if isinstance(s, (list, tuple)) else s for s in (e.input_shapes or [])]
        dtypes = getattr(e, "input_dtypes", None)
        dtypes = list(dtypes) if dtypes else None
        key = (e.name, str(shapes), str(dtypes))
        rec = groups.get(key)
        if rec is None:
            rec = groups[key] = OpRecord(e.name, shapes, dtypes)
        rec.calls += 1
        rec.self_cpu_us += float(e.self_cpu_time_total)
        rec.cpu_total_us += float(e.cpu_time_total)
        rec.self_device_us += float(event_self_device_us(e))
        rec.profiler_flops += int(getattr(e, "flops", 0) or 0)
    return list(groups.values())
