"""The training loop, and only the loop: forward, loss, backward, clip, step, log, evaluate.

Measurement sits outside the loop body: a :class:`StepTimer` brackets each step and a
:class:`MetricLogger` receives one record every ``log_every`` steps. Per-step values (loss, grad norm,
and on CUDA the step times, as timing events) stay on the device and are read (a host-device sync on
CUDA) only when a record is logged: a steady step between two records never waits for the device.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Iterable, Iterator
from typing import Any, Optional, Union

import torch
from torch.utils.data import DataLoader

from train.accumulation import gradient_sync, loss_weights, sync_owner, target_count
from train.callbacks import Callback
from train.clipping import clip_gradients
from train.compat import fused_adamw_supported, local_tensor
from train.config import RunConfig
from train.data.batch import epochs, move, packed_inputs
from train.errors import UserError
from train.evaluation import EvaluationAbandoned, evaluate
from train.models.adapter import hold_frozen_base
from train.models.encoder import EncoderClassifier, param_groups
from train.models.varlen import plan_pairs
from train.numerics import NumericsGuard
from train.parallel.fsdp import full_optimizer_state, load_optimizer_state
from train.parallel.process_group import DistContext
from train.perf.memory import metered
from train.perf.timer import StepTimer
from train.precision import DTYPES, PrecisionPolicy
from train.profiling.ranges import null_ranges
from train.step_record import StepRecord, TrainStats, window_record
from train.tasks import task_for
from train.tasks.base import LossHead
from train.tools.progress import progress_bar
from train.tracking.loggers import MetricLogger, NullLogger

__all__ = ["StepRecord", "TrainStats", "Trainer", "linear_warmup_decay"]  # StepRecord, TrainStats: train/step_record.py


def linear_warmup_decay(total_steps: int, warmup_steps: int):
    """LambdaLR factor: 0→1 linearly over ``warmup_steps``, then 1→0 linearly at ``total_steps``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / max(1, warmup_steps)
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))

    return factor


class Trainer:
    """Runs ``total_steps`` optimizer steps over ``train_loader``, cycling epochs as needed.

    Built with keyword arguments only:

    Args:
        cfg: the run config (``train``, ``optim``, ``clip``, ``numerics`` sections are read here).
        model: the plain module: its parameters are optimised, evaluation and checkpoints use it.
        policy: the precision policy (autocast for the blocks, GradScaler for fp16).
        device: where batches go.
        train_loader: yields padded batches (``input_ids`` [B, S], ``attention_mask`` [B, S], ``labels`` [B]); None for
            a trainer whose caller hands every batch to :meth:`step` (a probe): then ``total_steps`` is
            ``train.max_steps`` (or 1) and :meth:`fit` cannot run.
        num_classes: for evaluation metrics.
        eval_loader: periodic evaluation every ``train.eval_every`` steps, or None.
        logger: receives one record every ``train.log_every`` steps (default: a NullLogger).
        callbacks: :class:`~train.callbacks.Callback` objects, called in order (more with :meth:`add_callback`).
        dist_ctx: the torchrun/DDP context (default: single process).
        train_model: what a training step calls, when it is not ``model`` itself: the DDP wrapper or the
            compiled forward (``train.compiling.session.CompiledForward``).

    Raises:
        RuntimeError: a training loader that yields no batches.
        UserError: ``optim.fused=true`` where torch has no fused AdamW for the device.
    """

    def __init__(self, *, cfg: RunConfig, model: EncoderClassifier, policy: PrecisionPolicy, device: torch.device,
                 train_loader: Optional[DataLoader], num_classes: int, eval_loader: Optional[DataLoader] = None,
                 logger: Optional[MetricLogger] = None, callbacks: Iterable[Callback] = (),
                 dist_ctx: Optional[DistContext] = None, train_model: Optional[torch.nn.Module] = None) -> None:
        self.cfg, self.model, self.policy, self.device = cfg, model, policy, device
        self.dist = dist_ctx or DistContext()
        self.train_model = train_model or model
        self.callbacks: list[Callback] = list(callbacks)
        self.train_loader, self.eval_loader = train_loader, eval_loader
        self.logger: MetricLogger = logger if logger is not None else NullLogger()
        self.num_classes = num_classes
        self.task = task_for(cfg.model.task)  # the batch's loss and held-out quality (train/tasks/)
        t = cfg.train
        if train_loader is None:
            self.total_steps = t.max_steps or 1
        else:
            batches_per_epoch = len(train_loader)
            if batches_per_epoch == 0:
                raise RuntimeError("the training loader yields no batches")
            self.total_steps = t.max_steps or max(1, math.ceil(t.epochs * batches_per_epoch / t.grad_accum))
        o = cfg.optim
        at = local_tensor(next(model.parameters())).device  # where AdamW steps: the host under dist.offload
        fused = fused_adamw_supported(at) if o.fused is None else o.fused
        if fused and not fused_adamw_supported(at):
            raise UserError(f"optim.fused=true: torch {torch.__version__} has no fused AdamW on {at.type}; "
                            "use null")
        self.optimizer = torch.optim.AdamW(param_groups(model, o.weight_decay), lr=o.lr, betas=o.betas, eps=o.eps,
                                           fused=fused)
        hold_frozen_base(model, DTYPES[policy.mode])  # an adapter's frozen base in the compute dtype
        self.guard = NumericsGuard(model, device, cfg.numerics.max_bad_steps, cfg.numerics.diagnose)
        warmup = int(o.warmup_fraction * self.total_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer,
                                                           linear_warmup_decay(self.total_steps, warmup))
        self.timer = StepTimer(device)
        self.stats = TrainStats()
        self.epoch = 0
        # the stage ranges (train/profiling/ranges.py): a shared no-op context unless a profiler sets its own
        self.ranges = null_ranges
        self.batches_in_epoch = 0  # consumed by the loop (the DataLoader prefetches ahead of the sampler)
        self.last_batch_shape: Optional[tuple[int, int]] = None  # (rows, seq) of the step just taken: for callbacks
        self.start_step = 0  # > 0 after resuming from a checkpoint
        self.stopped_at: Optional[int] = None  # the step the loop stopped at when a callback asked
        self.last_grad_norm: Optional[torch.Tensor] = None  # the last step's pre-clip global norm (device tensor)
        self._stream: Optional[Iterator[tuple[int, dict]]] = None  # (epoch, batch) of train_loader, from self.epoch
        self._counted = 0  # steps counted by this process (the first one is cold)
        self._last_inputs: Optional[tuple] = None  # the last step's device inputs, for the numerics diagnosis
        self.activation_bytes: Optional[int] = None  # the first counted step's saved activations (SavedTensorMeter)
        self.reset_window()

    def add_callback(self, callback: Callback) -> None:
        """Call ``callback`` from the next event on (after the ones already there)."""
        self.callbacks.append(callback)

    def remove_callback(self, callback: Callback) -> None:
        """Stop calling ``callback`` (a no-op when it is not there); safe from inside an event."""
        if callback in self.callbacks:
            self.callbacks.remove(callback)

    def set_ranges(self, ranges) -> None:
        """Use ``ranges(name)`` contexts around the step's stages (a profiler's record_function/NVTX ranges);
        :data:`~train.profiling.ranges.null_ranges` turns them off again."""
        self.ranges = ranges

    def reset_window(self) -> None:
        """Start a new logging window (loss/norm accumulate on the device in ``self.guard`` until the next record)."""
        self.window = {"steps": 0, "ms": 0.0, "samples": 0, "real": 0, "padded": 0}

    def next_batch(self) -> dict:
        """The next batch of ``train_loader``, epoch after epoch (the sampler's ``set_epoch`` before each pass);
        ``epoch`` and ``batches_in_epoch`` follow what was consumed (the DataLoader prefetches ahead)."""
        if self._stream is None:
            if self.train_loader is None:
                raise RuntimeError("this trainer has no train_loader: pass the batch to step()")
            self._stream = epochs(self.train_loader, self.epoch)
        epoch, batch = next(self._stream)
        if epoch != self.epoch:
            self.epoch, self.batches_in_epoch = epoch, 0
        self.batches_in_epoch += 1
        return batch

    @property
    def _varlen(self) -> bool:  # packed rows run varlen attention: the step counts its query–key pairs for FLOPs
        return getattr(self.model, "packed_attention", None) == "varlen"

    def step(self, batch: Union[dict, list[dict], None] = None, *, resolve: bool = False,
             count: bool = True) -> StepRecord:
        """One training step — the only code in this project that runs one: fetch (``batch`` None: the next
        ``train.grad_accum`` batches of ``train_loader``, the wait timed as part of the step; a list: those
        micro-batches; a dict: that one), move to the device, per micro-batch forward (packed rows with their
        positions and block mask), fp32 cross-entropy weighted by the global target count (train/accumulation.py;
        the ranks exchange gradients on the last micro-batch only) and backward, then unscale, clip
        (``clip.method``), the numerics guard (a non-finite step is skipped and counted on the device, no host sync),
        optimizer and scheduler step.

        ``count`` (default): time the step with ``self.timer`` (``resolve``: read its duration now, a device sync on
        CUDA; the first counted step always is: time to first step) and add it to ``self.stats`` and the logging
        window. ``count=False``: nothing is counted or timed (warm-up and probes, which time and restore around it).
        Returns the :class:`StepRecord`.
        """
        first = count and self._counted == 0
        if count:
            self.timer.start()
        with self.ranges("data_wait"):
            micro = [self.next_batch() for _ in range(self.cfg.train.grad_accum)] if batch is None else \
                list(batch) if isinstance(batch, list) else [batch]
            inputs = [(*move(b, self.device), packed_inputs(b, self.device)) for b in micro]
            weights = loss_weights([target_count(x[2]) for x in inputs], self.dist)  # one all-reduce on 2+ ranks
        with self.ranges("optimizer"):
            self.optimizer.zero_grad(set_to_none=True)
        eager = self.device.type != "cuda" and self.cfg.compile.enabled != "true"  # no hooks in compiled graphs
        loss = self._forward_backward(inputs, weights, measure=first and eager)
        with self.ranges("optimizer"):
            self.policy.unscale_(self.optimizer)  # clip in true units
            clip = clip_gradients(self.model.parameters(), **dataclasses.asdict(self.cfg.clip))
            self.guard.step(self.policy, self.optimizer, self.guard.observe(loss, clip))
            self.scheduler.step()
        ms = self.timer.stop(resolve=resolve or first) if count else None
        rec = StepRecord.of_micro_batches(self.stats.steps + 1, loss, clip.grad_norm, micro, ms, lambda m: plan_pairs(
            m["seq_index"]) if self._varlen and "seq_index" in m else 0)
        self.last_grad_norm, self.last_batch_shape = clip.grad_norm, (rec.rows, rec.seq_len)
        self._last_inputs = inputs[-1]
        if count:
            self._counted += 1
            if first:
                self.stats.first_step_end = time.perf_counter()
            self.stats.add(rec, steady=not first)
            w = self.window
            w["steps"], w["samples"] = w["steps"] + 1, w["samples"] + rec.samples
            w["real"], w["padded"] = w["real"] + rec.real_tokens, w["padded"] + rec.padded_tokens
        return rec

    def _forward_backward(self, inputs: list[tuple], weights: Optional[list], measure: bool = False) -> torch.Tensor:
        """Forward, loss and backward of each micro-batch (``weights``: :func:`~train.accumulation.loss_weights`'s,
        None: the one micro-batch's mean as it is); the step's loss (detached, fp32): its weighted sum (``measure``:
        the first micro-batch's saved activations into ``self.activation_bytes``)."""
        owner = sync_owner(self.train_model, self.model) if len(inputs) > 1 else None
        total: Optional[torch.Tensor] = None
        for i, x in enumerate(inputs):
            with gradient_sync(owner, i == len(inputs) - 1):
                run = functools.partial(self._forward_loss, *x, None if weights is None else weights[i])
                loss, saved = metered(run, self.model.parameters(), measure and i == 0)
                self.activation_bytes = saved if saved is not None else self.activation_bytes
                with self.ranges("backward"):
                    self.policy.backward(loss)
            total = loss.detach() if total is None else total + loss.detach()
        return total

    def _forward_loss(self, ids, mask, labels, packed: dict, weight: Optional[torch.Tensor]) -> torch.Tensor:
        with self.ranges("forward"), self.guard.forward_context():  # the guard's hooks only while diagnosing
            output = self.train_model(ids, mask, self.policy.blocks_autocast, **packed)  # fp32
        with self.ranges("loss"):
            loss = self.loss(output, labels)  # fp32, outside autocast
            return loss if weight is None else loss * weight

    def loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The task's loss of a training forward's ``output``: logits, or the hidden states of a model whose
        ``loss_head()`` is set (``model.chunked_loss``: the task applies the head chunk by chunk)."""
        linear = self.model.loss_head() if hasattr(self.model, "loss_head") else None
        head = None if linear is None else LossHead(linear, DTYPES[self.policy.mode])
        return self.task.loss(output, labels, head)

    def _diagnostic_pass(self) -> torch.Tensor:
        """Forward + backward on the last step's batch, no optimizer step (for the numerics guard's diagnosis)."""
        ids, mask, labels, packed = self._last_inputs
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss(self.model(ids, mask, self.policy.blocks_autocast, **packed), labels)
        loss.backward()
        return loss.detach()

    def fit(self) -> TrainStats:
        """Train from ``start_step + 1`` to ``total_steps`` (or until a callback asks to stop); returns the stats."""
        self.model.train()
        bar = progress_bar(self.total_steps, "train", self.cfg.train.progress and self.dist.is_main,
                           initial=self.start_step)
        for step in range(self.start_step + 1, self.total_steps + 1):
            for cb in tuple(self.callbacks):
                cb.on_step_start(step)
            # on CUDA a step's duration is read at once only when a callback asks (else once per logged step)
            rec = self.step(resolve=any(getattr(cb, "needs_step_ms", False) for cb in self.callbacks))
            if step % self.cfg.train.log_every == 0 or step == self.total_steps:
                self._log(step, bar)
            if self.eval_loader is not None and (step % self.cfg.train.eval_every == 0 or step == self.total_steps):
                self.evaluate_now(step, bar)
            bar.update(1)
            stop = False
            for cb in tuple(self.callbacks):  # every callback sees every step; one may remove itself
                stop = cb.on_step_end(step, rec.ms) or stop
            if stop:
                self.stopped_at = step
                break
        bar.close()
        self.settle_times()
        for cb in tuple(self.callbacks):
            cb.on_fit_end(self.stats)
        return self.stats

    def _log(self, step: int, bar: Any) -> None:
        """One metrics record of the open window; abort on too many bad steps; the ``on_log`` callbacks."""
        record = self._log_record(step, self.window)
        self.logger.log(record)
        if self.guard.should_abort():
            self.guard.diagnose_batch(self._diagnostic_pass)
            bar.close()
            raise self.guard.abort(step)
        for cb in tuple(self.callbacks):  # this step's gradients are still in .grad
            cb.on_log(record)
        self.stats.final_train_loss = record["loss"]
        bar.set_postfix(loss="n/a" if record["loss"] is None else f"{record['loss']:.3f}",
                        samples_s=f"{record['samples_per_s']:.0f}",
                        pad=f"{100 * (1 - record['token_efficiency']):.0f}%")
        self.reset_window()

    def evaluate_now(self, step: int, bar: Any) -> None:
        """Evaluate on ``eval_loader`` at ``step`` (0: before the first); a signal abandons it (``stats``, said)."""
        try:
            result = evaluate(self.model, self.eval_loader, self.policy, self.num_classes, self.device, self.dist,
                              phase="periodic evaluation", task=self.task)
        except EvaluationAbandoned as exc:
            self.stats.abandoned_eval = f"periodic evaluation at step {step}"
            result = {"accuracy": None, "unavailable_reason": str(exc)}
        else:
            self.stats.evals.append({"step": step, **result})
            self.logger.log({"step": step, "event": "eval", **{f"eval_{k}": v for k, v in result.items()}})
        msg = (f"step {step}/{self.total_steps}: {self.task.eval_line(result)}" if result["accuracy"] is not None else
               f"step {step}/{self.total_steps}: no evaluation ({result.get('unavailable_reason')})")
        if not bar.disable:
            bar.write(msg)
        elif self.dist.is_main:
            print(msg, flush=True)

    def settle_times(self) -> None:
        """Read the step durations the timer still holds into the open window (a sync point on CUDA)."""
        self.window["ms"] += sum(self.timer.flush())

    def _log_record(self, step: int, window: dict) -> dict[str, Any]:
        self.settle_times()
        return window_record(step, window, self.guard.end_window(window["steps"]), epoch=self.epoch,  # a sync point
                             lr=self.scheduler.get_last_lr()[0], scaler=self.policy.scaler, dist=self.dist,
                             device=self.device)

    def state_dict(self, whole_optimizer: bool = True) -> dict[str, Any]:
        """The training state every rank shares: progress, optimizer, scheduler, GradScaler, evaluations.

        Plain values and tensors only (loadable with ``weights_only=True``). ``batches_in_epoch`` is the
        sampler position: batches of ``epoch`` the loop has consumed (not what the DataLoader prefetched). Under
        FSDP2 the optimizer state is gathered whole (a collective: every rank calls this); ``whole_optimizer=False``
        leaves it out (a sharded checkpoint writes its shards itself).
        """
        scaler = self.policy.scaler
        optimizer = {"optimizer": full_optimizer_state(self.optimizer)} if whole_optimizer else {}
        return {"step": self.stats.steps, "epoch": self.epoch, "batches_in_epoch": self.batches_in_epoch,
                "total_steps": self.total_steps, **optimizer, "scheduler": self.scheduler.state_dict(),
                "grad_scaler": scaler.state_dict() if scaler is not None else None,
                "evals": list(self.stats.evals), "final_train_loss": self.stats.final_train_loss}

    def rank_state_dict(self) -> dict[str, Any]:
        """This rank's own state: its open logging window and its counters."""
        self.settle_times()
        return {"guard": self.guard.state_dict(), "window": dict(self.window), **self.stats.rank_counters()}

    def load_state_dict(self, state: dict[str, Any], rank_state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` / :meth:`rank_state_dict`: the next step is ``state['step'] + 1``."""
        if state.get("optimizer") is not None:  # None: loaded from a sharded checkpoint's shards already
            load_optimizer_state(self.optimizer, state["optimizer"])  # sharded as this run holds it
        self.scheduler.load_state_dict(state["scheduler"])
        if self.policy.scaler is not None and state.get("grad_scaler") is not None:
            self.policy.scaler.load_state_dict(state["grad_scaler"])
        self.start_step = int(state["step"])
        self.epoch, self.batches_in_epoch = int(state["epoch"]), int(state["batches_in_epoch"])
        self.train_loader.batch_sampler.load_state_dict(
            {"epoch": self.epoch, "start": self.batches_in_epoch, "seed": self.cfg.train.seed})
        s = self.stats
        s.steps, s.evals, s.final_train_loss = self.start_step, list(state["evals"]), state["final_train_loss"]
        self.guard.load_state_dict(rank_state["guard"])
        self.window = dict(rank_state["window"])
        s.load_rank_counters(rank_state)
