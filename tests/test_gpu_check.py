"""scripts/gpu_check.sh: the dry run (every step on the CPU, tiny sizes) passes, so the GPU check cannot rot while no
GPU is around; a failing or timed-out step is recorded and the script goes on, exiting nonzero."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
STEPS = ["verify-gpu", "bench-precision", "bench", "compile-default", "compile-reduce-overhead", "compile-run",
         "profile", "sync-audit", "optimize", "causal-lm", "generate", "generate-0.5b", "fsdp", "fsdp-run"]
FSDP_STEPS = ("fsdp", "fsdp-run")  # dist.strategy=fsdp: torch >= 2.6


def run_check(tmp_path: Path, wndb: Path, python: str = sys.executable, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "DRY_RUN": "1", "PYTHON": python, "OUT": str(tmp_path / "out"),
            "WORK": str(tmp_path / "work"), "WORDNET_DIR": str(wndb), **env}
    full.pop("WNHOME", None)
    return subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=full, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_dry_run_passes_every_step_and_writes_a_small_output(tmp_path: Path, wndb: Path) -> None:
    from train.compat import fsdp2_api

    steps = [s for s in STEPS if fsdp2_api()[0] is not None or s not in FSDP_STEPS]
    proc = run_check(tmp_path, wndb, STEPS=",".join(steps))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    out = tmp_path / "out"
    doc = json.loads((out / "gpu_check.json").read_text())
    assert doc["mode"] == "dry-run" and doc["passed"] and list(doc["steps"]) == STEPS
    for name, step in ((n, s) for n, s in doc["steps"].items() if n in steps):
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
    if "fsdp" in steps:  # on a CPU: no device figure (device = host), offload's losses those of plain fsdp
        memory = steps["fsdp"]["result"]
        assert memory["on_device_over_ddp_per_rank"] is None and memory["offload_max_loss_difference"] <= 1e-5
        assert steps["fsdp-run"]["result"]["dist"] == {"strategy": "fsdp", "offload": True, "auto": None}
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


def test_the_fsdp_summary_reads_the_device_bytes_and_the_offload_target(tmp_path: Path) -> None:
    """On a GPU: the worst rank's state on the device per strategy, offload's ratio to ddp's against the 0.1 target;
    on a CPU the device figure is not claimed."""
    spec = importlib.util.spec_from_file_location("gpu_check_report", ROOT / "scripts" / "gpu_check_report.py")
    gcr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gcr)

    def ranks(on_device: int) -> list[dict]:
        return [{"on_device": on_device, "total": 4 << 20}, {"on_device": on_device - 1, "total": 4 << 20}]

    doc = {"device": "cuda", "ranks": 2, "precision": "bf16", "parameters": 10, "ddp": ranks(4 << 20),
           "fsdp": ranks(2 << 20), "fsdp-offload": ranks(1), "offload_max_loss_difference": 0.0,
           "on_device_over_ddp_per_rank": {"fsdp": 0.5, "fsdp-offload": 0.0}}
    (tmp_path / "fsdp_memory.json").write_text(json.dumps(doc))
    _, line = gcr.STEPS["fsdp"](tmp_path)
    assert "on the device: ddp 4.0 MiB, fsdp 2.0 MiB, fsdp+offload 0.0 MiB (0.000x ddp's; target <= 0.1)" in line
    target = gcr.targets({"fsdp": {"result": doc}})["fsdp_offload_device_state_le_0_1x_ddp"]
    assert target == {"value": 0.0, "reached": True}
    cpu = {**doc, "device": "cpu", "on_device_over_ddp_per_rank": None}
    (tmp_path / "fsdp_memory.json").write_text(json.dumps(cpu))
    _, line = gcr.STEPS["fsdp"](tmp_path)
    assert "in all (the CPU: device = host): ddp 4.0 MiB" in line and "target" not in line
