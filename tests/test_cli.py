"""Bad input through the real command line: one `error:` line, exit code 2, no traceback."""

import json
import os
from pathlib import Path

import pytest

from tests.conftest import assert_clean_error, run_cli, write_jsonl


def test_missing_wordnet(tmp_path: Path) -> None:
    proc = run_cli("train", f"data.wordnet_dir={tmp_path / 'none'}", f"train.output_dir={tmp_path}")
    assert_clean_error(proc, "apt-get install wordnet-base", "WNHOME")


def test_unknown_config_key(tmp_path: Path) -> None:
    assert_clean_error(run_cli("train", "model.hiden_size=3"), "Did you mean 'model.hidden_size'")


def test_malformed_jsonl(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "a", "label": 0}, "{oops"])
    proc = run_cli("train", f"data.source={path}", f"train.output_dir={tmp_path / 'runs'}")
    assert_clean_error(proc, f"{path}:2: malformed JSON")
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").rglob("report.json"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_run_dir(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    assert_clean_error(run_cli("train", f"train.output_dir={ro}"), "cannot write the run directory")


def test_unwritable_run_dir_as_file(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("")
    assert_clean_error(run_cli("train", f"train.output_dir={tmp_path / 'afile'}"), "cannot write the run directory")


def test_buckets_command_writes_plan_and_training_checks_it(wndb: Path, tmp_path: Path) -> None:
    common = [f"data.wordnet_dir={wndb}", f"data.cache_dir={tmp_path / 'cache'}", "data.vocab_size=200",
              "batching.num_buckets=4"]
    out = tmp_path / "b.json"
    proc = run_cli("buckets", *common, "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(out.read_text())
    assert plan["method"] == "optimal" and len(plan["bounds"]) <= 4
    # the same plan against other data (another vocab → another tokenizer fingerprint) is refused
    proc = run_cli("train", *common[:-2], "data.vocab_size=150", f"batching.boundaries_file={out}",
                   f"train.output_dir={tmp_path / 'runs'}", "train.max_steps=1")
    assert_clean_error(proc, "fitted for another tokenizer", "--buckets-force")


def test_overrides_after_flags_reach_the_config(tmp_path: Path) -> None:
    """`a=1 --run-id x b=2`: the override after the flag is a config override (here a bad key, so it is named)."""
    proc = run_cli("train", f"train.output_dir={tmp_path}", "--run-id", "r", "train.no_such_key=1")
    assert_clean_error(proc, "train.no_such_key")
    bad_flag = run_cli("train", f"train.output_dir={tmp_path}", "--no-such-flag")
    assert bad_flag.returncode == 2 and "unrecognized arguments: --no-such-flag" in bad_flag.stderr


def test_every_command_that_writes_a_run_directory_takes_overwrite() -> None:
    from train.cli import COMMANDS, build_parser, flag_overrides

    writers = [name for name, c in COMMANDS.items() if c.run_id]
    assert {"train", "profile", "warmup", "bench"} <= set(writers)
    for name in writers:
        assert "train.overwrite=true" in flag_overrides(build_parser().parse_args([name, "--overwrite"])), name


def test_sync_audit_command_writes_its_json_and_exits_by_the_verdict(wndb: Path, tmp_path: Path) -> None:
    """``python -m train sync-audit`` (scripts/gpu_check.sh's sync-audit step): the audit's JSON at ``--out``."""
    out = tmp_path / "audit.json"
    proc = run_cli("sync-audit", "--mode", "warn", "--out", str(out), "--run-id", "audit",
                   f"data.wordnet_dir={wndb}", f"data.cache_dir={tmp_path / 'cache'}", "data.vocab_size=200",
                   "data.max_len=32", "model.num_layers=1", "model.hidden_size=32", "model.num_heads=2",
                   "model.ffn_size=64", "train.max_steps=12", "train.log_every=5", "train.eval_every=100000",
                   "train.progress=false", f"train.output_dir={tmp_path / 'runs'}")
    result = json.loads(out.read_text())
    assert proc.returncode == (0 if result["passed"] else 1), proc.stderr
    assert result["watched_steps"] > 0 and result["report_path"] == str(tmp_path / "runs" / "audit" / "report.json")
    assert f"wrote {out}" in proc.stdout


@pytest.mark.parametrize("rank, printed", [("0", True), ("1", False)])
def test_an_error_every_rank_raises_is_printed_once_by_rank_0(monkeypatch, capsys, rank, printed) -> None:
    """Under torchrun a refusal agreed across ranks (``agreed``) used to print N copies of the same line."""
    import dataclasses

    from train import cli
    from train.errors import UserError

    def refuse(args, t_start):
        exc = UserError("data.source=x: no such file")
        exc.every_rank = True
        raise exc

    monkeypatch.setitem(cli.COMMANDS, "train", dataclasses.replace(cli.COMMANDS["train"], run=refuse))
    monkeypatch.setenv("RANK", rank)
    assert cli.main(["train"]) == 2
    assert ("error: data.source=x: no such file" in capsys.readouterr().err) is printed
