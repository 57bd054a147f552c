"""``profile.*`` settings: the profiler window and the attribution thresholds (composed into RunConfig)."""

from __future__ import annotations

from dataclasses import dataclass

from train.errors import Frozen, allowed, check_fields


@dataclass
class ProfileConfig(Frozen):
    """``python -m train profile``: which steps are captured and how the attribution is judged (train/profiling)."""

    wait: int = allowed(2, ge=0)
    """torch.profiler schedule: steps skipped first (cold steps: allocator warm-up, lazy init)."""
    warmup: int = allowed(2, ge=0)
    """torch.profiler schedule: steps traced but discarded (the profiler's own warm-up)."""
    active: int = allowed(5, ge=1, le=20)
    """torch.profiler schedule: steps recorded. Bounded (≤ 20) because it sets the trace size."""
    top_k: int = allowed(10, ge=1)
    """Rows in the attribution table (ops by self device time on CUDA, self CPU time on CPU)."""
    max_trace_mb: float = allowed(50.0, gt=0)
    """Size cap for the gzipped Chrome/Perfetto trace; a larger trace is deleted and reported (lower ``active``)."""
    pyspy_steps: int = allowed(20, ge=3)
    """py-spy: steps per window; windows run off/on/off/on/off, so overhead compares step times side by side."""
    pyspy_rate: int = allowed(20, ge=1)
    """py-spy sampling rate (samples per second). 20 Hz: the rate whose overhead stayed within 5% of the step in
    every run of the comparison in docs/profiling.md (100 Hz costs several times more); it gives up resolution: ~90
    stacks per 20-step window of 220 ms steps, enough to rank functions above ~2% of the time. Raise it (and
    ``pyspy_steps``) for detail at that cost."""
    pyspy_native: bool = False
    """py-spy ``--native``: include C/C++ frames (torch's kernels) in the stacks. Off by default: unwinding native
    stacks pauses the process at every sample, several times the cost of Python frames read without a pause
    (docs/profiling.md); without it an op's time is attributed to the Python line that called it."""
    pyspy_nonblocking: bool = True
    """py-spy ``--nonblocking``: read the stacks without pausing the process (the default: a paused trainer waits for
    py-spy to be scheduled, which on a loaded machine costs far more than the read; occasionally a torn stack).
    Ignored with ``pyspy_native=true``: py-spy reads native stacks only from a paused process."""
    nsys_steps: int = allowed(5, ge=1)
    """Nsight Systems: steps inside the capture range (cudaProfilerStart/Stop)."""
    gpu_sample_ms: int = allowed(100, ge=10)
    """NVML sampling interval during CUDA profiles, milliseconds."""
    data_bound_share: float = allowed(0.10, gt=0, lt=1)
    """A step is data-bound when waiting on the DataLoader takes at least this share of it."""
    padding_share: float = allowed(0.25, gt=0, lt=1)
    """Recommend bucketing when at least this share of the processed tokens is padding."""
    launch_us: float = allowed(10.0, gt=0)
    """An op whose mean time per call is below this many µs is launch/dispatch-bound."""
    launch_share: float = allowed(0.20, gt=0, lt=1)
    """Recommend fusing small ops (torch.compile, CUDA graphs) when launch-bound ops take at least this share of the
    step."""
    memory_share: float = allowed(0.30, gt=0, lt=1)
    """Recommend fusing elementwise chains / a 16-bit dtype when memory-bound ops take at least this share of the
    step."""
    compute_share: float = allowed(0.30, gt=0, lt=1)
    """Recommend fewer FLOPs per useful token when compute-bound ops take at least this share of the step."""
    optimizer_share: float = allowed(0.15, gt=0, lt=1)
    """Recommend a foreach/fused AdamW when the optimizer stage takes at least this share of the step."""
    other_share: float = allowed(0.15, gt=0, lt=1)
    """Recommend less logging and fewer host-device syncs when time outside data/forward/backward/optimizer takes at
    least this share of the step."""

    def __post_init__(self) -> None:
        check_fields(self, "profile")

