"""``model.task=causal-lm``: next-token prediction. The collators hand the step its targets already shifted
(``labels[b, t]`` is the token position ``t`` predicts, ``IGNORE_INDEX`` where nothing is trained: prompt tokens,
padding, each sample's last position — so no target crosses into the next sample of a packed row); the loss is the
mean cross-entropy over the trained targets, computed here from the model's fp32 logits ``[B, T, V]`` (a Hugging
Face model, which would shift labels itself, is given none). Held out: loss per target token, perplexity
(``exp`` of it) and next-token accuracy."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F

from train.tasks.base import LossHead, Metrics, Task
from train.tasks.chunked_loss import IGNORE_INDEX, chunked_cross_entropy

__all__ = ["IGNORE_INDEX", "CausalLM", "CausalLMMetrics"]


class CausalLMMetrics(Metrics):
    def __init__(self, device: torch.device) -> None:
        self.totals = torch.zeros(4, dtype=torch.float64, device=device)  # loss sum, targets, correct, samples

    def update(self, logits: torch.Tensor, labels: torch.Tensor, batch: dict) -> None:
        flat, targets = logits.flatten(0, 1), labels.flatten()
        trained = targets != IGNORE_INDEX
        loss_sum = F.cross_entropy(flat, targets, reduction="sum", ignore_index=IGNORE_INDEX)
        correct = ((flat.argmax(-1) == targets) & trained).sum()
        samples = float(batch.get("samples", labels.shape[0]))
        self.totals += torch.stack([loss_sum.double(), trained.sum().double(), correct.double(),
                                    torch.tensor(samples, dtype=torch.float64, device=self.totals.device)])

    def sums(self) -> torch.Tensor:
        return self.totals

    def result(self, sums: torch.Tensor) -> Optional[dict[str, Any]]:
        loss_sum, targets, correct, samples = (float(x) for x in sums)  # the sync point, once per evaluation
        if targets == 0:
            return None
        loss = loss_sum / targets
        return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "accuracy": correct / targets,
                "macro_f1": None, "target_tokens": int(targets), "samples": int(samples)}


class CausalLM(Task):
    name = "causal-lm"

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, head: Optional[LossHead] = None) -> torch.Tensor:
        if head is not None:  # logits are the hidden states [B, T, H]: the memory-bounded head + loss
            return chunked_cross_entropy(logits, head.linear, labels, head.compute_dtype)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)

    def metrics(self, num_classes: int, device: torch.device) -> Metrics:
        return CausalLMMetrics(device)

    def eval_line(self, result: dict[str, Any]) -> str:
        return (f"eval loss {result['loss']:.4f} per target token, perplexity {result['perplexity']:.2f}, "
                f"next-token accuracy {result['accuracy']:.4f}")
