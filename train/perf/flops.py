"""FLOPs per training step, counted by ``torch.utils.flop_counter.FlopCounterMode`` on real shapes.

FlopCounterMode counts matmuls and linear layers (multiply-add = 2 FLOPs). Attention through
``scaled_dot_product_attention`` is counted analytically instead, because which SDPA kernel runs
(and whether FlopCounterMode has a formula for it) differs by device, mask and torch version —
on CPU with a bool mask, torch 2.13 dispatches to a kernel the counter does not see at all.
Attention per layer: forward QKᵀ and A·V = 4·B·S²·H, backward twice that, so 12·B·S²·H in all
(the algorithmic count: no recomputation, masked positions included, as in the MFU convention
of Chowdhery et al. 2022, PaLM, appendix B).
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from train.model import EncoderClassifier


def attention_training_flops(batch: int, seq: int, hidden: int, layers: int) -> int:
    """Forward + backward FLOPs of the attention score and value matmuls: 12·B·S²·H per layer."""
    return 12 * batch * seq * seq * hidden * layers


def training_step_flops(model: EncoderClassifier, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> int:
    """FLOPs of one forward + backward on this batch shape (input_ids: LongTensor[B, S]).

    Elementwise ops, norms and the optimizer are not counted, by the usual MFU convention.
    Gradients produced here are discarded.
    """
    was_training = model.training
    model.train()
    counter = FlopCounterMode(display=False)
    with counter:
        logits = model(input_ids, attention_mask)
        logits.float().sum().backward()
    model.zero_grad(set_to_none=True)
    model.train(was_training)
    counts = counter.get_flop_counts().get("Global", {})
    sdpa = sum(v for op, v in counts.items() if "scaled_dot_product" in str(op))
    b, s = input_ids.shape
    spec = model.spec
    return int(counter.get_total_flops() - sdpa + attention_training_flops(b, s, spec.hidden_size, spec.num_layers))
