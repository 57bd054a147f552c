"""Evaluation of a classifier over a loader: accuracy, macro-F1 and mean cross-entropy, under DDP too."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from train.data.batch import move
from train.data.collate import IGNORE_LABEL
from train.distributed import DistContext, all_reduce_sum, any_rank
from train.precision import PrecisionPolicy
from train.shutdown import pause_point, requested_signal, stop_requested


class EvaluationAbandoned(Exception):
    """SIGTERM/SIGINT arrived during an evaluation: it was stopped between two batches (``str()`` says so)."""


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: DataLoader, policy: PrecisionPolicy, num_classes: int,
             device: torch.device, dist_ctx: Optional[DistContext] = None,
             phase: str = "evaluation") -> dict[str, float]:
    """Accuracy (micro), macro-F1 (torchmetrics) and mean cross-entropy over ``loader``.

    Under DDP each rank evaluates its shard (``loader`` from ``make_loader(..., world_size, rank)``):
    torchmetrics all-gathers its states in ``compute()``; the loss sum and count are all-reduced. Filler rows
    (label ``IGNORE_LABEL``, which fill a bucket's last batch to the training shape) count nowhere.

    A signal (train/shutdown.py) stops the loop before the next batch; under DDP the ranks agree once, after their
    loops, so a rank that finished its shard never waits for one that stopped.

    Raises:
        EvaluationAbandoned: a signal arrived during the evaluation (``phase`` names it in the message).
    """
    # here: its import costs ~1 s of start-up
    from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score

    ctx = dist_ctx or DistContext()
    was_training = model.training
    model.eval()
    acc = MulticlassAccuracy(num_classes=num_classes, average="micro", ignore_index=IGNORE_LABEL).to(device)
    f1 = MulticlassF1Score(num_classes=num_classes, average="macro", ignore_index=IGNORE_LABEL).to(device)
    loss_sum = torch.zeros((), device=device)
    n = 0
    abandoned = False
    for batch in loader:
        if stop_requested():
            abandoned = True
            break
        ids, mask, labels = move(batch, device)
        logits = model(ids, mask, policy.blocks_autocast)
        loss_sum += F.cross_entropy(logits, labels, reduction="sum", ignore_index=IGNORE_LABEL)
        acc.update(logits, labels)
        f1.update(logits, labels)
        n += batch.get("samples", labels.numel())
        pause_point(phase)  # a test hook (no-op): a signal during the evaluation
    model.train(was_training)
    if any_rank(abandoned, ctx):
        raise EvaluationAbandoned(f"{requested_signal()} during the {phase}: evaluation abandoned")
    if ctx.enabled:  # every rank, even one with an empty shard, joins the reductions
        totals = all_reduce_sum(torch.stack([loss_sum.double(), torch.tensor(float(n), dtype=torch.float64,
                                                                              device=device)]), ctx)
        loss_sum, n = totals[0], int(totals[1])
    if n == 0:
        return {"accuracy": None, "macro_f1": None, "loss": None, "samples": 0,
                "unavailable_reason": "the split has no examples"}
    return {"accuracy": float(acc.compute()), "macro_f1": float(f1.compute()),
            "loss": float(loss_sum) / n, "samples": n}  # float(): sync point, once per evaluation
