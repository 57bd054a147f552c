"""What one training step did (:class:`StepRecord`, returned by :meth:`train.trainer.Trainer.step`) and what the
loop counted over all of them (:class:`TrainStats`: the report is built from it)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch


@dataclass
class TrainStats:
    """What the loop measured; the report is built from it."""

    steps: int = 0
    samples: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    steady_samples: int = 0
    steady_real_tokens: int = 0
    target_tokens: int = 0  # causal LM: the tokens trained as next-token targets
    steady_target_tokens: int = 0
    truncated_in_collate: int = 0
    seq_lens: set = field(default_factory=set)
    batch_shapes: set = field(default_factory=set)
    steady_shape_counts: Counter = field(default_factory=Counter)  # (B, S) → micro-batches, first step excluded
    steady_steps: int = 0  # optimizer steps, first step excluded
    steady_attention_pairs: int = 0  # varlen attention: per-head query–key pairs computed, first step excluded
    final_train_loss: Optional[float] = None
    first_step_end: Optional[float] = None  # time.perf_counter() at the end of step 1
    evals: list = field(default_factory=list)
    abandoned_eval: Optional[str] = None  # what a signal cut short ("periodic evaluation at step N")
    answers: dict = field(default_factory=dict)  # causal LM: fixed prompts answered "before" / "after" (evaluation.py)

    def add(self, rec: "StepRecord", steady: bool) -> None:
        """Count one step (``steady``: not this process's first, cold step)."""
        self.steps, self.samples = rec.step, self.samples + rec.samples
        self.real_tokens += rec.real_tokens
        self.target_tokens += rec.target_tokens
        self.padded_tokens += rec.padded_tokens
        self.truncated_in_collate += rec.truncated
        self.seq_lens.update(s for _, s in rec.shapes)
        self.batch_shapes.update(rec.shapes)
        if steady:
            self.steady_shape_counts.update(rec.shapes)  # per micro-batch: what the FLOPs count multiplies
            self.steady_steps += 1
            self.steady_samples += rec.samples
            self.steady_real_tokens += rec.real_tokens
            self.steady_target_tokens += rec.target_tokens
            self.steady_attention_pairs += rec.attention_pairs

    def rank_counters(self) -> dict:
        """This rank's counters for its checkpoint (plain values: ``weights_only`` loadable)."""
        return {"samples": self.samples, "real_tokens": self.real_tokens, "padded_tokens": self.padded_tokens,
                "truncated_in_collate": self.truncated_in_collate, "seq_lens": sorted(self.seq_lens),
                "batch_shapes": [list(x) for x in sorted(self.batch_shapes)]}

    def load_rank_counters(self, r: dict) -> None:
        """Continue from :meth:`rank_counters`."""
        self.samples, self.real_tokens, self.padded_tokens = r["samples"], r["real_tokens"], r["padded_tokens"]
        self.truncated_in_collate = r["truncated_in_collate"]
        self.seq_lens, self.batch_shapes = set(r["seq_lens"]), {tuple(x) for x in r["batch_shapes"]}


@dataclass(frozen=True)
class StepRecord:
    """What one :meth:`Trainer.step` did.

    ``loss``: the batch's mean cross-entropy, an fp32 scalar tensor on the device (not read back: no sync);
    ``grad_norm``: the pre-clip global gradient norm in true units (device tensor, or None when clipping computes
    none); ``rows`` × ``seq_len`` the batch's shape (rows hold several samples when packed); ``samples``,
    ``real_tokens`` (tokens that are not padding), ``target_tokens`` (causal LM: tokens trained as targets; 0 for a
    classifier) and ``truncated`` (samples cut to fit) counts; ``ms`` the step's
    duration in milliseconds when the host knows it (always on a CPU; on CUDA only when resolved), else None;
    ``attention_pairs``: per-head query–key pairs the ``varlen`` attention computed (0 on every other path, whose
    attention the FLOP count takes per row from the shape).
    """

    step: int
    loss: torch.Tensor
    grad_norm: Optional[torch.Tensor]
    rows: int
    seq_len: int
    samples: int
    real_tokens: int
    truncated: int
    ms: Optional[float] = None
    target_tokens: int = 0
    attention_pairs: int = 0
    shapes: tuple = ()
    """The ``(rows, seq_len)`` of each micro-batch (``train.grad_accum``); empty: one, ``(rows, seq_len)``."""

    def __post_init__(self) -> None:
        if not self.shapes:
            object.__setattr__(self, "shapes", ((self.rows, self.seq_len),))

    @property
    def padded_tokens(self) -> int:
        """Token slots the step processed, padding included: Σ rows × seq_len over its micro-batches."""
        return sum(b * s for b, s in self.shapes)

    @classmethod
    def of_micro_batches(cls, step: int, loss: torch.Tensor, grad_norm: Optional[torch.Tensor], micro: list[dict],
                         ms: Optional[float], attention_pairs: Callable[[dict], int]) -> "StepRecord":
        """The record of a step over ``micro`` (its batches, as the loaders give them: ``input_ids`` [B, S] and
        their counts): rows and counts summed, ``seq_len`` the last micro-batch's, padded tokens Σ B·S;
        ``attention_pairs(batch)``: a batch's varlen query–key pairs (0 where none)."""
        from train.data.batch import batch_samples

        shapes = [tuple(m["input_ids"].shape) for m in micro]
        return cls(step=step, loss=loss, grad_norm=grad_norm, rows=sum(b for b, _ in shapes), seq_len=shapes[-1][1],
                   samples=sum(batch_samples(m) for m in micro), real_tokens=sum(int(m["real_tokens"]) for m in micro),
                   truncated=sum(int(m.get("truncated", 0)) for m in micro), ms=ms,
                   target_tokens=sum(int(m.get("target_tokens", 0)) for m in micro),
                   attention_pairs=sum(attention_pairs(m) for m in micro), shapes=tuple(shapes))

    def counts(self) -> dict[str, int]:
        """The step's work as numbers that add up over steps (what an A/B window sums)."""
        return {"samples": self.samples, "real_tokens": self.real_tokens, "padded_tokens": self.padded_tokens}


def window_record(step: int, window: dict, numerics: dict, *, epoch: int, lr: float, scaler: Any, dist: Any,
                  device: torch.device) -> dict[str, Any]:
    """One metrics record of a logging window (``window``: steps, ms, samples, real and padded tokens of this rank;
    ``numerics``: the guard's window, whose ``loss`` is the mean over the window's non-skipped steps). Over ranks:
    the loss is the mean of the ranks' step losses — each rank's is its share of the global-batch loss times the
    world size (train/accumulation.py), so the mean is that loss —, samples and tokens summed, time this rank's."""
    from train.parallel.process_group import all_reduce_sum

    n, numerics = window["steps"], dict(numerics)
    loss = numerics.pop("loss")
    if dist.enabled:
        totals = all_reduce_sum(torch.tensor([loss if loss is not None else float("nan"), window["samples"],
                                              window["real"], window["padded"]], dtype=torch.float64, device=device),
                                dist)
        loss = float(totals[0]) / dist.world_size
        window = {**window, "samples": int(totals[1]), "real": int(totals[2]), "padded": int(totals[3])}
    secs = window["ms"] / 1e3
    record = {"step": step, "epoch": epoch, "loss": loss, "lr": lr,
              "step_time_ms": window["ms"] / n, "samples_per_s": window["samples"] / secs if secs else None,
              "real_tokens": window["real"], "padded_tokens": window["padded"],
              "token_efficiency": window["real"] / window["padded"], "steps_in_window": n, **numerics}
    if scaler is not None:
        record["loss_scale"] = float(scaler.get_scale())
    return record
