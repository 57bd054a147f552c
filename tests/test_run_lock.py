"""One writer per run directory (issue 31): an exclusive flock held for the life of the process; a second writer gets
one line naming the holder's pid and exit 2; a lock left by a killed process never blocks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import tiny_overrides
from train.config import load_config
from train.errors import UserError
from train.tools.run_dir import make_run_dir
from train.tools.run_lock import LOCK_FILE, unlock_run_dir

ROOT = Path(__file__).resolve().parent.parent
HOLD = """
import sys, time
from train.config import load_config
from train.tools.run_dir import make_run_dir
make_run_dir(load_config(None, [f"train.output_dir={sys.argv[1]}", "train.run_id=held"]), resume=True)
print("locked", flush=True)
time.sleep(60)
"""


def _holder(out: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_writer_is_refused_naming_the_holder_and_a_dead_holder_never_blocks(tmp_path) -> None:
    cfg = load_config(None, [f"train.output_dir={tmp_path}", "train.run_id=held"])
    proc = _holder(tmp_path)
    try:
        for resume in (True, False):
            with pytest.raises(UserError, match=rf"being written by another process \(pid {proc.pid}\)") as info:
                make_run_dir(cfg.with_values({"train.overwrite": True}), resume=resume)
            assert "\n" not in str(info.value)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert (tmp_path / "held" / LOCK_FILE).is_file(), "the dead holder's lock file is still there"
    run_dir = make_run_dir(cfg, resume=True)  # killed: the OS released its lock
    assert (run_dir / LOCK_FILE).read_text().strip() == str(os.getpid())
    unlock_run_dir(run_dir)
    # the lock file alone is no earlier run: a fresh run may use the directory
    assert make_run_dir(cfg) == run_dir
    unlock_run_dir(run_dir)


def test_two_resumes_of_one_run_cannot_both_train(wndb, tmp_path) -> None:
    from train.cli import main

    over = tiny_overrides(wndb, tmp_path, "train.max_steps=2", "train.run_id=r", "train.checkpoint_every=1")
    assert main(["train", *over]) == 0
    unlock_run_dir(tmp_path / "runs" / "r")
    holder = subprocess.Popen([sys.executable, "-c", HOLD.replace("held", "r"), str(tmp_path / "runs")], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert holder.stdout.readline().strip() == "locked"  # another process is writing runs/r
    try:
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "train", "train", "--resume", str(tmp_path / "runs" / "r"),
                              "train.max_steps=4"], cwd=ROOT, capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert out.returncode == 2 and f"pid {holder.pid}" in out.stderr and "Traceback" not in out.stderr
        assert time.perf_counter() - t0 < 60
    finally:
        holder.kill()
        holder.wait()


def test_a_refused_resume_releases_the_run_for_the_next_command_in_this_process(tiny_cfg) -> None:
    # an in-process caller that catches the refusal (a notebook, a test, a launcher) must be able to resume next
    from train.run.training import run_training
    from train.tools import run_lock

    cfg = tiny_cfg("train.run_id=refused", "train.max_steps=4", "train.eval_every=100")
    run_training(cfg, time.perf_counter())
    run_dir = Path(cfg.train.output_dir) / "refused"
    with pytest.raises(UserError):
        run_training(tiny_cfg("train.run_id=refused", "train.max_steps=4", "model.hidden_size=64"),
                     time.perf_counter(), resume=str(run_dir))
    assert str(run_dir.resolve()) not in run_lock._LOCKS


def test_a_run_that_crashes_before_its_first_step_leaves_no_directory(tiny_cfg, monkeypatch) -> None:
    """A crash (not bad input: an allocator error while the model is built, say) of a fresh run before it trains:
    its directory is released and removed, so the same run id starts again cleanly."""
    from train.run import training

    def crash(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(training, "resolve_run", crash)
    cfg = tiny_cfg("train.run_id=crashed", "train.max_steps=2")
    with pytest.raises(RuntimeError, match="allocate"):
        training.run_training(cfg, time.perf_counter())
    assert not (Path(cfg.train.output_dir) / "crashed").exists()


def test_a_refused_bench_generate_leaves_no_directory(tmp_path) -> None:
    from train.tools.run_lock import discard_if_unwritten, lock_run_dir

    empty, written = tmp_path / "empty", tmp_path / "written"
    for d in (empty, written):
        d.mkdir()
        lock_run_dir(d)
    (written / "generate.json").write_text("{}")
    assert discard_if_unwritten(empty) and not empty.exists()
    assert not discard_if_unwritten(written) and (written / "generate.json").is_file()


def test_a_resume_with_more_steps_trains_on_the_new_schedule_not_at_the_old_ones_zero(tiny_cfg, monkeypatch,
                                                                                       capsys) -> None:
    """The checkpoint of a finished 3-step run holds learning rate 0 (linear decay to 0); resumed to 6 steps, the
    first new step used to train at 0. It trains at the new schedule's rate for step 4 of 6, said in the resume line."""
    from train.run.training import run_training
    from train.trainer import Trainer, linear_warmup_decay

    cfg = tiny_cfg("train.run_id=longer", "train.max_steps=3", "train.eval_every=100", "optim.warmup_fraction=0.0")
    run_training(cfg, time.perf_counter())
    used: list[float] = []
    real = Trainer.step

    def step(self, *args, **kwargs):
        used.append(self.optimizer.param_groups[0]["lr"])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "step", step)
    capsys.readouterr()
    run_training(tiny_cfg("train.run_id=longer", "train.max_steps=6", "train.eval_every=100",
                          "optim.warmup_fraction=0.0"), time.perf_counter(),
                 resume=str(Path(cfg.train.output_dir) / "longer"))
    assert used[0] == pytest.approx(cfg.optim.lr * linear_warmup_decay(6, 0)(3)) and used[0] > 0
    assert "the learning rate follows the schedule of the new length" in capsys.readouterr().out


def test_a_refused_resume_leaves_the_runs_bucket_plan_as_it_was(tiny_cfg) -> None:
    from train.run.training import run_training

    cfg = tiny_cfg("train.run_id=plan", "train.max_steps=2", "train.eval_every=100")
    run_training(cfg, time.perf_counter())
    plan = Path(cfg.train.output_dir) / "plan" / "buckets.json"
    before = (plan.read_bytes(), plan.stat().st_mtime_ns)
    time.sleep(0.01)
    with pytest.raises(UserError):
        run_training(tiny_cfg("train.run_id=plan", "train.max_steps=4", "model.hidden_size=64"), time.perf_counter(),
                     resume=str(plan.parent))
    assert (plan.read_bytes(), plan.stat().st_mtime_ns) == before
