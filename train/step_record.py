"""What one training step did (:class:`StepRecord`, returned by :meth:`train.trainer.Trainer.step`) and what the
loop counted over all of them (:class:`TrainStats`: the report is built from it)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

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
    steady_shape_counts: Counter = field(default_factory=Counter)  # (B, S) → steps, first step excluded
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
        self.seq_lens.add(rec.seq_len)
        self.batch_shapes.add((rec.rows, rec.seq_len))
        if steady:
            self.steady_shape_counts[(rec.rows, rec.seq_len)] += 1
            self.steady_samples += rec.samples
            self.steady_real_tokens += rec.real_tokens
            self.steady_target_tokens += rec.target_tokens
            self.steady_attention_pairs += rec.attention_pairs


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

    @property
    def padded_tokens(self) -> int:
        """Token slots the step processed (rows × seq_len), padding included."""
        return self.rows * self.seq_len

    def counts(self) -> dict[str, int]:
        """The step's work as numbers that add up over steps (what an A/B window sums)."""
        return {"samples": self.samples, "real_tokens": self.real_tokens, "padded_tokens": self.padded_tokens}
