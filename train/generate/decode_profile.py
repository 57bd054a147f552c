"""Where a single request's time per output token goes, per serving path: a ``torch.profiler`` capture (CPU
activities) of batch-1 requests, each op's *self* time put in one category by its name, and the rest of the wall
time — spent outside any profiled op — called Python and dispatch.

Categories (self time, so a ``aten::linear`` that calls ``aten::addmm`` is counted once, in the callee):

* ``matmuls``: the projections and the LM head (``mm``/``addmm``/``bmm``/``linear``/``matmul``, oneDNN's);
* ``attention``: attention over the cache (``scaled_dot_product_attention`` and its kernels, eager softmax);
* ``kv_cache``: writing the new keys and values into the cache (``cat``, ``index_copy``, ``index_put``, ``copy_``);
* ``sampling``: picking the next token (``argmax``, ``topk``, ``sort``, ``multinomial``);
* ``compiled_kernels``: inductor's fused kernels (the ``CompiledFxGraph`` call, whose generated C++/Triton kernels the
  profiler does not see one by one) and the compiled region's guard checks (``Torch-Compiled Region``);
* ``other_ops``: every other op (norms, activations, rotary embeddings, masks, views);
* ``python_and_dispatch``: wall time minus the ops' self time — ``generate``'s loop, the model's Python, the logits
  processors' Python, the dispatcher's own time between ops.

Figures are ms per output token (the prompt's forward included: one step of ``max_new_tokens``). The capture slows
every op a little; compare paths with each other, not with the unprofiled TPOT.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

CATEGORY_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("compiled_kernels", ("compiledfxgraph", "torch-compiled region", "compiledfunction")),
    ("attention", ("scaled_dot_product", "flash_attention", "_efficient_attention", "softmax")),
    ("matmuls", ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul", "aten::baddbmm",
                 "mkldnn", "onednn")),
    ("kv_cache", ("aten::cat", "aten::index_copy", "aten::index_put", "aten::copy_", "aten::_index_put")),
    ("sampling", ("aten::argmax", "aten::topk", "aten::sort", "aten::multinomial")),
)
CATEGORIES = tuple(name for name, _ in CATEGORY_RULES) + ("other_ops", "python_and_dispatch")


def category(op_name: str) -> str:
    """The category of one profiler event by its name (module docstring); ``other_ops`` when no rule matches."""
    low = op_name.lower()
    for name, needles in CATEGORY_RULES:
        if any(n in low for n in needles):
            return name
    return "other_ops"


def breakdown(events: Iterable[Any], wall_s: float, output_tokens: int) -> dict[str, Any]:
    """ms per output token by category from profiler ``FunctionEvent``s (their ``self_cpu_time_total``, µs) over
    ``wall_s`` seconds that produced ``output_tokens`` tokens; the top ops by self time beside it."""
    per_cat: dict[str, float] = defaultdict(float)
    per_op: dict[str, float] = defaultdict(float)
    for ev in events:
        us = float(getattr(ev, "self_cpu_time_total", 0.0) or 0.0)
        per_cat[category(ev.name)] += us
        per_op[ev.name] += us
    ops_s = sum(per_cat.values()) / 1e6
    per_cat["python_and_dispatch"] = max(0.0, wall_s - ops_s) * 1e6
    tokens = max(1, output_tokens)
    ms = {c: per_cat.get(c, 0.0) / 1e3 / tokens for c in CATEGORIES}
    top = sorted(per_op.items(), key=lambda kv: -kv[1])[:8]
    return {"ms_per_output_token": ms, "wall_ms_per_output_token": 1e3 * wall_s / tokens,
            "output_tokens": output_tokens,
            "top_ops_ms_per_output_token": {name: us / 1e3 / tokens for name, us in top}}


def profile_single(model, path: str, prompts: list[list[int]], gen) -> dict[str, Any]:
    """Profile ``prompts`` served one at a time on ``path`` (a ``generate`` path, warmed up before) and break the
    time per output token down (:func:`breakdown`)."""
    from torch.profiler import ProfilerActivity, profile

    from train.generate.engines import serve
    from train.profiling.native_noise import filtered_stderr

    prof = profile(activities=[ProfilerActivity.CPU])
    with filtered_stderr():
        prof.start()
    try:
        t0 = time.perf_counter()
        timings = [serve(model, path, [p], gen, 1)[0] for p in prompts]
        wall = time.perf_counter() - t0
    finally:
        with filtered_stderr():
            prof.stop()
    return breakdown(prof.events(), wall, sum(len(t.output_ids) for t in timings))


def explain(profiles: dict[str, dict[str, Any]], baseline: str = "dynamic") -> list[str]:
    """One line per profiled path against ``baseline``: ms per token saved or added in each category, largest
    first — what the TPOT ratio is made of."""
    base = profiles.get(baseline)
    lines = []
    for path, prof in profiles.items():
        if path == baseline or base is None:
            continue
        diff = {c: prof["ms_per_output_token"][c] - base["ms_per_output_token"][c] for c in CATEGORIES}
        ranked = sorted(diff.items(), key=lambda kv: -abs(kv[1]))
        parts = ", ".join(f"{c} {d:+.2f}" for c, d in ranked if abs(d) >= 0.01)
        lines.append(f"{path} vs {baseline}: {prof['wall_ms_per_output_token']:.2f} vs "
                     f"{base['wall_ms_per_output_token']:.2f} ms per output token profiled; by category (ms): {parts}")
    return lines
