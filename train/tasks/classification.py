"""``model.task=classification``: one label per text; fp32 cross-entropy over logits ``[N, C]``; accuracy (micro),
macro-F1 (torchmetrics) and mean cross-entropy per sample on held-out data. Filler rows (label ``IGNORE_LABEL``, which
fill a bucket's last evaluation batch to the training shape) count nowhere."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from train.data.collate import IGNORE_LABEL
from train.tasks.base import LossHead, Metrics, Task


class ClassificationMetrics(Metrics):
    def __init__(self, num_classes: int, device: torch.device) -> None:
        # here: torchmetrics' import costs ~1 s of start-up
        from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score

        self.acc = MulticlassAccuracy(num_classes=num_classes, average="micro", ignore_index=IGNORE_LABEL).to(device)
        self.f1 = MulticlassF1Score(num_classes=num_classes, average="macro", ignore_index=IGNORE_LABEL).to(device)
        self.loss_sum = torch.zeros((), device=device)
        self.samples = 0

    def update(self, logits: torch.Tensor, labels: torch.Tensor, batch: dict) -> None:
        self.loss_sum += F.cross_entropy(logits, labels, reduction="sum", ignore_index=IGNORE_LABEL)
        self.acc.update(logits, labels)
        self.f1.update(logits, labels)
        self.samples += batch.get("samples", labels.numel())

    def sums(self) -> torch.Tensor:
        return torch.stack([self.loss_sum.double(), torch.tensor(float(self.samples), dtype=torch.float64,
                                                                  device=self.loss_sum.device)])

    def result(self, sums: torch.Tensor) -> Optional[dict[str, Any]]:
        n = int(sums[1])
        if n == 0:
            return None
        # torchmetrics all-gathers its states in compute(); float(): the sync point, once per evaluation
        return {"accuracy": float(self.acc.compute()), "macro_f1": float(self.f1.compute()),
                "loss": float(sums[0]) / n, "samples": n}


class Classification(Task):
    name = "classification"

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, head: Optional[LossHead] = None) -> torch.Tensor:
        return F.cross_entropy(logits, labels)  # logits [N, C] fp32, labels [N]; a classifier returns its logits

    def metrics(self, num_classes: int, device: torch.device) -> Metrics:
        return ClassificationMetrics(num_classes, device)

    def eval_line(self, result: dict[str, Any]) -> str:
        return f"eval accuracy {result['accuracy']:.4f}, macro-F1 {result['macro_f1']:.4f}"
