"""Honest resume: settings baked into the checkpoint refused in one line (config.yaml untouched) unless
``train.resume_apply`` applies them for real; settings that may change applied and listed in one notice line; a
complete run is said to be complete and left alone; a truncated checkpoint.pt named when skipped. Also the whole-run
sampler counts, ``data.max_eval_samples`` and the py-spy overhead said to be noise."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import synthetic_rows, tiny_overrides, write_wndb
from train.cli import main
from train.compat import load_state
from train.config import load_config


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> tuple[Path, list[str]]:
    """A complete 30-step run ``runs/base`` (periodic checkpoints at 10 and 20, checkpoint.pt at 30)."""
    root = tmp_path_factory.mktemp("honest")
    wndb = write_wndb(root / "wn", synthetic_rows())
    overrides = tiny_overrides(wndb, root, "train.checkpoint_every=10")
    assert main(["train", *overrides, "train.run_id=base"]) == 0
    return root / "runs" / "base", overrides


def _copy(finished, name: str, mid_run: bool = False) -> Path:
    """A copy of the finished run (modification times kept); ``mid_run``: as if stopped after step 20."""
    run_dir = finished[0].parent / name
    shutil.copytree(finished[0], run_dir)
    (run_dir / ".writer.lock").unlink(missing_ok=True)
    if mid_run:
        (run_dir / "checkpoint.pt").unlink()
        (run_dir / "report.json").unlink()
    return run_dir


def test_a_changed_baked_in_setting_is_refused_in_one_line_and_config_yaml_is_untouched(finished, capsys) -> None:
    run_dir = _copy(finished, "refused", mid_run=True)
    before = (run_dir / "config.yaml").read_bytes()
    capsys.readouterr()
    assert main(["train", "--resume", str(run_dir), "optim.lr=0.05", "batching.batch_size=16"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err
    assert "cannot change mid-run" in err and "optim.lr 0.005 → 0.05" in err and "batching.batch_size 8 → 16" in err
    assert "train.resume_apply=optim.lr" in err
    assert (run_dir / "config.yaml").read_bytes() == before
    assert not (run_dir / "report.json").exists()


def test_resume_apply_writes_the_new_lr_into_the_optimizer_and_the_scheduler(finished, capsys) -> None:
    run_dir = _copy(finished, "apply-lr", mid_run=True)
    capsys.readouterr()
    assert main(["train", "--resume", str(run_dir), "optim.lr=0.05", "train.resume_apply=optim.lr"]) == 0
    out = capsys.readouterr().out
    assert "optim.lr 0.005 → 0.05 (written into the optimizer and scheduler)" in out
    state = load_state(str(run_dir / "checkpoint.pt"))
    assert {g["initial_lr"] for g in state["optimizer"]["param_groups"]} == {0.05}
    assert state["scheduler"]["base_lrs"] == [0.05] * len(state["optimizer"]["param_groups"])
    assert state["config"]["optim"]["lr"] == 0.05
    lrs = {r["step"]: r["lr"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
           if "lr" in r}
    old = {r["step"]: r["lr"] for r in map(json.loads, (finished[0] / "metrics.jsonl").read_text().splitlines())
           if "lr" in r}
    assert lrs[18] == old[18]  # before the resume: the old rate
    assert lrs[21] == pytest.approx(old[21] * 10)  # after it: the same schedule at ten times the peak


def test_settings_that_may_change_apply_and_are_listed_in_one_notice_line(finished, capsys) -> None:
    run_dir = _copy(finished, "cadence", mid_run=True)
    capsys.readouterr()
    assert main(["train", "--resume", str(run_dir), "train.eval_every=5", "train.log_every=2"]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if "changed settings applied" in x]
    assert len(lines) == 1 and "train.eval_every 10 → 5" in lines[0] and "train.log_every 3 → 2" in lines[0]
    assert "eval_every: 5" in (run_dir / "config.yaml").read_text()
    assert [e["step"] for e in json.loads((run_dir / "report.json").read_text())["quality"]["evals"]] == [
        10, 20, 25, 30]


def test_resuming_a_complete_run_says_so_and_keeps_its_report(finished, capsys) -> None:
    run_dir = _copy(finished, "complete")
    report, metrics = (run_dir / "report.json").read_bytes(), (run_dir / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    assert main(["train", "--resume", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "the run is complete (step 30 of 30, report.json status completed)" in out
    assert "test accuracy" not in out  # no retold summary
    assert (run_dir / "report.json").read_bytes() == report and (run_dir / "metrics.jsonl").read_bytes() == metrics
    assert main(["train", "--resume", str(run_dir), "train.max_steps=36"]) == 0  # raised: trains the 6 more steps
    extended = json.loads((run_dir / "report.json").read_text())
    assert extended["resumed_from"] == {"checkpoint": str(run_dir / "checkpoint.pt"), "step": 30}
    assert extended["perf"]["steps"] == 36 and extended["status"] == "completed"


def test_a_truncated_checkpoint_pt_is_named_when_a_run_dir_resume_skips_it(finished, capsys) -> None:
    run_dir = _copy(finished, "truncated")
    data = (run_dir / "checkpoint.pt").read_bytes()
    (run_dir / "checkpoint.pt").write_bytes(data[: len(data) // 2])
    capsys.readouterr()
    assert main(["train", "--resume", str(run_dir)]) == 0
    captured = capsys.readouterr()
    skipped = [x for x in captured.err.splitlines() if "skipped" in x]
    assert len(skipped) == 1 and str(run_dir / "checkpoint.pt") in skipped[0]
    assert "step-00000020.pt" in skipped[0]
    assert json.loads((run_dir / "report.json").read_text())["resumed_from"]["step"] == 20


# -- whole-run sampler counts, the evaluation bound, py-spy noise -------------------------------------------------

def test_repeated_samples_count_every_epoch_of_the_run_also_after_a_resume() -> None:
    from train.data.packing import PackedBatchSampler
    from train.data.sampler import BucketBatchSampler
    from train.report import sampler_counts

    lengths = np.random.default_rng(0).integers(3, 30, size=203)
    for make in (lambda: BucketBatchSampler(lengths, [10, 20, 30], batch_size=8, seed=1, world_size=2, rank=0),
                 lambda: PackedBatchSampler(lengths, 32, 3, seed=1, window=64, world_size=2, rank=0)):
        live = make()
        per_epoch = []
        for epoch in range(3):
            live.set_epoch(epoch)
            list(live)
            per_epoch.append(live.repeated_samples)
        assert len(set(per_epoch)) > 1 or per_epoch[0] > 0, "the fixture must repeat samples"

        class Loader:
            batch_sampler = live

        assert sampler_counts(Loader(), 3)["repeated"] == sum(per_epoch)
        Loader.batch_sampler = make()  # a resumed process: epochs 0 and 1 were planned by another one
        Loader.batch_sampler.set_epoch(2)
        assert sampler_counts(Loader(), 3)["repeated"] == sum(per_epoch)


def test_max_eval_samples_bounds_validation_and_test_and_is_reported(tiny_cfg) -> None:
    from train.run.training import run_training

    cfg = tiny_cfg("data.max_eval_samples=5", "train.max_steps=6", "train.eval_every=3")
    report = run_training(cfg, time.perf_counter())
    assert report["data"]["max_eval_samples"] == 5
    assert [e["samples"] for e in report["quality"]["evals"]] == [5, 5]
    assert report["quality"]["eval_samples"] == 5 == report["quality"]["test_samples_evaluated"]
    assert report["data"]["validation_samples"] > 5 and report["data"]["test_samples"] > 5
    again = run_training(tiny_cfg("data.max_eval_samples=5", "train.max_steps=6", "train.eval_every=3",
                                  "train.run_id=t2"), time.perf_counter())
    assert again["quality"]["test_accuracy"] == report["quality"]["test_accuracy"]  # the same first five


def test_a_noise_level_py_spy_overhead_is_printed_as_noise(capsys) -> None:
    from train.profiling.pyspy import shape_matched_overhead
    from train.profiling.session import print_artifacts

    off = [((8, 16), ms) for ms in (10.0, 30.0, 12.0, 28.0, 11.0, 29.0)]
    on = [((8, 16), ms) for ms in (9.0, 10.0, 11.0)]
    res = shape_matched_overhead(on, off)
    assert res["overhead_ratio"] < 0 and res["overhead_within_noise"] and res["overhead_noise_ratio"] > 0.3
    print_artifacts(Path("."), {"pyspy": {"outputs": {}, "rate_hz": 100, **res}})
    line = next(x for x in capsys.readouterr().out.splitlines() if "py-spy overhead" in x)
    assert "within noise (measured -50.0%" in line and "no measurable cost" in line
    steady = shape_matched_overhead([((8, 16), 12.0)] * 4, [((8, 16), 10.0 + 0.01 * i) for i in range(6)])
    assert not steady["overhead_within_noise"] and steady["overhead_ratio"] == pytest.approx(0.2, abs=0.01)


def test_the_changed_keys_are_compared_on_the_resolved_configs() -> None:
    from train.errors import UserError
    from train.run.resume_settings import resume_changes

    saved = load_config(None, ["optim.betas=[0.9, 0.98]"]).to_dict()
    assert resume_changes(saved, load_config(None, ["optim.betas=[0.9, 0.98]", "train.max_steps=9"]), "x") == [
        "train.max_steps None → 9 (the learning rate follows the schedule of the new length from this step)"]
    with pytest.raises(UserError, match=r"optim.betas \[0.9, 0.98\] → \[0.9, 0.999\]"):
        resume_changes(saved, load_config(None, []), "x")


def test_a_tokenizer_overwritten_in_place_is_named_and_a_moved_one_is_listed(tmp_path: Path, capsys) -> None:
    """The refusal names the user's ``data.tokenizer_path`` (not the prepared-data cache's copy of it, which a second
    attempt reads), and the same tokenizer under another path resumes with the change listed."""
    from train.data.tokenizer import train_wordpiece

    user, kept = tmp_path / "user.json", tmp_path / "moved.json"
    train_wordpiece([f"a gloss of word {i} about things" for i in range(200)], 200).save(str(user))
    shutil.copyfile(user, kept)
    overrides = tiny_overrides(write_wndb(tmp_path / "wn", synthetic_rows()), tmp_path, "train.max_steps=10",
                               "train.checkpoint_every=5", f"data.tokenizer_path={user}")
    assert main(["train", *overrides, "train.run_id=tok"]) == 0
    run_dir = tmp_path / "runs" / "tok"
    train_wordpiece([f"other words {i} zzz qqq" for i in range(200)], 200).save(str(user))  # overwritten in place
    capsys.readouterr()
    for _ in range(2):  # the second attempt finds the new content prepared in the cache
        assert main(["train", "--resume", str(run_dir / "checkpoints" / "step-00000005.pt")]) == 2
        err = capsys.readouterr().err
        assert f"({user}" in err and str(tmp_path / "cache") not in err, err
    assert main(["train", "--resume", str(run_dir / "checkpoints" / "step-00000005.pt"),
                 f"data.tokenizer_path={kept}"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("resuming from"))
    assert f"changed settings applied: data.tokenizer_path '{user}' → '{kept}' (the same tokenizer)" in line
