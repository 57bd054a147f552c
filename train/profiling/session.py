"""``python -m train profile``: one real training run with the requested captures attached.

Tools: ``torch`` (torch.profiler window + attribution table), ``pyspy`` (flame graph, speedscope,
overhead), ``gpu`` (NVML sampling, CUDA only), ``nsys`` (a second run under Nsight Systems, CUDA
only). Each tool that cannot run here prints one skip line saying why; training goes on.
Artifacts land in ``runs/<run-id>/profile/``: ``summary.md``, ``summary.json``, ``trace.json.gz``,
``pyspy.svg``, ``pyspy.speedscope.json``, ``gpu_samples.csv/.png``, ``nsys/``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from train.config import RunConfig
from train.errors import UserError, atomic_write_text
from train.profiling.attribution import build_summary, render_markdown
from train.profiling.gpu_sampler import GpuSampler, nvml_reader
from train.profiling.nsys import NsysCapture
from train.profiling.pyspy import PySpyPhase, ptrace_preflight
from train.profiling.window import TorchProfileWindow
from train.tools.env import device_name

TOOLS = ("torch", "pyspy", "gpu", "nsys")
INTERNAL = ("nsys-capture",)
NSYS_FIRST_STEP = 3


def parse_tools(text: str) -> list[str]:
    """``"torch,pyspy"`` → ["torch", "pyspy"]. Raises UserError for an unknown tool."""
    tools = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in tools if t not in TOOLS + INTERNAL]
    if bad or not tools:
        raise UserError(f"--tools {text!r}: choose from {', '.join(TOOLS)} (comma-separated)")
    return tools


def pyspy_first_step(cfg: RunConfig, tools: list[str]) -> int:
    p = cfg.profile
    return (p.wait + p.warmup + p.active + 3) if "torch" in tools else 3


def steps_needed(cfg: RunConfig, tools: list[str]) -> int:
    """Training steps the requested captures need, plus one."""
    p = cfg.profile
    need = [2]
    if "torch" in tools:
        need.append(p.wait + p.warmup + p.active)
    if "pyspy" in tools:
        need.append(pyspy_first_step(cfg, tools) + len(PySpyPhase.WINDOWS) * p.pyspy_steps - 1)
    if "nsys-capture" in tools:
        need.append(NSYS_FIRST_STEP + p.nsys_steps - 1)
    return max(need) + 1


class ProfileSession:
    """A ``run_training`` hook: attaches the captures, and in ``finish`` writes the summary."""

    def __init__(self, cfg: RunConfig, tools: list[str], proc_root: Path = Path("/proc")) -> None:
        self.cfg, self.tools, self.proc_root = cfg, tools, proc_root
        self.window: Optional[TorchProfileWindow] = None
        self.pyspy: Optional[PySpyPhase] = None
        self.sampler: Optional[GpuSampler] = None
        self.skipped: dict[str, str] = {}
        self.out_dir: Optional[Path] = None

    def _skip(self, tool: str, reason: str) -> None:
        self.skipped[tool] = reason
        print(reason, flush=True)

    def attach(self, trainer, run_dir: Path) -> None:
        self.trainer, self.out_dir, self.device = trainer, run_dir / "profile", trainer.device
        self.out_dir.mkdir(parents=True, exist_ok=True)
        for stale in ("summary.json", "summary.md", "trace.json.gz", "pyspy.svg", "pyspy.speedscope.json"):
            (self.out_dir / stale).unlink(missing_ok=True)
        p = self.cfg.profile
        if "torch" in self.tools:
            self.window = TorchProfileWindow(p, self.out_dir, self.device)
            self.window.attach(trainer)
        if "pyspy" in self.tools:
            check = ptrace_preflight(proc=self.proc_root)
            if check.ok:
                self.pyspy = PySpyPhase(p, self.out_dir, pyspy_first_step(self.cfg, self.tools), check)
                self.pyspy.attach(trainer)
            else:
                self._skip("pyspy", f"py-spy skipped (training continues): {check.message()}")
        if "gpu" in self.tools:
            if self.device.type != "cuda":
                self._skip("gpu", "GPU sampling skipped: the run is not on CUDA")
            else:
                read, why = nvml_reader(self.device)
                if read is None:
                    self._skip("gpu", why)
                else:
                    self.sampler = GpuSampler(read, p.gpu_sample_ms)
                    self.sampler.start()
        if "nsys-capture" in self.tools:
            NsysCapture(NSYS_FIRST_STEP, p.nsys_steps).attach(trainer)

    def finish(self, report: dict[str, Any]) -> None:
        summary: dict[str, Any] = {}
        if self.window is not None:
            summary = self._attribution(report)
        if self.pyspy is not None:
            summary["pyspy"] = self.pyspy.result()
            unprofiled = [ms for _shape, ms in self.pyspy.times["off"]]
            if self.window is not None and unprofiled and self.window.timer_ms:
                summary["torch_profiler_overhead_ratio"] = float(np.median(self.window.timer_ms)
                                                                 / np.median(unprofiled) - 1)
        if self.sampler is not None:
            self.sampler.stop()
            summary["gpu_sampling"] = self.sampler.write(self.out_dir)
        summary["skipped"] = self.skipped
        write_summary(self.out_dir, summary)
        report["profile"] = profile_report_keys(self.out_dir, summary)
        print_artifacts(self.out_dir, summary)

    def _attribution(self, report: dict[str, Any]) -> dict[str, Any]:
        w = self.window
        if not w.done:
            w.close()
        if not w.step_us:
            return {"attribution_unavailable_reason": "the run ended before the profiler's active steps"}
        p, env = self.cfg.profile, report["env"]
        from train.profiling.roofline import ridge_point

        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else device_name(self.device)
        roof = ridge_point(self.device, name, env.get("precision", "fp32"))
        real, padded = w.tokens.get("real_tokens", 0), w.tokens.get("padded_tokens", 0)
        ctx = {"padding_share": 1 - real / padded if padded else None, "real_tokens": real, "padded_tokens": padded,
               "batching_method": self.cfg.batching.method, "num_workers": self.cfg.data.num_workers,
               "precision": env.get("precision")}
        default_bytes = 2 if env.get("precision") in ("bf16", "fp16") else 4
        summary = build_summary(w.ops, device_type=self.device.type, step_total_us=sum(w.step_us),
                                active_steps=len(w.step_us), stage_us=w.stage_us, roofline=roof, th=p,
                                default_bytes=default_bytes, ctx=ctx)
        summary["trace"] = w.trace
        summary["profiled_step_time_ms_median"] = float(np.median(w.timer_ms)) if w.timer_ms else None
        return summary


def write_summary(out_dir: Path, summary: dict[str, Any]) -> None:
    atomic_write_text(out_dir / "summary.json", json.dumps(summary, indent=2, default=str) + "\n")
    atomic_write_text(out_dir / "summary.md", render_markdown(summary))


def profile_report_keys(out_dir: Path, summary: dict[str, Any]) -> dict[str, Any]:
    """report.json ``profile`` section (keys are a contract)."""
    trace = summary.get("trace", {})
    pyspy = summary.get("pyspy", {})
    return {"summary_json": str(out_dir / "summary.json"), "summary_md": str(out_dir / "summary.md"),
            "trace_path": trace.get("path"), "trace_bytes": trace.get("bytes"),
            "pyspy_overhead_ratio": pyspy.get("overhead_ratio"),
            "pyspy_overhead_within_noise": pyspy.get("overhead_within_noise"),
            "recommendations": [r["rule"] for r in summary.get("recommendations", [])],
            "skipped": summary.get("skipped", {})}


def pyspy_overhead_text(ps: dict[str, Any]) -> str:
    """py-spy's overhead as printed: ``+2.7% step time (spread ±1.1%)``, or, when the figure is negative or no larger
    than the step-to-step spread, ``within noise (measured -51.2%, spread ±30.0%): no measurable cost``."""
    noise = ps.get("overhead_noise_ratio")
    spread = f"spread ±{100 * noise:.1f}%" if noise is not None else "spread unknown"
    if ps.get("overhead_within_noise"):
        return f"within noise (measured {100 * ps['overhead_ratio']:+.1f}%, {spread}): no measurable cost"
    return f"{100 * ps['overhead_ratio']:+.1f}% step time ({spread})"


def print_artifacts(out_dir: Path, summary: dict[str, Any]) -> None:
    print(f"profile: {out_dir / 'summary.md'} and summary.json", flush=True)
    trace = summary.get("trace")
    if trace:
        where = trace["path"] or trace.get("path_unavailable_reason")
        print(f"  torch.profiler trace: {where} ({trace['bytes'] / 2**20:.2f} MiB gzipped, "
              f"cap {trace['cap_bytes'] / 2**20:.0f} MiB; "
              "open in https://ui.perfetto.dev or chrome://tracing)")
    for rec in summary.get("recommendations", []):
        print(f"  recommendation: {rec['text']}")
    ps = summary.get("pyspy")
    if ps:
        for kind, o in ps["outputs"].items():
            print(f"  py-spy {kind}: {o['path']}")
        if ps.get("overhead_ratio") is not None:
            print(f"  py-spy overhead: {pyspy_overhead_text(ps)}, {ps['rate_hz']} Hz, matched by batch shape "
                  f"over {ps['steps_matched']} steps (plain medians {ps['step_time_ms_with']:.1f} ms with, "
                  f"{ps['step_time_ms_without']:.1f} ms without: {100 * ps['overhead_ratio_unmatched']:+.1f}%)")
        for err in ps.get("errors", []):
            print(f"  py-spy error: {err}")
    gs = summary.get("gpu_sampling")
    if gs:
        print(f"  GPU samples: {gs['csv']}, {gs.get('png') or gs.get('png_unavailable_reason')}")
    ns = summary.get("nsys")
    if ns:
        print(f"  nsys: {ns.get('report') or ns.get('error')}")
