"""``compile.*`` settings: torch.compile options, the cache directory and warm-up (composed into RunConfig)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from train.errors import Frozen, UserError, allowed, check_fields


@dataclass
class CompileConfig(Frozen):
    """``torch.compile`` of the model, warm-up per batch shape, the persistent cache (train/compiling/session.py)."""

    enabled: Union[bool, str] = allowed("auto", choices=("auto", "true", "false"))
    """``true``, ``false`` or ``auto``: on for CUDA; off on CPU, where it was measured to give no steady-state
    speedup for the tiny model and a cold compile of tens of seconds (README "torch.compile"; re-measure with
    ``python -m train bench-compile``)."""
    mode: str = allowed("default", choices=("default", "reduce-overhead", "max-autotune"))
    """``default``, ``reduce-overhead`` (CUDA graphs; needs the static bucket shapes) or ``max-autotune``."""
    dynamic: bool = False
    """False: one static graph per (batch, length) shape, which bucketing keeps few; True: symbolic shapes."""
    backend: str = "inductor"
    """The torch.compile backend. ``aot_eager`` traces the same graphs with the same guards (so the same recompiles)
    without inductor's code generation: a quick way to check recompile behaviour on a slow machine."""
    fullgraph: bool = False
    """Fail instead of splitting the model into several graphs at a graph break."""
    warmup: bool = True
    """Before training, compile and run every planned batch shape (train and eval) until its step time is stable;
    weights, optimizer state and RNG are restored afterwards."""
    warmup_eval: bool = True
    """Warm the evaluation shapes too (their graphs are separate: no autograd, dropout off)."""
    warmup_cv: float = allowed(0.05, gt=0, lt=1)
    """A shape is stable when the coefficient of variation (std/mean) of its last ``warmup_window`` step times is
    ≤ this."""
    warmup_window: int = allowed(5, ge=2)
    """n, the number of most recent steps whose CV decides stability."""
    warmup_max_steps: int = allowed(30, ge=2)
    """Cap on timed steps per shape after the compiling one; a shape that reaches it is reported as not stable."""
    cache_dir: Optional[str] = None
    """Persistent compile cache (``TORCHINDUCTOR_CACHE_DIR``; ``TRITON_CACHE_DIR`` = its ``triton/``). None:
    ``$TORCHINDUCTOR_CACHE_DIR`` if set, else ``.cache/inductor``. Unwritable → a per-user temp dir, with a warning."""
    recompile_limit: Optional[int] = allowed(None, ge=1)
    """dynamo's limit on compiled variants of the forward; None = max(torch's default, planned graphs + 8)."""

    def __post_init__(self) -> None:
        if isinstance(self.enabled, bool):
            self.enabled = "true" if self.enabled else "false"
        check_fields(self, "compile")
        if self.backend != "inductor" and self.mode != "default":
            raise UserError(f"compile.mode={self.mode!r} needs compile.backend=inductor (got {self.backend!r})")
        if self.warmup_max_steps < self.warmup_window:
            raise UserError(f"compile.warmup_max_steps={self.warmup_max_steps} must be ≥ "
                            f"compile.warmup_window={self.warmup_window}")
