"""Exact resume (bit-identical on CPU), clean shutdown on SIGTERM/SIGINT, and kill -9 at a random step."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import assert_same_final_state, interrupt_at, tiny_overrides
from train.cli import main
from train.compat import load_state
from train.config import load_config
from train.resume import list_checkpoints
from train.run.training import run_training

ROOT = Path(__file__).resolve().parent.parent
@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, Path, list[str]]:
    """(wndb, root, overrides) and an uninterrupted 40-step run ``root/runs/ref`` (dropout on, 1 thread, log every
    step)."""
    from tests.conftest import synthetic_rows, write_wndb

    root = tmp_path_factory.mktemp("resume")
    wndb = write_wndb(root / "wn", synthetic_rows())
    overrides = tiny_overrides(wndb, root, "train.max_steps=40", "train.log_every=1")
    run_training(load_config(None, overrides + ["train.run_id=ref"]), time.perf_counter())
    return wndb, root, overrides


def test_resume_from_a_middle_checkpoint_is_bit_identical(reference) -> None:
    _, root, overrides = reference
    cfg = load_config(None, overrides + ["train.run_id=mid", "train.checkpoint_every=6", "train.keep_checkpoints=2"])
    run_training(cfg, time.perf_counter())
    run_dir = root / "runs" / "mid"
    assert [p.name for p in list_checkpoints(run_dir)] == ["step-00000030.pt", "step-00000036.pt"]  # keep the last 2
    ckpt = load_state(str(list_checkpoints(run_dir)[0]))  # weights_only=True: RNG states are tensors/lists
    assert ckpt["batches_in_epoch"] > 0 and ckpt["epoch"] >= 1  # mid-epoch, after an epoch boundary
    assert isinstance(ckpt["ranks"][0]["rng"]["torch"], torch.Tensor)
    (run_dir / "checkpoint.pt").unlink()
    (run_dir / "report.json").unlink()
    report = run_training(cfg, time.perf_counter(), resume=str(list_checkpoints(run_dir)[0]))
    assert report["resumed_from"]["step"] == 30
    assert_same_final_state(root / "runs" / "ref", run_dir)


def test_packed_training_resumes_mid_epoch_bit_identically(reference) -> None:
    """batching.method=packed: the PackedBatchSampler's position is in the checkpoint; the resumed run equals an
    uninterrupted one (parameters, optimizer state, metrics)."""
    _, root, overrides = reference
    packed = overrides + ["batching.method=packed", "train.max_steps=16", "train.checkpoint_every=6"]
    run_training(load_config(None, packed + ["train.run_id=pref"]), time.perf_counter())
    cfg = load_config(None, packed + ["train.run_id=pmid"])
    run_training(cfg, time.perf_counter())
    run_dir = root / "runs" / "pmid"
    ckpt = list_checkpoints(run_dir)[0]
    assert load_state(str(ckpt))["batches_in_epoch"] > 0  # a cut inside an epoch
    (run_dir / "checkpoint.pt").unlink()
    (run_dir / "report.json").unlink()
    report = run_training(cfg, time.perf_counter(), resume=str(ckpt))
    assert report["batching"]["method"] == "packed" and report["resumed_from"]["step"] == 6
    assert_same_final_state(root / "runs" / "pref", run_dir)


def test_sigint_finishes_the_step_checkpoints_and_exits_130(reference, monkeypatch, capsys) -> None:
    _, root, overrides = reference
    interrupt_at(monkeypatch, 7, signal.SIGINT)
    assert main(["train", *overrides, "train.run_id=int"]) == 130
    run_dir = root / "runs" / "int"
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "interrupted" and report["interrupted"]["signal"] == "SIGINT"
    assert report["interrupted"]["step"] == 7 and report["perf"]["steps"] == 7
    assert [p.name for p in list_checkpoints(run_dir)] == ["step-00000007.pt"]
    assert not (run_dir / "checkpoint.pt").exists()  # the final checkpoint is only written by a finished run
    assert "resume with: make train ARGS=\"--resume" in capsys.readouterr().out
    monkeypatch.undo()
    assert main(["train", "--resume", str(run_dir)]) == 0
    assert json.loads((run_dir / "report.json").read_text())["status"] == "completed"
    assert_same_final_state(root / "runs" / "ref", run_dir)


def _cli(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "train", "train", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_step(run_dir: Path, proc: subprocess.Popen, step: int, timeout: float = 120) -> int:
    """Poll metrics.jsonl (log_every=1) until it shows ``step``; returns the last step seen."""
    deadline = time.monotonic() + timeout
    last = 0
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            lines = (run_dir / "metrics.jsonl").read_text().splitlines()
            # system records: no step
            last = max([json.loads(x).get("step", 0) for x in lines if x.endswith("}")] or [0])
        except (OSError, json.JSONDecodeError):
            pass
        if last >= step:
            return last
        time.sleep(0.005)
    return last


def test_sigterm_from_outside_exits_143_with_a_checkpoint_and_a_partial_report(reference) -> None:
    _, root, overrides = reference
    run_dir = root / "runs" / "term"
    proc = _cli(*overrides, "train.run_id=term", "train.checkpoint_every=null", "train.shutdown_timeout_s=60")
    _wait_for_step(run_dir, proc, 3)
    proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err  # checkpointed; non-zero, so a scheduler restarts it
    assert time.monotonic() - t0 < 60  # bounded: one step + a checkpoint, else the watchdog exits (non-zero)
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "interrupted" and report["interrupted"]["signal"] == "SIGTERM"
    stopped = report["interrupted"]["step"]
    assert 3 <= stopped < 40 and "SIGTERM" in err
    assert list_checkpoints(run_dir)[-1].name == f"step-{stopped:08d}.pt"
    assert report["quality"]["test_accuracy"] is None and report["quality"]["test_unavailable_reason"]


def test_kill_9_at_a_random_step_then_resume_is_bit_identical(reference) -> None:
    _, root, overrides = reference
    target = random.SystemRandom().randint(8, 30)
    print(f"kill -9 after step {target}")  # shown on failure, to reproduce
    run_dir = root / "runs" / "kill"
    proc = _cli(*overrides, "train.run_id=kill", "train.checkpoint_every=4")
    seen = _wait_for_step(run_dir, proc, target)
    proc.kill()  # SIGKILL: no handler, no cleanup
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL, f"the run ended before the kill (last step {seen})"
    assert not (run_dir / "checkpoint.pt").exists() and list_checkpoints(run_dir)
    resumed = _cli("--resume", str(run_dir))
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    assert f"resuming from {list_checkpoints(run_dir)[0].parent}" in out
    assert_same_final_state(root / "runs" / "ref", run_dir)
