"""``profile.*`` settings: the profiler window and the attribution thresholds (composed into RunConfig)."""

from __future__ import annotations

from dataclasses import dataclass

from train.errors import UserError


@dataclass
class ProfileConfig:
    """``python -m train profile``: which steps are captured and how the attribution is judged (train/profiling)."""

    wait: int = 2
    """torch.profiler schedule: steps skipped first (cold steps: allocator warm-up, lazy init)."""
    warmup: int = 2
    """torch.profiler schedule: steps traced but discarded (the profiler's own warm-up)."""
    active: int = 5
    """torch.profiler schedule: steps recorded. Bounded (≤ 20) because it sets the trace size."""
    top_k: int = 10
    """Rows in the attribution table (ops by self device time on CUDA, self CPU time on CPU)."""
    max_trace_mb: float = 50.0
    """Size cap for the gzipped Chrome/Perfetto trace; a larger trace is deleted and reported (lower ``active``)."""
    pyspy_steps: int = 12
    """py-spy: steps per window; windows run off/on/off/on/off, so overhead compares medians side by side."""
    pyspy_rate: int = 100
    """py-spy sampling rate (samples per second)."""
    pyspy_native: bool = True
    """py-spy ``--native``: include C/C++ frames (torch's kernels) in the stacks."""
    nsys_steps: int = 5
    """Nsight Systems: steps inside the capture range (cudaProfilerStart/Stop)."""
    gpu_sample_ms: int = 100
    """NVML sampling interval during CUDA profiles, milliseconds."""
    data_bound_share: float = 0.10
    """A step is data-bound when waiting on the DataLoader takes at least this share of it."""
    padding_share: float = 0.25
    """Recommend bucketing when at least this share of the processed tokens is padding."""
    launch_us: float = 10.0
    """An op whose mean time per call is below this many µs is launch/dispatch-bound."""
    launch_share: float = 0.20
    """Recommend fusing small ops (torch.compile, CUDA graphs) when launch-bound ops take at least this share of the step."""
    memory_share: float = 0.30
    """Recommend fusing elementwise chains / a 16-bit dtype when memory-bound ops take at least this share of the step."""
    compute_share: float = 0.30
    """Recommend fewer FLOPs per useful token when compute-bound ops take at least this share of the step."""
    optimizer_share: float = 0.15
    """Recommend a foreach/fused AdamW when the optimizer stage takes at least this share of the step."""
    other_share: float = 0.15
    """Recommend less logging and fewer host-device syncs when time outside data/forward/backward/optimizer takes at
    least this share of the step."""

    def __post_init__(self) -> None:
        if self.wait < 0 or self.warmup < 0:
            raise UserError("profile.wait and profile.warmup must be ≥ 0")
        if not 1 <= self.active <= 20:
            raise UserError(f"profile.active={self.active} must be in [1, 20] (it bounds the trace size)")
        if self.top_k < 1:
            raise UserError("profile.top_k must be ≥ 1")
        if self.max_trace_mb <= 0:
            raise UserError("profile.max_trace_mb must be > 0")
        if self.pyspy_steps < 3 or self.pyspy_rate < 1 or self.nsys_steps < 1 or self.gpu_sample_ms < 10:
            raise UserError("profile: pyspy_steps ≥ 3, pyspy_rate ≥ 1, nsys_steps ≥ 1 and gpu_sample_ms ≥ 10 are required")
        for name in ("data_bound_share", "padding_share", "launch_share", "memory_share", "compute_share",
                     "optimizer_share", "other_share"):
            if not 0 < getattr(self, name) < 1:
                raise UserError(f"profile.{name} must be in (0, 1)")
        if self.launch_us <= 0:
            raise UserError("profile.launch_us must be > 0")
