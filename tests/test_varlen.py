"""Variable-length attention for packed rows (train/models/varlen.py): the plan finds every sample of a packed
batch and groups them by length; the attention equals the block-causal masked attention on every real token,
forward and gradients, for any packing (hypothesis), grouped-query attention included; padding gets zeros; a
decoder's whole training step through ``varlen`` gives the gradients of the ``sdpa-mask`` path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from train.compat import hf_attn_implementation
from train.models.causal import causal_block_mask
from train.models.varlen import GROUP_ROUND, segments, varlen_attention, varlen_plan


def _rows(lengths_per_row: list[list[int]], capacity: int) -> torch.Tensor:
    seq = torch.full((len(lengths_per_row), capacity), -1, dtype=torch.long)
    for r, lengths in enumerate(lengths_per_row):
        at = 0
        for k, n in enumerate(lengths):
            seq[r, at:at + n] = k
            at += n
    return seq


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
    rep = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                         attn_mask=causal_block_mask(seq)[:, None])
    return out.transpose(1, 2)  # [R, C, H, D]


def test_segments_are_runs_of_one_sample_within_a_row() -> None:
    seq = torch.tensor([[0, 0, 0, 1, 1, -1], [0, 1, 1, 1, 1, 1]])  # sample numbers restart per row
    starts, lengths = segments(seq)
    assert starts.tolist() == [0, 3, 6, 7] and lengths.tolist() == [3, 2, 1, 5]


def test_the_plan_groups_by_rounded_length_and_computes_only_those_pairs() -> None:
    seq = _rows([[20, 3, 5], [17, 40]], 64)
    plan = varlen_plan(seq, round_to=16)
    assert sorted((g.count, g.length) for g in plan.groups) == [(1, 40), (2, 5), (2, 20)]
    assert plan.pairs == 2 * 25 + 2 * 400 + 1600 < 2 * 64 * 64
    assert plan.scatter.shape == (2 * 64,) and GROUP_ROUND > 1


@settings(max_examples=30, deadline=None)
@given(layout=st.lists(st.lists(st.integers(1, 24), min_size=1, max_size=4), min_size=1, max_size=3),
       kv_heads=st.sampled_from([1, 2, 4]), round_to=st.sampled_from([1, 4, 16]))
def test_varlen_equals_the_block_causal_mask_forward_and_backward(layout, kv_heads, round_to) -> None:
    capacity = max([sum(r) for r in layout] + [1]) + 2  # at least two padding tokens per row
    seq = _rows(layout, capacity)
    gen = torch.Generator().manual_seed(sum(map(sum, layout)))
    r = len(layout)
    q = torch.randn(r, 4, capacity, 8, generator=gen, dtype=torch.float64).requires_grad_()
    k = torch.randn(r, kv_heads, capacity, 8, generator=gen, dtype=torch.float64).requires_grad_()
    v = torch.randn(r, kv_heads, capacity, 8, generator=gen, dtype=torch.float64).requires_grad_()
    real = seq >= 0
    got = varlen_attention(q, k, v, varlen_plan(seq, round_to))
    want = _dense(q, k, v, seq)
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-10)
    assert got[~real].abs().max() == 0 if (~real).any() else True
    w = torch.randn(want[real].shape, generator=gen, dtype=torch.float64)
    g_got = torch.autograd.grad((got[real] * w).sum(), (q, k, v))
    g_want = torch.autograd.grad((want[real] * w).sum(), (q, k, v))
    for a, b in zip(g_got, g_want):  # the padding tokens' q/k/v get no gradient through real outputs in either
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def test_a_decoder_training_step_through_varlen_has_the_block_mask_gradients() -> None:
    pytest.importorskip("transformers")
    from tests.conftest import causal_samples, packed_causal_batch, tiny_causal_lm
    from train.models.causal_probe import probe_causal_packing

    model = tiny_causal_lm("llama", hf_attn_implementation())
    assert probe_causal_packing(model)[0] and model.path_available("varlen") is None
    model.train()
    batch = packed_causal_batch(causal_samples())
    grads = {}
    for path in ("sdpa-mask", "varlen"):
        model.set_packed_attention(path)
        model.zero_grad()
        logits = model(batch["input_ids"], batch["attention_mask"], position_ids=batch["position_ids"],
                       seq_index=batch["seq_index"])
        F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100).backward()
        grads[path] = [p.grad.clone() for p in model.parameters()]
    for a, b in zip(grads["sdpa-mask"], grads["varlen"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_varlen_flops_charge_each_sample_group_not_the_row() -> None:
    """The MFU's FLOPs on the varlen path: the step less its attention, plus 12·pairs·D per layer; at pairs = B·S²
    that is the row-dense count, whether the counter saw the attention (eager) or it was added analytically."""
    pytest.importorskip("transformers")
    from tests.conftest import CAUSAL_ATTENTION, tiny_causal_lm
    from train.perf.flops import ModuleFlops

    for attn in CAUSAL_ATTENTION:
        flops = ModuleFlops(tiny_causal_lm("llama", attn).train(), 64)
        dense = flops(2, 16)
        assert flops.without_attention(2, 16) + flops.attention_for_pairs(2 * 16 * 16) == pytest.approx(dense, rel=1e-4)
        assert flops.without_attention(2, 16) < dense
        assert flops.for_step(2, 16, 2 * 16 * 16) == pytest.approx(dense, rel=1e-4)
        assert flops.for_step(2, 16, 0) == dense
        assert flops.for_step(2, 16, 2 * 16) < dense  # a bench row's step on the varlen path: its pairs, not C² a row
        seq = _rows([[20, 31, 25, 40], [64, 18, 22]], 128)  # glosses-like samples in rows of 128
        assert flops.attention_for_pairs(varlen_plan(seq).pairs) < flops.attention_for_pairs(2 * 128 * 128) / 2


def test_plan_pairs_are_the_plans_pairs() -> None:
    from train.models.varlen import plan_pairs

    seq = _rows([[20, 3, 5], [17, 40], [1]], 64)
    for round_to in (1, 8, 16):
        assert plan_pairs(seq, round_to) == varlen_plan(seq, round_to).pairs


def test_the_attention_choice_offers_a_decoder_varlen_and_refuses_what_it_has_not(monkeypatch, tiny_cfg) -> None:
    from types import SimpleNamespace

    from train.data import attention as attn
    from train.errors import UserError

    decoder = SimpleNamespace(packed_attention_paths=("sdpa-mask", "varlen"), set_packed_attention=None,
                              path_available=lambda path: None)
    cpu = torch.device("cpu")
    # the other task's path is refused by the config itself, before any data is prepared
    for task, requested in (("classification", "varlen"), ("causal-lm", "flex")):
        with pytest.raises(UserError) as info:
            tiny_cfg("batching.method=packed", f"model.task={task}", f"model.packed_attention={requested}")
        assert "\n" not in str(info.value) and f"model.packed_attention={requested} is for" in str(info.value)
    # a model without the path (here the built-in encoder: None) is refused by the choice
    cfg = tiny_cfg("batching.method=packed", "model.task=causal-lm", "model.packed_attention=varlen")
    with pytest.raises(UserError, match="model.packed_attention=varlen: .* runs sdpa-mask or flex"):
        attn.choose_packed_attention(None, None, cfg, None, cpu, compiled=False)
    assert attn.choose_packed_attention(decoder, None, cfg, None, cpu, compiled=False).path == "varlen"
    with pytest.raises(UserError, match="compile.enabled=false"):  # per-batch shapes would recompile
        attn.choose_packed_attention(decoder, None, cfg, None, cpu, compiled=True)
    auto = tiny_cfg("batching.method=packed", "model.task=causal-lm", "model.packed_attention=auto")
    ruled = attn.choose_packed_attention(decoder, None, auto, None, cpu, compiled=True)
    assert (ruled.path, ruled.source) == ("sdpa-mask", "rule") and "recompile" in ruled.reason
    windowed = SimpleNamespace(**{**vars(decoder), "path_available": lambda path: "hf:qwen2: a sliding window"})
    ruled = attn.choose_packed_attention(windowed, None, auto, None, cpu, compiled=False)
    assert (ruled.path, ruled.source) == ("sdpa-mask", "rule") and "sliding window" in ruled.reason


def test_auto_times_every_decoder_path_that_runs_and_keeps_the_fastest(monkeypatch, tiny_cfg, tmp_path) -> None:
    """A decoder has three packed paths: ``auto`` times sdpa-mask against each one that runs here (varlen not under
    compile) and keeps the fastest; a path the probe did not find exact is refused in one line when asked for."""
    import contextlib
    from types import SimpleNamespace

    from train.data import attention as attn
    from train.errors import UserError

    why = {"varlen": None, "eager-mask": None}
    decoder = SimpleNamespace(packed_attention_paths=("sdpa-mask", "varlen", "eager-mask"), set_packed_attention=None,
                              path_available=why.get, spec="hf:llama")
    monkeypatch.setattr(attn, "probe_batch", lambda cfg, bundle: {"input_ids": torch.zeros(3, 64, dtype=torch.long),
                                                                 "labels": torch.zeros(3, 64, dtype=torch.long)})
    monkeypatch.setattr(attn, "machine_load", lambda: 0.0)
    cpu, policy, asked = torch.device("cpu"), SimpleNamespace(mode="bf16"), []

    def forced(ms: dict):
        def measure(model, step, batch, device, fns, alts):
            asked.append(alts)
            return {**{p: ms[p] for p in ("sdpa-mask", *alts)}, "repeats": 3, "shape": "3x64"}
        return measure

    times = {"sdpa-mask": 10.0, "varlen": 12.0, "eager-mask": 8.0}
    cfg = tiny_cfg("batching.method=packed", "model.task=causal-lm", f"data.cache_dir={tmp_path / 'a'}")
    choice = attn.choose_packed_attention(decoder, policy, cfg, None, cpu, False, probe=contextlib.nullcontext,
                                          measure=forced(times))
    assert (choice.path, choice.source, asked[-1]) == ("eager-mask", "measured", ("varlen", "eager-mask"))
    assert "eager-mask ran 1.25x the speed of sdpa-mask" in choice.reason and "varlen 12.0 ms" in choice.reason
    # compiled: varlen's per-batch shapes would recompile, so only eager-mask is timed; slower here: sdpa-mask
    choice = attn.choose_packed_attention(decoder, policy, cfg, None, cpu, True, probe=contextlib.nullcontext,
                                          measure=forced({**times, "eager-mask": 11.0}))
    assert (choice.path, asked[-1]) == ("sdpa-mask", ("eager-mask",)) and choice.reason.endswith(": sdpa-mask")
    # requested where the probe found it inexact: one line naming the key and the fix
    why["eager-mask"] = "LlamaForCausalLM: eager-mask logits differ from unpacked by 1.0e-02"
    asked_cfg = tiny_cfg("batching.method=packed", "model.task=causal-lm", "model.packed_attention=eager-mask")
    with pytest.raises(UserError) as info:
        attn.choose_packed_attention(decoder, policy, asked_cfg, None, cpu, False)
    assert "\n" not in str(info.value) and "model.packed_attention=eager-mask: LlamaForCausalLM" in str(info.value)
    # neither other path runs: sdpa-mask by rule, nothing timed
    why["varlen"] = "a sliding window"
    n = len(asked)
    ruled = attn.choose_packed_attention(decoder, policy, tiny_cfg("batching.method=packed", "model.task=causal-lm",
                                                                   f"data.cache_dir={tmp_path / 'b'}"),
                                         None, cpu, False, probe=contextlib.nullcontext, measure=forced(times))
    assert (ruled.path, ruled.source, len(asked)) == ("sdpa-mask", "rule", n) and "sliding window" in ruled.reason
