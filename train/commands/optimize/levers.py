"""The lever catalogue of ``make optimize``: what each lever changes, where it applies, which profile evidence makes
it promising, and what it may change in training.

A :class:`Lever` turns the current best config and the latest profile's :class:`Evidence` into candidates — one per
value worth trying, each with ``overrides`` (``section.key → value``), a predicted speedup and the evidence behind
it — or into the one reason it does not apply here. Predictions are Amdahl's law on the profile's shares: a lever
that makes a fraction ``s`` of the step ``k`` times faster predicts ``1 / (1 − s + s / k)`` (Amdahl, AFIPS 1967).
They only rank candidates; every candidate is measured before it is kept (train/commands/optimize/search.py).

``may_change`` says what a lever can change in training: ``exact`` (the same computation), ``numerics`` (the same
samples in the same order, other rounding), ``sample order`` (other batches), ``training`` (other optimizer steps
per sample) or ``rng stream`` (other random masks). Everything but ``exact`` goes through the quality guard.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional, Union

EXACT, NUMERICS, SAMPLE_ORDER, TRAINING, RNG = "exact", "numerics", "sample order", "training", "rng stream"


@dataclass
class Evidence:
    """What a short profile of the current best config measured. Shares are fractions of the profiled step time
    (None: not measured). ``samples_per_s`` from the profiled steps; ``peak_memory_bytes`` / ``memory_total_bytes``
    on CUDA (None elsewhere, with the reason in ``notes``)."""

    step_ms: Optional[float] = None
    samples_per_s: Optional[float] = None
    padding_share: Optional[float] = None
    compute_share: Optional[float] = None
    memory_share: Optional[float] = None
    launch_share: Optional[float] = None
    data_wait_share: Optional[float] = None
    optimizer_share: Optional[float] = None
    other_share: Optional[float] = None
    dropout_mask_share: Optional[float] = None
    attention_share: Optional[float] = None
    top_memory_op: Optional[str] = None
    top_op: Optional[str] = None
    peak_memory_bytes: Optional[int] = None
    memory_total_bytes: Optional[int] = None
    notes: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class LeverContext:
    """What a lever may look at besides the evidence: the current best ``cfg`` (a RunConfig, ``train.precision``
    explicit), the device type, the model's capabilities and the machine."""

    cfg: Any
    device_type: str
    supports_packing: bool = False
    dropout_modules: int = 0
    native_bf16: bool = False
    cuda_bf16: bool = False
    fused_adamw: bool = False
    cpu_count: int = field(default_factory=lambda: os.cpu_count() or 1)
    torch_threads: int = 1
    planned_steps: Optional[int] = None
    batch_shapes: int = 1
    base_budget: Optional[int] = None  # the baseline's token budget (bounds the token-budget lever)
    batching_costs: dict[str, Any] = field(default_factory=dict)
    """``"current"`` and each value of :data:`BATCHING` → its :class:`~train.data.layout_cost.LayoutCost` on this data;
    empty: the batching lever falls back to the padding share alone."""


@dataclass
class Candidate:
    """One value of one lever to try: ``overrides`` on the current best, the ``predicted`` speedup (Amdahl on the
    evidence) and the ``evidence`` sentence behind it; ``may_change`` (module docstring); ``warmup_s_estimate``:
    one-off seconds the candidate costs before its steady state (compilation), amortised over the planned run;
    ``other_steps`` (set by the search from the backend's samples per step)."""

    lever: str
    value: str
    overrides: dict[str, Any]
    predicted: float
    evidence: str
    may_change: str
    warmup_s_estimate: float = 0.0
    other_steps: bool = False
    """Its samples per optimizer step differ from the current best's: judged by the quality guard at the horizon."""

    @property
    def key(self) -> tuple:
        return tuple(sorted((k, repr(v)) for k, v in self.overrides.items()))


Proposal = Union[list[Candidate], str]  # candidates, or why the lever does not apply


@dataclass(frozen=True)
class Lever:
    """A catalogue entry: ``name``, what it ``changes``, where it ``applies`` (words), which ``evidence`` ranks it,
    what it ``may_change``, ``propose(ctx, evidence) -> candidates | reason``; an exact one predicts its bound."""

    name: str
    changes: str
    applies: str
    evidence: str
    may_change: str
    propose: Callable[[LeverContext, Evidence], Proposal]


def amdahl(share: Optional[float], k: float) -> float:
    """Speedup when a fraction ``share`` of the step becomes ``k`` times faster (``share`` None: 1.0)."""
    s = min(1.0, share or 0.0)
    return 1.0 / (1.0 - s + s / k) if s > 0 else 1.0


def _pct(x: Optional[float]) -> str:
    return "not measured" if x is None else f"{100 * x:.1f}%"


def _precision(ctx: LeverContext, ev: Evidence) -> Proposal:
    mode = ctx.cfg.train.precision
    dense = (ev.compute_share or 0) + (ev.memory_share or 0)
    out = []
    if ctx.device_type == "cuda":
        for value, ok in (("bf16", ctx.cuda_bf16), ("fp16", True)):
            if value != mode and ok:
                out.append(Candidate("precision", value, {"train.precision": value}, amdahl(dense, 2.0),
                                     f"compute- and memory-bound ops {_pct(dense)} of the step: 16-bit tensor cores "
                                     "and half the bytes", NUMERICS))
        return out or f"already {mode}"
    if mode != "fp32":
        return f"already {mode}; fp32 would only be slower on this CPU's evidence"
    if not ctx.native_bf16:
        return "this CPU has no native bf16 (avx512_bf16 / amx_bf16): emulated bf16 is slower than fp32"
    return [Candidate("precision", "bf16", {"train.precision": "bf16"}, amdahl(dense, 1.8),
                      f"compute- and memory-bound ops {_pct(dense)} of the step; the CPU has native bf16", NUMERICS)]


BATCHING = {"optimal": ({"batching.method": "optimal", "batching.pad_to": "bound"}, 0.85),
            "optimal+batch-max": ({"batching.method": "optimal", "batching.pad_to": "batch-max"}, 0.9),
            "packed": ({"batching.method": "packed"}, 0.97)}
"""The batching lever's values: fitted buckets padded to their bounds (static shapes), the same buckets padded to each
batch's longest sample (dynamic padding), packing; with the share of the padding each is expected to remove (the
ranking without layout costs). Every one takes a token budget; ``hf-group-by-length`` (a fixed batch size) stays a
baseline to start from."""


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
            # attention share, fitted buckets can beat packing (measured: 1.38x on the tiny model, 2-core CPU)
            gain = batching_speedup(now, cost, ev.attention_share)
            words = (f"tokens processed per sample {now.tokens:.1f} -> {cost.tokens:.1f}, attention scores "
                     f"{now.scores:.0f} -> {cost.scores:.0f} (attention {_pct(ev.attention_share)} of the step; "
                     f"padding {_pct(pad)})")
        else:
            gain = amdahl(pad * removed, 1e9)
            words = f"padding {_pct(pad)} of the processed tokens"
        out.append(Candidate("batching", value, batching_settings(ctx.cfg, value), gain, words, SAMPLE_ORDER))
    return out or f"no other batching method for this model (batching.method={b.method})"


SCHEDULE_KEYS = ("optim.lr", "train.max_steps", "train.eval_every", "train.checkpoint_every")
"""What :func:`schedule_in_samples` sets: the settings counted in optimizer steps, and the peak learning rate."""
LR_EXPONENT = {"sqrt": 0.5, "linear": 1.0, "none": 0.0}


def schedule_in_samples(base: Any, k: float, rule: str) -> dict[str, Any]:
    """The settings of ``base`` (the config as given) for a candidate that takes ``k`` times its samples per optimizer
    step: every setting counted in steps (``train.max_steps``, ``eval_every``, ``checkpoint_every``; null stays null)
    divided by ``k`` (the step count rounded, the intervals rounded up; at least 1), so the run trains the same samples,
    warms its learning rate up over the same samples and evaluates as often; the peak ``optim.lr`` times ``k ** e`` with
    ``e`` = 0.5 for ``rule="sqrt"`` (the square-root scaling rule for adaptive optimizers: Malladi et al., "On the SDEs
    and Scaling Rules for Adaptive Gradient Algorithms", NeurIPS 2022), 1 for ``linear`` (Goyal et al. 2017, SGD), 0 for
    ``none``. ``k`` within 2 % of 1: ``base``'s own values. Returns all of :data:`SCHEDULE_KEYS`.

    Raises:
        ValueError: ``k`` ≤ 0 or an unknown ``rule``.
    """
    if not k > 0 or rule not in LR_EXPONENT:
        raise ValueError(f"schedule_in_samples: k={k!r} must be > 0 and rule={rule!r} one of {list(LR_EXPONENT)}")
    if abs(k - 1) <= 0.02:
        k = 1.0

    def steps(n: Optional[int]) -> Optional[int]:
        return None if n is None else max(1, round(n / k))

    def every(n: Optional[int]) -> Optional[int]:  # rounded up: no extra evaluation just before the final one
        return None if n is None else max(1, math.ceil(n / k - 1e-9))

    t = base.train
    return {"optim.lr": float(f"{base.optim.lr * k ** LR_EXPONENT[rule]:.4g}"), "train.max_steps": steps(t.max_steps),
            "train.eval_every": every(t.eval_every), "train.checkpoint_every": every(t.checkpoint_every)}


DYNAMIC_FIXED_BATCH = ("hf-group-by-length", "random")
"""Batching methods of a fixed batch size padded to each batch's longest sample: the token-budget lever proposes its
budgets in fitted buckets padded the same way (the batching lever's ``optimal+batch-max``), as one candidate — from
such a start, fitted buckets alone change little (the padding is already low: 4 % on WordNet with
``hf-group-by-length``), and the budget is what pays."""


def _budget_methods() -> tuple[str, ...]:
    return ("optimal", "quantile", "kmeans", "packed")


def budget_ladder(base_budget: int, max_factor: int) -> list[int]:
    """The token budgets the token-budget lever and ``optimize-grid`` choose from: ``base_budget`` (the config's
    ``batch_size × max_len``) times powers of two, from an eighth up to ``max_factor`` times (tokens per step)."""
    out, v = [], max(1, base_budget // 8)
    while v <= base_budget * max_factor:
        out.append(v)
        v *= 2
    return out


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
        words = (f"per-step overhead (launch-bound, optimizer, other) {_pct(per_step)} of the step, {spread} the "
                 f"tokens per step ({tokens_now:.0f} -> {value})"
                 + (f"; {100 * head:.0f}% of device memory free" if head is not None else "") + how)
        out.append(Candidate("token_budget", str(value), {**switch, "batching.max_tokens": int(value)},
                             amdahl(per_step, k) * layout, words, TRAINING))
    return out


def _fast_dropout(ctx: LeverContext, ev: Evidence) -> Proposal:
    if ctx.cfg.model.fast_dropout == "true":
        return "already on"
    if not ctx.dropout_modules:
        return "the model has no nn.Dropout module with p > 0"
    return [Candidate("fast_dropout", "true", {"model.fast_dropout": "true"}, amdahl(ev.dropout_mask_share, 4.0),
                      f"dropout mask ops (bernoulli_/rand) {_pct(ev.dropout_mask_share)} of the step", RNG)]


def _fused_adamw(ctx: LeverContext, ev: Evidence) -> Proposal:
    if not ctx.fused_adamw:
        return f"torch has no fused AdamW on {ctx.device_type} here"
    if ctx.cfg.optim.fused is not False:
        return "already fused (optim.fused=null uses it where torch supports it)"
    return [Candidate("fused_adamw", "true", {"optim.fused": True}, amdahl(ev.optimizer_share, 2.0),
                      f"optimizer stage {_pct(ev.optimizer_share)} of the step", NUMERICS)]


def _workers(ctx: LeverContext, ev: Evidence) -> Proposal:
    if ctx.cfg.data.num_workers:
        return f"data.num_workers={ctx.cfg.data.num_workers} already"
    n = 2 if ctx.device_type == "cuda" else min(2, max(1, ctx.cpu_count - 1))
    if ctx.device_type != "cuda" and ctx.cpu_count <= 2:
        n = 1
    return [Candidate("workers", str(n), {"data.num_workers": n}, amdahl(ev.data_wait_share, 1e9),
                      f"DataLoader wait {_pct(ev.data_wait_share)} of the step"
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
                      f"launch-bound {_pct(ev.launch_share)} and memory-bound {_pct(ev.memory_share)} of the step; "
                      f"~{warm:.0f} s of compilation over a {run_s:.0f} s run", NUMERICS, warm) for mode in modes]


def _allocator(ctx: LeverContext, ev: Evidence) -> Proposal:
    if ctx.device_type != "cuda":
        return "CUDA caching allocator: CUDA only"
    return ("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True is process-wide: both arms of an in-process A/B would "
            "share it, so it is measured by running make bench twice, not by this search")


CATALOGUE: tuple[Lever, ...] = (
    Lever("precision", "train.precision (bf16 / fp16 with a loss scaler / fp32)", "bf16 where the device has native "
          "bf16; fp16 on CUDA", "compute- and memory-bound share", NUMERICS, _precision),
    Lever("batching", "batching.method (dynamic padding, fitted buckets, packing) and its attention path",
          "packing where the model runs packed rows", "attention share, with each method's tokens and attention "
          "scores per sample on this data (padding share alone without them)", SAMPLE_ORDER, _batching),
    Lever("token_budget", "batching.max_tokens: tokens per step, the next power-of-two multiple of the config's "
          "batch_size x max_len at least 1.5x the current tokens per step, up to optimize.max_budget_factor while "
          "memory fits; the schedule kept in samples (optimize.lr_scaling)", "bucketed or packed batching",
          "per-step overhead share, memory headroom", TRAINING, _token_budget),
    Lever("fast_dropout", "model.fast_dropout: dropout masks drawn as 16-bit uniform integers",
          "models with nn.Dropout", "dropout-mask op share", RNG, _fast_dropout),
    Lever("fused_adamw", "optim.fused: AdamW's fused kernel", "CUDA; CPU from torch 2.4", "optimizer share",
          NUMERICS, _fused_adamw),
    Lever("workers", "data.num_workers (and pinned memory on CUDA)", "any", "data-wait share", EXACT, _workers),
    Lever("threads", "train.num_threads", "CPU", "compute share, cores unused", EXACT, _threads),
    Lever("compile", "compile.enabled/mode (default, reduce-overhead = CUDA graphs, max-autotune), warm-up amortised "
          "over the planned steps", "fixed batch shapes", "launch- and memory-bound share", NUMERICS, _compile),
    Lever("allocator", "PYTORCH_CUDA_ALLOC_CONF (expandable segments)", "CUDA", "memory fragmentation", EXACT,
          _allocator),
)


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
