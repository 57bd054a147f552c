"""Evaluation over a loader by the run's task (train/tasks/), under DDP too."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Optional

import torch
from torch.utils.data import DataLoader

from train.callbacks import Callback
from train.data.batch import move, packed_inputs
from train.parallel.fsdp import EXHAUSTED, idle_forward, is_sharded, lockstep, reshard
from train.parallel.process_group import DistContext, all_reduce_sum, any_rank
from train.precision import PrecisionPolicy
from train.shutdown import pause_point, requested_signal, stop_requested
from train.tasks import Task, task_for


class EvaluateBefore(Callback):
    """The held-out figures of the model as it starts, before the first step of a fresh run (a pretrained base before
    fine-tuning: what the run improved on). Recorded as the evaluation at step 0 (``stats.evals``, metrics.jsonl,
    report.json ``quality.eval_*_before``) and said on the console; a resumed run (its loop starts later) skips it.
    A causal LM also answers three fixed prompts before the first step and after the last (``stats.answers``:
    train/generate/answers.py; one process only: a sharded model's generate would need every rank)."""

    def __init__(self, trainer: Any, bundle: Any) -> None:
        self.trainer, self.bundle, self.done = trainer, bundle, False
        self.answers = getattr(bundle, "task", None) == "causal-lm"

    def _answer(self, when: str) -> None:
        from train.generate.answers import answer_prompts

        t = self.trainer
        t.stats.answers[when] = {"answers": None, "unavailable_reason": "a multi-process run"} if t.dist.enabled \
            else answer_prompts(t.model, self.bundle, t.device, t.policy.blocks_autocast)

    def on_step_start(self, step: int) -> None:
        if not self.done and step == 1:
            self.trainer.evaluate_now(0, SimpleNamespace(disable=True))
            if self.answers:
                self._answer("before")
        self.done = True

    def on_fit_end(self, stats: Any) -> None:
        if self.answers and "before" in stats.answers and self.trainer.stopped_at is None:
            self._answer("after")


def eval_before_wanted(cfg: Any) -> bool:
    """``train.eval_before`` resolved: null (auto) evaluates first where the weights are pretrained (``hf:<dir>``
    with a weights file), not a random init, whose figures say nothing."""
    if cfg.train.eval_before is not None:
        return bool(cfg.train.eval_before)
    from train.models.external import has_pretrained_weights

    return has_pretrained_weights(cfg.model.source)


class EvaluationAbandoned(Exception):
    """SIGTERM/SIGINT arrived during an evaluation: it was stopped between two batches (``str()`` says so)."""


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: DataLoader, policy: PrecisionPolicy, num_classes: int,
             device: torch.device, dist_ctx: Optional[DistContext] = None,
             phase: str = "evaluation", task: Optional[Task] = None) -> dict[str, Any]:
    """The task's held-out figures over ``loader`` (``task``, or the model's own: ``model.spec.task``, else
    classification; train/tasks/: classification — accuracy, macro-F1, mean cross-entropy per sample; causal LM —
    loss per target token, perplexity, next-token accuracy), ``samples``.

    Under DDP each rank evaluates its shard (``loader`` from ``make_loader(..., world_size, rank)``): the task's
    totals are all-reduced (torchmetrics all-gathers its own states). A signal (train/shutdown.py) stops the loop
    before the next batch; under DDP the ranks agree once, after their loops, so a rank that finished its shard
    never waits for one that stopped. An FSDP2-sharded model's forwards are collectives: the ranks step through
    their shards together (:func:`~train.parallel.fsdp.lockstep`), a rank whose shard is done running idle forwards.

    Raises:
        EvaluationAbandoned: a signal arrived during the evaluation (``phase`` names it in the message).
    """
    ctx = dist_ctx or DistContext()
    # no task given: the model's own (a causal LM's spec says causal-lm; every classifier's says nothing)
    task = task or task_for(getattr(getattr(model, "spec", None), "task", "classification"))
    metrics = task.metrics(num_classes, device)
    was_training = model.training
    model.eval()
    abandoned = False
    sharded = ctx.enabled and is_sharded(model)  # FSDP2: the ranks' forwards run in lockstep (all-gathers)
    for batch in lockstep(loader, ctx, stop_requested) if sharded else loader:
        if batch is None or (not sharded and stop_requested()):
            abandoned = True
            break
        if batch is EXHAUSTED:
            idle_forward(model, policy.blocks_autocast, device)
            continue
        ids, mask, labels = move(batch, device)
        metrics.update(model(ids, mask, policy.blocks_autocast, **packed_inputs(batch, device)), labels, batch)
        pause_point(phase)  # a test hook (no-op): a signal during the evaluation
    model.train(was_training)
    if sharded:
        reshard(model)
    if any_rank(abandoned, ctx):
        raise EvaluationAbandoned(f"{requested_signal()} during the {phase}: evaluation abandoned")
    sums = metrics.sums()
    if ctx.enabled:  # every rank, even one with an empty shard, joins the reductions
        sums = all_reduce_sum(sums, ctx)
    result = metrics.result(sums)
    if result is None:
        return {"accuracy": None, "macro_f1": None, "loss": None, "samples": 0,
                "unavailable_reason": "the split has no examples"}
    return result
