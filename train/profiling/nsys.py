"""Nsight Systems: run the job under ``nsys profile`` (CUDA + NVTX tracing) over a capture range of
a few steps, export fresh, and fold ``nsys stats`` kernel and memcpy summaries into the summary.

The child training process brackets ``profile.nsys_steps`` steps with ``cudaProfilerStart/Stop``
(``torch.cuda.profiler``), so ``--capture-range=cudaProfilerApi`` records only those, with the
trainer's NVTX stage ranges. The export is always redone (``--force-export=true``) and an
``.sqlite`` older than the report or than this run is refused (:class:`StaleExportError`).
Source: Nsight Systems User Guide ("CLI profile/stats command switches").
"""

from __future__ import annotations

import csv
import shutil
import subprocess
from pathlib import Path
from typing import Any, Optional

import torch

from train.callbacks import Callback
from train.perf.timer import synchronize
from train.profiling.ranges import ProfilerRanges, null_ranges

REPORTS = {"kernels": ("cuda_gpu_kern_sum", "gpukernsum"), "memcpy": ("cuda_gpu_mem_time_sum", "gpumemtimesum")}
"""summary key → (report name in nsys ≥ 2023.x, older name)."""


class StaleExportError(RuntimeError):
    """An nsys export (.sqlite) that predates its report or this run: its numbers would be someone else's."""


def nsys_available(cuda_available: Optional[bool] = None, which=shutil.which) -> tuple[Optional[str], Optional[str]]:
    """(path to nsys, None) when it can be used, else (None, the reason to print)."""
    nsys = which("nsys")
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    if nsys is None:
        return None, ("nsys skipped: `nsys` is not on PATH (install Nsight Systems, e.g. the nsight-systems-cli "
                      "package from NVIDIA's CUDA repository, or use the CUDA image)")
    if not cuda:
        return None, "nsys skipped: CUDA is not available here (Nsight Systems traces CUDA kernels)"
    return nsys, None


def profile_command(nsys: str, out_prefix: Path, child: list[str]) -> list[str]:
    """``nsys profile`` over the cudaProfilerApi capture range, CUDA + NVTX, overwriting the old report."""
    return [nsys, "profile", "--trace=cuda,nvtx", "--capture-range=cudaProfilerApi", "--capture-range-end=stop",
            "--force-overwrite=true", f"--output={out_prefix}", *child]


def check_fresh(rep: Path, sqlite: Path, started_at: float) -> None:
    """Raise :class:`StaleExportError` unless ``sqlite`` exists and is newer than ``rep`` and ``started_at``
    (epoch s)."""
    if not sqlite.is_file():
        raise StaleExportError(f"{sqlite} was not exported")
    mtime = sqlite.stat().st_mtime
    if rep.is_file() and mtime < rep.stat().st_mtime:
        raise StaleExportError(f"{sqlite} is older than {rep}: refusing a stale export "
                               "(rerun nsys stats --force-export=true)")
    if mtime < started_at:
        raise StaleExportError(f"{sqlite} predates this run: refusing a stale export")


def parse_stats_csv(path: Path, top: int = 10) -> list[dict[str, Any]]:
    """Rows of an ``nsys stats --format csv`` summary: name, time share, total/avg ns, instances."""
    with open(path, newline="", encoding="utf-8") as f:
        lines = [ln for ln in f if ln.strip() and "," in ln]  # nsys may print a title line first
    rows = []
    for rec in csv.DictReader(lines):
        rows.append({"name": rec.get("Name") or rec.get("Operation"), "time_pct": _num(rec, "Time (%)", "Time(%)"),
                     "total_time_ns": _num(rec, "Total Time (ns)", "Total Time"),
                     "instances": _num(rec, "Instances", "Count", "Calls"),
                     "avg_ns": _num(rec, "Avg (ns)", "Average", "Avg")})
    return rows[:top]


def _num(rec: dict, *keys: str) -> Optional[float]:
    for k in keys:
        if rec.get(k) not in (None, ""):
            return float(rec[k].replace(",", ""))
    return None


def export_stats(nsys: str, rep: Path, started_at: float, top: int = 10, run=subprocess.run) -> dict[str, Any]:
    """``nsys stats`` kernel and memcpy summaries of ``rep`` (exported fresh), as
    ``{"kernels": [...], "memcpy": [...]}``.

    Raises:
        StaleExportError: the .sqlite export is missing or older than the report/run.
        RuntimeError: nsys stats failed for both report-name generations.
    """
    sqlite = rep.with_suffix(".sqlite")
    prefix = rep.with_suffix("")
    sqlite.unlink(missing_ok=True)  # never read an old export
    for old in rep.parent.glob(f"{prefix.name}_*.csv"):
        old.unlink()
    last = ""
    for gen in (0, 1):
        names = [REPORTS[k][gen] for k in REPORTS]
        cmd = [nsys, "stats", "--force-export=true", "--format=csv", f"--output={prefix}"]
        for n in names:
            cmd.append(f"--report={n}")
        proc = run(cmd + [str(rep)], capture_output=True, text=True)
        if proc.returncode == 0:
            check_fresh(rep, sqlite, started_at)
            out: dict[str, Any] = {"report": str(rep), "sqlite": str(sqlite)}
            for key, name in zip(REPORTS, names):
                csv_path = Path(f"{prefix}_{name}.csv")
                out[key] = parse_stats_csv(csv_path, top) if csv_path.is_file() else []
            return out
        last = (proc.stderr or proc.stdout or "")[-400:]
    raise RuntimeError(f"nsys stats failed: {last}")


class NsysCapture(Callback):
    """Child-side hook: cudaProfilerStart before step ``first_step``, Stop after ``first_step + n - 1``."""

    def __init__(self, first_step: int, n: int) -> None:
        self.first_step, self.last_step = first_step, first_step + n - 1
        self._trainer = None

    def attach(self, trainer) -> None:
        self._trainer = trainer
        trainer.add_callback(self)
        if self.first_step == 1:
            self._begin()

    def _begin(self) -> None:
        self._trainer.set_ranges(ProfilerRanges(nvtx=True))
        torch.cuda.profiler.start()

    def on_step_end(self, step: int, step_ms: float) -> bool:
        if step + 1 == self.first_step:
            self._begin()
        if step == self.last_step:
            synchronize(self._trainer.device)  # the nsys capture stops after the last step's kernels
            torch.cuda.profiler.stop()
            self._trainer.set_ranges(null_ranges)
            self._trainer.remove_callback(self)
        return False
