"""Resume is a contract across AdamW implementations and torch versions: a checkpoint written by one implementation
(fused, foreach, single-tensor) or one torch (the image's 2.1.0, the local one) resumes on the other, the current
run's choice applying after the state is loaded, with one notice line; bit-exact when nothing changed
(tests/test_resume.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import synthetic_rows, tiny_overrides, write_wndb
from train.checkpoint import implementation, optimizer_state_for
from train.compat import fused_adamw_supported
from train.config import load_config
from train.resume import list_checkpoints
from train.run.training import run_training

ROOT = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")
FUSED_ON_CPU = fused_adamw_supported(CPU)


def _adamw(fused: bool) -> torch.optim.AdamW:
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=0.1, fused=fused or None, foreach=False if not fused else None)
    p.grad = torch.ones(3)
    opt.step()
    return opt


@pytest.mark.skipif(not FUSED_ON_CPU, reason=f"torch {torch.__version__} has no fused AdamW on the CPU")
@pytest.mark.parametrize("saved_fused", [False, True])
def test_an_optimizer_state_loads_into_the_other_implementation_and_steps(saved_fused: bool) -> None:
    saved = _adamw(saved_fused).state_dict()
    target = _adamw(not saved_fused)
    state, note = optimizer_state_for(target, saved)
    assert [implementation(g) for g in state["param_groups"]] == [implementation(target.param_groups[0])]
    assert note and "fused" in note and "single-tensor" in note
    target.load_state_dict(state)
    target.param_groups[0]["params"][0].grad = torch.ones(3)
    target.step()  # before the fix: AssertionError (grad_scale/found_inf) or a device mismatch of `step`
    assert bool(target.defaults.get("fused")) is (not saved_fused)
    same, none = optimizer_state_for(_adamw(saved_fused), saved)
    assert none is None and same["param_groups"][0]["fused"] == saved["param_groups"][0]["fused"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, list[str]]:
    root = tmp_path_factory.mktemp("resume-impl")
    wndb = write_wndb(root / "wn", synthetic_rows())
    return root, tiny_overrides(wndb, root, "train.max_steps=20", "train.checkpoint_every=10", "train.eval_every=20")


def _final_loss(run_dir: Path) -> float:
    return json.loads((run_dir / "report.json").read_text())["quality"]["final_train_loss"]


@pytest.mark.skipif(not FUSED_ON_CPU, reason=f"torch {torch.__version__} has no fused AdamW on the CPU")
@pytest.mark.parametrize("before, after", [("false", "true"), ("true", "false")])
def test_resume_with_optim_fused_switched_continues(tiny, before: str, after: str, capsys) -> None:
    root, overrides = tiny
    run_id = f"fused-{before}"
    cfg0 = load_config(None, overrides + [f"train.run_id={run_id}", f"optim.fused={before}"])
    run_training(cfg0, time.perf_counter())
    run_dir = root / "runs" / run_id
    reference = _final_loss(run_dir)
    config_before = (run_dir / "config.yaml").read_text()
    first = str(list_checkpoints(run_dir)[0])
    (run_dir / "report.json").unlink()
    capsys.readouterr()
    cfg = load_config(str(run_dir / "config.yaml"), [f"optim.fused={after}"])
    report = run_training(cfg, time.perf_counter(), resume=first)
    out = capsys.readouterr().out
    assert report["status"] == "completed" and report["resumed_from"]["step"] == 10
    assert out.count("notice: --resume") == 1 and "the kernels differ" in out
    assert abs(report["quality"]["final_train_loss"] - reference) < 0.05 * abs(reference)  # continuous, not equal
    assert (run_dir / "config.yaml").read_text() != config_before  # the resumed run's setting, once it trained


def _other_python() -> Path | None:
    """The other torch's interpreter: ``DMP_OTHER_PYTHON``, else ``.venv-torch21`` when this is not it."""
    explicit = os.environ.get("DMP_OTHER_PYTHON")
    if explicit:
        return Path(explicit)
    candidate = ROOT / ".venv-torch21" / "bin" / "python"
    installed = (ROOT / ".venv-torch21" / ".installed").is_file()  # make test-torch21's mark: torch is in it
    if installed and Path(sys.prefix).resolve() != (ROOT / ".venv-torch21").resolve():
        return candidate
    return None


OTHER = _other_python()


def _train(python: Path | str, overrides: list[str], *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([str(python), "-m", "train", "train", *overrides, *extra], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)


@pytest.mark.skipif(OTHER is None, reason="no second torch installed (make test-torch21 builds .venv-torch21; "
                                          "DMP_OTHER_PYTHON names another interpreter)")
@pytest.mark.parametrize("direction", ["other-to-this", "this-to-other"])
def test_a_checkpoint_resumes_across_torch_versions(tmp_path: Path, direction: str) -> None:
    wndb = write_wndb(tmp_path / "wn", synthetic_rows())
    overrides = tiny_overrides(wndb, tmp_path, "train.max_steps=20", "train.checkpoint_every=10",
                               "train.eval_every=20", "train.run_id=x")
    first, second = (OTHER, sys.executable) if direction == "other-to-this" else (sys.executable, OTHER)
    made = _train(first, overrides)
    assert made.returncode == 0, made.stderr[-2000:]
    run_dir = tmp_path / "runs" / "x"
    (run_dir / "report.json").unlink()
    resumed = _train(second, [f"data.cache_dir={tmp_path / 'cache'}"], "--resume", str(list_checkpoints(run_dir)[0]))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "Traceback" not in resumed.stderr
    assert resumed.stdout.count("notice: --resume") == 1 and "resumed on torch" in resumed.stdout
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "completed" and report["resumed_from"]["step"] == 10
    assert report["quality"]["final_train_loss"] == report["quality"]["final_train_loss"]  # finite, not NaN


def test_a_resume_that_crashes_before_it_trains_leaves_config_yaml(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """The resumed run's config.yaml (and tokenizer copy) are written once it has trained a step: a resume that
    crashes in its first step leaves the run as it was."""
    from train.trainer import Trainer

    root, overrides = tiny
    run_training(load_config(None, overrides + ["train.run_id=crash"]), time.perf_counter())
    run_dir = root / "runs" / "crash"
    before = (run_dir / "config.yaml").read_text()

    def crash(self, *_args, **_kwargs):
        raise RuntimeError("a kernel failed")

    monkeypatch.setattr(Trainer, "step", crash)
    cfg = load_config(str(run_dir / "config.yaml"), ["train.max_steps=30"])
    with pytest.raises(RuntimeError, match="a kernel failed"):
        run_training(cfg, time.perf_counter(), resume=str(list_checkpoints(run_dir)[0]))
    assert (run_dir / "config.yaml").read_text() == before
    monkeypatch.undo()
    report = run_training(cfg, time.perf_counter(), resume=str(list_checkpoints(run_dir)[0]))
    assert report["status"] == "completed" and "max_steps: 30" in (run_dir / "config.yaml").read_text()


def test_the_precision_reason_of_a_resumed_run_is_said_once() -> None:
    from train.precision import resumed_reason

    once = resumed_reason("auto: measured 1.4x")
    assert once == "resumed in the checkpoint's precision (auto: measured 1.4x)"
    assert resumed_reason(resumed_reason(once)) == once  # was nested one level deeper with each resume
