"""The levers of ``make optimize`` on the model's own kernels — the dropout mask, the LM head's loss, packed rows'
attention path, block checkpointing (memory for time) — with their values, declared once here (``optimize-grid``
crosses :data:`FAST_DROPOUT`). The catalogue that lists them with the others is levers.py."""

from __future__ import annotations

from typing import Optional

from train.data.attention import ruled_out
from train.optimize.proposals import (
    NUMERICS,
    RNG,
    TRAINING,
    Candidate,
    Evidence,
    LeverContext,
    Proposal,
    amdahl,
    pct,
)

FAST_DROPOUT = ("false", "true")
"""``model.fast_dropout`` off (nn.Dropout) and on (masks drawn as 16-bit integers: the lever's value);
``optimize-grid`` crosses both."""


def fast_dropout_lever(ctx: LeverContext, ev: Evidence) -> Proposal:
    on = FAST_DROPOUT[1]
    if ctx.cfg.model.fast_dropout == on:
        return "already on"
    if not ctx.dropout_modules:
        return "the model has no nn.Dropout module with p > 0"
    return [Candidate("fast_dropout", on, {"model.fast_dropout": on}, amdahl(ev.dropout_mask_share, 4.0),
                      f"dropout mask ops (bernoulli_/rand) {pct(ev.dropout_mask_share)} of the step", RNG)]


CHUNKED_LOSS = ("false", "true")
"""``model.chunked_loss`` off (the LM head's logits whole) and on (head + cross-entropy chunk by chunk: the lever's
value)."""


def chunked_loss_lever(ctx: LeverContext, ev: Evidence) -> Proposal:
    if ctx.cfg.model.task != "causal-lm":
        return f"model.task={ctx.cfg.model.task}: logits [N, classes], nothing to chunk"
    if ctx.cfg.model.chunked_loss == CHUNKED_LOSS[1]:
        return "already on"
    # the head's matmuls run either way; what goes is the fp32 [tokens, vocab] logits' round trips through memory
    # (log-softmax, its gradient, the casts), which live in the loss stage and the head's backward
    return [Candidate("chunked_loss", CHUNKED_LOSS[1], {"model.chunked_loss": CHUNKED_LOSS[1]},
                      amdahl(ev.loss_share, 2.0),
                      f"the loss stage (cross-entropy over the whole fp32 logits) {pct(ev.loss_share)} of the step",
                      NUMERICS)]


EAGER_MASK_K = 2.0
"""How many times faster ``eager-mask`` makes the attention's share of a 16-bit CPU step, to rank it: the same scores
without the fused kernel, whose per-block cost dominates short rows (docs/models.md: 2.6x on rows of 64 in bf16,
0.6x in fp32). ``varlen`` and ``flex`` are ranked by the scores they skip (the layout costs)."""


def attention_lever(ctx: LeverContext, ev: Evidence) -> Proposal:
    cfg = ctx.cfg
    if cfg.batching.method != "packed":
        return f"batching.method={cfg.batching.method}: the attention path is packed rows' (batching.method=packed)"
    if not ctx.attention_paths:
        return "the model runs its own attention with a block-diagonal mask (no other path)"
    now, fitted = ctx.batching_costs.get("current"), ctx.batching_costs.get("optimal+batch-max")
    skipped = now.scores / fitted.scores if now is not None and fitted is not None and fitted.scores else 2.0
    out, why_not = [], []
    for path, why in ctx.attention_paths.items():
        if path == cfg.model.packed_attention:
            continue
        why = why or ruled_out(path, cfg.compile.enabled == "true", cfg.model.dropout) or (
            "the fused kernel is the faster one on CUDA" if path == "eager-mask" and ctx.device_type == "cuda" else "")
        if why:
            why_not.append(f"{path}: {why}")
            continue
        if path == "eager-mask":
            k = EAGER_MASK_K if cfg.train.precision != "fp32" else 1.0
            words = (f"attention {pct(ev.attention_share)} of the step (top op {ev.top_op}); the same scores without "
                     f"the fused kernel, whose per-block cost dominates short rows on a CPU in 16-bit"
                     + ("" if k > 1 else " (fp32 here: no gain expected)"))
        else:
            k = skipped
            words = (f"attention {pct(ev.attention_share)} of the step; scores per sample {now.scores:.0f} -> "
                     f"{fitted.scores:.0f} when each sample attends over itself only" if now is not None and fitted
                     is not None else f"attention {pct(ev.attention_share)} of the step; other samples' scores "
                     "skipped")
        out.append(Candidate("attention", path, {"model.packed_attention": path}, amdahl(ev.attention_share, k),
                             words, NUMERICS))
    return out or "; ".join(why_not) or f"already {cfg.model.packed_attention}"


RECOMPUTE_COST = 1.3
"""Step time with every block checkpointed over without: one more forward per block, a forward being about a third
of a step (forward + backward ≈ 3 forwards). It only ranks the candidate; the A/B measures it."""
MEMORY_BOUND = 0.9
"""The profiled step's peak over the device's memory from which memory is the constraint (CUDA: the profile's
``torch.cuda.max_memory_allocated`` over the device's total)."""


def memory_constraint(ctx: LeverContext, ev: Evidence) -> Optional[str]:
    """Why memory, not speed, limits the current best — an arm that ran out of memory, or the profiled peak at
    :data:`MEMORY_BOUND` of the device's memory or more — or None (not seen)."""
    if ctx.out_of_memory is not None:
        return f"{ctx.out_of_memory.lever}={ctx.out_of_memory.value} ran out of memory"
    if ev.peak_memory_bytes and ev.memory_total_bytes and ev.peak_memory_bytes >= MEMORY_BOUND * ev.memory_total_bytes:
        return f"the profiled step's peak is {pct(ev.peak_memory_bytes / ev.memory_total_bytes)} of device memory"
    return None


def checkpoint_blocks_lever(ctx: LeverContext, ev: Evidence) -> Proposal:
    """``memory.checkpoint_blocks=true`` only where memory is the constraint (:func:`memory_constraint`), with what
    memory refused: the candidate that ran out of memory, else twice the token budget. Alone it only slows the step
    (a search for speed would never keep it), so elsewhere it is a reason, never a candidate."""
    cfg = ctx.cfg
    if cfg.memory.checkpoint_blocks:
        return "already on"
    why = memory_constraint(ctx, ev)
    cost = f"every block's forward recomputed in the backward (about +{100 * (RECOMPUTE_COST - 1):.0f}% step time)"
    if why is None:
        peak = (f"peak {pct(ev.peak_memory_bytes / ev.memory_total_bytes)} of device memory"
                if ev.peak_memory_bytes and ev.memory_total_bytes else "peak memory not measured on this device")
        return (f"memory is not the constraint ({peak}, no arm ran out of memory): {cost} would buy memory this "
                "run does not need")
    refused = ctx.out_of_memory
    if refused is not None:
        return [Candidate("checkpoint_blocks", "true", {**refused.overrides, "memory.checkpoint_blocks": True},
                          refused.predicted / RECOMPUTE_COST, f"memory is the constraint: {why}; with {cost} it may "
                          f"fit ({refused.evidence})", refused.may_change)]
    budget = cfg.batching.max_tokens
    if not budget:
        return (f"memory is the constraint ({why}), but this config has no token budget to grow into the memory it "
                f"frees, and alone {cost} only slows the step: set memory.checkpoint_blocks=true by hand where the "
                "run must fit")
    per_step = (ev.launch_share or 0) + (ev.other_share or 0) + (ev.optimizer_share or 0)
    return [Candidate("checkpoint_blocks", "true", {"memory.checkpoint_blocks": True,
                                                    "batching.max_tokens": 2 * budget},
                      amdahl(per_step, 2.0) / RECOMPUTE_COST,
                      f"memory is the constraint: {why}; with {cost} twice the tokens per step may fit ({budget} -> "
                      f"{2 * budget}: per-step overhead {pct(per_step)} of the step spread over them)", TRAINING)]
