"""SIGTERM/SIGINT in every phase of a run, each signalled deterministically: the process pauses in the phase named by
``DMP_PAUSE_AT`` (train/shutdown.py ``pause_point``), writes ``DMP_PAUSE_FILE``, and the test signals it there.

During an evaluation (periodic or final) the evaluation is abandoned (said), the last completed step is checkpointed,
report.json says ``interrupted``, exit 143 (SIGTERM); before the first step (data preparation, compile warm-up, the
``warmup`` command) the fresh run directory is removed and the exit is one line, 128 + the signal number.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import synthetic_rows, tiny_overrides, write_wndb
from train.resume import list_checkpoints

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("phases")
    return write_wndb(root / "wn", synthetic_rows()), root


def _signal_in(phase: str, args: list[str], root: Path, signum: int = signal.SIGTERM,
               command: str = "train") -> tuple[subprocess.CompletedProcess, float]:
    """Run ``python -m train <command> *args`` until it pauses in ``phase``, send ``signum``; (result, seconds from
    the signal to the exit)."""
    flag = root / f"paused-{phase.replace(' ', '-')}-{time.monotonic_ns()}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DMP_PAUSE_AT": phase, "DMP_PAUSE_FILE": str(flag)}
    proc = subprocess.Popen([sys.executable, "-m", "train", command, *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not flag.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    if not flag.exists():
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the run never paused in {phase!r} (exit {proc.returncode}):\n{out[-2000:]}\n{err[-2000:]}")
    proc.send_signal(signum)
    t0 = time.monotonic()
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), time.monotonic() - t0


def _report(run_dir: Path) -> dict:
    return json.loads((run_dir / "report.json").read_text())


def _sigterm_in_evaluation(base, run_id: str, phase: str) -> tuple[subprocess.CompletedProcess, Path, dict]:
    """SIGTERM a tiny run (no periodic checkpoints, 30 s shutdown timeout) paused in ``phase``: it must exit 143 within
    30 s without a traceback; returns the process, its run directory and its report."""
    wndb, root = base
    args = tiny_overrides(wndb, root, f"train.run_id={run_id}", "train.checkpoint_every=null",
                          "train.shutdown_timeout_s=30")
    proc, secs = _signal_in(phase, args, root)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert secs < 30 and "Traceback" not in proc.stderr
    run_dir = root / "runs" / run_id
    return proc, run_dir, _report(run_dir)


def test_sigterm_during_a_periodic_evaluation_abandons_it_checkpoints_and_exits_143(base) -> None:
    proc, run_dir, report = _sigterm_in_evaluation(base, "periodic", "periodic evaluation")
    assert "SIGTERM during the periodic evaluation: evaluation abandoned" in proc.stdout
    assert report["status"] == "interrupted"
    info = report["interrupted"]
    assert info["step"] == 10 and info["evaluation_abandoned"] == "periodic evaluation at step 10"
    assert [p.name for p in list_checkpoints(run_dir)] == ["step-00000010.pt"] == [Path(info["checkpoint"]).name]
    assert report["quality"]["evals"] == []  # the abandoned evaluation is not reported as one


def test_sigterm_during_the_final_evaluation_keeps_the_trained_state_and_resume_evaluates(base) -> None:
    proc, run_dir, report = _sigterm_in_evaluation(base, "final", "final evaluation")
    assert "evaluation abandoned" in proc.stdout
    info = report["interrupted"]
    assert report["status"] == "interrupted" and info["step"] == 30 == info["total_steps"]
    assert info["checkpoint"] == str(run_dir / "checkpoint.pt") and (run_dir / "checkpoint.pt").is_file()
    assert info["evaluation_abandoned"] == "final evaluation"
    assert report["quality"]["test_accuracy"] is None
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    resumed = subprocess.run([sys.executable, "-m", "train", "train", "--resume", str(run_dir)], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert "training finished at step 30 of 30; running the final evaluation" in resumed.stdout
    report = _report(run_dir)
    assert report["status"] == "completed" and report["resumed_from"]["step"] == 30
    assert report["perf"]["steps"] == 30 and report["quality"]["test_accuracy"] is not None
    assert report["quality"]["evals"][-1]["step"] == 30


def test_sigint_during_the_final_evaluation_exits_130_with_an_interrupted_report(base) -> None:
    wndb, root = base
    args = tiny_overrides(wndb, root, "train.run_id=final-int", "train.max_steps=12", "train.checkpoint_every=null")
    proc, _ = _signal_in("final evaluation", args, root, signal.SIGINT)
    assert proc.returncode == 130, proc.stderr
    assert _report(root / "runs" / "final-int")["interrupted"]["signal"] == "SIGINT"


def test_sigterm_during_data_preparation_removes_the_fresh_run_and_the_partial_cache_entry(base) -> None:
    wndb, root = base
    cache = root / "cold-cache"  # nothing prepared yet: the build runs
    args = tiny_overrides(wndb, root, "train.run_id=prep", f"data.cache_dir={cache}")
    proc, secs = _signal_in("data preparation", args, root)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert proc.stderr.count("\n") == 1 and "SIGTERM during data preparation" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and secs < 30
    assert not (root / "runs" / "prep").exists()
    assert not [p for p in (cache / "data").iterdir() if p.name.startswith(".")]  # no temporary entry left


def test_sigterm_during_compile_warm_up_removes_the_fresh_run(base) -> None:
    wndb, root = base
    args = tiny_overrides(wndb, root, "train.run_id=warm", "compile.enabled=true", "compile.backend=eager",
                          "compile.warmup_max_steps=3", "compile.warmup_window=2")
    proc, secs = _signal_in("compile warm-up", args, root)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert "SIGTERM during compile warm-up" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and secs < 30
    assert not (root / "runs" / "warm").exists()


def test_sigterm_during_the_warmup_command_is_one_line_and_removes_its_run(base) -> None:
    wndb, root = base
    args = [*tiny_overrides(wndb, root, "compile.warmup_max_steps=3", "compile.warmup_window=2"), "--run-id", "wcmd"]
    proc, secs = _signal_in("compile warm-up", args, root, command="warmup")
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert proc.stderr.startswith("interrupted: SIGTERM during compile warm-up"), proc.stderr
    assert "Traceback" not in proc.stderr and secs < 30
    assert not (root / "runs" / "wcmd").exists()
