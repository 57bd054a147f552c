"""``bench-generate`` (train/generate/, train/bench/generate.py): the figures' definitions on hand-made timestamps,
the precomputed Poisson schedule, greedy outputs token-identical across serving paths and padding, EOS ending a
request, and bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.conftest import assert_clean_error, run_cli
from train.config import load_config
from train.errors import UserError
from train.generate.figures import RequestTiming, poisson_arrivals, summarize

transformers = pytest.importorskip("transformers")


def test_ttft_tpot_gaps_and_e2e_follow_their_definitions() -> None:
    a = RequestTiming(sent=10.0, token_times=[10.1, 10.15, 10.25, 10.30])  # TTFT 100, E2E 300, TPOT 200/3
    b = RequestTiming(sent=10.05, token_times=[10.45])  # one token: no TPOT, no gap
    fig = summarize([a, b], slo_ttft_ms=150, slo_tpot_ms=50)
    assert a.ttft_ms() == pytest.approx(100) and a.e2e_ms() == pytest.approx(300)
    assert a.tpot_ms() == pytest.approx(200 / 3) and b.tpot_ms() is None
    assert fig["tpot_ms"]["p50"] == pytest.approx(200 / 3)  # one value per request that has one
    assert sorted(a.gaps_ms()) == pytest.approx([50, 50, 100]) and fig["itl_ms"]["p50"] == pytest.approx(50)
    assert fig["e2e_ms"]["p99"] == pytest.approx(np.percentile([300, 400], 99))
    assert fig["span_s"] == pytest.approx(0.45) and fig["output_tokens"] == 5
    assert fig["output_tokens_per_s"] == pytest.approx(5 / 0.45) and fig["requests_per_s"] == pytest.approx(2 / 0.45)
    # a: TTFT 100 ≤ 150 but TPOT 66.7 > 50; b: TTFT 400 > 150 — none meets every SLO at once
    assert fig["requests_meeting_slo"] == 0 and fig["goodput_requests_per_s"] == 0
    assert summarize([a, b], slo_ttft_ms=500)["requests_meeting_slo"] == 2
    free = summarize([a, b])
    assert free["goodput_requests_per_s"] is None and "no SLO" in free["goodput_unavailable_reason"]
    with pytest.raises(ValueError, match="no output token"):
        summarize([RequestTiming(sent=0.0)])


def test_the_poisson_schedule_is_computed_before_the_run_at_the_asked_rate() -> None:
    t = poisson_arrivals(4000, rate=50.0, seed=3)
    assert np.all(np.diff(t) > 0) and np.array_equal(t, poisson_arrivals(4000, 50.0, seed=3))
    assert 4000 / t[-1] == pytest.approx(50.0, rel=0.05)
    gaps = np.diff(t)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.1)  # exponential gaps: coefficient of variation 1
    with pytest.raises(ValueError):
        poisson_arrivals(3, 0.0)


def _tiny_llama():
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(
        "llama", vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=128, eos_token_id=2, bos_token_id=1, pad_token_id=0)
    from train.compat import hf_attn_implementation

    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=hf_attn_implementation()).eval()


PROMPTS = [[1, 5, 6, 7], [1, 9, 10], [1, 11, 12, 13, 14, 15, 16], [1, 30, 31]]


def _greedy_by_hand(model, prompt: list[int], new_tokens: int) -> list[int]:
    """The reference no serving path shares: the whole sequence's forward each step (no KV cache, no padding, no
    ``generate``), the argmax of the last position's logits appended."""
    ids, out = torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(new_tokens):
            nxt = int(model(ids).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


@pytest.mark.parametrize("path", ["dynamic", "static-compile", "continuous"])
def test_greedy_outputs_are_token_identical_across_paths_padding_and_batching(path) -> None:
    from train.generate.engines import PATHS, continuous, generate_batch, greedy_config
    from train.generate.serving import available_paths

    assert path in PATHS
    model = _tiny_llama()
    why = available_paths(model)[path]
    if why is not None:
        pytest.skip(f"{path} does not run here: {why}")  # said, never a silent pass
    gen = greedy_config(transformers, 6, 2, 0, ignore_eos=True)
    ref = [_greedy_by_hand(model, p, 6) for p in PROMPTS]
    single = [t.output_ids for t in continuous(model, PROMPTS, gen, closed_loop=True)] if path == "continuous" \
        else [generate_batch(model, [p], path, gen)[0].output_ids for p in PROMPTS]
    batched = continuous(model, PROMPTS, gen) if path == "continuous" else generate_batch(model, PROMPTS, path, gen)
    assert single == ref, path
    assert [t.output_ids for t in batched] == ref, f"{path}: left padding or batching changed a request's tokens"
    assert all(len(t.token_times) == 6 and t.ttft_ms() > 0 for t in batched), path


def test_eos_ends_a_request_unless_ignore_eos() -> None:
    from train.generate.engines import generate_batch, greedy_config

    model = _tiny_llama()
    free = generate_batch(model, PROMPTS[:1], "dynamic", greedy_config(transformers, 8, None, 0, True))[0]
    eos = free.output_ids[2]  # make the third generated token the end of sequence
    stopped = generate_batch(model, PROMPTS[:1], "dynamic", greedy_config(transformers, 8, eos, 0, False))[0]
    assert stopped.output_ids == free.output_ids[:free.output_ids.index(eos) + 1]
    assert len(stopped.token_times) == len(stopped.output_ids) < 8
    ignored = generate_batch(model, PROMPTS[:1], "dynamic", greedy_config(transformers, 8, eos, 0, True))[0]
    assert len(ignored.output_ids) == 8
    model.generation_config.eos_token_id = eos  # as a trained run's export writes it: ignore_eos still ignores it
    ignored = generate_batch(model, PROMPTS[:1], "dynamic", greedy_config(transformers, 8, eos, 0, True))[0]
    assert ignored.output_ids == free.output_ids and len(ignored.token_times) == 8


def test_a_static_batching_server_counts_queueing_in_latency() -> None:
    from train.generate.engines import greedy_config, static_batching_server

    model = _tiny_llama()
    gen = greedy_config(transformers, 4, None, 0, True)
    served = static_batching_server(model, PROMPTS, "dynamic", gen, max_batch=1)  # all arrive at 0, one at a time
    ttft = [t.ttft_ms() for t in served]
    assert ttft == sorted(ttft) and ttft[-1] > 2 * ttft[0]  # the last waited for three batches before it


@pytest.mark.parametrize("override,match", [
    ("generate.load_levels=0,1.5", "generate.load_levels"), ("generate.path=vllm", "generate.path"),
    ("generate.max_new_tokens=0", "generate.max_new_tokens"), ("generate.slo_ttft_ms=-5", "generate.slo_ttft_ms")])
def test_malformed_generate_settings_are_one_line(override, match) -> None:
    with pytest.raises(UserError, match=match):
        load_config(None, [override])


@pytest.mark.parametrize("levels", ["[0]", "[1.5]", "[abc]"])
def test_load_levels_in_the_yaml_list_form_get_the_message_that_names_the_format(levels) -> None:
    with pytest.raises(UserError, match=r"generate.load_levels='.*': expected comma-separated shares of the maximum "
                                        r"rate in \(0, 1\], e.g. 0.25,0.5,0.9"):
        load_config(None, [f"generate.load_levels={levels}"])
    assert load_config(None, ["generate.load_levels=[0.25, 0.5]"]).generate.levels == [0.25, 0.5]


def test_an_unfinished_run_names_its_newest_periodic_checkpoint_and_how_to_export_it(tmp_path) -> None:
    from train.generate.source import load_served

    run = tmp_path / "run"
    (run / "checkpoints" / "step-20.dcp").mkdir(parents=True)
    (run / "checkpoints" / "step-100.dcp").mkdir()
    (run / "checkpoints" / ".step-120.dcp.tmp").mkdir()  # an interrupted write: not a checkpoint
    (run / "config.yaml").write_text("model:\n  task: causal-lm\n")
    cfg = load_config(str(run / "config.yaml"))
    with pytest.raises(UserError, match=r"no model/ and no checkpoint.pt.*newest .*step-100.dcp.*python -m train "
                                        r"export .* --checkpoint .*step-100.dcp"):
        load_served(str(run), cfg)


def test_bench_generate_on_a_classifier_run_or_a_missing_directory_is_one_line(tmp_path) -> None:
    (tmp_path / "clf").mkdir()
    (tmp_path / "clf" / "config.yaml").write_text("model:\n  task: classification\n")
    proc = run_cli("bench-generate", str(tmp_path / "clf"), f"train.output_dir={tmp_path / 'runs'}")
    assert_clean_error(proc, "is a classification run", "model.task=causal-lm")
    # no run, no --config and no model installed under data.cache_dir (make models): one line that says the three ways
    proc = run_cli("bench-generate", f"train.output_dir={tmp_path / 'runs'}", f"data.cache_dir={tmp_path / 'c'}")
    assert_clean_error(proc, "give a run directory", "run `make models` first")
    assert not list((tmp_path / "runs").glob("*"))  # a refused command leaves no directory (not even a lock)


def test_a_prompt_too_long_for_the_context_is_refused_or_cut_as_asked(monkeypatch) -> None:
    from train.generate import source

    class Split:
        ids = [np.array([1] + list(range(3, 40)) + [2])]
        labels = np.array([0])

        def __len__(self) -> int:
            return 1

    class Bundle:
        splits = {"test": Split(), "validation": Split()}
        eos_id = 2

    monkeypatch.setattr("train.data.prepare_data", lambda *a, **k: Bundle())
    Split.ids, Split.labels = Split.ids * 2, np.array([0, 0])
    Split.__len__ = lambda self: 2
    with pytest.raises(UserError, match="exceeds the model's 24-token context.*truncate_prompts"):
        source.held_out_prompts(None, 2, 0.9, 24, 8, None)
    prompts, facts = source.held_out_prompts(None, 2, 0.9, 24, 8, "left")
    assert all(len(p) == 16 for p in prompts) and facts["truncated_prompts"] == 2
    assert facts["fewer_than_requested"] is None
    _, facts = source.held_out_prompts(None, 5, 0.9, 24, 8, "left")  # the split has 2: said, not silently capped
    assert facts["prompts"] == 2 and "2 of the 5 prompts asked for" in facts["fewer_than_requested"]
    Split.ids, Split.labels = Split.ids[:1], np.array([0])
    Split.__len__ = lambda self: 1
    with pytest.raises(UserError, match="has 1 sample.*raise data.test_fraction"):
        source.held_out_prompts(None, 2, 0.9, 24, 8, "left")
    assert prompts[0][-1] == Split.ids[0][math.floor(38 * 0.9) - 1]  # the end of the prompt kept


def test_fresh_process_first_response_runs_cold_then_warm_on_one_emptied_cache(tmp_path) -> None:
    from train.generate.first_response import fresh_process_first_response

    cache = tmp_path / "inductor-cache"
    cache.mkdir()
    (cache / "stale").write_text("left by an earlier run")
    calls: list[list[str]] = []

    def runner(cmd: list[str], out) -> dict:
        calls.append(cmd)
        state = "warm" if (cache / "entry").exists() else "cold"  # the first child fills the cache
        cache.mkdir(exist_ok=True)
        (cache / "entry").write_text("compiled")
        return {"cache_state": state, "first_response_s": 8.0 if state == "cold" else 1.0,
                "time_to_first_response_s": 12.0 if state == "cold" else 5.0}

    got = fresh_process_first_response("runs/x", "c.yaml", ["generate.path=dynamic", "generate.requests=4"], tmp_path,
                                       runner=runner)
    assert not (cache / "stale").exists()  # emptied first: the cold child found nothing
    assert got["cold"]["cache_state"] == "cold" and got["warm"]["cache_state"] == "warm"
    assert got["warm_over_cold_first_response"] == pytest.approx(1 / 8)
    assert got["target"]["warm_first_response_le_25pct_of_cold"]["reached"] is True
    for cmd in calls:  # both children: the same run, config and cache, the path forced, the user's path dropped
        assert cmd[cmd.index("bench-generate") + 1] == "runs/x" and "--child" in cmd
        assert f"compile.cache_dir={cache.resolve()}" in cmd and "generate.path=static-compile" in cmd
        assert "generate.path=dynamic" not in cmd and "generate.requests=4" in cmd


def test_fresh_process_first_response_is_null_with_a_reason_where_compile_cannot_run(tmp_path) -> None:
    from train.generate.first_response import fresh_process_first_response

    def runner(cmd, out):
        raise AssertionError("no child may start")

    got = fresh_process_first_response(None, None, [], tmp_path, unavailable="no dynamo", runner=runner)
    assert got["cold"] is None and got["warm_over_cold_first_response"] is None
    assert "no dynamo" in got["unavailable_reason"]


def test_fresh_process_children_that_did_not_see_cold_then_warm_give_a_null_ratio_with_the_reason(tmp_path) -> None:
    """A first request that ends at its first token compiles no decode step: the warm child finds the cache cold.
    The figures stay, the ratio is null with that reason; the run goes on (it used to end in a traceback)."""
    from train.generate.first_response import fresh_process_first_response

    def runner(cmd, out):
        return {"cache_state": "cold", "first_response_s": 1.0, "time_to_first_response_s": 2.0, "output_tokens": 1}

    got = fresh_process_first_response(None, None, [], tmp_path, runner=runner)
    assert got["warm_over_cold_first_response"] is None and got["cold"]["first_response_s"] == 1.0
    assert "cold/cold, not cold/warm" in got["unavailable_reason"] and "first token" in got["unavailable_reason"]


def test_one_token_answers_have_no_tpot_counted_and_said() -> None:
    one = [RequestTiming(sent=0.0, token_times=[0.1]), RequestTiming(sent=0.0, token_times=[0.2])]
    fig = summarize(one)
    assert fig["tpot_ms"]["p50"] is None and fig["one_token_requests"] == 2
    assert "ended at its first token" in fig["tpot_unavailable_reason"]
    mixed = summarize(one + [RequestTiming(sent=0.0, token_times=[0.1, 0.3])])
    assert mixed["tpot_ms"]["p50"] == pytest.approx(200) and mixed["one_token_requests"] == 2
    assert "tpot_unavailable_reason" not in mixed


def test_a_forced_path_serves_itself_and_the_reference_only() -> None:
    from train.bench.generate import served_paths

    avail = {"dynamic": None, "static-compile": None, "continuous": None}
    assert served_paths("auto", avail) == ["dynamic", "static-compile", "continuous"]
    assert served_paths("continuous", avail) == ["dynamic", "continuous"]
    assert served_paths("dynamic", {**avail, "continuous": "not here"}) == ["dynamic"]


def test_bench_generate_with_one_new_token_and_a_failing_path_finishes_with_nulls_and_reasons(
        wndb, tmp_path, monkeypatch) -> None:
    """``generate.max_new_tokens=1`` (every answer one token: TPOT undefined) on a random-init tiny Llama, with
    ``continuous`` failing while it warms up: generate.json is written, the failing path left out with its error,
    TPOT null with the reason, and the summary line prints (it used to crash on a None TPOT)."""
    from tests.conftest import tiny_overrides
    from train.bench.generate import run_bench_generate, summary_line, write_outputs
    from train.generate import engines, serving

    real_serve = engines.serve

    def serve(model, path, *args, **kwargs):
        if path == "continuous":
            raise RuntimeError("the engine broke")
        return real_serve(model, path, *args, **kwargs)

    monkeypatch.setattr(serving, "serve", serve)
    monkeypatch.setattr(serving, "continuous", lambda *a, **k: serve(None, "continuous"))
    monkeypatch.setattr(serving, "available_paths", lambda m: {"dynamic": None, "continuous": None,
                                                               "static-compile": "left out (compile time)"})
    monkeypatch.setattr("train.bench.generate.available_paths", serving.available_paths)
    llama = ("model.hf_overrides={num_hidden_layers: 1, hidden_size: 32, num_attention_heads: 4, "
             "num_key_value_heads: 2, intermediate_size: 64}")
    cfg = load_config(None, tiny_overrides(
        wndb, tmp_path, "model.task=causal-lm", "model.source=hf:llama", llama, "data.vocab_size=300",
        "generate.max_new_tokens=1", "generate.requests=3", "generate.fresh_process=false", "bench.rounds=2",
        "generate.profile_requests=0", "generate.load_levels=0.5"))
    lines: list[str] = []
    result = run_bench_generate(cfg, None, tmp_path / "out", notice=lines.append)
    line = summary_line(result, write_outputs(result, tmp_path / "out"))
    failed = result["warm"]["continuous"]
    assert failed["warmup_s"] is None and "the engine broke" in failed["error"]
    assert "continuous" not in result["batched"] and result["chosen_path"] == "dynamic"
    batched = result["batched"]["dynamic"]
    assert batched["tpot_ms"]["p50"] is None and batched["one_token_requests"] == 3
    assert "no TPOT (every request ended at its first token" in line
    assert any("continuous failed while warming up" in m for m in lines)
    floor = result["floor"]
    assert floor["tpot_floor_ms"]["single"] > 0 and floor["peaks"]["source"].startswith("measured here")
    assert batched["tpot_x_floor"] is None  # no TPOT, no multiple
    fake = {"batched": {"dynamic": {"tpot_ms": {"p50": 3.0}, "output_tokens_per_s": 10.0, "tpot_x_floor": 2.5}},
            "chosen_path": "dynamic", "choice": {"reason": "r"}, "busy_note": "",
            "correctness": {"identical_to_dynamic_single": True}}
    assert "TPOT p50 3.0 ms = 2.50x the bandwidth floor" in summary_line(fake, tmp_path / "g.json")


def test_the_decode_profile_puts_each_ops_self_time_in_one_category_and_the_rest_in_python() -> None:
    from train.generate.decode_profile import CATEGORIES, breakdown, category, explain

    assert category("aten::addmm") == "matmuls" and category("aten::_scaled_dot_product_flash_attention_for_cpu") \
        == "attention" and category("## Call CompiledFxGraph abc ##") == "compiled_kernels"
    assert category("aten::index_copy_") == "kv_cache" and category("aten::argmax") == "sampling"
    assert category("aten::rsqrt") == "other_ops"

    class Ev:
        def __init__(self, name: str, us: float) -> None:
            self.name, self.self_cpu_time_total = name, us

    events = [Ev("aten::mm", 4000), Ev("aten::linear", 100), Ev("aten::argmax", 200), Ev("aten::rsqrt", 700)]
    got = breakdown(events, wall_s=0.010, output_tokens=2)  # 5 ms of ops in 10 ms of wall, 2 tokens
    ms = got["ms_per_output_token"]
    assert set(ms) == set(CATEGORIES)
    assert ms["matmuls"] == pytest.approx(2.05) and ms["sampling"] == pytest.approx(0.1)
    assert ms["python_and_dispatch"] == pytest.approx(2.5) and sum(ms.values()) == pytest.approx(5.0)
    faster = breakdown(events[:1], wall_s=0.006, output_tokens=2)
    line = explain({"dynamic": got, "static-compile": faster})[0]
    assert line.startswith("static-compile vs dynamic: 3.00 vs 5.00") and "python_and_dispatch -1.50" in line


def test_a_real_decode_profile_counts_each_op_once_within_the_wall_time() -> None:
    """The ops' own (self) times of a real capture fit inside the wall time they were measured in, with room
    left for Python: counting an op's children twice (total instead of self time: ``aten::linear`` and the
    ``aten::addmm`` it calls) or a wall clock around the wrong span would break it. The remainder category is not
    looked at: it is wall minus the rest by definition."""
    import time

    from train.generate.decode_profile import profile_single
    from train.generate.engines import greedy_config

    model = _tiny_llama()
    gen = greedy_config(transformers, 4, None, 0, True)
    t0 = time.perf_counter()
    got = profile_single(model, "dynamic", PROMPTS[:2], gen)
    outside_ms = 1e3 * (time.perf_counter() - t0) / got["output_tokens"]
    ms = got["ms_per_output_token"]
    ops = sum(v for k, v in ms.items() if k != "python_and_dispatch")
    assert got["output_tokens"] == 8 and ms["matmuls"] > 0 and ms["compiled_kernels"] == 0
    assert 0 < ops < got["wall_ms_per_output_token"] <= outside_ms
    assert ms["python_and_dispatch"] == pytest.approx(got["wall_ms_per_output_token"] - ops, rel=1e-6)


def test_the_kv_cache_share_follows_the_models_shape_and_each_paths_allocation() -> None:
    from train.generate.resources import kv_bytes_per_token, kv_cache_tokens

    cfg = transformers.LlamaConfig(num_hidden_layers=3, hidden_size=64, num_attention_heads=8, num_key_value_heads=2)
    assert kv_bytes_per_token(cfg, torch.float32) == 2 * 3 * 2 * 8 * 4  # grouped-query: 2 KV heads of dim 8
    assert kv_bytes_per_token(cfg, torch.bfloat16) == 2 * 3 * 2 * 8 * 2
    prompts = [[1] * 5, [1] * 3, [1] * 2]
    assert kv_cache_tokens("dynamic", prompts, 4, 2) == 2 * (5 + 4)  # the largest batch: two rows at the longest
    assert kv_cache_tokens("dynamic", prompts + [[1] * 30], 4, 3) == 1 * (30 + 4)  # one long row outweighs three
    assert kv_cache_tokens("static-compile", prompts, 4, 2) == 2 * (16 + 4)  # rounded up to the prompt bucket
    if hasattr(transformers, "ContinuousBatchingConfig"):  # continuous batching runs only where transformers has it
        assert kv_cache_tokens("continuous", prompts, 4, 2) % 32 == 0  # whole pages, allocated up front


def test_generate_precision_places_the_served_model_in_that_dtype_and_unknown_ones_are_refused() -> None:
    from train.generate.source import Served, place

    model = _tiny_llama()
    got = place(Served(model, "x", None, 0, None), torch.device("cpu"), "bf16")
    assert next(got.model.parameters()).dtype == torch.bfloat16 and not got.model.training
    with pytest.raises(UserError, match="generate.precision"):
        load_config(None, ["generate.precision=int8"])


def test_the_auto_path_is_measured_once_per_machine_and_workload_and_not_cached_when_busy(tmp_path,
                                                                                          monkeypatch) -> None:
    from train.generate import serving as generate

    cfg = load_config(None, [f"data.cache_dir={tmp_path}", "generate.max_new_tokens=4"])
    model = _tiny_llama()
    calls: list[int] = []

    def measure(*args):
        calls.append(1)
        return "continuous", {"reason": "auto: continuous served the most", "vs_dynamic": {}}

    monkeypatch.setattr("train.tools.env.machine_load", lambda: 0.0)
    monkeypatch.setattr("train.tools.decisions.cpu_used_elsewhere", lambda *a: 0.0)
    args = (cfg, model, ["dynamic", "continuous"], PROMPTS, None, torch.device("cpu"))
    assert generate.auto_path(*args, measure=measure)[0] == "continuous"
    best, choice = generate.auto_path(*args, measure=measure)
    assert best == "continuous" and len(calls) == 1 and "(cached " in choice["reason"]
    other = (cfg, model, ["dynamic", "continuous"], PROMPTS[:1], None, torch.device("cpu"))
    generate.auto_path(*other, measure=measure)  # another workload: measured again
    assert len(calls) == 2
    monkeypatch.setattr("train.tools.env.machine_load", lambda: 99.0)
    monkeypatch.setattr("train.tools.decisions.cpu_used_elsewhere", lambda *a: 2.0)
    busy = (cfg, model, ["dynamic", "continuous"], PROMPTS[1:], None, torch.device("cpu"))
    generate.auto_path(*busy, measure=measure)
    generate.auto_path(*busy, measure=measure)
    assert len(calls) == 4  # a busy machine's answer is used, never cached


def test_the_floor_counts_each_weight_once_leaves_out_an_untied_input_table_and_divides_by_the_bandwidth() -> None:
    """A decode step's bytes: tied embeddings once (as the head), an untied input table left out; the TPOT floor at
    batch B is (weights + B x KV at the mean cache length) / bandwidth, the TTFT floor 2 x parameters x mean prompt /
    peak FLOP/s; a path's TPOT p50 over it is its multiple."""
    from train.compat import hf_attn_implementation
    from train.generate.floor import generation_floor, times_floor, weight_bytes_read

    shape = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    attn = {"attn_implementation": hf_attn_implementation()}  # torch 2.1's transformers refuses its SDPA default
    tied = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**shape, tie_word_embeddings=True),
                                                         **attn)
    untied = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**shape, tie_word_embeddings=False), **attn)
    every = sum(p.numel() * 4 for p in untied.parameters())
    table = 100 * 32 * 4
    assert weight_bytes_read(untied) == every - table  # one row of the input table per token: left out
    assert weight_bytes_read(tied) == every - table  # the shared matrix counted once, as the head
    prompts = [[1] * 6, [1] * 10]
    peaks = {"bytes_per_s": 1e9, "flops_per_s": 1e10}
    floor = generation_floor(untied, prompts, 9, 4, peaks)
    kv = 2 * 2 * 2 * 8 * 4 * (8 + (9 - 1) / 2)  # 2 x layers x KV heads x head dim x 4 B at 8 + 4 tokens
    assert floor["kv_bytes_per_request_step"] == pytest.approx(kv)
    assert floor["tpot_floor_ms"]["single"] == pytest.approx((every - table + kv) / 1e9 * 1e3)
    assert floor["tpot_floor_ms"]["batched"] == pytest.approx((every - table + 4 * kv) / 1e9 * 1e3)
    params = sum(p.numel() for p in untied.parameters())
    assert floor["ttft_floor_ms"] == pytest.approx(2 * params * 8 / 1e10 * 1e3)
    assert times_floor({"tpot_ms": {"p50": 3.0}}, 1.5) == 2.0
    assert times_floor({"tpot_ms": {"p50": None}}, 1.5) is None


def test_auto_precision_keeps_16_bits_only_when_measurably_faster_and_within_the_loss_tolerance() -> None:
    from train.generate.decode_choices import greedy_agreement, keep_half
    from train.perf.ab import Ratio

    faster = Ratio("bf16", "fp32", "output_tokens", [1.6, 1.7, 1.8], 1.7, 1.6, 1.8)
    same = Ratio("bf16", "fp32", "output_tokens", [0.9, 1.1, 1.2], 1.1, 0.9, 1.2)
    assert keep_half(faster, 2.0, 2.01)[0] is True
    assert keep_half(faster, 2.0, 2.03) == (False, "held-out loss 2.0300 vs 2.0000 (+1.50%): above the 1% tolerance")
    kept, why = keep_half(same, 2.0, 2.0)
    assert kept is False and "not measurably faster" in why
    assert greedy_agreement([[1, 2, 3], [4, 5]], [[1, 2, 9], [4, 5]]) == {
        "requests": 2, "identical_requests": 1, "tokens": 5, "agreeing_tokens": 4}


def test_auto_precision_is_fp32_by_rule_without_native_16_bits_and_measured_where_forced(monkeypatch) -> None:
    """The decision's input forced: no native bf16 → fp32 without a measurement; a bf16 candidate (emulated here, so
    the speed may go either way) → both dtypes timed and the loss and greedy agreement reported, the choice
    consistent with them. The prompt loss is transformers' own mean loss of one prompt."""
    import train.precision
    from train.generate.decode_choices import choose_precision, half_candidate, prompt_loss
    from train.generate.engines import greedy_config

    cpu = torch.device("cpu")
    monkeypatch.setattr(train.precision, "cpu_native_bf16", lambda: False)
    assert half_candidate(cpu)[0] is None
    monkeypatch.setattr(train.precision, "cpu_native_bf16", lambda: True)
    assert half_candidate(cpu)[0] == "bf16"
    model = _tiny_llama()
    with torch.no_grad():
        ref = float(model(input_ids=torch.tensor([PROMPTS[2]]), labels=torch.tensor([PROMPTS[2]])).loss)
    assert prompt_loss(model, [PROMPTS[2]]) == pytest.approx(ref, rel=1e-5)
    gen = greedy_config(transformers, 4, 2, 0, True)
    chosen, choice = choose_precision(model, cpu, PROMPTS, gen, 2, candidate=(None, "no native bf16"))
    assert chosen == "fp32" and choice["candidate"] is None and "fp32 by rule" in choice["reason"]
    chosen, choice = choose_precision(model, cpu, PROMPTS, gen, 2, candidate=("bf16", "forced"))
    assert choice["candidate"] == "bf16" and set(choice["held_out_loss"]) == {"fp32", "bf16"}
    assert choice["greedy_agreement"]["requests"] == 4 and choice["greedy_agreement"]["tokens"] == 16
    assert len(choice["ratio"]["per_round"]) == 2 and next(model.parameters()).dtype == torch.float32
    faster = choice["ratio"]["verdict"] == "faster"
    within = choice["held_out_loss"]["bf16"] <= 1.01 * choice["held_out_loss"]["fp32"]
    assert chosen == ("bf16" if faster and within else "fp32"), choice["reason"]


def test_one_thread_is_kept_for_batch_1_decoding_only_when_measurably_faster(monkeypatch) -> None:
    """The decision's input forced: a ``serve`` whose tokens take 1 ms on one thread and 4 ms on more keeps one
    thread; the reverse keeps every thread; the thread count is restored either way; a single thread has nothing to
    choose."""
    import time as time_

    from train.generate import engines
    from train.generate.decode_choices import choose_threads
    from train.generate.figures import RequestTiming

    def fake(one_ms: float, many_ms: float):
        def serve(model, path, prompts, gen, batch_size):
            ms = one_ms if torch.get_num_threads() == 1 else many_ms
            out = []
            for p in prompts:
                t = RequestTiming(sent=time_.perf_counter(), prompt_tokens=len(p))
                for _ in range(4):
                    time_.sleep(ms / 1e3)
                    t.token_times.append(time_.perf_counter())
                out.append(t)
            return out
        return serve

    cpu = torch.device("cpu")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        monkeypatch.setattr(engines, "serve", fake(1.0, 4.0))
        threads, choice = choose_threads(None, cpu, PROMPTS, None, 3)
        assert threads == 1 and choice["ratio"]["verdict"] == "faster" and torch.get_num_threads() == 2
        monkeypatch.setattr(engines, "serve", fake(4.0, 1.0))
        threads, choice = choose_threads(None, cpu, PROMPTS, None, 3)
        assert threads == 2 and "for the single-request runs" in choice["reason"]
        torch.set_num_threads(1)
        assert choose_threads(None, cpu, PROMPTS, None, 3)[0] == 1
    finally:
        torch.set_num_threads(before)


def test_without_a_run_the_installed_smollm2_is_served_by_default(tmp_path, monkeypatch) -> None:
    """``make bench-generate`` without RUN: once ``make models`` installed SmolLM2 under ``data.cache_dir``, its
    shipped config and that directory; before, nothing (the command then asks for a run or a model)."""
    from train.bench import generate
    from train.models import pretrained

    cfg = load_config(None, [f"data.cache_dir={tmp_path}"])
    assert generate.real_model_default(cfg) is None
    d = tmp_path / "models" / "smollm2-135m-instruct"
    d.mkdir(parents=True)
    monkeypatch.setattr(pretrained, "installed", lambda model, cache_dir: d if cache_dir == str(tmp_path) else None)
    path, overrides = generate.real_model_default(cfg)
    assert overrides == [f"model.source=hf:{d}"]
    real = load_config(path, overrides)
    assert real.model.task == "causal-lm" and real.data.wordnet_format == "chat" and real.model.source == f"hf:{d}"
