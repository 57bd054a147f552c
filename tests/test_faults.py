"""Faults and surprising input that must not go silently wrong (issue 21), beside the one-line errors of
tests/test_bad_input.py: concurrent runs, labels seen only outside training, empty evaluation splits, BOMs,
signals before the first step, file modes under the umask, the Hub without network, every config field's range,
and the guarantees that already held (truncated caches, CSV quoting, epochs with workers)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import signal
import stat
import subprocess
import sys
import time
import types
import typing
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import tiny_overrides, write_jsonl
from train.cli import main
from train.config import RunConfig, build_config
from train.data.sources import split_of
from train.errors import UserError

REPO = Path(__file__).resolve().parents[1]


def _train(wndb: Path, tmp: Path, *extra: str) -> int:
    return main(["train", *tiny_overrides(wndb, tmp, "train.max_steps=6", *extra)])


# -- 1. concurrent runs -------------------------------------------------------------------------------------------

def test_two_runs_started_together_get_two_directories_each_complete(wndb: Path, tmp_path: Path) -> None:
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-m", "train", "train",
                               *tiny_overrides(wndb, tmp_path, "train.max_steps=4", f"train.seed={seed}")],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for seed in (1, 2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    run_dirs = sorted(d for d in (tmp_path / "runs").iterdir() if d.is_dir())
    assert len(run_dirs) == 2
    seeds = set()
    for d in run_dirs:
        report = json.loads((d / "report.json").read_text())
        assert report["status"] == "completed" and report["run_dir"] == str(d)
        records = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
        steps = [r["step"] for r in records if r.get("event") is None and "loss" in r]
        assert steps == sorted(set(steps)), "metrics of two runs interleaved in one file"
        seeds.add(yaml.safe_load((d / "config.yaml").read_text())["train"]["seed"])
    assert seeds == {1, 2}


# -- 2. a label seen only in validation/test --------------------------------------------------------------------

def test_a_class_without_training_examples_is_warned_about_and_reported(wndb, tmp_path, capsys) -> None:
    rows = [{"text": f"word{i} thing{i % 7} stuff{i % 3}", "label": "ab"[i % 2]} for i in range(120)]
    zebra, i = [], 0
    while len(zebra) < 6:  # rows of class "zebra" that all hash outside the training split
        text, i = f"zebra stripes {i}", i + 1
        if split_of(text, 0.05, 0.05) != "train":
            zebra.append({"text": text, "label": "zebra"})
    p = write_jsonl(tmp_path / "d.jsonl", rows + zebra)
    assert _train(wndb, tmp_path, f"data.source={p}", "train.run_id=z") == 0
    err = capsys.readouterr().err
    assert "1 class(es) have no training example" in err and "'zebra': train 0, validation" in err
    report = json.loads((tmp_path / "runs" / "z" / "report.json").read_text())
    assert report["data"]["classes_without_training_examples"] == ["zebra"]


# -- 4. an empty validation (and test) split -------------------------------------------------------------------

def test_empty_validation_and_test_splits_train_and_report_null_with_a_reason(wndb, tmp_path, capsys) -> None:
    p = write_jsonl(tmp_path / "d.jsonl", [{"text": f"w{i} v{i % 5}", "label": i % 2} for i in range(50)])
    assert _train(wndb, tmp_path, f"data.source={p}", "data.val_fraction=0", "data.test_fraction=0",
                  "train.eval_every=2", "train.run_id=e") == 0
    run_dir = tmp_path / "runs" / "e"
    q = json.loads((run_dir / "report.json").read_text())["quality"]
    assert q["eval_accuracy"] is None and "validation split is empty" in q["eval_unavailable_reason"]
    assert q["test_accuracy"] is None and "test split is empty" in q["test_unavailable_reason"]
    assert (run_dir / "checkpoint.pt").is_file() and "Traceback" not in capsys.readouterr().err


# -- 6. a UTF-8 byte-order mark -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["jsonl", "csv"])
def test_a_utf8_bom_is_not_part_of_the_first_field(kind: str, tmp_path: Path) -> None:
    from train.config import DataConfig
    from train.data.sources import load_corpus

    rows = [("hello there, friend", "a"), ("good bye", "b"), ("more text", "a")]
    if kind == "jsonl":
        body = "".join(json.dumps({"text": t, "label": lab}) + "\r\n" for t, lab in rows)
    else:
        body = "text,label\r\n" + "".join(f'"{t}",{lab}\r\n' for t, lab in rows)
    p = tmp_path / f"d.{kind}"
    p.write_bytes(b"\xef\xbb\xbf" + body.encode("utf-8"))
    corpus = load_corpus(DataConfig(source=str(p), val_fraction=0.0, test_fraction=0.0))
    assert sorted(corpus.train.texts) == sorted(t for t, _ in rows) and corpus.label_names == ["a", "b"]


# -- 10. a signal before the first step ---------------------------------------------------------------------------

def test_sigterm_during_data_preparation_is_one_line_and_leaves_no_run_directory(wndb, tmp_path, monkeypatch,
                                                                                 capsys) -> None:
    import train.run.ranks

    real = train.run.ranks.prepare_data

    def prepare_then_signal(*args, **kwargs):
        bundle = real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)  # as if the scheduler preempted the job while the data was prepared
        return bundle

    monkeypatch.setattr(train.run.ranks, "prepare_data", prepare_then_signal)
    code = _train(wndb, tmp_path, "train.run_id=sig")
    err = capsys.readouterr().err
    assert code == 128 + signal.SIGTERM, err
    assert err.count("\n") == 1 and "SIGTERM during data preparation" in err and "Traceback" not in err
    assert not (tmp_path / "runs" / "sig").exists()  # nothing was trained: no run directory pretending to be a run
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored


# -- 11. file modes -----------------------------------------------------------------------------------------------

def test_every_file_a_run_writes_honours_the_umask(wndb, tmp_path) -> None:
    old = os.umask(0o022)
    try:
        assert _train(wndb, tmp_path, "train.run_id=m", "train.checkpoint_every=3") == 0
    finally:
        os.umask(old)
    run_dir = tmp_path / "runs" / "m"
    files = [p for p in run_dir.rglob("*") if p.is_file()] + [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    names = {p.name for p in files}
    assert {"report.json", "config.yaml", "buckets.json", "checkpoint.pt", "metrics.jsonl", "tokenizer.json"} <= names
    modes = {str(p.relative_to(tmp_path)): stat.S_IMODE(p.stat().st_mode) for p in files}
    assert all(m == 0o644 for m in modes.values()), modes


# -- 9. the Hugging Face Hub without network ----------------------------------------------------------------------

def test_hf_source_without_network_fails_fast_in_offline_mode(monkeypatch) -> None:
    from train.config import DataConfig
    from train.data import readers, sources

    seen = {}

    def load_dataset(name, config=None):
        seen["offline"] = os.environ.get("HF_DATASETS_OFFLINE")
        raise ConnectionError("Couldn't reach 'x' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(readers, "hub_reachable", lambda timeout_s=3.0: (False, "huggingface.co:443 cannot be reached"))
    t0 = time.monotonic()
    with pytest.raises(UserError, match="not in the local Hugging Face cache and huggingface.co:443 cannot be reached"):
        sources.load_corpus(DataConfig(source="hf:imdb"))
    assert time.monotonic() - t0 < 5 and seen["offline"] == "1"  # datasets ran in offline mode: no retries


def test_hub_reachable_is_bounded(monkeypatch) -> None:
    from train.data.sources import hub_reachable

    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing listens
    t0 = time.monotonic()
    ok, why = hub_reachable(timeout_s=1.0)
    assert not ok and "127.0.0.1:9" in why and time.monotonic() - t0 < 3


# -- 8. every config field's type and range, declared on the field ------------------------------------------------

def _sections() -> list[tuple[str, type]]:
    return [(f.name, typing.get_type_hints(RunConfig)[f.name]) for f in dataclasses.fields(RunConfig)]


def _fields_with_rules() -> list[tuple[str, str, object]]:
    return [(section, f.name, f.metadata["allowed"]) for section, cls in _sections() for f in dataclasses.fields(cls)
            if "allowed" in f.metadata]


def test_every_numeric_field_declares_its_range() -> None:
    missing = []
    for section, cls in _sections():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            base = [a for a in typing.get_args(hints[f.name]) if a is not type(None)] or [hints[f.name]]
            if base[0] in (int, float) and "allowed" not in f.metadata:
                missing.append(f"{section}.{f.name}")
    assert not missing, f"declare allowed(...) for {missing}"


def test_enum_choices_match_the_code_that_uses_them() -> None:
    from train.clipping import METHODS
    from train.config.sections import ClipConfig, ModelConfig
    from train.models.encoder import PRESETS

    rules = {f.name: f.metadata["allowed"] for cls in (ModelConfig, ClipConfig) for f in dataclasses.fields(cls)
             if "allowed" in f.metadata}
    assert set(rules["preset"].choices) == set(PRESETS) and set(rules["method"].choices) == set(METHODS)


def _bad_value(rule, draw_float, draw_text):
    if rule.choices is not None:
        return "bad-" + draw_text
    below = rule.ge if rule.ge is not None else rule.gt
    above = rule.le if rule.le is not None else rule.lt
    options = [math.nan, math.inf, "x" + draw_text]
    if below is not None:
        options.append(below - 1 - abs(draw_float) if rule.ge is not None else below - abs(draw_float))
    if above is not None:
        options.append(above + 1 + abs(draw_float) if rule.le is not None else above + abs(draw_float))
    return options


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_an_out_of_range_or_wrong_typed_value_names_its_key(data) -> None:
    section, name, rule = data.draw(st.sampled_from(_fields_with_rules()))
    values = _bad_value(rule, data.draw(st.floats(0, 1e6)), data.draw(st.text("abcxyz", min_size=1, max_size=5)))
    value = values if isinstance(values, str) else data.draw(st.sampled_from(values))
    hints = typing.get_type_hints(dict(_sections())[section])
    if isinstance(value, float) and math.isfinite(value) and int in (hints[name], *typing.get_args(hints[name])):
        value = int(math.floor(value)) if value < 0 else int(math.ceil(value))  # an int field gets an int
    with pytest.raises(UserError) as err:
        build_config({section: {name: value}})
    assert f"{section}.{name}" in str(err.value), str(err.value)


# -- guarantees that already held (keep them) ---------------------------------------------------------------------

def test_a_truncated_tokenizer_cache_is_rebuilt(tmp_path: Path) -> None:
    from train.data.tokenizer import load_or_train

    texts = [f"alpha beta gamma {i}" for i in range(50)]
    _, info = load_or_train(texts, 100, str(tmp_path))
    cached = Path(info["path"])
    cached.write_text(cached.read_text()[:100])  # truncated
    tok, again = load_or_train(texts, 100, str(tmp_path))
    assert again["source"] == "trained" and json.loads(Path(again["path"]).read_text())  # rebuilt, valid JSON
    assert tok.encode("alpha beta").ids


def test_a_truncated_bucket_json_is_one_clear_error(tmp_path: Path) -> None:
    from train.data.buckets import BucketPlan

    p = tmp_path / "b.json"
    p.write_text('{"schema_version": 1, "bounds": [19, 2')
    with pytest.raises(UserError, match="not a bucket-boundaries JSON file"):
        BucketPlan.load(p, "d", "t")


def test_csv_with_quoted_commas_and_embedded_newlines_parses_exactly(tmp_path: Path) -> None:
    from train.config import DataConfig
    from train.data.sources import load_corpus

    rows = [("a, b, and c", "x"), ("line one\nline two", "y"), ('she said "hi", twice', "x")]
    body = "text,label\n" + "".join('"' + t.replace('"', '""') + f'",{lab}\n' for t, lab in rows)
    p = tmp_path / "d.csv"
    p.write_text(body, encoding="utf-8")
    corpus = load_corpus(DataConfig(source=str(p), val_fraction=0.0, test_fraction=0.0))
    assert sorted(corpus.train.texts) == sorted(t for t, _ in rows)


def test_three_epochs_with_two_workers_do_not_stall_at_epoch_boundaries(wndb, tmp_path) -> None:
    t0 = time.monotonic()
    assert _train(wndb, tmp_path, "train.max_steps=null", "train.epochs=3", "data.num_workers=2",
                  "train.run_id=w") == 0
    report = json.loads((tmp_path / "runs" / "w" / "report.json").read_text())
    steps = report["perf"]["steps"]
    assert steps > 3 * 10 and report["status"] == "completed"
    assert time.monotonic() - t0 < 120  # an epoch-boundary stall waits on a dead worker for minutes


# -- leftovers of a kill: the atomic writes' temporary files -------------------------------------------------------

def test_a_resume_removes_the_temporary_files_a_killed_write_left_and_nothing_else(wndb, tmp_path, capsys) -> None:
    """A ``kill -9`` during ``checkpoint.pt``'s write leaves ``.checkpoint.pt.<8 random>.tmp`` (the checkpoint's size);
    once a successful resume kept it. The run's other files, whatever their names, stay."""
    assert _train(wndb, tmp_path, "train.checkpoint_every=2", "train.run_id=k") == 0
    run_dir = tmp_path / "runs" / "k"
    (run_dir / "checkpoint.pt").rename(run_dir / ".checkpoint.pt.k9ed0ut7.tmp")  # killed before the rename
    (run_dir / "report.json").unlink()
    (run_dir / "checkpoints" / ".step-00000006.pt.ab_12cd3.tmp").write_bytes(b"PK\x03\x04 partial")
    kept = [run_dir / "notes.tmp", run_dir / ".notes.tmp", run_dir / ".checkpoint.pt.bak", run_dir / ".x.short.tmp"]
    for path in kept:
        path.write_text("mine")
    capsys.readouterr()
    assert main(["train", "--resume", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert f"notice: removed 2 temporary file(s) of an interrupted write from {run_dir}: " in out
    assert ".checkpoint.pt.k9ed0ut7.tmp (0." in out and "checkpoints/.step-00000006.pt.ab_12cd3.tmp" in out
    assert sorted(p.name for p in run_dir.rglob("*.tmp")) == [".notes.tmp", ".x.short.tmp", "notes.tmp"]
    assert all(path.read_text() == "mine" for path in kept)
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "completed" and report["resumed_from"]["step"] == 4


def test_a_run_killed_in_its_first_checkpoint_is_told_what_happened_and_how_to_start_again(wndb, tmp_path,
                                                                                           capsys) -> None:
    """No complete checkpoint: once ``no checkpoint in …/checkpoints (periodic checkpoints need
    train.checkpoint_every …)``, which blamed a setting, and left the temporary file (182 MB on the smoke config)."""
    assert _train(wndb, tmp_path, "train.max_steps=4", "train.run_id=k") == 0
    run_dir = tmp_path / "runs" / "k"
    temp = run_dir / ".checkpoint.pt.k9ed0ut7.tmp"
    (run_dir / "checkpoint.pt").rename(temp)  # its first (and only) checkpoint, killed before the rename
    (run_dir / "report.json").unlink()
    capsys.readouterr()
    assert main(["train", "--resume", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert (f"--resume {run_dir}: no complete checkpoint was written before the run was killed or crashed, so there "
            f"is nothing to resume; the unfinished write left .checkpoint.pt.k9ed0ut7.tmp (0.") in err
    assert f"start it again with python -m train train --config {run_dir / 'config.yaml'} --overwrite, which " \
           "removes that temporary file; with train.checkpoint_every=500 the run's only checkpoint is its last " \
           "step's: set a smaller train.checkpoint_every" in err
    assert temp.is_file()  # a refused command changes nothing
    assert main(["train", "--config", str(run_dir / "config.yaml"), "--overwrite"]) == 0  # the advice works
    assert not temp.exists() and json.loads((run_dir / "report.json").read_text())["status"] == "completed"


def test_kill_9_during_the_first_checkpoint_write(wndb, tmp_path, capsys) -> None:
    """A real ``kill -9`` while the first periodic checkpoint is written (the process waits there:
    ``DMP_PAUSE_AT=checkpoint write step-00000002.pt``): its temporary file is left, ``--resume`` says what happened
    in one line, and the advised ``--overwrite`` run completes and removes it."""
    pause = tmp_path / "pause"
    env = {**os.environ, "PYTHONPATH": str(REPO), "DMP_PAUSE_AT": "checkpoint write step-00000002.pt",
           "DMP_PAUSE_FILE": str(pause)}
    argv = tiny_overrides(wndb, tmp_path, "train.max_steps=6", "train.checkpoint_every=2", "train.run_id=k")
    proc = subprocess.Popen([sys.executable, "-m", "train", "train", *argv], env=env, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (pause.is_file() and pause.read_text().endswith("\n")):
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "the run never reached its first checkpoint"
        time.sleep(0.05)
    proc.kill()  # SIGKILL, in the middle of the checkpoint's write
    proc.communicate()
    run_dir = tmp_path / "runs" / "k"
    temps = list((run_dir / "checkpoints").glob(".step-00000002.pt.*.tmp"))
    assert len(temps) == 1 and temps[0].stat().st_size > 0
    assert not list((run_dir / "checkpoints").glob("step-*.pt")) and not (run_dir / "checkpoint.pt").exists()
    capsys.readouterr()
    assert main(["train", "--resume", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no complete checkpoint was written before the run was killed" in err, err
    assert f"the unfinished write left checkpoints/{temps[0].name} (" in err
    assert "checkpoint_every" not in err  # it was set below max_steps: the setting is not what went wrong
    assert main(["train", "--config", str(run_dir / "config.yaml"), "--overwrite"]) == 0
    assert not list(run_dir.rglob("*.tmp"))
    assert json.loads((run_dir / "report.json").read_text())["status"] == "completed"


# -- a read-only HOME -----------------------------------------------------------------------------------------------

def test_unwritable_home_directories_are_redirected_with_one_notice(tmp_path: Path) -> None:
    """HOME that is a file: nothing can be made beneath it, root or not. Each of matplotlib's and W&B's variables
    the user has not set points at a writable directory; a writable HOME changes nothing."""
    from train.tools.home import redirect_home_caches

    home = tmp_path / "home-is-a-file"
    home.write_text("")
    env = {"HOME": str(home), "TMPDIR": str(tmp_path)}
    note = redirect_home_caches(env)
    assert note is not None and note.startswith(f"notice: HOME={home} is not a writable directory") and "\n" not in note
    assert set(env) == {"HOME", "TMPDIR", "MPLCONFIGDIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"}
    for var in ("MPLCONFIGDIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        assert f"{var}={env[var]}" in note and Path(env[var]).is_dir() and os.access(env[var], os.W_OK)
    assert redirect_home_caches(env) is None  # set now (a child process inherits them): nothing more to say
    own = {"HOME": str(home), "TMPDIR": str(tmp_path), "MPLCONFIGDIR": str(tmp_path / "mine")}
    note = redirect_home_caches(own)
    assert note is not None and "MPLCONFIGDIR" not in note and "WANDB_CACHE_DIR=" in note
    assert own["MPLCONFIGDIR"] == str(tmp_path / "mine")  # the user's choice stands
    (tmp_path / "home").mkdir()
    fine = {"HOME": str(tmp_path / "home")}
    assert redirect_home_caches(fine) is None and fine == {"HOME": str(tmp_path / "home")}


def _make_read_only(path: Path) -> Callable[[], None]:
    """Make ``path`` unwritable — for root too (``chattr +i``), else ``chmod a-w`` — and return the undo."""
    if os.geteuid() == 0 and subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0:
        return lambda: subprocess.run(["chattr", "-i", str(path)], capture_output=True)
    path.chmod(0o555)
    return lambda: path.chmod(0o755)


def test_a_run_with_a_read_only_home_says_one_notice_line_and_nothing_else_on_stderr(wndb, tmp_path) -> None:
    """Once 21 lines on stderr (W&B's ``ERROR main: failed to get logger path … mkdir …/.cache`` and its service's
    INFO lines, matplotlib's cache warnings) where a writable HOME gives none; W&B on (offline), as a new user has
    it."""
    home = tmp_path / "home"
    home.mkdir()
    undo = _make_read_only(home)
    try:
        if os.access(home, os.W_OK):
            pytest.skip("cannot make a directory read-only here (no chattr +i as root)")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "XDG_", "MPLCONFIGDIR"))}
        env.update(HOME=str(home), TMPDIR=str(tmp_path), PYTHONPATH=str(REPO))
        proc = subprocess.run([sys.executable, "-m", "train", "train",
                               *tiny_overrides(wndb, tmp_path, "train.max_steps=2", "train.run_id=ro")],
                              env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    finally:
        undo()
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"notice: HOME={home} is not a writable directory"), proc.stderr
    assert "MPLCONFIGDIR=" in lines[0] and "WANDB_CACHE_DIR=" in lines[0]
    tracking = json.loads((tmp_path / "runs" / "ro" / "report.json").read_text())["tracking"]
    if importlib.util.find_spec("wandb") is not None:  # W&B stays on (offline) where the package is installed
        assert tracking["wandb_active"] and tracking["wandb_mode"] == "offline"
    assert not list(home.iterdir())
