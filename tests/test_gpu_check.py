"""scripts/gpu_check.sh: the dry run (every step on the CPU, tiny sizes) passes, so the GPU check cannot rot while no
GPU is around; a failing or timed-out step is recorded and the script goes on, exiting nonzero."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
STEPS = ["verify-gpu", "bench-precision", "bench", "compile-default", "compile-reduce-overhead", "compile-run",
         "profile", "sync-audit", "optimize", "causal-lm", "generate", "generate-0.5b"]


def run_check(tmp_path: Path, wndb: Path, python: str = sys.executable, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "DRY_RUN": "1", "PYTHON": python, "OUT": str(tmp_path / "out"),
            "WORK": str(tmp_path / "work"), "WORDNET_DIR": str(wndb), **env}
    full.pop("WNHOME", None)
    return subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=full, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_dry_run_passes_every_step_and_writes_a_small_output(tmp_path: Path, wndb: Path) -> None:
    proc = run_check(tmp_path, wndb)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    out = tmp_path / "out"
    doc = json.loads((out / "gpu_check.json").read_text())
    assert doc["mode"] == "dry-run" and doc["passed"] and list(doc["steps"]) == STEPS
    for name, step in doc["steps"].items():
        assert step["passed"] and step["result"] is not None, (name, step.get("error"))
        assert any(line.startswith(f"{name}: OK") for line in proc.stdout.splitlines()), name  # its one-line summary
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8 and all(len(p.relative_to(out).parts) <= 2 for p in files)
    assert (out / "gpu_check.md").is_file() and "| sync-audit | ok |" in (out / "gpu_check.md").read_text()
    steps = doc["steps"]
    assert steps["sync-audit"]["result"]["host_syncs"] == 0 and steps["sync-audit"]["result"]["watched_steps"] > 0
    run = steps["compile-run"]["result"]
    assert run["report"]["compile"]["recompiles_after_warmup"] == 0 and run["warmup"]["totals"]["shapes"] > 0
    assert {r["requested"] for r in steps["bench-precision"]["result"]["rows"]} >= {"fp32"}
    assert {r["name"] for r in steps["bench"]["result"]["training"]["configs"]} >= {"naive", "hf-style", "optimized"}
    # a rerun of some steps into the same OUT/WORK (after a failed first try on the GPU host) overwrites their runs
    again = run_check(tmp_path, wndb, STEPS="bench-precision,profile")
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-2000:]
    redo = json.loads((out / "gpu_check.json").read_text())["steps"]
    assert redo["bench-precision"]["passed"] and redo["profile"]["passed"]


def test_a_failing_and_a_hanging_step_are_recorded_and_the_script_goes_on(tmp_path: Path, wndb: Path) -> None:
    # a python that fails bench-precision, hangs in verify-gpu, and is the real one otherwise
    fake = tmp_path / "python"
    fake.write_text(f"""#!/usr/bin/env bash
case "$*" in
  *"-m train bench-precision"*) echo "boom: CUDA error: out of memory" >&2; exit 3 ;;
  *"-m train.tools.verify_gpu"*) sleep 60 ;;
esac
exec {sys.executable} "$@"
""")
    fake.chmod(0o755)
    proc = run_check(tmp_path, wndb, python=str(fake), STEPS="verify-gpu,bench-precision", TIMEOUT_PCT="10")
    assert proc.returncode == 1, proc.stdout[-3000:]
    doc = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    steps = doc["steps"]
    assert steps["verify-gpu"]["status"] == "timeout" and steps["verify-gpu"]["rc"] in (124, 137)
    assert steps["bench-precision"]["status"] == "failed" and "out of memory" in steps["bench-precision"]["error"]
    assert all(steps[n]["status"] == "not run" for n in STEPS[2:]) and not doc["passed"]
    assert "bench-precision: FAILED" in proc.stdout and "verify-gpu: TIMEOUT" in proc.stdout
    assert "## bench-precision: failed" in (tmp_path / "out" / "gpu_check.md").read_text()


def test_a_python_without_torch_stops_at_once_with_one_line(tmp_path: Path, wndb: Path) -> None:
    # once: a warning line, then every step ran that python and printed its own ImportError traceback (exit 1)
    fake = tmp_path / "python"
    fake.write_text("""#!/usr/bin/env bash
echo "Traceback (most recent call last):" >&2
echo '  File "<string>", line 1, in <module>' >&2
echo "ModuleNotFoundError: No module named 'torch'" >&2
exit 1
""")
    fake.chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    (out / "gpu_check.json").write_text("{}")  # an earlier result is left alone
    proc = run_check(tmp_path, wndb, python=str(fake))
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout[-2000:]
    assert proc.stderr == (f"gpu-check: error: {fake} cannot import torch "
                           "(ModuleNotFoundError: No module named 'torch'); "
                           "install torch into it or point PYTHON at a python that has it\n")
    assert (out / "gpu_check.json").read_text() == "{}" and not (tmp_path / "work").exists()
