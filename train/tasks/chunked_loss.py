"""A memory-bounded LM-head cross-entropy (``model.chunked_loss``): the output layer and the cross-entropy computed
over chunks of tokens, each chunk's gradient computed in the forward pass, so the fp32 ``[tokens, vocab]`` logits
never exist whole — at most one chunk of them, ``[chunk_rows, V]``, at a time.

The method is Liger-Kernel's fused linear cross-entropy (``liger_kernel/ops/fused_linear_cross_entropy.py``: the
chunk size rule, the gradient taken in the forward pass) written in plain PyTorch, so it runs on CPU and torch 2.1.
Recomputing each chunk's logits in the backward pass (checkpointing the head) would cost a second head matmul per
step; taking ``softmax - onehot`` while the chunk's logits are at hand costs none.

Numerics follow the unchunked path of :class:`train.models.causal.ExternalCausalLM` under autocast: the head's
matmul runs in ``compute_dtype`` (the precision policy's: bf16, fp16 or fp32), its logits are upcast to fp32 and the
cross-entropy is fp32; the gradients are kept in fp32 until the backward pass scales them by the incoming gradient
(the GradScaler's scale under fp16) and casts them to the inputs' dtypes.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
"""A target that is not trained (``F.cross_entropy``'s default ``ignore_index``)."""


def chunk_rows(tokens: int, hidden: int, vocab: int) -> int:
    """Rows per chunk: Liger's rule, ``next_pow2(ceil(tokens / ceil(vocab / hidden)))`` — a chunk's logits
    ``[rows, vocab]`` hold about as many values as the hidden states ``[tokens, hidden]`` — at least 1."""
    per = math.ceil(tokens / max(1, math.ceil(vocab / max(1, hidden))))
    return max(1, 1 << max(0, per - 1).bit_length())


class FusedLinearCrossEntropy(torch.autograd.Function):
    """loss = mean over trained targets of ``cross_entropy(hidden @ weightᵀ + bias, targets)``.

    forward(hidden FloatTensor[N, H] (any float dtype), weight FloatTensor[V, H], bias FloatTensor[V] or None,
    targets LongTensor[N] (``IGNORE_INDEX`` = not trained), rows int (per chunk), compute_dtype torch.dtype)
    → fp32 scalar. With no trained target the loss is 0 and every gradient 0 (``F.cross_entropy`` would give NaN).
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                targets: torch.Tensor, rows: int, compute_dtype: torch.dtype) -> torch.Tensor:
        trained = targets != IGNORE_INDEX
        count = trained.sum().clamp_min(1).to(torch.float32)  # a tensor: no host sync
        w = weight.to(compute_dtype)
        b = None if bias is None else bias.to(compute_dtype)
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        grad_bias = None if bias is None else torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
        for start in range(0, hidden.shape[0], rows):
            h = hidden[start:start + rows].to(compute_dtype)
            t = targets[start:start + rows]
            keep = trained[start:start + rows]
            logits = F.linear(h, w, b).float()  # [rows, V] fp32: the only chunk alive
            lse = torch.logsumexp(logits, dim=-1)
            safe = t.clamp_min(0)
            picked = logits.gather(1, safe[:, None])[:, 0]
            loss += torch.where(keep, lse - picked, torch.zeros_like(lse)).sum()
            # d(loss)/d(logits) = (softmax - onehot) / count, 0 on untrained rows; in place on the chunk's logits
            grad = logits.sub_(lse[:, None]).exp_()
            grad.scatter_add_(1, safe[:, None], -torch.ones_like(lse)[:, None])
            grad.mul_((keep.to(torch.float32) / count)[:, None])
            g = grad.to(compute_dtype)
            grad_hidden[start:start + rows] = (g @ w).float()
            grad_weight += (g.t() @ h).float()
            if grad_bias is not None:
                grad_bias += grad.sum(0)
        ctx.has_bias = bias is not None
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.save_for_backward(grad_hidden, grad_weight, *(() if grad_bias is None else (grad_bias,)))
        return loss / count

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        saved = ctx.saved_tensors
        gh, gw = saved[0] * grad_out, saved[1] * grad_out
        gb = saved[2] * grad_out if ctx.has_bias else None
        hd, wd, bd = ctx.dtypes
        return gh.to(hd), gw.to(wd), (None if gb is None else gb.to(bd)), None, None, None


def chunked_cross_entropy(hidden: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor,
                          compute_dtype: torch.dtype = torch.float32, rows: Optional[int] = None) -> torch.Tensor:
    """The mean next-token cross-entropy (fp32 scalar) of hidden states ``[..., H]`` through ``head`` (an
    ``nn.Linear`` H → V: the LM head) against ``targets`` ``[...]`` (``IGNORE_INDEX`` = not trained), chunked by
    :func:`chunk_rows` unless ``rows`` is given."""
    flat, t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    n = rows or chunk_rows(flat.shape[0], flat.shape[1], head.weight.shape[0])
    return FusedLinearCrossEntropy.apply(flat, head.weight, head.bias, t, n, compute_dtype)


CHUNKED_MARGIN = 1.05
"""``auto`` keeps the chunked loss unless it measures slower than this × the unchunked one (median step ms): within
5 % the two are a tie on a shared CPU, and the memory saved decides."""


def measure_head_paths(head: torch.nn.Linear, tokens: int, compute_dtype: torch.dtype, device: torch.device,
                       rounds: int = 5) -> dict[str, Any]:
    """Median ms of the head + cross-entropy forward and backward on ``tokens`` random hidden states, unchunked
    (fp32 logits ``[tokens, V]`` whole) and chunked, through the one A/B primitive (one untimed call each, then
    ``rounds`` rotated rounds). The head's ``.grad`` is not touched; no RNG of the run is drawn from."""
    from train.perf.ab import Arm, interleave

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, head.in_features, generator=gen).to(device, compute_dtype).requires_grad_()
    targets = torch.randint(0, head.out_features, (tokens,), generator=gen).to(device)

    wrt = [hidden, *head.parameters()]  # gradients returned, never accumulated into the model's .grad

    def unchunked() -> None:
        logits = F.linear(hidden, head.weight.to(compute_dtype),
                          None if head.bias is None else head.bias.to(compute_dtype)).float()
        torch.autograd.grad(F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX), wrt)

    def chunked() -> None:
        torch.autograd.grad(chunked_cross_entropy(hidden, head, targets, compute_dtype), wrt)

    ab = interleave([Arm("unchunked", unchunked), Arm("chunked", chunked)], rounds=rounds, window=1, warmup=1,
                    device=device)
    med = {arm: ab.arms[arm].median_step_ms() for arm in ("unchunked", "chunked")}
    ratio = ab.ratio("chunked", "unchunked", "steps")
    return {**med, "speedup": med["unchunked"] / med["chunked"], "speedup_interval": [ratio.low, ratio.high],
            "rounds": rounds, "tokens": tokens, "vocab": head.out_features,
            "chunk_rows": chunk_rows(tokens, head.in_features, head.out_features)}


def decide_chunked_loss(requested: str, task: str, model: torch.nn.Module, tokens: int, compute_dtype: torch.dtype,
                        device: torch.device, measure: Optional[Any] = None) -> dict[str, Any]:
    """Resolve ``model.chunked_loss`` (``auto`` | ``true`` | ``false``) for a run: report.json's
    ``levers.chunked_loss`` — ``applied``, ``requested``, ``reason``, ``source`` (requested | rule | measured) and,
    when measured, ``measurement`` (:func:`measure_head_paths` on ``tokens``, the run's token budget; tests force
    ``measure``).

    Raises:
        UserError: ``true`` where it cannot run (a classifier; a causal LM whose logits are not a linear head over
            its last hidden states).
    """
    from train.errors import UserError

    def out(applied: bool, reason: str, source: str, m: Optional[dict] = None) -> dict[str, Any]:
        return {"applied": applied, "requested": requested, "reason": reason, "source": source, "measurement": m}

    if task != "causal-lm":
        if requested == "true":
            raise UserError(f"model.chunked_loss=true: model.task={task} has logits [N, classes], nothing to chunk; "
                            "set model.chunked_loss=auto or false")
        return out(False, f"{task}: logits [N, classes] are small, nothing to chunk", "rule")
    if requested == "false":
        return out(False, "requested (model.chunked_loss=false)", "requested")
    from train.models.causal import probe_loss_head

    ok, why = probe_loss_head(model) if hasattr(model, "set_chunked_loss") else (False, "not a causal-LM wrapper")
    if not ok:
        if requested == "true":
            raise UserError(f"model.chunked_loss=true: {why}; set model.chunked_loss=auto or false")
        return out(False, f"auto: {why}: unchunked", "rule")
    if requested == "true":
        return out(True, "requested (model.chunked_loss=true)", "requested")
    m = (measure or measure_head_paths)(model.inner.get_output_embeddings(), tokens, compute_dtype, device)
    applied = m["chunked"] <= CHUNKED_MARGIN * m["unchunked"]
    reason = (f"auto: the LM head + cross-entropy over {m['tokens']} tokens x vocabulary {m['vocab']} took "
              f"{m['chunked']:.1f} ms chunked ({m['chunk_rows']} rows a chunk) vs {m['unchunked']:.1f} ms with the "
              f"logits whole (median of {m['rounds']}; chunked kept unless > {CHUNKED_MARGIN}x): "
              f"{'chunked' if applied else 'unchunked'}")
    return out(applied, reason, "measured", m)
