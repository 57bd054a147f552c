"""The attribution table: which ops take the step, and why (compute-, memory-, launch- or data-bound).

Input: :class:`~train.profiling.ops.OpRecord`s from the profiled steps, the step-time breakdown by
stage, the device's ridge point (:mod:`train.profiling.roofline`) and what the run knows about its
batches. Output: a JSON-able summary with the top-K rows, the breakdown, and up to three
recommendations, each citing the number that triggered it. The funnel follows the original design:
symptom → where (stage, op) → why (verdict).
"""

from __future__ import annotations

from typing import Any, Optional

from train.config.profiling import ProfileConfig
from train.profiling.ops import FLOAT_DTYPES, OpRecord, bytes_moved, estimated_flops
from train.profiling.ranges import STAGES

COMPUTE, MEMORY, LAUNCH, DATA, UNKNOWN = "compute-bound", "memory-bound", "CPU/launch-bound", "data-bound", "unknown"
LAUNCH_CPU_RATIO = 2.0
"""CUDA: an op whose CPU time (with children) is at least this multiple of its device time is launch-bound."""


def verdict(row: dict[str, Any], ridge: Optional[float], device_type: str, th: ProfileConfig) -> tuple[str, str]:
    """(verdict, reason) for one table row.

    Rules, in order: mean time per call < ``launch_us`` → launch-bound; on CUDA, CPU time ≥
    ``LAUNCH_CPU_RATIO`` × device time → launch-bound; intensity ≥ ridge → compute-bound;
    intensity < ridge → memory-bound; no intensity → unknown.
    """
    calls = max(1, row["calls"])
    per_call = row["self_time_us"] / calls
    if per_call < th.launch_us:
        return LAUNCH, f"{per_call:.1f} µs per call < {th.launch_us:g} µs: dispatch/launch overhead dominates"
    if (device_type == "cuda" and row["self_time_us"] > 0
            and row["cpu_total_us"] >= LAUNCH_CPU_RATIO * row["self_time_us"]):
        return LAUNCH, f"CPU {row['cpu_total_us']:.0f} µs ≥ {LAUNCH_CPU_RATIO:g}× device {row['self_time_us']:.0f} µs"
    ai = row.get("intensity_flop_per_byte")
    if ai is None or ridge is None:
        return UNKNOWN, "no FLOP formula or byte count for this op"
    if ai >= ridge:
        return COMPUTE, f"intensity {ai:.2f} FLOP/B ≥ ridge {ridge:.2f}"
    return MEMORY, f"intensity {ai:.2f} FLOP/B < ridge {ridge:.2f}"


def op_row(rec: OpRecord, device_type: str, step_total_us: float, default_bytes: int) -> dict[str, Any]:
    """One table row (times µs, FLOPs and bytes summed over the captured calls)."""
    self_us = rec.self_us(device_type)
    flops: Optional[float] = float(rec.profiler_flops) if rec.profiler_flops else None
    source = "torch.profiler" if flops else None
    if flops is None:
        per_call, source = estimated_flops(rec.name, rec.input_shapes, rec.input_dtypes, default_bytes)
        flops = per_call * rec.calls if per_call is not None else None
    nbytes = bytes_moved(rec.name, rec.input_shapes, rec.input_dtypes, default_bytes)
    total_bytes = nbytes * rec.calls if nbytes is not None else None
    intensity = flops / total_bytes if flops is not None and total_bytes else None
    return {
        "op": rec.name, "calls": rec.calls, "input_shapes": rec.input_shapes, "input_dtypes": rec.input_dtypes,
        "self_time_us": self_us, "self_cpu_us": rec.self_cpu_us, "cpu_total_us": rec.cpu_total_us,
        "self_device_us": rec.self_device_us if device_type == "cuda" else None,
        "flops": flops, "flops_source": source if flops is not None else None, "bytes_moved": total_bytes,
        "intensity_flop_per_byte": intensity,
        "achieved_flops_per_s": flops / (self_us / 1e6) if flops is not None and self_us > 0 else None,
        "share_of_step": self_us / step_total_us if step_total_us > 0 else None,
    }


def float_mask_rows(ops: list[OpRecord]) -> list[OpRecord]:
    """``scaled_dot_product_attention`` calls whose attn_mask (4th input) is floating point, not bool."""
    out = []
    for rec in ops:
        if rec.name == "aten::scaled_dot_product_attention" and rec.input_dtypes and len(rec.input_dtypes) > 3:
            if rec.input_dtypes[3] in FLOAT_DTYPES and rec.input_shapes[3]:
                out.append(rec)
    return out


def recommendations(summary: dict[str, Any], ops: list[OpRecord], th: ProfileConfig, ctx: dict[str, Any]) -> list[dict]:
    """Up to three recommendations, highest trigger ratio (measured ÷ threshold) first; each cites its number."""
    recs = []
    shares = summary["breakdown_share"]
    by_verdict = summary["share_by_verdict"]

    def add(rule: str, measured: float, threshold: float, text: str) -> None:
        if measured >= threshold:
            recs.append({"rule": rule, "measured": measured, "threshold": threshold, "score": measured / threshold,
                         "text": text})

    pad = ctx.get("padding_share")
    if pad is not None:
        fix = ("bucket by length: batching.method=optimal (make buckets)"
               if ctx.get("batching_method") in ("pad-to-max", "random")
               else "more buckets: raise batching.num_buckets")
        add("padding", pad, th.padding_share,
            f"{100 * pad:.1f}% of the processed tokens were padding (token efficiency {1 - pad:.3f}, "
            f"threshold {100 * th.padding_share:.0f}%) → {fix}.")
    data = shares.get("data_wait")
    if data is not None:
        fix = ("start DataLoader workers: data.num_workers=2 (and pin_memory on CUDA)" if not ctx.get("num_workers")
               else f"more DataLoader workers than data.num_workers={ctx.get('num_workers')}, or precompute batches")
        add("data_wait", data, th.data_bound_share,
            f"waiting on the DataLoader took {100 * data:.1f}% of the step "
            f"(threshold {100 * th.data_bound_share:.0f}%) → {fix}.")
    launch = by_verdict.get(LAUNCH, 0.0)
    add("launch_bound", launch, th.launch_share,
        f"launch/dispatch-bound ops took {100 * launch:.1f}% of the step (threshold {100 * th.launch_share:.0f}%) → "
        "fuse small ops with torch.compile; on CUDA capture static-shape steps in CUDA graphs "
        "(mode='reduce-overhead').")
    masks = float_mask_rows(ops)
    if masks:
        add("float_mask", float(len(masks)), 1.0,
            f"{sum(r.calls for r in masks)} scaled_dot_product_attention calls got a floating-point attn_mask "
            f"{masks[0].input_shapes[3]} → pass a bool mask (True = attend): less memory, and fused kernels accept it.")
    mem = by_verdict.get(MEMORY, 0.0)
    top_mem = next((r for r in summary["table"] if r["verdict"] == MEMORY), None)
    if top_mem is not None:
        add("memory_bound", mem, th.memory_share,
            f"memory-bound ops took {100 * mem:.1f}% of the step (largest: {top_mem['op']} at "
            f"{top_mem['intensity_flop_per_byte']:.2f} FLOP/B < ridge "
            f"{summary['roofline']['ridge_flop_per_byte']:.1f}) → "
            "fuse elementwise chains (torch.compile); a 16-bit dtype halves the bytes moved "
            "(on CPU only with native bf16).")
    comp = by_verdict.get(COMPUTE, 0.0)
    top_comp = next((r for r in summary["table"] if r["verdict"] == COMPUTE), None)
    if top_comp is not None and top_comp["achieved_flops_per_s"]:
        frac = top_comp["achieved_flops_per_s"] / summary["roofline"]["peak_flops_per_s"]
        add("compute_bound", comp, th.compute_share,
            f"compute-bound ops took {100 * comp:.1f}% of the step; the largest ({top_comp['op']}) reached "
            f"{top_comp['achieved_flops_per_s'] / 1e9:.1f} GFLOP/s = {100 * frac:.0f}% of the peak → "
            "fewer FLOPs per useful token (less padding), a lower-precision matmul dtype where the hardware has one, "
            "or tile-friendly sizes (multiples of 8).")
    opt = shares.get("optimizer")
    if opt is not None:
        add("optimizer", opt, th.optimizer_share,
            f"the optimizer stage (zero_grad, clip, AdamW step) took {100 * opt:.1f}% of the step (threshold "
            f"{100 * th.optimizer_share:.0f}%) → AdamW(foreach=True), or fused=True on CUDA.")
    other = shares.get("other")
    if other is not None:
        add("other", other, th.other_share,
            f"{100 * other:.1f}% of the step is outside data/forward/backward/optimizer (Python bookkeeping, logging) "
            f"(threshold {100 * th.other_share:.0f}%) → log less often (train.log_every) "
            "and keep host-device syncs out of the loop.")
    recs.sort(key=lambda r: -r["score"])
    return recs[:3]


def build_summary(ops: list[OpRecord], *, device_type: str, step_total_us: float, active_steps: int,
                  stage_us: dict[str, float], roofline: dict[str, Any], th: ProfileConfig,
                  default_bytes: int = 4, ctx: Optional[dict] = None) -> dict[str, Any]:
    """The attribution summary (what summary.json holds).

    Args:
        ops: grouped op records over the captured (active) steps.
        device_type: ``"cuda"`` ranks by self device time, anything else by self CPU time.
        step_total_us: wall time of the captured steps, summed (µs).
        stage_us: µs per stage (:data:`~train.profiling.ranges.STAGES`: ``data_wait``, ``forward``, ``loss``,
            ``backward``, ``optimizer``) summed over the steps.
        roofline: from :func:`train.profiling.roofline.ridge_point` (needs ``ridge_flop_per_byte``,
            ``peak_flops_per_s``).
        th: the run's ``profile`` section: the verdict and recommendation thresholds and ``top_k`` (table rows).
        ctx: run facts for the recommendations: ``padding_share``, ``batching_method``, ``num_workers``.
    Raises:
        ValueError: ``step_total_us`` ≤ 0 or ``active_steps`` < 1.
    """
    if step_total_us <= 0 or active_steps < 1:
        raise ValueError("the profile captured no step time")
    ctx = ctx or {}
    ridge = roofline.get("ridge_flop_per_byte")
    rows = [op_row(r, device_type, step_total_us, default_bytes) for r in ops]
    for row in rows:
        row["verdict"], row["verdict_reason"] = verdict(row, ridge, device_type, th)
    rows.sort(key=lambda r: -r["self_time_us"])
    share_by_verdict: dict[str, float] = {}
    for row in rows:
        share_by_verdict[row["verdict"]] = share_by_verdict.get(row["verdict"], 0.0) + (row["share_of_step"] or 0.0)
    stages = {k: stage_us.get(k, 0.0) for k in STAGES}
    stages["other"] = max(0.0, step_total_us - sum(stages.values()))
    breakdown_ms = {k: v / 1e3 / active_steps for k, v in stages.items()}
    breakdown_share = {k: v / step_total_us for k, v in stages.items()}
    data_share = breakdown_share["data_wait"]
    share_by_verdict[DATA] = data_share
    summary: dict[str, Any] = {
        "device_type": device_type,
        "ranked_by": "self device time" if device_type == "cuda" else "self CPU time",
        "active_steps": active_steps,
        "step_time_ms": step_total_us / 1e3 / active_steps,
        "breakdown_ms": breakdown_ms,
        "breakdown_share": breakdown_share,
        "data_bound": data_share >= th.data_bound_share,
        "data_verdict": (f"{DATA}: DataLoader wait {100 * data_share:.1f}% of the step "
                         f"≥ {100 * th.data_bound_share:.0f}%"
                         if data_share >= th.data_bound_share else
                         f"not data-bound: DataLoader wait {100 * data_share:.1f}% of the step "
                         f"< {100 * th.data_bound_share:.0f}%"),
        "share_by_verdict": share_by_verdict,
        "roofline": roofline,
        "table": rows[:th.top_k],
        "ops_total": len(rows),
        "context": ctx,
    }
    summary["recommendations"] = recommendations(summary, ops, th, ctx)
    return summary


def _fmt(x: Optional[float], spec: str, scale: float = 1.0, none: str = "–") -> str:
    return none if x is None else format(x / scale, spec)


def render_markdown(summary: dict[str, Any]) -> str:
    """summary.md: the attribution table, the breakdown and the recommendations (and the other tools' sections)."""
    lines = _table_markdown(summary) if "table" in summary else ["# Profile", ""]
    for key, title in (("pyspy", "py-spy"), ("nsys", "Nsight Systems"), ("gpu_sampling", "GPU sampling"),
                       ("trace", "Trace"), ("skipped", "Skipped")):
        if summary.get(key):
            lines += ["", f"## {title}", "", "```", _plain(summary[key]), "```"]
    return "\n".join(lines) + "\n"


def _table_markdown(summary: dict[str, Any]) -> list[str]:
    r = summary["roofline"]
    lines = [f"# Profile attribution ({summary['device_type']}, {summary['active_steps']} active steps, "
             f"step {summary['step_time_ms']:.1f} ms under the profiler)", ""]
    lines += [f"Ridge point {r['ridge_flop_per_byte']:.2f} FLOP/B "
              f"({r['source']}: peak {r['peak_flops_per_s'] / 1e9:.1f} GFLOP/s, "
              f"{r['peak_bytes_per_s'] / 1e9:.1f} GB/s). Ranked by {summary['ranked_by']}.", ""]
    lines += ["| op | calls | input shapes | self ms | CPU total ms | GFLOP | GFLOP/s | FLOP/B | share | verdict |",
              "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for row in summary["table"]:
        shapes = ", ".join(str(s) for s in row["input_shapes"] if s)[:60]
        lines.append(f"| `{row['op']}` | {row['calls']} | {shapes} | {row['self_time_us'] / 1e3:.2f} | "
                     f"{row['cpu_total_us'] / 1e3:.2f} | "
                     f"{_fmt(row['flops'], '.3f', 1e9)} | {_fmt(row['achieved_flops_per_s'], '.1f', 1e9)} | "
                     f"{_fmt(row['intensity_flop_per_byte'], '.2f')} | {_fmt(row['share_of_step'], '.1%')} | "
                     f"{row['verdict']} |")
    lines += ["", f"Data: {summary['data_verdict']}.", "", "## Step-time breakdown (per step)", "",
              "| stage | ms | share |", "| --- | ---: | ---: |"]
    for k, ms in summary["breakdown_ms"].items():
        lines.append(f"| {k} | {ms:.2f} | {summary['breakdown_share'][k]:.1%} |")
    lines += ["", "Share of the step by verdict: "
              + ", ".join(f"{k} {v:.1%}" for k, v in summary["share_by_verdict"].items()), ""]
    lines += ["## Recommendations", ""]
    recs = summary["recommendations"]
    lines += [f"{i}. {rec['text']}" for i, rec in enumerate(recs, 1)] or [
        "No rule fired: no measured figure crossed its threshold."]
    if 0 < len(recs) < 3:
        lines.append(f"(only {len(recs)} rule(s) fired; the other measured figures are below their thresholds)")
    return lines


def _plain(obj: Any, indent: str = "") -> str:
    if isinstance(obj, dict):
        return "\n".join(f"{indent}{k}: "
                         + (("\n" + _plain(v, indent + "  ")) if isinstance(v, (dict, list)) and v else str(v))
                         for k, v in obj.items())
    if isinstance(obj, list):
        return "\n".join(f"{indent}- {_plain(v).strip()}" if not isinstance(v, dict)
                         else f"{indent}- " + _plain(v, indent + "  ").strip()
                         for v in obj)
    return f"{indent}{obj}"
