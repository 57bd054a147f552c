"""A whole ``model.task=causal-lm`` run: a tiny random-init Llama on WordNet glosses in packed rows — the report's
figures, exact resume from a middle checkpoint, two DDP ranks, and a resume that would change the task."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from tests.conftest import assert_same_final_state, causal_overrides, resume_from_first_checkpoint, tiny_overrides
from train.config import load_config
from train.errors import UserError
from train.run.training import run_training


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, Path, list[str], dict]:
    """(wndb, root, overrides, report) of an uninterrupted 16-step run ``root/runs/ref``."""
    from tests.conftest import synthetic_rows, write_wndb

    root = tmp_path_factory.mktemp("causal")
    wndb = write_wndb(root / "wn", synthetic_rows())
    overrides = causal_overrides(wndb, root, "train.max_steps=16", "train.eval_every=8", "train.log_every=1")
    report = run_training(load_config(None, overrides + ["train.run_id=ref"]), time.perf_counter())
    return wndb, root, overrides, report


def test_a_causal_run_reports_loss_per_target_token_and_packs_one_shape(reference) -> None:
    *_, report = reference
    q, p, b = report["quality"], report["perf"], report["batching"]
    assert report["task"] == "causal-lm" and report["status"] == "completed"
    assert q["eval_perplexity"] == pytest.approx(math.exp(q["eval_loss"]), rel=1e-6)
    assert q["test_perplexity"] == pytest.approx(math.exp(q["test_loss"]), rel=1e-6)
    assert q["eval_target_tokens"] > 0 and q["test_majority_class_accuracy"] is None
    first, last = q["evals"][0], q["evals"][-1]
    assert last["loss"] < first["loss"]  # held-out loss falls over the run
    assert b["method"] == "packed" and b["distinct_shapes"] == 1 and b["token_efficiency"] > 0.9
    assert 0 < p["throughput_target_tokens_per_s"] <= p["throughput_tokens_per_s"]
    # text rows train every position but each sample's last (its EOS predicts nothing): targets = tokens - samples
    assert p["throughput_target_tokens_per_s"] == pytest.approx(
        p["throughput_tokens_per_s"] - p["throughput_samples_per_s"], rel=1e-9)


def test_a_causal_run_resumes_from_a_middle_checkpoint_bit_identically(reference, capsys) -> None:
    _, root, overrides, _ = reference
    cfg = load_config(None, overrides + ["train.run_id=mid", "train.checkpoint_every=6"])
    report, _ = resume_from_first_checkpoint(cfg, root / "runs" / "mid")
    assert report["resumed_from"]["step"] == 6 and report["task"] == "causal-lm"
    roles = report["data"]["tokenizer"]["roles"]  # the trained BPE has no pad token: the console says so, once a run
    assert roles["pad_is_eos"] and sum(line.startswith(f"tokenizer: pad = EOS (id {roles['eos_id']})")
                                       for line in capsys.readouterr().out.splitlines()) == 2
    assert_same_final_state(root / "runs" / "ref", root / "runs" / "mid")


def test_resuming_a_causal_run_as_a_classifier_is_refused_in_one_line(reference) -> None:
    wndb, root, overrides, _ = reference
    cfg = load_config(None, tiny_overrides(wndb, root, "train.run_id=ref"))
    with pytest.raises(UserError, match="cannot change mid-run.*model.task 'causal-lm' → 'classification'"):
        run_training(cfg, time.perf_counter(), resume=str(root / "runs" / "ref"))


def test_two_ranks_train_a_causal_lm_on_packed_rows(reference, tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    from tests.conftest import ddp_worker, free_port

    wndb, _, _, _ = reference
    overrides = causal_overrides(wndb, tmp_path, "train.max_steps=6", "train.eval_every=6", "train.run_id=ddp-lm")
    out = tmp_path / "out"
    out.mkdir()
    mp.spawn(ddp_worker, args=(2, free_port(), overrides, str(out), None, None, None), nprocs=2, join=True)
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    report = results[0]["report"]
    assert report["env"]["world_size"] == 2 and report["task"] == "causal-lm" and report["status"] == "completed"
    assert report["batching"]["distinct_shapes"] == 1 and report["quality"]["eval_target_tokens"] > 0
    assert results[0]["param_sha256"] == results[1]["param_sha256"]  # DDP kept the replicas identical
    assert json.loads((tmp_path / "runs" / "ddp-lm" / "report.json").read_text())["task"] == "causal-lm"


def test_a_varlen_run_counts_attention_per_sample_and_resumes_bit_identically(reference) -> None:
    wndb, root, overrides, ref = reference
    varlen = overrides + ["model.packed_attention=varlen", "train.max_steps=6", "train.eval_every=6"]
    report = run_training(load_config(None, varlen + ["train.run_id=varlen"]), time.perf_counter())
    b, p = report["batching"], report["perf"]
    assert b["attention_path"] == "varlen" and "per sample" in b["attention"]["detail"]
    assert "over itself (varlen)" in report["levers"]["packing"]["reason"]
    assert p["mfu"] is not None and "varlen attention counted per sample group" in p["flops_method"]
    assert p["flops_per_step_mean"] < ref["perf"]["flops_per_step_mean"]  # the same shape, C² per row there
    cfg = load_config(None, varlen + ["train.run_id=varlen-mid", "train.checkpoint_every=3"])
    resumed, _ = resume_from_first_checkpoint(cfg, root / "runs" / "varlen-mid")
    assert resumed["resumed_from"]["step"] == 3 and resumed["batching"]["attention_path"] == "varlen"
    assert_same_final_state(root / "runs" / "varlen", root / "runs" / "varlen-mid")


def test_auto_attention_is_written_into_the_runs_config_so_a_resume_replays_it(reference) -> None:
    import yaml

    wndb, root, overrides, _ = reference
    report = run_training(load_config(None, overrides + ["model.packed_attention=auto", "train.max_steps=2",
                                                         "train.run_id=auto-att"]), time.perf_counter())
    saved = yaml.safe_load((root / "runs" / "auto-att" / "config.yaml").read_text())
    assert report["batching"]["attention"]["requested"] == "auto"
    assert saved["model"]["packed_attention"] == report["batching"]["attention_path"] in ("sdpa-mask", "varlen",
                                                                                           "eager-mask")


def test_a_bench_row_or_optimize_arm_runs_the_attention_and_loss_its_config_names(reference, monkeypatch) -> None:
    """``build_run`` without the resolve phase (bench rows, optimize arms, bench-vs-hf sides) puts the model on the
    config's packed attention and chunked loss — before, every such packed arm ran ``sdpa-mask`` with the logits
    whole, whatever it asked for; ``auto`` is decided by the resolve phase's own measurement (forced here)."""
    import torch

    from train.data import attention as attn
    from train.data import prepare_data
    from train.precision import PrecisionPolicy
    from train.setup import build_run

    _, root, overrides, _ = reference
    cpu = torch.device("cpu")

    def built(*extra: str):
        cfg = load_config(None, overrides + list(extra))
        return build_run(cfg, prepare_data(cfg, None, notice=lambda _m: None), cpu, PrecisionPolicy.create("fp32", cpu))

    run = built("model.packed_attention=varlen", "model.chunked_loss=true")
    assert (run.model.packed_attention, run.model.chunked_loss) == ("varlen", True)
    assert run.attention.source == "requested"
    run = built("model.packed_attention=sdpa-mask", "model.chunked_loss=false")
    assert (run.model.packed_attention, run.model.chunked_loss, run.attention) == ("sdpa-mask", False, None)
    for speedup, path in ((2.0, "varlen"), (0.5, "sdpa-mask")):
        forced = {"sdpa-mask": 2.0, "varlen": 2.0 / speedup, "eager-mask": 4.0, "repeats": 1, "shape": [2, 64]}
        monkeypatch.setattr(attn, "measure_paths", lambda *_a, f=forced, **_k: f)
        run = built("model.packed_attention=auto", f"data.cache_dir={root / f'cache-{path}'}")
        assert (run.model.packed_attention, run.attention.source) == (path, "measured"), run.attention.reason
