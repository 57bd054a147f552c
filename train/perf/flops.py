"""FLOPs per training step, counted by ``torch.utils.flop_counter.FlopCounterMode`` on real shapes.

FlopCounterMode counts matmuls and linear layers (multiply-add = 2 FLOPs). Attention through
``scaled_dot_product_attention`` is counted analytically instead, because which SDPA kernel runs
(and whether FlopCounterMode has a formula for it) differs by device, mask and torch version —
on CPU with a bool mask, torch 2.13 dispatches to a kernel the counter does not see at all, while
on the meta device it decomposes into ``bmm`` calls the counter does see. Attention per layer:
forward QKᵀ and A·V = 4·B·S²·H, backward twice that, so 12·B·S²·H in all (the algorithmic count:
no recomputation, masked positions included, as in the MFU convention of Chowdhery et al. 2022,
PaLM, appendix B).

:class:`ModuleFlops` counts any module on its own device; the built-in encoder is counted from its spec
(train/models/flops.py, whose :func:`~train.models.flops.step_flops_for` picks between the two). This module imports
no model.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.utils.flop_counter import FlopCounterMode


def attention_training_flops(batch: int, seq: int, hidden: int, layers: int) -> int:
    """Forward + backward FLOPs of the attention score and value matmuls: 12·B·S²·H per layer."""
    return 12 * batch * seq * seq * hidden * layers


class ModuleFlops:
    """``ModuleFlops(model, max_len)(batch, seq)`` → training FLOPs of one step of that shape for any classifier
    module called as ``model(input_ids, attention_mask)`` → logits (a Hugging Face or ``python:`` model in
    :class:`~train.models.wrap.ExternalClassifier`, or the built-in encoder).

    Method: ``FlopCounterMode`` around one real forward + backward at batch 1 and three sequence lengths on the
    model's own device (a Hugging Face forward reads mask values, so the meta device cannot run it), fitted exactly
    as ``a·S² + b·S + c`` (attention score/value matmuls grow with S², per-token layers with S, the pooler and head
    are per sample) and multiplied by the batch size: a classifier's step is linear in the batch. Matmuls count
    2 FLOPs per multiply-add; elementwise ops, norms and the optimizer are not counted (the MFU convention). The
    counting leaves no trace: gradients, RNG state and training mode are restored.

    ``attention_seen``: the counter saw attention matmuls (``bmm``/SDPA). Where it did not (an attention kernel it
    has no formula for, e.g. SDPA's CPU flash kernel), a model that states its ``attention_dims`` (layers, query
    heads × head dim: the causal-LM wrapper) gets them analytically, ``12·B·S²·D`` per layer for a row of S tokens
    (the kernel computes every score of the row, masked or not); otherwise the S² term is missing and
    :attr:`method` says so. A causal LM is counted through its logits (the chunked loss runs the same head
    matmuls chunk by chunk).
    """

    def __init__(self, model: torch.nn.Module, max_len: int) -> None:
        lengths = [s for s in (4, 8, 16) if s <= max_len] or [1]
        while len(lengths) < 3:
            lengths = sorted({*lengths, max(1, min(lengths) - 1), max(lengths) + 1})[:3]
        self.lengths = lengths
        counts = [self._count(model, s) for s in lengths]
        self.counts = [c for c, _ in counts]
        self.attention_counted = [a for _, a in counts]  # the counter's attention matmuls (0 where unseen)
        self.attention_seen = all(a > 0 for _, a in counts)
        dims = getattr(model, "attention_dims", None)
        self.dims = dims if dims and all(dims) else None
        self.analytic = None if self.attention_seen else self.dims
        self.method = ("FlopCounterMode on one real forward+backward at batch 1, lengths "
                       f"{', '.join(map(str, lengths))}, fitted as a·S²+b·S+c and scaled by the batch"
                       + ("" if self.attention_seen else
                          f"; attention analytic (the counter did not see the kernel): 12·B·S²·{dims[1]} per layer, "
                          f"{dims[0]} layers, per row" if self.analytic else
                          "; attention matmuls were not seen by the counter (not counted)"))

    @staticmethod
    def _count(model: torch.nn.Module, seq: int) -> tuple[int, bool]:
        device = next(model.parameters()).device
        ids = torch.ones(1, seq, dtype=torch.long, device=device)
        mask = torch.ones(1, seq, dtype=torch.bool, device=device)
        saved = {p: p.grad for p in model.parameters()}
        for p in saved:
            p.grad = None
        chunked = getattr(model, "chunked_loss", False)
        if chunked:
            model.set_chunked_loss(False)  # count through the logits: the same head matmuls
        counter = FlopCounterMode(display=False)
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), counter:
                model(ids, mask).float().sum().backward()
        finally:
            for p, g in saved.items():
                p.grad = g
            if chunked:
                model.set_chunked_loss(True)
        ops = counter.get_flop_counts().get("Global", {})
        attention = sum(v for op, v in ops.items()
                        if "bmm" in str(op) or "scaled_dot_product" in str(op) or "attention" in str(op))
        return int(counter.get_total_flops()), int(attention)

    def _per_sample(self, seq: int, counts: list[int]) -> float:
        (s1, s2, s3), (f1, f2, f3) = self.lengths, counts
        return (f1 * (seq - s2) * (seq - s3) / ((s1 - s2) * (s1 - s3))
                + f2 * (seq - s1) * (seq - s3) / ((s2 - s1) * (s2 - s3))
                + f3 * (seq - s1) * (seq - s2) / ((s3 - s1) * (s3 - s2)))  # Lagrange: exact on a quadratic

    def __call__(self, batch: int, seq: int) -> int:
        attention = 0 if self.analytic is None else attention_training_flops(batch, seq, self.analytic[1],
                                                                             self.analytic[0])
        return int(round(batch * self._per_sample(seq, self.counts))) + attention

    def without_attention(self, batch: int, seq: int) -> int:
        """:meth:`__call__` less the attention score and value matmuls (counted or analytic)."""
        rest = [c - a for c, a in zip(self.counts, self.attention_counted)]
        return int(round(batch * self._per_sample(seq, rest)))

    def attention_for_pairs(self, pairs: int) -> Optional[int]:
        """Training FLOPs of the score and value matmuls over ``pairs`` per-head query–key pairs in all
        (``12·pairs·D`` per layer; the ``varlen`` path's Σ n·L² over its groups), or None without
        ``attention_dims``."""
        return None if self.dims is None else 12 * pairs * self.dims[1] * self.dims[0]

    def for_step(self, batch: int, seq: int, pairs: int) -> int:
        """One ``[batch, seq]`` step's FLOPs with its attention counted over the ``pairs`` per-head query–key pairs
        the ``varlen`` path computed (0: another path, C² per row as :meth:`__call__`)."""
        attention = self.attention_for_pairs(pairs) if pairs else None
        return self(batch, seq) if attention is None else attention + self.without_attention(batch, seq)


VARLEN_FLOPS_METHOD = "; varlen attention counted per sample group: 12·Σ n·L²·D per layer"
"""What a FLOP method adds where packed rows ran ``varlen`` attention (:meth:`ModuleFlops.attention_for_pairs`)."""
