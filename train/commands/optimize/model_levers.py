"""The levers of ``make optimize`` on the model's own kernels — the dropout mask, the LM head's loss, packed rows'
attention path — with their values, declared once here (``optimize-grid`` crosses :data:`FAST_DROPOUT`). The
catalogue that lists them with the others is levers.py."""

from __future__ import annotations

from train.commands.optimize.proposals import NUMERICS, RNG, Candidate, Evidence, LeverContext, Proposal, amdahl, pct
from train.data.attention import ruled_out

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
