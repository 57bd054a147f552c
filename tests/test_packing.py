"""Sequence packing: every sample once, rows within capacity, and logits identical to unpacked."""

import contextlib
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from train.data.packing import PackCollate, pack_rows, packed_batches, packed_forward
from train.models.encoder import EncoderClassifier, resolve_spec


@settings(max_examples=50, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=300), cap=st.integers(8, 64), seed=st.integers(0, 3))
def test_pack_rows_exactly_once_within_capacity(lengths, cap, seed) -> None:
    rows = pack_rows(lengths, cap, seed=seed)
    assert Counter(i for r in rows for i in r) == Counter(range(len(lengths)))
    assert all(sum(min(lengths[i], cap) for i in r) <= cap for r in rows)
    assert rows == pack_rows(lengths, cap, seed=seed)
    batches = packed_batches(lengths, cap, 4, seed=seed, epoch=1)
    assert sorted(i for b in batches for r in b for i in r) == list(range(len(lengths)))


def test_packing_is_dense_on_a_realistic_length_distribution() -> None:
    lengths = np.clip(np.random.default_rng(0).lognormal(3.2, 0.45, 5000).astype(int), 3, 128)
    rows = pack_rows(lengths, 128)
    assert lengths.sum() / (128 * len(rows)) > 0.97
    assert pack_rows(lengths, 128, epoch=1) != rows  # rows differ per epoch


def _best_fit_decreasing_rows(lengths: np.ndarray, cap: int) -> int:
    """Rows used by plain best-fit decreasing (the packer before least-slack rows): the bar to beat."""
    rooms: list[int] = []
    for n in sorted(lengths, reverse=True):
        fits = [k for k, r in enumerate(rooms) if r >= n]
        if fits:
            k = min(fits, key=lambda k: rooms[k])
            rooms[k] -= n
        else:
            rooms.append(cap - n)
    return len(rooms)


def test_least_slack_rows_leave_less_padding_than_best_fit_decreasing() -> None:
    # Long-tailed lengths with few short samples: best-fit decreasing uses the short ones up on the gaps the long ones
    # leave and ends with rows of equal medium lengths that cannot be filled (0.994 here); the least-slack rows
    # keep the mix and come within a row or two of the lower bound ceil(tokens / capacity).
    lengths = np.clip(np.random.default_rng(0).lognormal(3.2, 0.5, 4096).astype(int), 4, 128)
    rows = pack_rows(lengths, 128)
    bound = -(-int(lengths.sum()) // 128)
    assert len(rows) <= bound + 2 < _best_fit_decreasing_rows(lengths, 128)
    assert lengths.sum() / (128 * len(rows)) > 0.997


def test_a_short_last_packed_batch_has_its_own_rows_unless_compiled(tiny_cfg) -> None:
    from train.data import make_loader, prepare_data

    rows_seen = {}
    for enabled in ("false", "true"):
        cfg = tiny_cfg("batching.method=packed", "batching.pack_rows=3", f"compile.enabled={enabled}")
        bundle = prepare_data(cfg, None, notice=lambda _m: None)
        loader = make_loader(bundle, "train", cfg, train=True, device=torch.device("cpu"))
        batches = list(loader)
        rows_seen[enabled] = [int(b["input_ids"].shape[0]) for b in batches]
        real = sum(int(b["attention_mask"][r].any()) for b in batches for r in range(b["input_ids"].shape[0]))
        assert real == sum(len(r) for r in loader.batch_sampler._global_plan())  # every row's samples, nothing lost
    eager, compiled = rows_seen["false"], rows_seen["true"]
    assert set(compiled) == {3}  # one static shape for the compiled graph
    assert eager[:-1] == compiled[:-1] and eager[-1] < 3, eager  # the tiny split leaves a short last batch


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_packed_logits_equal_unpacked(pooling: str) -> None:
    torch.manual_seed(0)
    spec = resolve_spec("tiny", 50, 4, 16, 0.0, pooling, num_layers=2, hidden_size=32, num_heads=2, ffn_size=64)
    model = EncoderClassifier(spec).eval()
    rng = np.random.default_rng(0)
    samples = [(np.concatenate([[2], rng.integers(5, 50, n - 2), [3]]).astype(np.int32), k % 4)
               for k, n in enumerate([5, 9, 3, 12, 7, 4, 20])]  # the last one is longer than the capacity
    rows = pack_rows([len(s) for s, _ in samples], 16)
    batch = PackCollate(0, 16, rows_per_batch=len(rows) + 1)([[samples[i] for i in r] for r in rows])
    order = [i for r in rows for i in r]
    assert batch["truncated"] == 1 and batch["input_ids"].shape == (len(rows) + 1, 16)
    with torch.no_grad():
        packed = packed_forward(model, batch["input_ids"], batch["position_ids"], batch["seq_index"], len(order))
        for j, i in enumerate(order):
            ids = (samples[i][0] if len(samples[i][0]) <= 16
                   else np.concatenate([samples[i][0][:15], samples[i][0][-1:]]))
            x = torch.zeros(1, 16, dtype=torch.long)
            x[0, : len(ids)] = torch.from_numpy(ids.astype(np.int64))
            mask = torch.zeros(1, 16, dtype=torch.bool)
            mask[0, : len(ids)] = True
            torch.testing.assert_close(packed[j], model(x, mask)[0], rtol=1e-5, atol=1e-5)
    assert batch["labels"].tolist() == [samples[i][1] for i in order]


# -- packed training (batching.method=packed) ------------------------------------------------------------------

from train.data.packing import PackedBatchSampler  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 70), min_size=1, max_size=250), cap=st.integers(8, 64), rows=st.integers(1, 6),
       window=st.integers(1, 80), world=st.integers(1, 4), drop_last=st.booleans(), seed=st.integers(0, 3))
def test_packed_sampler_exactly_once_or_counted(lengths, cap, rows, window, world, drop_last, seed) -> None:
    samplers = [PackedBatchSampler(lengths, cap, rows, seed=seed, window=window, drop_last=drop_last, world_size=world,
                                   rank=r) for r in range(world)]
    plans = [list(s) for s in samplers]
    assert len({len(p) for p in plans}) == 1 and all(len(p) == len(s) for p, s in zip(plans, samplers))
    seen = Counter(i for plan in plans for batch in plan for _, i in batch)
    s = samplers[0]
    if drop_last:
        assert all(c == 1 for c in seen.values()) and len(seen) + s.dropped_samples == len(lengths)
    else:
        assert set(seen) == set(range(len(lengths))) and sum(seen.values()) - len(lengths) == s.repeated_samples
    for plan in plans:
        for batch in plan:
            by_row = Counter()
            for r, i in batch:
                by_row[r] += min(lengths[i], cap)
            assert max(by_row) < rows and max(by_row.values()) <= cap  # ≤ rows rows, each within capacity


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=150), cut=st.integers(0, 40), seed=st.integers(0, 3))
def test_packed_sampler_resumes_at_any_cut_and_is_deterministic(lengths, cut, seed) -> None:
    def fresh():
        s = PackedBatchSampler(lengths, 48, 2, seed=seed, window=32)
        s.set_epoch(3)
        return s

    expected = list(fresh())
    assert expected == list(fresh())  # same (seed, epoch): same batches
    first = fresh()
    it = iter(first)
    taken = [next(it) for _ in range(min(cut, len(expected)))]
    resumed = PackedBatchSampler(lengths, 48, 2, seed=seed, window=32)
    resumed.load_state_dict(first.state_dict())
    assert taken + list(resumed) == expected
    if len(lengths) > 20:
        other = PackedBatchSampler(lengths, 48, 2, seed=seed, window=32)
        other.set_epoch(4)
        assert list(other) != expected  # another epoch, another order


def test_a_packed_training_run_is_dense_with_one_shape_and_learns(tiny_cfg) -> None:
    import time

    from train.run.training import run_training

    bucketed = run_training(tiny_cfg("train.run_id=b", "train.max_steps=40"), time.perf_counter())
    packed = run_training(tiny_cfg("train.run_id=p", "batching.method=packed", "train.max_steps=40"),
                          time.perf_counter())
    b = packed["batching"]
    assert b["distinct_shapes"] == 1 and b["token_efficiency"] > max(0.9, bucketed["batching"]["token_efficiency"])
    assert b["rows_per_step"] >= 1 and b["samples_per_row"] > 1 and b["pack_len"] == 32
    assert packed["quality"]["eval_accuracy"] > 0.5 and packed["perf"]["train_samples_seen"] > 0


def test_packed_logits_through_the_trainer_inputs_equal_unpacked() -> None:
    from train.data.batch import packed_inputs

    torch.manual_seed(0)
    spec = resolve_spec("tiny", 50, 4, 16, 0.0, "mean", num_layers=2, hidden_size=32, num_heads=2, ffn_size=64)
    model = EncoderClassifier(spec).eval()
    rng = np.random.default_rng(1)
    items = [(r, np.concatenate([[2], rng.integers(5, 50, n - 2), [3]]).astype(np.int32), k % 4)
             for k, (r, n) in enumerate([(0, 5), (0, 9), (1, 3), (1, 12), (2, 7)])]
    batch = PackCollate(0, 16, 3, max_seqs=8).collate_items(items)
    assert batch["samples"] == 5 and batch["labels"].tolist()[5:] == [-100] * 3  # static label slots
    extra = packed_inputs(batch, torch.device("cpu"))
    with torch.no_grad():
        logits = model(batch["input_ids"], batch["attention_mask"], **extra)
        assert logits.shape == (8, 4)
        for j, (_, ids, _) in enumerate(items):
            alone = model(torch.from_numpy(ids.astype(np.int64))[None], torch.ones(1, len(ids), dtype=torch.bool))
            torch.testing.assert_close(logits[j], alone[0], rtol=1e-5, atol=1e-5)


def test_pack_len_above_the_position_table_is_one_clear_error() -> None:
    from train.config import load_config
    from train.errors import UserError

    with pytest.raises(UserError, match="batching.pack_len=256 exceeds data.max_len=128 \\(the position table\\)"):
        load_config(None, ["batching.method=packed", "batching.pack_len=256"])


# -- packed attention paths (model.packed_attention: sdpa-mask | flex | auto; train/data/attention.py) ---------

from train import compat  # noqa: E402
from train.data import attention as attn  # noqa: E402


def _flex_or_skip(backward: bool):
    fns, why = compat.flex_attention_functions("cpu", backward=backward)
    if fns is None:
        pytest.skip(f"flex unavailable: {why}")
    return fns


def _packed_case(path: str, backward: bool):
    torch.manual_seed(0)
    spec = resolve_spec("tiny", 50, 4, 16, 0.0, "mean", num_layers=2, hidden_size=32, num_heads=2, ffn_size=64)
    model = EncoderClassifier(spec).eval()
    if path == "flex":
        model.set_packed_attention("flex", _flex_or_skip(backward))
    rng = np.random.default_rng(2)
    lengths = [5, 9, 3, 12, 7, 4, 16, 2]
    samples = [(np.concatenate([[2], rng.integers(5, 50, n - 2), [3]]).astype(np.int32), k % 4)
               for k, n in enumerate(lengths)]
    rows = pack_rows(lengths, 16)
    batch = PackCollate(0, 16, rows_per_batch=len(rows) + 1)([[samples[i] for i in r] for r in rows])  # + a padding row
    return model, samples, [i for r in rows for i in r], batch


@pytest.mark.parametrize("path", ["sdpa-mask", "flex"])
def test_packed_logits_equal_unpacked_on_both_attention_paths(path: str) -> None:
    model, samples, order, batch = _packed_case(path, backward=False)
    with torch.no_grad():
        packed = packed_forward(model, batch["input_ids"], batch["position_ids"], batch["seq_index"], len(order))
        assert torch.isfinite(packed).all()
        for j, i in enumerate(order):
            alone = model(torch.from_numpy(samples[i][0].astype(np.int64))[None],
                          torch.ones(1, len(samples[i][0]), dtype=torch.bool))
            torch.testing.assert_close(packed[j], alone[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("path", ["sdpa-mask", "flex"])
def test_packed_gradients_equal_unpacked_on_both_attention_paths(path: str) -> None:
    model, samples, order, batch = _packed_case(path, backward=True)
    labels = torch.tensor([samples[i][1] for i in order])
    packed = packed_forward(model, batch["input_ids"], batch["position_ids"], batch["seq_index"], len(order))
    torch.nn.functional.cross_entropy(packed, labels, reduction="sum").backward()
    g_packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    model.set_packed_attention("sdpa-mask")
    total = sum(torch.nn.functional.cross_entropy(model(torch.from_numpy(samples[i][0].astype(np.int64))[None],
                                                        torch.ones(1, len(samples[i][0]), dtype=torch.bool)),
                                                  labels[j : j + 1], reduction="sum") for j, i in enumerate(order))
    total.backward()
    for n, p in model.named_parameters():
        if n != "pos_emb.weight":  # unpacked rows are shorter: the same rows of the table get gradient
            torch.testing.assert_close(g_packed[n], p.grad, rtol=1e-4, atol=1e-5, msg=n)
    torch.testing.assert_close(g_packed["pos_emb.weight"], model.pos_emb.weight.grad, rtol=1e-4, atol=1e-5)


def test_flex_requested_where_unavailable_is_one_line_error(monkeypatch, tiny_cfg) -> None:
    from train.errors import UserError

    monkeypatch.setattr(attn, "flex_attention_functions",
                        lambda device_type, backward=True: (None, "torch 2.1.0 has no FlexAttention (needs ≥ 2.5)"))
    cfg = tiny_cfg("batching.method=packed", "model.packed_attention=flex")
    with pytest.raises(UserError) as info:
        attn.choose_packed_attention(None, None, cfg, None, torch.device("cpu"), compiled=False)
    msg = str(info.value)
    assert "\n" not in msg and "model.packed_attention=flex" in msg and "torch 2.1.0 has no FlexAttention" in msg
    assert "model.packed_attention=sdpa-mask" in msg and torch.__version__ in msg
    cfg = tiny_cfg("batching.method=packed", "model.packed_attention=auto", "model.dropout=0")
    choice = attn.choose_packed_attention(None, None, cfg, None, torch.device("cpu"), compiled=False)
    assert (choice.path, choice.source) == ("sdpa-mask", "rule") and "needs ≥ 2.5" in choice.reason


@pytest.mark.parametrize("speedup, expected", [(1.3, "flex"), (1.0, "flex"), (0.8, "sdpa-mask")])
def test_auto_picks_flex_only_when_it_measures_at_least_as_fast(monkeypatch, tiny_cfg, tmp_path, speedup,
                                                                 expected) -> None:
    from types import SimpleNamespace

    from train.data import prepare_data

    monkeypatch.setattr(attn, "flex_attention_functions", lambda device_type, backward=True: ((object(), object()), ""))
    monkeypatch.setattr(attn, "machine_load", lambda: 0.0)
    cfg = tiny_cfg("batching.method=packed", "model.dropout=0", f"data.cache_dir={tmp_path}")
    bundle = prepare_data(cfg, notice=lambda _m: None)
    spec = resolve_spec("tiny", bundle.vocab_size, bundle.num_classes, cfg.data.max_len, 0.0, num_layers=1,
                        hidden_size=32, num_heads=2, ffn_size=64)
    model, policy = EncoderClassifier(spec), SimpleNamespace(mode="fp32")
    calls = []

    def forced(model, step, batch, device, flex, alt):
        calls.append(batch["input_ids"].shape)
        return {"sdpa-mask": 10.0 * speedup, "flex": 10.0, "speedup": speedup, "repeats": 3,
                "shape": "x".join(map(str, batch["input_ids"].shape))}

    choice = attn.choose_packed_attention(model, policy, cfg, bundle, torch.device("cpu"), False,
                                          probe=contextlib.nullcontext, measure=forced)
    assert (choice.path, choice.source) == (expected, "measured") and f"{speedup:.2f}x" in choice.reason
    assert choice.reason.endswith(f": {expected}") and choice.cache_path and len(calls) == 1
    again = attn.choose_packed_attention(model, policy, cfg, bundle, torch.device("cpu"), False,
                                         probe=contextlib.nullcontext, measure=forced)
    assert (again.path, again.source, len(calls)) == (expected, "cached", 1)
    # dropout > 0: flex would drop attention dropout, so auto keeps sdpa-mask by rule, unmeasured
    ruled = attn.choose_packed_attention(model, policy, tiny_cfg("batching.method=packed", "model.dropout=0.1"), bundle,
                                         torch.device("cpu"), False, probe=contextlib.nullcontext, measure=forced)
    assert (ruled.path, ruled.source, len(calls)) == ("sdpa-mask", "rule", 1)


def test_report_records_the_attention_path_that_ran(tiny_cfg) -> None:
    import time

    from train.run.training import run_training

    report = run_training(tiny_cfg("train.run_id=att", "batching.method=packed", "model.packed_attention=sdpa-mask",
                                   "train.max_steps=3"), time.perf_counter())
    b = report["batching"]
    assert b["attention_path"] == "sdpa-mask" and b["attention_reason"].startswith("requested")
    assert b["attention"]["requested"] == "sdpa-mask" and "block-diagonal" in b["attention"]["detail"]
