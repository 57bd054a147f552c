"""A tiny end-to-end bench producing every JSON key (fixture data, smallest model)."""

import json
from pathlib import Path

import pytest

from train.bench.rows import CONFIGS
from train.bench.suite import run_bench_suite

ROW_KEYS = {"name", "samples_per_s", "tokens_per_s", "time_to_first_step_s", "step_time_ms", "peak_memory_bytes",
            "energy_j_per_sample", "mfu", "mfu_vs_measured_peak", "samples_per_s_vs_naive", "samples_per_s_vs_hf-style"}


def test_tiny_bench_writes_every_key(tiny_cfg) -> None:
    cfg = tiny_cfg("train.run_id=bench", "batching.max_tokens=256", "bench.warmup_steps=1", "bench.rounds=2",
                   "bench.window=2", "bench.requests=6", "bench.inference_batch_size=4")
    run_bench_suite(cfg, notice=lambda _m: None)
    out = Path(cfg.train.output_dir) / "bench" / "bench"
    on_disk = json.loads((out / "bench.json").read_text())
    rows = {r["name"]: r for r in on_disk["training"]["configs"]}
    assert list(rows) == list(CONFIGS)
    for row in rows.values():
        assert ROW_KEYS <= set(row), ROW_KEYS - set(row)
        assert set(row["step_time_ms"]) == {"p50", "p90", "p99"} and row["timed_steps"] == 4
        assert row["samples_per_s"] > 0 and row["mfu_vs_measured_peak"] > 0
        assert row["energy_j_per_sample"] is not None or row["energy_unavailable_reason"]
    assert rows["naive"]["samples_per_s_vs_naive"] == 1.0
    assert rows["naive"]["token_efficiency"] < rows["naive+buckets"]["token_efficiency"]
    assert rows["naive"]["distinct_shapes"] == 1
    inf = on_disk["inference"]
    assert inf["time_to_first_response_s"] > 0 and inf["single"]["requests"] == 6
    for mode in ("single", "batched"):
        assert set(inf[mode]["latency_ms"]) == {"p50", "p90", "p99"} and inf[mode]["requests_per_s"] > 0
    assert {"throughput.png", "memory.png", "latency_cdf.png"} <= {p.name for p in out.iterdir()}
    assert "| naive |" in (out / "bench.md").read_text()


def test_inference_from_a_trained_checkpoint(tiny_cfg) -> None:
    import time

    from train.run.training import run_training

    report = run_training(tiny_cfg("train.max_steps=40", "train.run_id=ck"), time.perf_counter())
    cfg = tiny_cfg("train.run_id=benchck", "bench.configs=naive", "bench.warmup_steps=1", "bench.rounds=1",
                   "bench.window=1", f"bench.checkpoint={Path(report['run_dir']) / 'checkpoint.pt'}",
                   "bench.requests=20", "bench.inference_batch_size=5")
    result = run_bench_suite(cfg, notice=lambda _m: None)
    assert result["inference"]["model"].endswith("checkpoint.pt")
    assert result["inference"]["accuracy_on_requests"] > 0.3  # a trained model, not chance (1/45)


def test_open_loop_load_counts_queueing_and_batches_dynamically() -> None:
    import time as _time

    from train.bench.inference import open_loop

    calls: list[int] = []

    def answer(texts):  # a server that takes 2 ms per call whatever the batch size
        calls.append(len(texts))
        _time.sleep(0.002)
        return ["x"] * len(texts)

    slow = open_loop(answer, ["t"] * 60, rate=100.0, max_batch=8, max_delay_s=0.001, seed=0)
    calls.clear()
    fast = open_loop(answer, ["t"] * 200, rate=4000.0, max_batch=8, max_delay_s=0.001, seed=0)
    assert slow["mean_batch_size"] < 2 and fast["mean_batch_size"] > 4 and max(calls) <= 8  # batches grow with load
    assert slow["latency_ms"]["p50"] >= 2.0 and fast["latency_ms"]["p99"] > fast["latency_ms"]["p50"]
    assert (0 < slow["achieved_requests_per_s"] <= 200
            and fast["achieved_requests_per_s"] > slow["achieved_requests_per_s"])


def _inference_setup(tiny_cfg):
    import torch

    from train.data import prepare_data
    from train.data.tokenizer import load_or_train
    from train.precision import PrecisionPolicy
    from train.setup import build_model

    cfg = tiny_cfg()
    bundle = prepare_data(cfg, None, notice=lambda *a, **k: None)
    tok, _ = load_or_train(bundle.corpus.train.texts, cfg.data.vocab_size, cfg.data.cache_dir)
    return cfg, bundle, tok, build_model(cfg, bundle), PrecisionPolicy.for_config(cfg, torch.device("cpu"))


def test_batched_inference_groups_requests_by_bucket(tiny_cfg) -> None:
    import torch

    from train.bench.inference import Classifier

    cfg, bundle, tok, model, policy = _inference_setup(tiny_cfg)
    clf = Classifier(model, tok, bundle, bundle.corpus.label_names, policy, torch.device("cpu"), cfg.data.max_len,
                     "bucket")
    texts = bundle.corpus.validation.texts[:12]
    shapes = []
    hook = model.register_forward_pre_hook(lambda m, args: shapes.append(tuple(args[0].shape)))
    together = clf(texts)
    hook.remove()
    lengths = [len(tok.encode(t).ids) for t in texts]
    needed = {next(b for b in bundle.bounds if b >= min(n, bundle.bounds[-1])) for n in lengths}
    assert sorted(s for _, s in shapes) == sorted(needed)  # one forward per bucket present, padded to its bound
    assert sum(b for b, _ in shapes) == len(texts)
    assert together == [clf([t])[0] for t in texts]  # grouping changes nothing but the padding


def test_packed_inference_is_one_forward_per_call_with_the_same_answers(tiny_cfg) -> None:
    import torch

    from train.bench.inference import Classifier

    cfg, bundle, tok, model, policy = _inference_setup(tiny_cfg)
    cpu = torch.device("cpu")
    packed = Classifier(model, tok, bundle, bundle.corpus.label_names, policy, cpu, cfg.data.max_len)  # auto
    bucket = Classifier(model, tok, bundle, bundle.corpus.label_names, policy, cpu, cfg.data.max_len, "bucket")
    assert packed.batching == "packed", "auto packs a model that supports packing"
    texts = bundle.corpus.validation.texts[:24]
    calls = []
    hook = model.register_forward_pre_hook(lambda m, args, kw: calls.append((tuple(args[0].shape), kw.get("num_seqs"))),
                                           with_kwargs=True)
    answers = packed(texts)
    hook.remove()
    lengths = [min(len(tok.encode(t).ids), cfg.data.max_len) for t in texts]
    longest_bound = next(b for b in bundle.bounds if b >= max(lengths))
    assert len(calls) == 1, "one forward for the whole call"
    (rows, capacity), num_seqs = calls[0]
    assert capacity == longest_bound and num_seqs == len(texts) and rows * capacity < len(texts) * longest_bound
    assert rows >= -(-sum(lengths) // capacity)  # every request's tokens fit, none dropped
    assert answers == bucket(texts) == [packed([t])[0] for t in texts]


def test_packed_inference_is_refused_for_a_model_that_cannot_pack(tiny_cfg) -> None:
    import torch

    from train.bench.inference import Classifier
    from train.errors import UserError

    cfg, bundle, tok, model, policy = _inference_setup(tiny_cfg)
    model.supports_packing = False  # as an external model (train/models/wrap.py)
    with pytest.raises(UserError, match="inference_batching=packed.*cannot run packed rows"):
        Classifier(model, tok, bundle, bundle.corpus.label_names, policy, torch.device("cpu"), cfg.data.max_len,
                   "packed")
    assert Classifier(model, tok, bundle, bundle.corpus.label_names, policy, torch.device("cpu"), cfg.data.max_len,
                      "auto").batching == "bucket"


def test_a_decoder_bench_has_decoder_inference_rows(wndb, tmp_path, monkeypatch) -> None:
    from tests.conftest import tiny_overrides
    from train.config import load_config

    # compile's first graphs take minutes on a CPU: the rows of the paths that run here, static-compile left out
    from train.generate import serving as generate
    real = generate.available_paths
    monkeypatch.setattr(generate, "available_paths",
                        lambda m: {**real(m), "static-compile": "left out of this test (compile time)"})
    llama = ("model.hf_overrides={num_hidden_layers: 1, hidden_size: 32, num_attention_heads: 4, "
             "num_key_value_heads: 2, intermediate_size: 64}")
    cfg = load_config(None, tiny_overrides(
        wndb, tmp_path, "model.task=causal-lm", "model.source=hf:llama", llama, "data.vocab_size=300",
        "batching.method=packed", "batching.max_tokens=128", "model.packed_attention=sdpa-mask",
        "model.chunked_loss=false", "bench.configs=naive", "bench.warmup_steps=1", "bench.rounds=2",
        "bench.window=1", "bench.requests=3", "generate.max_new_tokens=4", "generate.ignore_eos=true",
        "train.run_id=bench"))
    run_bench_suite(cfg, notice=lambda _m: None)
    out = Path(cfg.train.output_dir) / "bench" / "bench"
    inf = json.loads((out / "bench.json").read_text())["inference"]
    assert inf["kind"] == "decoder" and "static-compile" in inf["not_run"]
    for path, modes in inf["paths"].items():
        assert modes["single"]["requests"] == 3 and modes["single"]["output_tokens"] == 12, path
        assert modes["single"]["tpot_ms"]["p50"] > 0 and modes["batched"]["output_tokens_per_s"] > 0, path
    assert set(inf["batched_output_tokens_per_s_vs_dynamic"]) == set(inf["paths"]) - {"dynamic"}
    md = (out / "bench.md").read_text()
    assert "## Inference (decoder)" in md and "| dynamic | single |" in md


def test_a_decoder_bench_with_a_missing_checkpoint_is_refused_before_any_step(wndb, tmp_path) -> None:
    from tests.conftest import tiny_overrides
    from train.config import load_config
    from train.errors import UserError

    cfg = load_config(None, tiny_overrides(wndb, tmp_path, "model.task=causal-lm", "model.source=hf:llama",
                                           f"bench.checkpoint={tmp_path / 'nope.pt'}"))
    with pytest.raises(UserError, match="bench.checkpoint=.*no such file"):
        run_bench_suite(cfg, notice=lambda _m: None)
    assert not (Path(cfg.train.output_dir) / "bench").exists()
