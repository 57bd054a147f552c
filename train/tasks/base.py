"""What the training step, evaluation and report ask of a task, instead of assuming classification.

A task turns a batch's model output into its loss (fp32, outside autocast: the model returns fp32 logits) and keeps
the held-out quality: an accumulator updated batch by batch (:class:`Metrics`), reduced over ranks, read once per
evaluation. Adding a task is a new module here and an entry in :data:`train.tasks.TASKS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch


class Metrics:
    """Held-out quality over an evaluation: ``update`` per batch (no host sync), ``sums`` the additive totals as one
    float64 tensor (all-reduced over ranks by the caller), ``result`` the figures from the reduced totals."""

    def update(self, logits: torch.Tensor, labels: torch.Tensor, batch: dict) -> None:
        raise NotImplementedError

    def sums(self) -> torch.Tensor:
        raise NotImplementedError

    def result(self, sums: torch.Tensor) -> Optional[dict[str, Any]]:
        """The figures, or None when the split had nothing to evaluate."""
        raise NotImplementedError


@dataclass(frozen=True)
class LossHead:
    """The model's output layer (``linear``: hidden → vocabulary) and the dtype its matmul runs in
    (``compute_dtype``: the precision policy's), given to :meth:`Task.loss` when the model's training forward
    returns hidden states instead of logits (``model.chunked_loss``)."""

    linear: torch.nn.Linear
    compute_dtype: torch.dtype


class Task:
    """``name`` (``model.task``); :meth:`loss` of a batch; :meth:`metrics` for an evaluation; :meth:`eval_line`."""

    name: str = ""

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, head: Optional[LossHead] = None) -> torch.Tensor:
        """The batch's mean loss, an fp32 scalar tensor (the quantity the optimizer minimises). ``head`` given: the
        model returned hidden states and the loss applies the head itself."""
        raise NotImplementedError

    def metrics(self, num_classes: int, device: torch.device) -> Metrics:
        raise NotImplementedError

    def eval_line(self, result: dict[str, Any]) -> str:
        """The held-out figures in a few words (the periodic evaluation's log line)."""
        raise NotImplementedError
