"""The ``optimize`` section of ``RunConfig``: what ``python -m train optimize`` (``make optimize``) may spend and how
sure it must be before it keeps a lever (docs/optimize.md). Kept free of torch imports like the bench sections."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from train.errors import Frozen, UserError, allowed, check_fields, comma_list


@dataclass
class OptimizeConfig(Frozen):
    """Attribution-driven progressive optimisation: profile, rank the lever catalogue, A/B the best candidate against
    the current best, keep it when it clears ``min_gain`` and the quality guard, re-profile, repeat."""

    budget_s: float = allowed(900.0, gt=0)
    """Wall-clock budget of the whole command in seconds, from its start to its written outputs: set-up, data
    preparation, profiles, every A/B and the final confirmation count. Work whose estimate (from measured times) no
    longer fits is not started — a candidate is listed as not tried, an A/B runs the rounds that fit — and once a lever
    is kept the final confirmation's estimate is held back; the command ends within ``budget_s`` + max(10 %, 30 s)
    (what cannot be split: a window, a build, the outputs' writing; docs/optimize.md, "The budget")."""
    levers: Optional[str] = None
    """Comma-separated lever names to consider (train/optimize/levers.py ``CATALOGUE``); null = all that
    apply on this device and model."""
    rounds: int = allowed(5, ge=2)
    """Interleaved rounds per A/B (paired per-round ratios; at least 2 for an interval)."""
    window_samples: int = allowed(384, ge=1)
    """Samples per timed window: both arms see the same number of samples per round, whatever their batch size. Large
    enough that a bucketed arm's window covers many buckets (with 96, three batch-32 steps of whichever buckets came
    up made per-window rates swing 2x and intervals span 0.6-1.5)."""
    window_steps: int = allowed(8, ge=0)
    """Each timed window of the search's A/Bs holds at least this many optimizer steps of the pair's arm with the
    most samples per step (``window_samples`` at the least): a 4096-token budget puts ~136 samples in a step, so a
    384-sample window held ~3 steps of whichever buckets came up and budget A/Bs on hf:bert spanned 0.69-1.28. The
    quality verdict stays after ``(1 + rounds) × window_samples`` samples whatever the window. Not the final
    confirmation's: its baseline is often ten times slower per sample. A window never holds
    more than the planned run's samples ÷ ``rounds`` (the timed rounds train no arm more than the run does: one epoch
    of bench-vs-hf's 6,000 samples is 1,200 per window). 0: samples only."""
    warmup_steps: int = allowed(3, ge=1)
    """Untimed steps per arm before its timed windows (compiled arms warm every planned shape instead)."""
    min_gain: float = allowed(1.02, ge=1.0)
    """A lever is kept only when its ratio's confidence interval lies at or above this (1.02: at least 2 % faster)."""
    quality_tolerance: float = allowed(0.05, ge=0)
    """The quality guard: a lever that may change training is rejected when its held-out loss, after the same
    number of samples from the same initial weights, exceeds the current best's by more than this fraction."""
    quality_samples: int = allowed(512, ge=1)
    """The fixed held-out slice of the quality guard: the first this-many validation samples (the test split when
    there is no validation split)."""
    arm_timeout_s: float = allowed(600.0, gt=0)
    """One candidate's A/B (build, warm-up, rounds, quality check) may take this long, never past ``budget_s``: no
    timed window starts that would end after it (the A/B is judged on the rounds it has), and an A/B still running
    at it (a hang) is stopped and rejected."""
    confirm_rounds: int = allowed(8, ge=2)
    """Rounds of the final confirmation: the baseline vs the optimized config, interleaved."""
    profile_steps: int = allowed(4, ge=2)
    """Steps of each (re-)profile: the first warms up, the rest are captured by torch.profiler."""
    max_budget_factor: int = allowed(4, ge=1)
    """The token-budget lever tries budgets up to this multiple of the current one (bounded, OOM-safe probe)."""
    lr_scaling: str = allowed("none", choices=("none", "sqrt", "linear"))
    """When a lever changes the samples per optimizer step by a factor k (a token budget, packing), the candidate keeps
    the run's schedule in samples — ``train.max_steps``, ``eval_every`` and ``checkpoint_every`` divided by k, so the
    run trains the same samples, warms up over the same samples and evaluates as often — and keeps the peak
    ``optim.lr`` (``none``), or scales it by √k (``sqrt``: the square-root rule for Adam, Malladi et al., NeurIPS
    2022) or by k (``linear``: Goyal et al. 2017, SGD). ``none`` by default: on the tiny model the √k rule lost test
    accuracy at equal samples where the same lr did not (docs/optimize.md has the figures). The quality guard
    compares learning at equal samples seen either way."""
    horizon_fraction: float = allowed(1.0, gt=0, le=1)
    """A lever that changes the optimizer steps per sample (a token budget, packing: its samples per optimizer step
    differ from the current best's, the run counted in steps or in epochs) is judged by the quality guard after this
    share of the planned run's samples, both arms trained on untimed, not after ``(1 + rounds)`` windows: early in
    training fewer, larger steps always look worse, and the gap narrows by the end of the run (docs/optimize.md has
    the held-out losses of a 4096-token budget against batches of 32). Capped by what fits in ``arm_timeout_s`` and
    half the budget left (the verdict says where it was judged)."""
    min_predicted: float = allowed(0.97, gt=0, le=1.005)
    """Candidates whose predicted speedup is below 1.005 (the profile shows no gain) but at or above this are
    near-neutral: measured after every candidate predicted to gain, while ``budget_s`` lasts; below it, never.
    The predictions are Amdahl's law on profile shares and layout costs that leave out per-shape effects (cache reuse,
    allocator, kernel choice per shape), so a candidate predicted near 1.0 can still measure a gain (docs/optimize.md:
    fitted buckets padded to their bounds against the same padded to the batch maximum). 1.005 measures none of
    them."""
    grid_rounds: int = allowed(3, ge=2)
    """``optimize-grid``: interleaved rounds over every combination (each arm once per round): the screening."""
    grid_finalists: int = allowed(4, ge=1)
    """``optimize-grid``: the fastest combinations of the screening re-measured against each other (and the
    ``--optimized`` arm) over ``confirm_rounds`` interleaved rounds; the grid's best is the final's."""
    recheck_rounds: int = allowed(16, ge=2)
    """``optimize-grid --optimized``: rounds of the re-check, the grid's best against the search's result once more
    after the pick; the ">= 95 % of the best" verdict is taken on its interval. 16 rounds: with 8, the interval of
    the search's settings against themselves was too wide to clear 0.95 (docs/optimize.md)."""

    def __post_init__(self) -> None:
        check_fields(self, "optimize")
        if self.levers is not None and not self.lever_names():
            raise UserError("optimize.levers must name at least one lever, or be null for all")

    def lever_names(self) -> Optional[list[str]]:
        """The levers named in ``levers`` (None: all)."""
        return comma_list(self.levers)
