"""What a lever of ``make optimize`` proposes from, and what it proposes: the profile's :class:`Evidence` and the
:class:`LeverContext` in; :class:`Candidate` values (or the one reason it does not apply) out; the :class:`Lever`
itself and Amdahl's law its predictions rest on. The catalogue of levers is levers.py.

``may_change`` says what a lever can change in training: ``exact`` (the same computation), ``numerics`` (the same
samples in the same order, other rounding), ``sample order`` (other batches), ``training`` (other optimizer steps
per sample) or ``rng stream`` (other random masks). Everything but ``exact`` goes through the quality guard.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional, Union

EXACT, NUMERICS, SAMPLE_ORDER, TRAINING, RNG = "exact", "numerics", "sample order", "training", "rng stream"


@dataclass
class Evidence:
    """What a short profile of the current best config measured. Shares are fractions of the profiled step time
    (None: not measured). ``samples_per_s`` from the profiled steps; ``peak_memory_bytes`` / ``memory_total_bytes``
    on CUDA (None elsewhere, with the reason in ``notes``)."""

    step_ms: Optional[float] = None
    samples_per_s: Optional[float] = None
    padding_share: Optional[float] = None
    compute_share: Optional[float] = None
    memory_share: Optional[float] = None
    launch_share: Optional[float] = None
    data_wait_share: Optional[float] = None
    optimizer_share: Optional[float] = None
    other_share: Optional[float] = None
    dropout_mask_share: Optional[float] = None
    attention_share: Optional[float] = None
    loss_share: Optional[float] = None
    """The step's ``loss`` stage (train/profiling/ranges.py): a causal LM's cross-entropy over the whole logits, or
    with the chunked loss the LM head and its gradient too."""
    top_memory_op: Optional[str] = None
    top_op: Optional[str] = None
    peak_memory_bytes: Optional[int] = None
    memory_total_bytes: Optional[int] = None
    unprofiled_samples_per_s: Optional[float] = None
    """Samples per second of the profile's second step, before the profiler records (its overhead — 2× and more on a
    CPU — and the first step's one-off work left out): where the search's time estimates start, before an A/B has
    timed a window."""
    steps_s: Optional[float] = None
    """Seconds of all the profile's steps: the profile's wall time less this is its build."""
    notes: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class LeverContext:
    """What a lever may look at besides the evidence: the current best ``cfg`` (a RunConfig, ``train.precision``
    explicit), the device type, the model's capabilities and the machine."""

    cfg: Any
    device_type: str
    supports_packing: bool = False
    dropout_modules: int = 0
    attention_paths: dict[str, str] = field(default_factory=dict)
    """The model's packed-rows attention paths besides ``sdpa-mask`` → why each cannot run here ("" where it can;
    :func:`train.data.attention.alternatives`)."""
    native_bf16: bool = False
    cuda_bf16: bool = False
    fused_adamw: bool = False
    cpu_count: int = field(default_factory=lambda: os.cpu_count() or 1)
    torch_threads: int = 1
    planned_steps: Optional[int] = None
    batch_shapes: int = 1
    base_budget: Optional[int] = None  # the baseline's token budget (bounds the token-budget lever)
    out_of_memory: Optional["Candidate"] = None
    """The latest candidate whose arm ran out of memory (the search fills it from its decisions; a test forces it):
    with the profile's peak near the device's memory, what says memory, not speed, is the constraint."""
    batching_costs: dict[str, Any] = field(default_factory=dict)
    """``"current"`` and each value of :data:`~train.optimize.levers.BATCHING` → its
    :class:`~train.data.layout_cost.LayoutCost` on this data; empty: the batching lever falls back to the padding
    share alone."""


@dataclass
class Candidate:
    """One value of one lever to try: ``overrides`` on the current best, the ``predicted`` speedup (Amdahl on the
    evidence) and the ``evidence`` sentence behind it; ``may_change`` (module docstring); ``warmup_s_estimate``:
    one-off seconds the candidate costs before its steady state (compilation), amortised over the planned run;
    ``other_steps`` (set by the search from the backend's samples per step)."""

    lever: str
    value: str
    overrides: dict[str, Any]
    predicted: float
    evidence: str
    may_change: str
    warmup_s_estimate: float = 0.0
    other_steps: bool = False
    """Its samples per optimizer step differ from the current best's: judged by the quality guard at the horizon."""

    @property
    def key(self) -> tuple:
        return tuple(sorted((k, repr(v)) for k, v in self.overrides.items()))


Proposal = Union[list[Candidate], str]  # candidates, or why the lever does not apply


@dataclass(frozen=True)
class Lever:
    """A catalogue entry: ``name``, what it ``changes``, where it ``applies`` (words), which ``evidence`` ranks it,
    what it ``may_change``, ``propose(ctx, evidence) -> candidates | reason``; an exact one predicts its bound.
    ``keys``: the settings its candidates may set."""

    name: str
    changes: str
    applies: str
    evidence: str
    may_change: str
    propose: Callable[[LeverContext, Evidence], Proposal]
    keys: tuple[str, ...] = ()


def pct(x: Optional[float]) -> str:
    """A share as a lever's evidence words put it: ``12.3%``, or ``not measured`` (None)."""
    return "not measured" if x is None else f"{100 * x:.1f}%"


def amdahl(share: Optional[float], k: float) -> float:
    """Speedup when a fraction ``share`` of the step becomes ``k`` times faster (``share`` None: 1.0)."""
    s = min(1.0, share or 0.0)
    return 1.0 / (1.0 - s + s / k) if s > 0 else 1.0
