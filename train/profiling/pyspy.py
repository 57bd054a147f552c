"""py-spy: sample the running training process (native frames too) into an SVG flame graph and
speedscope JSON, and measure what sampling costs in the same run.

The process attaches py-spy to itself (``py-spy record --pid <own pid>``) for two windows of steps,
one per output format, interleaved with windows without it: off / on (flamegraph) / off / on
(speedscope) / off. Overhead is matched by batch shape (:func:`shape_matched_overhead`): each step with
py-spy ÷ the median step without it of the same (rows, seq) shape, median − 1; the first step of each
window is left out (attach/detach transitions). Step times come from the trainer's own
synchronised StepTimer; the hooks run between steps, so attaching and detaching are not timed.

Preflight (:func:`ptrace_preflight`) tries the real thing, a ``py-spy dump`` of this process, after the
static blockers (Yama scope 3, scope 2 without CAP_SYS_PTRACE, another tracer); capability bits alone say
nothing under Yama scope 1 or without Yama (a container's non-root user has CapEff=0 even with
``--cap-add SYS_PTRACE``, yet may trace its own processes). A failure at attach time is reported too, and
training always goes on.
Source: py-spy README (https://github.com/benfred/py-spy), Linux Yama docs (ptrace_scope).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from train.callbacks import Callback
from train.config import ProfileConfig

CAP_SYS_PTRACE = 19
PR_SET_PTRACER = 0x59616D61
PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value


def shape_matched_overhead(on: list[tuple[Any, float]], off: list[tuple[Any, float]]) -> dict[str, Any]:
    """What sampling costs, from ``(batch_shape, step_ms)`` pairs with (``on``) and without (``off``) the sampler.

    Bucketed batches differ in cost by shape, and two short windows draw different shapes, so a ratio of plain
    medians mixes the shapes drawn with the sampler's cost. Here each step with the sampler is divided by the
    median step time without it *of the same shape*, and ``overhead_ratio`` is the median of those ratios − 1.
    Steps whose shape never ran without the sampler are left out (``steps_matched`` counts the rest); with no shape
    in common, the ratio of plain medians is returned and ``overhead_method`` says so.
    Returns overhead_ratio, overhead_method, steps_matched, step_time_ms_with/without (plain medians, ms),
    overhead_ratio_unmatched (their ratio − 1), overhead_noise_ratio (half the interquartile range of the steps
    without the sampler, each divided by its shape's median: the step-to-step spread, a fraction; None with fewer
    than 4 such steps) and overhead_within_noise (true when the overhead is negative, a sampler cannot speed a step
    up, or no larger than that spread: the figure is noise, not a cost). Raises ValueError when either list is empty.
    """
    if not on or not off:
        raise ValueError("shape_matched_overhead needs steps with and without the sampler")
    by_shape: dict[Any, list[float]] = {}
    for shape, ms in off:
        by_shape.setdefault(shape, []).append(ms)
    ref = {shape: float(np.median(v)) for shape, v in by_shape.items()}
    ratios = [ms / ref[shape] for shape, ms in on if shape in ref]
    m_on, m_off = float(np.median([ms for _, ms in on])), float(np.median([ms for _, ms in off]))
    res = {"step_time_ms_with": m_on, "step_time_ms_without": m_off, "overhead_ratio_unmatched": m_on / m_off - 1,
           "steps_matched": len(ratios)}
    if ratios:
        res.update(overhead_ratio=float(np.median(ratios)) - 1, overhead_method="median of per-step ratios to the "
                   "median step without py-spy of the same batch shape")
    else:
        res.update(overhead_ratio=m_on / m_off - 1, overhead_method="ratio of medians (no batch shape ran both with "
                   "and without py-spy)")
    spread = [ms / ref[shape] for shape, ms in off]
    noise = float(np.subtract(*np.percentile(spread, [75, 25]))) / 2 if len(spread) >= 4 else None
    res["overhead_noise_ratio"] = noise
    res["overhead_within_noise"] = bool(res["overhead_ratio"] < 0 or (noise is not None
                                                                      and abs(res["overhead_ratio"]) <= noise))
    return res


@dataclass
class PtraceCheck:
    """Result of :func:`ptrace_preflight`: ``ok`` and, when not, each missing piece with its fix."""

    ok: bool
    pyspy: Optional[str]
    missing: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def message(self) -> str:
        if self.ok:
            return "py-spy can attach" + (f" ({'; '.join(self.notes)})" if self.notes else "")
        return "py-spy cannot attach: " + "; ".join(self.missing)


def find_pyspy() -> Optional[str]:
    """The py-spy binary: next to this interpreter (a venv) or on PATH."""
    local = Path(sys.executable).with_name("py-spy")
    return str(local) if local.is_file() else shutil.which("py-spy")


def _cap_eff(status: str) -> Optional[int]:
    for line in status.splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return None


def _in_container(proc: Path, root: Path) -> bool:
    try:
        cgroup = (proc / "1" / "cgroup").read_text()
    except OSError:
        cgroup = ""
    return (root / ".dockerenv").exists() or any(k in cgroup for k in ("docker", "kubepods", "containerd", "lxc"))


def try_attach(pyspy: str, timeout_s: float = 30.0) -> tuple[bool, str]:
    """Attach for real: ``py-spy dump --pid <this process>`` after :func:`allow_tracer` (what the capture does)."""
    allow_tracer()
    try:
        out = subprocess.run([pyspy, "dump", "--pid", str(os.getpid())], capture_output=True, text=True,
                             timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"{exc.__class__.__name__}: {exc}"
    text = (out.stdout + out.stderr).strip()
    return out.returncode == 0, (text.splitlines() or [f"exit {out.returncode}"])[-1]


def ptrace_preflight(pyspy: Optional[str] = None, proc: Path = Path("/proc"), root: Optional[Path] = None,
                     attach: Callable[[str], tuple[bool, str]] = try_attach) -> PtraceCheck:
    """Can a child py-spy ptrace this process? Static blockers first, from ``proc/self/status`` (CapEff,
    TracerPid) and ``proc/sys/kernel/yama/ptrace_scope``; then ``attach(pyspy)`` tries it (default
    :func:`try_attach`); on failure ``proc/1/cgroup`` and ``root/.dockerenv`` (``root`` defaults to
    ``proc/..``) choose the advice. Parameters so tests can simulate any host.

    Yama scopes: 0 classic (same uid); 1 restricted: only ancestors may trace, so this process
    declares py-spy with ``prctl(PR_SET_PTRACER)`` (done in :func:`allow_tracer`) unless it has
    CAP_SYS_PTRACE; 2 admin-only: CAP_SYS_PTRACE required; 3: no ptrace at all.
    """
    pyspy = pyspy if pyspy is not None else find_pyspy()
    check = PtraceCheck(ok=True, pyspy=pyspy)
    if not pyspy:
        check.missing.append("py-spy is not installed: pip install -r requirements-dev.txt (pins py-spy)")
    try:
        status = (proc / "self" / "status").read_text()
    except OSError:
        status = ""
    caps = _cap_eff(status)
    has_cap = caps is not None and bool(caps >> CAP_SYS_PTRACE & 1)
    for line in status.splitlines():
        if line.startswith("TracerPid:") and line.split()[1] != "0":
            check.missing.append(f"this process is already traced by pid {line.split()[1]} (a debugger or another "
                                 "profiler); only one tracer can attach")
    try:
        scope: Optional[int] = int((proc / "sys" / "kernel" / "yama" / "ptrace_scope").read_text().strip())
    except (OSError, ValueError):
        scope = None
    if scope == 3:
        check.missing.append("kernel.yama.ptrace_scope=3 disables ptrace until reboot (set it to 1 or 0 at boot)")
    elif scope == 2 and not has_cap:
        check.missing.append("kernel.yama.ptrace_scope=2 allows only CAP_SYS_PTRACE holders: add the capability "
                             "(docker run --cap-add SYS_PTRACE) or run sysctl kernel.yama.ptrace_scope=1 on the host")
    elif scope == 1 and not has_cap:
        check.notes.append("kernel.yama.ptrace_scope=1: this process allows py-spy via prctl(PR_SET_PTRACER)")
    if not check.missing and pyspy:
        ok, detail = attach(pyspy)
        if ok:
            check.notes.append("a test attach (py-spy dump of this process) worked")
        elif not has_cap and _in_container(proc, root if root is not None else proc.parent):
            check.missing.append(f"a test attach failed ({detail}) in a container without CAP_SYS_PTRACE: start it "
                                 "with --cap-add SYS_PTRACE (docker run / compose cap_add: [SYS_PTRACE])")
        else:
            check.missing.append(f"a test attach (py-spy dump of this process) failed: {detail}")
    check.ok = not check.missing
    return check


def allow_tracer() -> bool:
    """``prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)`` so a child py-spy may trace us under Yama scope 1 (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


class PySpyPhase(Callback):
    """Windows of ``cfg.pyspy_steps`` steps from training step ``first_step``: off, on, off, on, off."""

    WINDOWS = ("off", "flamegraph", "off", "speedscope", "off")
    needs_step_ms = True  # the on/off step times are compared per step

    def __init__(self, cfg: ProfileConfig, out_dir: Path, first_step: int, check: PtraceCheck,
                 attach_wait_s: float = 1.0) -> None:
        self.cfg, self.out_dir, self.first_step, self.check = cfg, out_dir, first_step, check
        self.attach_wait_s = attach_wait_s
        self.n = cfg.pyspy_steps
        self.last_step = first_step + len(self.WINDOWS) * self.n - 1
        self.times: dict[str, list[tuple[Any, float]]] = {"off": [], "on": []}  # (batch shape, step ms)
        self.outputs: dict[str, Any] = {}
        self.errors: list[str] = []
        self._proc: Optional[subprocess.Popen] = None
        self._kind: Optional[str] = None
        self._trainer = None

    def window_of(self, step: int) -> Optional[tuple[int, str]]:
        """(index, kind) of the window holding training ``step``, or None outside the phase."""
        if not self.first_step <= step <= self.last_step:
            return None
        i = (step - self.first_step) // self.n
        return i, self.WINDOWS[i]

    def attach(self, trainer) -> None:
        self._trainer = trainer
        trainer.add_callback(self)
        allow_tracer()

    def on_step_end(self, step: int, step_ms: float) -> bool:
        w = self.window_of(step)
        if w is not None:
            i, kind = w
            if (step - self.first_step) % self.n != 0:  # the first step of a window is a transition
                shape = getattr(self._trainer, "last_batch_shape", None)
                self.times["off" if kind == "off" else "on"].append((shape, step_ms))
        nxt = self.window_of(step + 1)
        if self._proc is not None and (nxt is None or nxt[1] != self._kind):
            self._stop()
        if nxt is not None and nxt[1] != "off" and self._proc is None and not self.errors:
            self._start(nxt[1])
        if step >= self.last_step:
            self._stop()
            self._trainer.remove_callback(self)
        return False

    def _start(self, kind: str) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        out = self.out_dir / ("pyspy.svg" if kind == "flamegraph" else "pyspy.speedscope.json")
        out.unlink(missing_ok=True)  # never report an old capture
        cmd = [self.check.pyspy, "record", "--pid", str(os.getpid()), "--rate", str(self.cfg.pyspy_rate),
               "--format", kind, "--output", str(out)] + (["--native"] if self.cfg.pyspy_native else []) \
            + (["--nonblocking"] if self.cfg.pyspy_nonblocking and not self.cfg.pyspy_native else [])
        self._log = open(self.out_dir / f"pyspy-{kind}.log", "w")
        self._proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        self._kind, self._out, self._cmd = kind, out, cmd
        time.sleep(self.attach_wait_s)  # between steps: not timed
        if self._proc.poll() is not None:
            self._finish_proc()

    def _stop(self) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGINT)  # py-spy writes its output on Ctrl-C
            try:
                self._proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._finish_proc()

    def _finish_proc(self) -> None:
        rc = self._proc.returncode
        self._log.close()
        log = Path(self._log.name).read_text(errors="replace").strip()
        if self._out.is_file() and self._out.stat().st_size > 0:
            self.outputs[self._kind] = {"path": str(self._out), "bytes": self._out.stat().st_size}
        else:
            self.errors.append(f"py-spy {self._kind} exited {rc} without output: {log[-500:]} "
                               f"(command: {' '.join(self._cmd)}); {self.check.message()}")
        self._proc = None

    def result(self) -> dict[str, Any]:
        """What summary.json's ``pyspy`` section holds."""
        on, off = self.times["on"], self.times["off"]
        res: dict[str, Any] = {"outputs": self.outputs, "preflight": self.check.message(),
                               "rate_hz": self.cfg.pyspy_rate, "native": self.cfg.pyspy_native,
                               "nonblocking": self.cfg.pyspy_nonblocking and not self.cfg.pyspy_native,
                               "steps_with": len(on), "steps_without": len(off)}
        if self.errors:
            res["errors"] = self.errors
        if on and off and not self.errors:
            res.update(shape_matched_overhead(on, off))
        else:
            res["overhead_ratio"] = None
            res["overhead_unavailable_reason"] = ("py-spy did not sample (see errors)" if self.errors
                                                  else "no steps in the windows")
        return res
