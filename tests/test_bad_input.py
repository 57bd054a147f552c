"""The bad-input catalogue (README "Troubleshooting"): each entry through ``python -m train``'s entry point.

Every case: exit code 2, one ``error:`` line naming the file/line/field and the fix, no traceback, and
nothing half-written (no report.json, no final checkpoint, no temporary files).
"""

from __future__ import annotations

import errno
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.conftest import write_jsonl
from tests.ddp_helpers import tiny_overrides
from train.cli import main
from train.resume import list_checkpoints

Case = Callable[[Path, Path], tuple[list[str], list[str]]]  # (wndb, tmp) -> (argv, expected fragments)


def _run_with_checkpoints(wndb: Path, tmp: Path, *extra: str) -> Path:
    """A finished tiny run with periodic checkpoints; returns its run directory."""
    assert main(["train", *tiny_overrides(wndb, tmp, "train.max_steps=6", "train.checkpoint_every=2",
                                          "train.run_id=base", *extra)]) == 0
    return tmp / "runs" / "base"


def missing_data(wndb, tmp):
    return [f"data.source={tmp / 'nope.jsonl'}"], ["nope.jsonl", "no such file"]


def empty_data(wndb, tmp):
    (tmp / "empty.jsonl").write_text("")
    return [f"data.source={tmp / 'empty.jsonl'}"], ["no examples found"]


def malformed_jsonl(wndb, tmp):
    p = write_jsonl(tmp / "d.jsonl", [{"text": "a b", "label": 0}, "{oops"])
    return [f"data.source={p}"], [f"{p}:2: malformed JSON"]


def malformed_csv_row(wndb, tmp):
    p = tmp / "d.csv"
    p.write_text("text,label\nhello there,a\nextra,b,c\n", encoding="utf-8")
    return [f"data.source={p}"], [f"{p}:3: expected 2 columns"]


def missing_column(wndb, tmp):
    p = tmp / "d.csv"
    p.write_text("body,label\nhello,a\n", encoding="utf-8")
    return [f"data.source={p}"], [f"{p}:1: no text column 'text'", "data.text_field"]


def missing_jsonl_field(wndb, tmp):
    p = write_jsonl(tmp / "d.jsonl", [{"text": "a", "label": 0}, {"text": "b"}])
    return [f"data.source={p}"], [f"{p}:2: no label field 'label'"]


def label_out_of_range(wndb, tmp):
    p = write_jsonl(tmp / "d.jsonl", [{"text": "a", "label": 0}, {"text": "b", "label": 7}])
    return [f"data.source={p}", "data.num_classes=2"], [f"{p}:2: label 7 is out of range [0, 2)"]


def more_labels_than_classes(wndb, tmp):
    p = write_jsonl(tmp / "d.jsonl", [{"text": "a", "label": x} for x in ("x", "y", "z")])
    return [f"data.source={p}", "data.num_classes=2"], ["3 distinct labels but data.num_classes=2"]


def unseen_labels_on_resume(wndb, tmp):
    rows = [{"text": f"word{i} thing{i % 5}", "label": "ab"[i % 2]} for i in range(60)]
    p = write_jsonl(tmp / "d.jsonl", rows)
    run_dir = _run_with_checkpoints(wndb, tmp, f"data.source={p}")
    write_jsonl(p, rows + [{"text": "new words here", "label": "c"}])  # a label the checkpoint never saw
    return ["--resume", str(list_checkpoints(run_dir)[0])], ["trained on other labels (2 classes, this data has 3)"]


def empty_text(wndb, tmp):
    p = write_jsonl(tmp / "d.jsonl", [{"text": "a", "label": 0}, {"text": "  ", "label": 1}])
    return [f"data.source={p}"], [f"{p}:2: empty text"]


def non_utf8(wndb, tmp):
    p = tmp / "d.jsonl"
    p.write_bytes(b'{"text": "ok", "label": 0}\n{"text": "caf\xe9", "label": 1}\n')
    return [f"data.source={p}"], [f"{p}:2: not valid UTF-8"]


def bucket_json_from_other_data(wndb, tmp):
    other = tmp / "other.jsonl"
    write_jsonl(other, [{"text": f"w{i} " * (1 + i % 9), "label": i % 2} for i in range(80)])
    plan = tmp / "b.json"
    assert main(["buckets", *tiny_overrides(wndb, tmp, f"data.source={other}"), "--out", str(plan)]) == 0
    return [f"batching.boundaries_file={plan}"], ["fitted for another data", "--buckets-force"]


def bucket_bound_above_position_table(wndb, tmp):
    plan = tmp / "b.json"
    assert main(["buckets", *tiny_overrides(wndb, tmp, "data.max_len=64", "data.cache_dir=" + str(tmp / "cache")),
                 "--out", str(plan)]) == 0
    data = json.loads(plan.read_text())
    data["bounds"][-1] = 60  # as if fitted with a longer max_len
    plan.write_text(json.dumps(data))
    return [f"batching.boundaries_file={plan}"], ["exceeds data.max_len=32 (the position table)"]


def max_len_above_checkpoint_positions(wndb, tmp):
    run_dir = _run_with_checkpoints(wndb, tmp)
    return ["--resume", str(run_dir), "data.max_len=64"], ["position table holds 32 positions but data.max_len=64"]


def corrupt_checkpoint(wndb, tmp):
    run_dir = _run_with_checkpoints(wndb, tmp)
    ckpt = list_checkpoints(run_dir)[-1]
    ckpt.write_bytes(ckpt.read_bytes()[: ckpt.stat().st_size // 2])  # truncated
    return ["--resume", str(ckpt)], ["is corrupt or truncated"]


class Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def pickled_object_checkpoint(wndb, tmp):
    run_dir = _run_with_checkpoints(wndb, tmp)
    ckpt = list_checkpoints(run_dir)[-1]
    torch.save({"model": {}, "payload": Evil()}, ckpt)
    return ["--resume", str(ckpt)], ["holds objects other than tensors and plain values", "weights_only=True"]


def resume_without_checkpoint(wndb, tmp):
    return ["--resume", str(tmp / "runs" / "nothing")], ["no such run directory or checkpoint file"]


def unknown_config_key(wndb, tmp):
    return ["train.checkpoint_evry=5"], ["unknown key 'train.checkpoint_evry'", "Did you mean 'train.checkpoint_every'"]


def batch_larger_than_token_budget(wndb, tmp):
    return ["batching.max_tokens=16"], ["batching.max_tokens=16 cannot hold one sample of the longest bucket",
                                        "raise batching.max_tokens to at least"]


def unwritable_run_dir(wndb, tmp):
    (tmp / "afile").write_text("")
    return [f"train.output_dir={tmp / 'afile'}"], ["cannot write the run directory"]


def disk_full_on_checkpoint_write(wndb, tmp, monkeypatch=None):
    return ["train.checkpoint_every=2"], ["cannot write checkpoint", "No space left on device", "the disk is full",
                                         "earlier checkpoints are intact"]


CASES: list[Case] = [missing_data, empty_data, malformed_jsonl, malformed_csv_row, missing_column, missing_jsonl_field,
                     label_out_of_range, more_labels_than_classes, unseen_labels_on_resume, empty_text, non_utf8,
                     bucket_json_from_other_data, bucket_bound_above_position_table, max_len_above_checkpoint_positions,
                     corrupt_checkpoint, pickled_object_checkpoint, resume_without_checkpoint, unknown_config_key,
                     batch_larger_than_token_budget, unwritable_run_dir, disk_full_on_checkpoint_write]


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_bad_input_is_one_clear_error(case: Case, wndb: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    argv, fragments = case(wndb, tmp_path)
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()}
    if case is disk_full_on_checkpoint_write:
        _fill_disk_after(monkeypatch, writes=1)  # the first checkpoint fits, the second hits ENOSPC
    capsys.readouterr()
    resume = argv[0] == "--resume"
    code = main(["train", *argv] if resume else ["train", *tiny_overrides(wndb, tmp_path, "train.run_id=bad"), *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, err
    # nothing half-written: no temporary files; no new report or final checkpoint
    assert not [p for p in tmp_path.rglob("*.tmp")]
    changed = [p for p in tmp_path.rglob("*") if p.is_file() and before.get(p) != p.stat().st_mtime_ns]
    assert not [p for p in changed if p.name in ("report.json", "checkpoint.pt")], changed
    if case is disk_full_on_checkpoint_write:
        ckpts = list_checkpoints(tmp_path / "runs" / "bad")
        assert [p.name for p in ckpts] == ["step-00000002.pt"]
        assert torch.load(ckpts[0], weights_only=True)["step"] == 2  # the earlier checkpoint is intact


def _fill_disk_after(monkeypatch, writes: int) -> None:
    """Simulate a full disk: after ``writes`` successful checkpoint writes, ``torch.save`` writes part of the
    file and fails with ENOSPC, as ``write(2)`` does when the file system fills up."""
    real_save = torch.save
    count = {"n": 0}

    def save(obj, f, *args, **kwargs):
        count["n"] += 1
        if count["n"] <= writes:
            return real_save(obj, f, *args, **kwargs)
        Path(f).write_bytes(b"PK\x03\x04 partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", save)
