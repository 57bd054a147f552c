"""The bad-input catalogue (README "Troubleshooting"): each entry through ``python -m train``'s entry point.

Every case: exit code 2, one ``error:`` line naming the file/line/field and the fix, no traceback, and
nothing half-written (no report.json, no final checkpoint, no temporary files).
"""

from __future__ import annotations

import errno
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.conftest import tiny_overrides, write_jsonl
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


def sparse_integer_labels(wndb, tmp):  # issue 21 #3: once MemoryError after 30 s
    p = write_jsonl(tmp / "d.jsonl", [{"text": f"w{i} x{i % 3}", "label": (3, 200000000)[i % 2]} for i in range(40)])
    return [f"data.source={p}"], ["2 distinct integer labels (3, 200000000)", "num_classes would be 200000001",
                                  "remap the labels to 0..1", "data.num_classes"]


def one_sample_dataset(wndb, tmp):  # issue 21 #5: once a torchmetrics ValueError
    p = write_jsonl(tmp / "d.jsonl", [{"text": "hello world", "label": "greeting"}])
    return [f"data.source={p}"], ["every example has the label 'greeting'", "at least 2 classes"]


def config_yaml_in_latin1(wndb, tmp):  # issue 21 #8: once UnicodeDecodeError
    p = tmp / "c.yaml"
    p.write_bytes("# r\xe9glages\ntrain:\n  max_steps: 5\n".encode("latin-1"))
    return ["--config", str(p)], [f"{p}:1: not valid UTF-8", "save the config as UTF-8"]


def bucket_json_with_string_bounds(wndb, tmp):  # issue 21 #8: once a TypeError
    plan = tmp / "b.json"
    assert main(["buckets", *tiny_overrides(wndb, tmp), "--out", str(plan)]) == 0
    data = json.loads(plan.read_text())
    data["bounds"] = [str(b) for b in data["bounds"]]
    plan.write_text(json.dumps(data))
    return [f"batching.boundaries_file={plan}"], [f"{plan}: 'bounds' must be a non-empty strictly increasing list of "
                                                  "positive ints", "make buckets"]


def bucket_json_with_float_bounds(wndb, tmp):  # issue 21 #8: once silently accepted
    plan = tmp / "b.json"
    assert main(["buckets", *tiny_overrides(wndb, tmp), "--out", str(plan)]) == 0
    data = json.loads(plan.read_text())
    data["bounds"] = [b + 0.5 for b in data["bounds"]]
    plan.write_text(json.dumps(data))
    return [f"batching.boundaries_file={plan}"], [
        "'bounds' must be a non-empty strictly increasing list of positive ints"]


def run_id_that_exists(wndb, tmp):  # issue 21 #1: once two runs shared one directory
    assert main(["train", *tiny_overrides(wndb, tmp, "train.max_steps=2", "train.run_id=bad")]) == 0
    return [], ["run directory", "exists already", "continue it with --resume", "--overwrite (train.overwrite=true)"]


def resume_an_hf_model_as_builtin(wndb, tmp):  # once "model source=hf:bert but this config gives None"
    pytest.importorskip("transformers")
    run_dir = _run_with_checkpoints(wndb, tmp, "model.source=hf:bert", "model.hf_overrides={num_hidden_layers: 1, "
                                    "hidden_size: 32, num_attention_heads: 2, intermediate_size: 64}")
    return ["--resume", str(run_dir), "model.source=builtin"], [
        "these settings cannot change mid-run (checkpoint → requested): model.source 'hf:bert' → 'builtin'"]


def config_that_is_a_directory(wndb, tmp):  # once "config file … does not exist"
    (tmp / "configs").mkdir()
    return ["--config", str(tmp / "configs")], [f"config file {tmp / 'configs'} is a directory",
                                                "give one YAML file"]


def config_file_with_comments_only(wndb, tmp):  # once a silent run on the defaults
    p = tmp / "empty.yaml"
    p.write_text("# my settings, to do\n\n", encoding="utf-8")
    return ["--config", str(p)], [f"{p}: empty config file", "remove --config to use the defaults, or add settings"]


def multi_label_jsonl(wndb, tmp):  # once "must be a string or an integer"
    p = write_jsonl(tmp / "d.jsonl", [{"text": "a b", "label": "x"}, {"text": "c d", "label": ["x", "y"]}])
    return [f"data.source={p}"], [f"{p}:2: label ['x', 'y'] is a list: multi-label rows are not supported (one "
                                  "label per row)"]


def disk_full_reported_as_runtime_error(wndb, tmp):  # issue 21 #7: torch 2.13's zip writer, no errno
    return ["train.checkpoint_every=2"], ["cannot write checkpoint", "No space left on device", "the disk is full",
                                         "earlier checkpoints are intact"]


def _value_case(override: str, *fragments: str) -> Case:
    def case(wndb, tmp):
        return [override], list(fragments)
    case.__name__ = "config_" + override.split("=")[0].replace(".", "_")
    return case


def _hf_dir(tmp: Path, weights: bool = False, **config) -> Path:
    """A Hugging Face model directory: config.json of a tiny BERT (+ its safetensors weights)."""
    transformers = pytest.importorskip("transformers")
    d = tmp / "hf-model"
    sizes = dict(vocab_size=300, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    model_config = transformers.BertConfig(**sizes)
    if weights:
        from train.compat import hf_attn_implementation

        transformers.AutoModelForSequenceClassification.from_config(
            model_config, attn_implementation=hf_attn_implementation()).save_pretrained(d)
    else:
        model_config.save_pretrained(d)
    raw = json.loads((d / "config.json").read_text())
    raw.update(config)
    (d / "config.json").write_text(json.dumps(raw))
    return d


def hf_model_dir_missing(wndb, tmp):
    pytest.importorskip("transformers")  # without it the error names the missing package instead (the torch 2.1 image)
    return [f"model.source=hf:{tmp / 'no-such-model'}"], ["no such directory", "never downloaded"]


def hf_hub_id_offline(wndb, tmp):
    pytest.importorskip("transformers")
    return ["model.source=hf:HuggingFaceTB/SmolLM2-135M-Instruct"], ["no such directory", "looks like a hub id",
                                                                      "make models"]


def hf_config_without_classification_head(wndb, tmp):
    d = _hf_dir(tmp, model_type="vit", architectures=["ViTModel"])
    return [f"model.source=hf:{d}"], ["architecture 'vit' has no sequence-classification head"]


def hf_num_labels_mismatch(wndb, tmp):
    d = _hf_dir(tmp, id2label={"0": "a", "1": "b", "2": "c"})
    return [f"model.source=hf:{d}"], ["the model has num_labels=3 but the data has", "model.num_labels_mismatch=resize"]


def hf_weights_that_do_not_match_the_config(wndb, tmp):
    d = _hf_dir(tmp, weights=True, id2label={str(i): str(i) for i in range(45)}, hidden_size=48)
    return [f"model.source=hf:{d}"], [f"the weights in {d} do not match its config.json"]


def python_model_that_does_not_import(wndb, tmp):
    return ["model.source=python:no_such_module_here:make"], ["cannot import 'no_such_module_here'",
                                                              "ModuleNotFoundError"]


def python_model_whose_forward_does_not_fit(wndb, tmp):
    (tmp / "bad_models.py").write_text("from torch import nn\n\ndef make(num_classes, vocab_size, max_len):\n"
                                       "    return nn.Linear(4, num_classes)\n")
    import sys
    sys.path.insert(0, str(tmp))
    return ["model.source=python:bad_models:make"], [
        "forward(input_ids LongTensor[2, 4], attention_mask BoolTensor[2, 4]) failed"]


def data_source_is_a_directory(wndb, tmp):
    return [f"data.source={tmp}"], ["is a directory", "give one .jsonl/.csv/.parquet file"]


def csv_float_labels(wndb, tmp):  # the JSONL reader refuses float labels; the CSV reader once made classes "0.0", "1.0"
    p = tmp / "f.csv"
    p.write_text("text,label\nhello,0.0\nworld,1.0\n", encoding="utf-8")
    return [f"data.source={p}"], [f"{p}:2: label '0.0' must be a string or an integer"]


def run_id_outside_the_output_dir(wndb, tmp):
    return ["train.run_id=../../escaped"], ["train.run_id='../../escaped' is not a plain directory name"]


def packed_model_that_cannot_pack(wndb, tmp):
    pytest.importorskip("transformers")
    return ["model.source=hf:albert", "model.hf_overrides={num_hidden_layers: 1, hidden_size: 32, "
            "num_attention_heads: 2, intermediate_size: 64, embedding_size: 16}", "batching.method=packed"], [
        "model.source=hf:albert cannot run packed rows: AlbertForSequenceClassification", "no known pooling path"]


CONFIG_VALUE_CASES = [  # issue 21 #8: each once a traceback from numpy or torch
    _value_case("train.seed=-1", "train.seed=-1 is out of range", "in [0, 4294967295]"),
    _value_case("optim.betas=[0.9,1.5]", "optim.betas=[0.9, 1.5]", "two numbers in [0, 1)"),
    _value_case("optim.eps=-1", "optim.eps=-1.0 is out of range", "> 0"),
    _value_case("train.num_threads=-1", "train.num_threads=-1 is out of range", "≥ 1"),
    _value_case("dist.offload=true", "dist.offload=true: CPU offload is FSDP2's, and dist.strategy=ddp",
                "set dist.strategy=fsdp, or dist.offload=false"),
]


CASES: list[Case] = [missing_data, empty_data, malformed_jsonl, malformed_csv_row, missing_column, missing_jsonl_field,
                     label_out_of_range, more_labels_than_classes, unseen_labels_on_resume, empty_text, non_utf8,
                     bucket_json_from_other_data, bucket_bound_above_position_table, max_len_above_checkpoint_positions,
                     corrupt_checkpoint, pickled_object_checkpoint, resume_without_checkpoint, unknown_config_key,
                     batch_larger_than_token_budget, unwritable_run_dir, disk_full_on_checkpoint_write,
                     sparse_integer_labels, one_sample_dataset, config_yaml_in_latin1, bucket_json_with_string_bounds,
                     bucket_json_with_float_bounds, run_id_that_exists, disk_full_reported_as_runtime_error,
                     hf_model_dir_missing, hf_hub_id_offline, hf_config_without_classification_head,
                     hf_num_labels_mismatch,
                     hf_weights_that_do_not_match_the_config, python_model_that_does_not_import,
                     python_model_whose_forward_does_not_fit, data_source_is_a_directory, csv_float_labels,
                     run_id_outside_the_output_dir, packed_model_that_cannot_pack, resume_an_hf_model_as_builtin,
                     config_that_is_a_directory, config_file_with_comments_only, multi_label_jsonl,
                     *CONFIG_VALUE_CASES]


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_bad_input_is_one_clear_error(case: Case, wndb: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    argv, fragments = case(wndb, tmp_path)
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()}
    if case in (disk_full_on_checkpoint_write, disk_full_reported_as_runtime_error):
        # the first checkpoint fits, the second hits a full disk (reported by errno, or as torch 2.13 does)
        _fill_disk_after(monkeypatch, writes=1, as_runtime_error=case is disk_full_reported_as_runtime_error)
    capsys.readouterr()
    resume = bool(argv) and argv[0] == "--resume"
    run_dir_before = (tmp_path / "runs" / "bad").exists()
    if argv[:1] == ["--config"]:  # the YAML file first, then the usual overrides
        argv = [*argv, *tiny_overrides(wndb, tmp_path, "train.run_id=bad")]
    code = main(["train", *argv] if resume or argv[:1] == ["--config"]
                else ["train", *tiny_overrides(wndb, tmp_path, "train.run_id=bad"), *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, err
    # nothing half-written: no temporary files; no new report or final checkpoint
    assert not [p for p in tmp_path.rglob("*.tmp")]
    changed = [p for p in tmp_path.rglob("*") if p.is_file() and before.get(p) != p.stat().st_mtime_ns]
    assert not [p for p in changed if p.name in ("report.json", "checkpoint.pt")], changed
    if not run_dir_before and case not in (disk_full_on_checkpoint_write, disk_full_reported_as_runtime_error):
        assert not (tmp_path / "runs" / "bad").exists()  # a refused fresh run leaves no directory to block its re-run
    if case in (disk_full_on_checkpoint_write, disk_full_reported_as_runtime_error):
        ckpts = list_checkpoints(tmp_path / "runs" / "bad")
        assert [p.name for p in ckpts] == ["step-00000002.pt"]
        assert torch.load(ckpts[0], weights_only=True)["step"] == 2  # the earlier checkpoint is intact


def _fill_disk_after(monkeypatch, writes: int, as_runtime_error: bool = False) -> None:
    """Simulate a full disk: after ``writes`` successful checkpoint writes, ``torch.save`` writes part of the
    file and fails with ENOSPC, as ``write(2)`` does when the file system fills up, or (``as_runtime_error``) with
    the errno-less ``RuntimeError`` torch 2.13's zip writer raises; the free space then reads 0 bytes."""
    real_save = torch.save
    count = {"n": 0}
    state = {"full": False}
    real_usage = shutil.disk_usage

    def save(obj, f, *args, **kwargs):
        count["n"] += 1
        if count["n"] <= writes:
            return real_save(obj, f, *args, **kwargs)
        Path(f).write_bytes(b"PK\x03\x04 partial")
        state["full"] = True
        if as_runtime_error:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1866816 vs 1866704")
        raise OSError(errno.ENOSPC, "No space left on device")

    def disk_usage(path):
        usage = real_usage(path)
        return usage._replace(free=0) if state["full"] else usage

    monkeypatch.setattr(torch, "save", save)
    monkeypatch.setattr(shutil, "disk_usage", disk_usage)


def test_packed_samples_longer_than_pack_len_are_truncated_counted_and_said(tiny_cfg, capsys) -> None:
    """Issue 15: a sample longer than ``batching.pack_len`` is cut to it and counted, never silently dropped."""
    import time

    from train.run.training import run_training

    report = run_training(tiny_cfg("batching.method=packed", "batching.pack_len=8", "train.max_steps=4"),
                          time.perf_counter())
    out = capsys.readouterr().out
    assert "training samples longer than 8 tokens are truncated to it" in out
    b = report["batching"]
    assert b["truncated_in_collate"] > 0 and b["dropped_samples"] == 0


def test_a_reused_optimize_run_id_is_told_to_overwrite_never_to_resume(tmp_path: Path, capsys) -> None:
    """``optimize`` has no ``--resume`` (argparse: unrecognized arguments): the refusal offers what the command has."""
    (tmp_path / "runs" / "X").mkdir(parents=True)
    (tmp_path / "runs" / "X" / "optimize.json").write_text("{}")
    code = main(["optimize", "--config", "configs/naive-cpu.yaml", "--run-id", "X",
                 f"train.output_dir={tmp_path / 'runs'}"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert f"run directory {tmp_path / 'runs' / 'X'} exists already" in err
    assert "choose another --run-id (train.run_id), or replace its run with --overwrite" in err
    assert "--resume" not in err


@pytest.mark.parametrize("text", ["", "  \n\n", "# only comments\n# here\n", "---\n"])
def test_an_empty_config_file_is_refused_not_a_silent_run_on_the_defaults(text: str, tmp_path: Path) -> None:
    from train.config import load_config
    from train.errors import UserError

    p = tmp_path / "c.yaml"
    p.write_text(text, encoding="utf-8")
    with pytest.raises(UserError, match="empty config file .* remove --config to use the defaults, or add settings"):
        load_config(str(p))
