"""The lever catalogue of ``make optimize``: what each lever changes, where it applies, which profile evidence makes
it promising, what it may change in training — and each lever's values, declared once here, with the share of them
``optimize-grid`` crosses stated beside them (``GRID_…``, :data:`FIXED_BATCH`).

A :class:`~train.optimize.proposals.Lever` turns the current best config and the latest profile's
``Evidence`` into candidates — one per value worth trying, each with ``overrides`` (``section.key → value``), a
predicted speedup and the evidence behind it — or into the one reason it does not apply here. Predictions are
Amdahl's law on the profile's shares: a lever that makes a fraction ``s`` of the step ``k`` times faster predicts
``1 / (1 − s + s / k)`` (Amdahl, AFIPS 1967). They only rank candidates; every candidate is measured before it is
kept (search.py). What each kind of ``may_change`` means: proposals.py.
"""

from __future__ import annotations

from typing import Any, Optional

from train.optimize.model_levers import (
    attention_lever,
    checkpoint_blocks_lever,
    chunked_loss_lever,
    fast_dropout_lever,
)
from train.optimize.proposals import (
    EXACT,
    NUMERICS,
    RNG,
    SAMPLE_ORDER,
    TRAINING,
    Candidate,
    Evidence,
    Lever,
    LeverContext,
    Proposal,
    amdahl,
    pct,
)
from train.optimize.schedule import SCHEDULE_KEYS

PRECISIONS = ("fp32", "bf16", "fp16")
"""``train.precision``'s values, those a device runs given by :func:`precisions_on`; ``optimize-grid`` crosses every
one the device runs (bf16 on any CUDA device)."""


def precisions_on(device_type: str, bf16: bool) -> list[str]:
    """fp32 everywhere; bf16 where ``bf16`` (the device runs it natively: a CPU with avx512_bf16 / amx_bf16, a CUDA
    device that supports it); fp16, with a loss scaler, on CUDA."""
    return [p for p in PRECISIONS if p == "fp32" or (p == "bf16" and bf16) or (p == "fp16" and device_type == "cuda")]


def _precision(ctx: LeverContext, ev: Evidence) -> Proposal:
    mode = ctx.cfg.train.precision
    dense = (ev.compute_share or 0) + (ev.memory_share or 0)
    if ctx.device_type == "cuda":
        out = [Candidate("precision", value, {"train.precision": value}, amdahl(dense, 2.0),
                         f"compute- and memory-bound ops {pct(dense)} of the step: 16-bit tensor cores and half the "
                         "bytes", NUMERICS)
               for value in precisions_on("cuda", ctx.cuda_bf16) if value not in ("fp32", mode)]
        return out or f"already {mode}"
    if mode != "fp32":
        return f"already {mode}; fp32 would only be slower on this CPU's evidence"
    if not ctx.native_bf16:
        return "this CPU has no native bf16 (avx512_bf16 / amx_bf16): emulated bf16 is slower than fp32"
    return [Candidate("precision", "bf16", {"train.precision": "bf16"}, amdahl(dense, 1.8),
                      f"compute- and memory-bound ops {pct(dense)} of the step; the CPU has native bf16", NUMERICS)]


BATCHING = {"optimal": ({"batching.method": "optimal", "batching.pad_to": "bound"}, 0.85),
            "optimal+batch-max": ({"batching.method": "optimal", "batching.pad_to": "batch-max"}, 0.9),
            "packed": ({"batching.method": "packed"}, 0.97)}
"""The batching lever's values: fitted buckets padded to their bounds (static shapes), the same buckets padded to each
batch's longest sample (dynamic padding), packing; with the share of the padding each is expected to remove (the
ranking without layout costs). Every one takes a token budget; ``hf-group-by-length`` (a fixed batch size) stays a
baseline to start from. ``optimize-grid`` crosses every one (packing where the model runs packed rows), each padded to
its bounds unless it says otherwise, with each of its token budgets (:data:`GRID_BUDGET_FACTORS`)."""

FIXED_BATCH = ("pad-to-max", "hf-group-by-length")
"""Fixed-batch methods a config starts from — every batch padded to ``data.max_len``, or to its longest sample: no
value of the batching lever, but ``optimize-grid`` crosses them too (without a token budget), as the starting points
the search improves on."""


def batching_settings(cfg: Any, value: str) -> dict[str, Any]:
    """The overrides of batching value ``value`` on ``cfg`` (packing keeps a fixed batch's size as rows)."""
    over = dict(BATCHING[value][0])
    if value == "packed" and cfg.batching.max_tokens is None:
        over["batching.max_tokens"] = None
    return over


def batching_speedup(current: Any, candidate: Any, attention_share: float) -> float:
    """Predicted speedup of a batching method over the current one from their layout costs
    (:class:`~train.data.layout_cost.LayoutCost`): Amdahl's law with two parts, the attention's S × S work
    (``attention_share`` of the step) scaling with the scores per sample, everything else with the tokens processed
    per sample: ``1 / ((1 − a) · tokens_m / tokens_c + a · scores_m / scores_c)``."""
    a = min(1.0, max(0.0, attention_share))
    per_token = candidate.tokens / current.tokens if current.tokens else 1.0
    per_score = candidate.scores / current.scores if current.scores else 1.0
    return 1.0 / ((1 - a) * per_token + a * per_score)


def _batching(ctx: LeverContext, ev: Evidence) -> Proposal:
    b = ctx.cfg.batching
    pad = ev.padding_share
    if pad is None:
        return "the profile measured no padding share"
    now = ctx.batching_costs.get("current")
    out = []
    for value, (settings, removed) in BATCHING.items():
        if all(getattr(b, k.split(".")[1]) == v for k, v in settings.items()) or (
                value == "packed" and not ctx.supports_packing):
            continue
        cost = ctx.batching_costs.get(value)
        if now is not None and cost is not None and ev.attention_share is not None:
            # packed rows pay C x C attention per row, buckets B x B per sample: on short samples and a large
            # attention share, fitted buckets can beat packing (docs/optimize.md, "The lever catalogue")
            gain = batching_speedup(now, cost, ev.attention_share)
            words = (f"tokens processed per sample {now.tokens:.1f} -> {cost.tokens:.1f}, attention scores "
                     f"{now.scores:.0f} -> {cost.scores:.0f} (attention {pct(ev.attention_share)} of the step; "
                     f"padding {pct(pad)})")
        else:
            gain = amdahl(pad * removed, 1e9)
            words = f"padding {pct(pad)} of the processed tokens"
        out.append(Candidate("batching", value, batching_settings(ctx.cfg, value), gain, words, SAMPLE_ORDER))
    return out or f"no other batching method for this model (batching.method={b.method})"


DYNAMIC_FIXED_BATCH = ("hf-group-by-length", "random")
"""Batching methods of a fixed batch size padded to each batch's longest sample: the token-budget lever proposes its
budgets in fitted buckets padded the same way (the batching lever's ``optimal+batch-max``), as one candidate — from
such a start the padding is already low, so fitted buckets alone change little, and the budget is what pays."""


def _budget_methods() -> tuple[str, ...]:
    return ("optimal", "quantile", "kmeans", "packed")


def budget_ladder(base_budget: int, max_factor: int) -> list[int]:
    """The token budgets the token-budget lever chooses from: ``base_budget`` (the config's ``batch_size × max_len``)
    times powers of two, from an eighth up to ``max_factor`` times (tokens per step)."""
    out, v = [], max(1, base_budget // 8)
    while v <= base_budget * max_factor:
        out.append(v)
        v *= 2
    return out


GRID_BUDGET_FACTORS = (0.5, 1, 2)
"""``optimize-grid``'s token budgets: the config's ``batch_size × max_len`` times each, rounded down — the rungs of
:func:`budget_ladder` around the config's tokens per step (the same numbers where that product is a multiple of 8) —
and no budget (the batch size), with each value of :data:`BATCHING`."""


def _token_budget(ctx: LeverContext, ev: Evidence) -> Proposal:
    b, max_len = ctx.cfg.batching, ctx.cfg.data.max_len
    switch: dict[str, Any] = {}  # a fixed batch padded to its longest sample: the budget comes with fitted buckets
    if b.method in DYNAMIC_FIXED_BATCH:
        switch = {"batching.method": "optimal", "batching.pad_to": "batch-max"}
    elif b.method not in _budget_methods():
        return f"batching.method={b.method} takes a fixed batch size (a token budget needs buckets or packing)"
    now = ctx.batching_costs.get("current")
    if b.max_tokens:
        tokens_now = float(b.max_tokens)
    elif now is not None and now.samples_per_step:
        tokens_now = now.samples_per_step * now.tokens  # the fixed batch's padded tokens per step
    else:
        tokens_now = float(b.batch_size * max_len)
    per_step = (ev.launch_share or 0) + (ev.other_share or 0) + (ev.optimizer_share or 0)
    head = None
    if ev.peak_memory_bytes and ev.memory_total_bytes:
        head = 1 - ev.peak_memory_bytes / ev.memory_total_bytes
    base = ctx.base_budget or b.batch_size * max_len
    factor = ctx.cfg.optimize.max_budget_factor
    ladder = budget_ladder(base, factor)
    bigger = [v for v in ladder if v >= 1.5 * tokens_now]
    # and the rung below a budget in place: near-neutral (large batches of a memory-bound step leave the caches)
    smaller = [v for v in ladder if v < b.max_tokens][-1:] if b.max_tokens and not switch else []
    if not bigger and not smaller:
        return (f"batching.max_tokens={b.max_tokens or round(tokens_now)} tokens per step: the next budget would pass "
                f"optimize.max_budget_factor={factor}x the config's {base}")
    layout, how = 1.0, ""
    fitted = ctx.batching_costs.get("optimal+batch-max")
    if switch:
        how = f"; in fitted buckets padded to the batch maximum (batching.method={b.method} takes a fixed batch size)"
        if now is not None and fitted is not None:
            layout = batching_speedup(now, fitted, ev.attention_share or 0.0)
    out = []
    for value in bigger[:2] + smaller:  # two rungs up: a budget that learns worse may have a smaller one that does not
        k = value / tokens_now
        # the overhead is paid once per step: per sample it shrinks by k (Amdahl on the per-step share)
        spread = f"spread over {k:.1f}x" if k > 1 else f"the rung down: {k:.1f}x"
        words = (f"per-step overhead (launch-bound, optimizer, other) {pct(per_step)} of the step, {spread} the "
                 f"tokens per step ({tokens_now:.0f} -> {value})"
                 + (f"; {100 * head:.0f}% of device memory free" if head is not None else "") + how)
        out.append(Candidate("token_budget", str(value), {**switch, "batching.max_tokens": int(value)},
                             amdahl(per_step, k) * layout, words, TRAINING))
    return out


FUSED_ADAMW = (False, True)
"""``optim.fused`` off and on (the lever's value); ``optimize-grid`` crosses both where torch has the fused kernel."""


def _fused_adamw(ctx: LeverContext, ev: Evidence) -> Proposal:
    off, on = FUSED_ADAMW
    if not ctx.fused_adamw:
        return f"torch has no fused AdamW on {ctx.device_type} here"
    if ctx.cfg.optim.fused is not off:
        return "already fused (optim.fused=null uses it where torch supports it)"
    return [Candidate("fused_adamw", "true", {"optim.fused": on}, amdahl(ev.optimizer_share, 2.0),
                      f"optimizer stage {pct(ev.optimizer_share)} of the step", NUMERICS)]


def _workers(ctx: LeverContext, ev: Evidence) -> Proposal:
    if ctx.cfg.data.num_workers:
        return f"data.num_workers={ctx.cfg.data.num_workers} already"
    n = 2 if ctx.device_type == "cuda" else min(2, max(1, ctx.cpu_count - 1))
    if ctx.device_type != "cuda" and ctx.cpu_count <= 2:
        n = 1
    return [Candidate("workers", str(n), {"data.num_workers": n}, amdahl(ev.data_wait_share, 1e9),
                      f"DataLoader wait {pct(ev.data_wait_share)} of the step"
                      + ("; pinned host memory is on for CUDA" if ctx.device_type == "cuda" else ""), EXACT)]


def _threads(ctx: LeverContext, ev: Evidence) -> Proposal:
    if ctx.device_type == "cuda":
        return "CPU threads: not the bottleneck of a CUDA step"
    if ctx.torch_threads >= ctx.cpu_count:
        return f"torch already uses every core ({ctx.torch_threads} threads, {ctx.cpu_count} cores)"
    dense = (ev.compute_share or 0) + (ev.memory_share or 0)
    return [Candidate("threads", str(ctx.cpu_count), {"train.num_threads": ctx.cpu_count},
                      amdahl(dense, ctx.cpu_count / max(1, ctx.torch_threads)),
                      f"{ctx.torch_threads} of {ctx.cpu_count} cores in use", EXACT)]


COMPILE_S_PER_SHAPE = {"cpu": 20.0, "cuda": 8.0}
"""Rough one-off compile seconds per batch shape (ranks compile against the run's length only; measured in the A/B)."""


def _compile(ctx: LeverContext, ev: Evidence) -> Proposal:
    c = ctx.cfg.compile
    if c.enabled == "true":
        return f"already compiled (mode {c.mode})"
    if ctx.cfg.batching.method in ("hf-group-by-length", "random") or (
            ctx.cfg.batching.pad_to != "bound" and ctx.cfg.batching.method not in ("pad-to-max", "packed")):
        return "batches are padded to their longest sample: no fixed set of shapes to compile"
    modes = ("default", "reduce-overhead", "max-autotune") if ctx.device_type == "cuda" else ("default",)
    fused = (ev.launch_share or 0) * 0.7 + (ev.memory_share or 0) * 0.3
    steady = amdahl(fused, 2.0)
    warm = COMPILE_S_PER_SHAPE.get(ctx.device_type, 20.0) * max(1, ctx.batch_shapes)
    run_s = (ctx.planned_steps or 0) * (ev.step_ms or 0) / 1e3
    amortised = run_s / (run_s / steady + warm) if run_s > 0 else steady
    return [Candidate("compile", mode, {"compile.enabled": "true", "compile.mode": mode}, amortised,
                      f"launch-bound {pct(ev.launch_share)} and memory-bound {pct(ev.memory_share)} of the step; "
                      f"~{warm:.0f} s of compilation over a {run_s:.0f} s run", NUMERICS, warm) for mode in modes]


def _allocator(ctx: LeverContext, ev: Evidence) -> Proposal:
    if ctx.device_type != "cuda":
        return "CUDA caching allocator: CUDA only"
    return ("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True is process-wide: both arms of an in-process A/B would "
            "share it, so it is measured by running make bench twice, not by this search")


BATCHING_KEYS = ("batching.method", "batching.pad_to", "batching.max_tokens")

CATALOGUE: tuple[Lever, ...] = (
    Lever("precision", "train.precision (bf16 / fp16 with a loss scaler / fp32)", "bf16 where the device has native "
          "bf16; fp16 on CUDA", "compute- and memory-bound share", NUMERICS, _precision, ("train.precision",)),
    Lever("batching", "batching.method (dynamic padding, fitted buckets, packing)",
          "packing where the model runs packed rows", "attention share, with each method's tokens and attention "
          "scores per sample on this data (padding share alone without them)", SAMPLE_ORDER, _batching, BATCHING_KEYS),
    Lever("token_budget", "batching.max_tokens: tokens per step, the next power-of-two multiple of the config's "
          "batch_size x max_len at least 1.5x the current tokens per step, up to optimize.max_budget_factor while "
          "memory fits; the schedule kept in samples (optimize.lr_scaling)", "bucketed or packed batching",
          "per-step overhead share, memory headroom", TRAINING, _token_budget, BATCHING_KEYS),
    Lever("attention", "model.packed_attention: packed rows' attention (varlen: each sample over itself; eager-mask: "
          "the block mask in transformers' eager attention; flex: FlexAttention)", "packed rows of a causal LM or the "
          "built-in encoder", "attention share (and the scores a row pays against its samples')", NUMERICS,
          attention_lever, ("model.packed_attention",)),
    Lever("fast_dropout", "model.fast_dropout: dropout masks drawn as 16-bit uniform integers",
          "models with nn.Dropout", "dropout-mask op share", RNG, fast_dropout_lever, ("model.fast_dropout",)),
    Lever("chunked_loss", "model.chunked_loss: the LM head + cross-entropy over token chunks, gradients in the "
          "forward pass (the fp32 logits never whole)", "causal LMs with a linear head", "loss-stage share", NUMERICS,
          chunked_loss_lever, ("model.chunked_loss",)),
    Lever("checkpoint_blocks", "memory.checkpoint_blocks: activations of each transformer block recomputed in the "
          "backward (about +30% step time), with what memory refused (the candidate that ran out of memory, or twice "
          "the token budget)", "only where memory is the constraint: an arm ran out of memory, or the profiled peak "
          "is at 90% of device memory or more", "peak memory, out-of-memory arms", TRAINING, checkpoint_blocks_lever,
          ("memory.checkpoint_blocks", "batching.max_tokens")),
    Lever("fused_adamw", "optim.fused: AdamW's fused kernel", "CUDA; CPU from torch 2.4", "optimizer share",
          NUMERICS, _fused_adamw, ("optim.fused",)),
    Lever("workers", "data.num_workers (and pinned memory on CUDA)", "any", "data-wait share", EXACT, _workers,
          ("data.num_workers",)),
    Lever("threads", "train.num_threads", "CPU", "compute share, cores unused", EXACT, _threads,
          ("train.num_threads",)),
    Lever("compile", "compile.enabled/mode (default, reduce-overhead = CUDA graphs, max-autotune), warm-up amortised "
          "over the planned steps", "fixed batch shapes", "launch- and memory-bound share", NUMERICS, _compile,
          ("compile.enabled", "compile.mode")),
    Lever("allocator", "PYTORCH_CUDA_ALLOC_CONF (expandable segments)", "CUDA", "memory fragmentation", EXACT,
          _allocator),
)


SETTINGS_KEYS = (*dict.fromkeys(k for lever in CATALOGUE for k in lever.keys), *SCHEDULE_KEYS)
"""Every setting a candidate may set: the levers' keys and the schedule's (what makes a config's result comparable,
e.g. ``optimize-grid --optimized``'s arm)."""


def select(names: Optional[list[str]], catalogue: tuple[Lever, ...] = CATALOGUE) -> tuple[Lever, ...]:
    """The levers named in ``names`` (None: all), in catalogue order.

    Raises:
        ValueError: a name not in the catalogue (the message lists the valid ones).
    """
    if names is None:
        return catalogue
    known = {lv.name: lv for lv in catalogue}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"optimize.levers: unknown lever(s) {unknown}; choose from {', '.join(known)}")
    return tuple(lv for lv in catalogue if lv.name in names)
