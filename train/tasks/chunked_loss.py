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
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from train.perf.probe_budget import ProbeBudget

IGNORE_INDEX = -100
"""A target that is not trained (``F.cross_entropy``'s default ``ignore_index``)."""


def chunk_rows(tokens: int, hidden: int, vocab: int) -> int:
    """Rows per chunk: Liger's rule, ``next_pow2(ceil(tokens / ceil(vocab / hidden)))`` (a chunk's logits
    ``[rows, vocab]`` hold about as many values as the hidden states ``[tokens, hidden]``), raised to at least
    ``next_pow2(hidden)`` rows, and at least 1.

    The floor: every chunk adds its ``[vocab, hidden]`` share to the head's fp32 weight gradient, a fixed cost per
    chunk; with ``rows ≥ hidden`` a chunk's logits are at least as large as that gradient, so the accumulation costs
    no more memory traffic than the logits themselves, and a chunk's logits take no more memory than the weight
    gradient the loss holds anyway. Liger's rule alone (sized for GPU memory) cut a CPU step into chunks so small
    that the accumulation dominated (docs/models.md has the head + loss timings per chunk size)."""
    per = math.ceil(tokens / max(1, math.ceil(vocab / max(1, hidden))))
    liger = 1 << max(0, per - 1).bit_length()
    return max(1, liger, 1 << max(0, hidden - 1).bit_length())


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
        # a frozen head (an adapter run's tied embedding) needs no [V, H] gradient: one matmul a chunk saved
        need_weight = bool(ctx.needs_input_grad[1])
        grad_weight = torch.zeros(weight.shape if need_weight else (), dtype=torch.float32, device=weight.device)
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
            if need_weight:
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
        gh = saved[0] * grad_out
        gw = saved[1] * grad_out if ctx.needs_input_grad[1] else None
        gb = saved[2] * grad_out if ctx.has_bias else None
        hd, wd, bd = ctx.dtypes
        return gh.to(hd), (None if gw is None else gw.to(wd)), (None if gb is None else gb.to(bd)), None, None, None


def chunked_cross_entropy(hidden: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor,
                          compute_dtype: torch.dtype = torch.float32, rows: Optional[int] = None) -> torch.Tensor:
    """The mean next-token cross-entropy (fp32 scalar) of hidden states ``[..., H]`` through ``head`` (an
    ``nn.Linear`` H → V: the LM head) against ``targets`` ``[...]`` (``IGNORE_INDEX`` = not trained), chunked by
    :func:`chunk_rows` unless ``rows`` is given."""
    flat, t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    n = rows or chunk_rows(flat.shape[0], flat.shape[1], head.weight.shape[0])
    return FusedLinearCrossEntropy.apply(flat, head.weight, head.bias, t, n, compute_dtype)


PROBE_ROUNDS = 5
"""Paired rounds of the chunked-loss probe (after one untimed step each way)."""
CHUNKED_MARGIN = 1.05
"""``auto`` keeps the chunked loss unless the run's training step measures slower with it: its paired interval
wholly below 1.0, or its median step more than this × the unchunked one (within 5 % the two are a tie on a shared
CPU, and the memory saved decides)."""
DECISION_FORMAT = 3  # 2: chunks of at least next_pow2(hidden) rows; 3: the shared step fingerprint


def measure_step_paths(model: torch.nn.Module, step: Callable[[dict], Any], batch: dict, device: torch.device,
                       rounds: int = PROBE_ROUNDS) -> dict[str, Any]:
    """Median ms of the run's whole training step (``step(batch)``: a probe trainer's
    :meth:`~train.trainer.Trainer.step`, restored by its caller) on one real training ``batch`` with the logits
    whole and with the chunked loss, through the one A/B primitive (one untimed step each, then ``rounds`` rotated
    rounds). The whole step, not the head alone: the head + loss measured alone favoured the chunked loss where the
    step was slower with it (it moves the head's gradient into the forward pass, beside the optimizer's work).
    Returns ``{"unchunked": ms, "chunked": ms, "speedup": unchunked ÷ chunked, "speedup_interval": [low, high],
    "rounds", "shape", "tokens", "vocab", "chunk_rows"}``; the model's setting is restored afterwards."""
    from train.perf.switch_ab import switch_ab

    ab = switch_ab(step, batch, model.set_chunked_loss, {"unchunked": False, "chunked": True},
                   restore=model.chunked_loss, rounds=rounds, device=device)
    med = {a: ab.arms[a].median_step_ms() for a in ("unchunked", "chunked")}
    ratio = ab.ratio("chunked", "unchunked", "steps")
    head = model.inner.get_output_embeddings()
    tokens = int(batch["input_ids"].numel())
    return {**med, "speedup": med["unchunked"] / med["chunked"], "speedup_interval": [ratio.low, ratio.high],
            "rounds": rounds, "shape": "x".join(map(str, batch["input_ids"].shape)), "tokens": tokens,
            "vocab": head.out_features, "chunk_rows": chunk_rows(tokens, head.in_features, head.out_features)}


def decide_chunked_loss(requested: str, task: str, model: torch.nn.Module, precision: str, device: torch.device, *,
                        cache_dir: Optional[str] = None, batch: Optional[Callable[[], dict]] = None,
                        probe: Optional[Callable[[], ContextManager[Callable[[dict], Any]]]] = None,
                        measure: Optional[Callable[..., dict[str, Any]]] = None,
                        budget: Optional["ProbeBudget"] = None) -> dict[str, Any]:
    """Resolve ``model.chunked_loss`` (``auto`` | ``true`` | ``false``) for a run (the model is left as it is: the
    caller sets it when ``applied``): report.json's ``levers.chunked_loss`` — ``applied``, ``requested``,
    ``reason``, ``source`` (requested | rule | measured | cached) and, when measured or cached, ``measurement``
    (:func:`measure_step_paths`). ``auto`` times the run's training step both ways on ``batch()`` (one real training
    batch, asked for only when measuring) through ``probe()`` (a context giving the run's step and restoring the
    model after it; :func:`train.setup.probe_steps`); ``measure`` replaces :func:`measure_step_paths` (tests);
    ``budget``: the run's probe allowance (train/perf/probe_budget.py): a measurement past it is not run (unchunked).
    Measured decisions are cached under ``cache_dir/decisions/`` like the other ``auto`` probes; a busy machine
    measures but does not cache.

    Raises:
        UserError: ``true`` where it cannot run (a classifier; a causal LM whose logits are not a linear head over
            its last hidden states).
    """
    from train.errors import UserError
    from train.tools import decisions
    from train.tools.env import machine_load

    def out(applied: bool, reason: str, source: str, m: Optional[dict] = None) -> dict[str, Any]:
        return {"applied": applied, "requested": requested, "reason": reason, "source": source, "measurement": m}

    if task != "causal-lm":
        if requested == "true":
            raise UserError(f"model.chunked_loss=true: model.task={task} has logits [N, classes], nothing to chunk; "
                            "set model.chunked_loss=auto or false")
        return out(False, f"{task}: logits [N, classes] are small, nothing to chunk", "rule")
    if requested == "false":
        return out(False, "requested (model.chunked_loss=false)", "requested")
    from train.models.causal_probe import probe_loss_head

    ok, why = probe_loss_head(model) if hasattr(model, "set_chunked_loss") else (False, "not a causal-LM wrapper")
    if not ok:
        if requested == "true":
            raise UserError(f"model.chunked_loss=true: {why}; set model.chunked_loss=auto or false")
        return out(False, f"auto: {why}: unchunked", "rule")
    if requested == "true":
        return out(True, "requested (model.chunked_loss=true)", "requested")
    if batch is None or probe is None:
        raise ValueError("model.chunked_loss=auto is measured on the run's step: pass batch and probe")
    sample = batch()
    fp = {**decisions.step_fingerprint(model, precision, sample),  # the step ran on the path resolved before it
          "attention": getattr(model, "packed_attention", None) if "seq_index" in sample else None}
    path = decisions.cache_path(cache_dir, "chunked-loss", fp, DECISION_FORMAT)
    cached = decisions.read_cached(path, fp, "applied", (True, False))
    if cached is not None:
        return out(cached["applied"], cached["reason"], "cached", cached["measurement"])
    load = machine_load()
    skip = budget.check("model.chunked_loss", 2 * (1 + PROBE_ROUNDS)) if budget is not None else None
    if skip:
        return out(False, f"auto: {skip}: unchunked (the logits whole, as transformers computes them)", "rule")
    with probe() as step:
        m = (measure or measure_step_paths)(model, step, sample, device)
    low, high = m["speedup_interval"]
    slower = high is not None and high < 1.0
    applied = not slower and m["chunked"] <= CHUNKED_MARGIN * m["unchunked"]
    interval = "no interval" if low is None else f"{low:.2f}, {high:.2f}"
    reason = (f"auto: the training step on [{m['shape']}] ({m['tokens']} tokens, vocabulary {m['vocab']}, "
              f"{precision}) ran {m['speedup']:.2f}x [{interval}] chunked ({m['chunk_rows']} rows a chunk; "
              f"{m['chunked']:.1f} vs {m['unchunked']:.1f} ms with the logits whole, median of {m['rounds']} paired "
              f"rounds; chunked kept unless measurably slower or > {CHUNKED_MARGIN}x): "
              f"{'chunked' if applied else 'unchunked'}")
    decisions.store(path, {"applied": applied, "reason": reason, "measurement": m, "fingerprint": fp}, load)
    return out(applied, reason + decisions.busy_note(load), "measured", m)
