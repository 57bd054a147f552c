"""The memory-bounded LM loss (train/tasks/chunked_loss.py, ``model.chunked_loss``): the chunked head +
cross-entropy equals the unchunked one (loss and every gradient, fp32, 1e-5) at any chunk size, with untrained
targets and a bias; a whole decoder's training step through the wrapper's hidden-state path equals its logits path
(per architecture, packed rows); the resolve decision (forced measurements: no timing asserted) and its refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from train.config import load_config
from train.errors import UserError
from train.models.causal_probe import probe_causal_packing, probe_loss_head
from train.perf.probe_budget import ProbeBudget
from train.tasks import task_for
from train.tasks.base import LossHead
from train.tasks.chunked_loss import (
    IGNORE_INDEX,
    chunk_rows,
    chunked_cross_entropy,
    decide_chunked_loss,
)

transformers = pytest.importorskip("transformers")

from tests.conftest import CAUSAL_ATTENTION as ATTENTION  # noqa: E402
from tests.conftest import CAUSAL_KINDS as KINDS  # noqa: E402
from tests.conftest import CAUSAL_VOCAB  # noqa: E402
from tests.conftest import causal_samples as _samples  # noqa: E402
from tests.conftest import packed_causal_batch as _packed_batch  # noqa: E402
from tests.conftest import tiny_causal_lm as _tiny  # noqa: E402


def _grads(loss: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, tensors))


@pytest.mark.parametrize("rows", [1, 5, 8, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_equals_unchunked_loss_and_gradients(rows: int, bias: bool) -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=bias)
    hidden = torch.randn(3, 13, 16, requires_grad=True)
    targets = torch.randint(0, 50, (3, 13))
    targets[:, -1] = IGNORE_INDEX
    targets[1, :4] = IGNORE_INDEX
    wrt = [hidden, *head.parameters()]
    got = chunked_cross_entropy(hidden, head, targets, rows=rows)
    want = F.cross_entropy(head(hidden).flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
    assert abs(float(got.detach()) - float(want.detach())) < 1e-5
    for g, w in zip(_grads(got, wrt), _grads(want, wrt)):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_no_trained_target_gives_zero_loss_and_zero_gradients() -> None:
    head = torch.nn.Linear(8, 20)
    hidden = torch.randn(6, 8, requires_grad=True)
    loss = chunked_cross_entropy(hidden, head, torch.full((6,), IGNORE_INDEX), rows=4)
    assert float(loss.detach()) == 0.0
    assert all(float(g.abs().max()) == 0.0 for g in _grads(loss, [hidden, *head.parameters()]))


def test_bf16_matmul_matches_autocast_head_within_bf16_rounding() -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(32, 300, bias=False)
    hidden = torch.randn(40, 32, requires_grad=True)
    targets = torch.randint(0, 300, (40,))
    got = chunked_cross_entropy(hidden, head, targets, torch.bfloat16, rows=7)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = head(hidden)
    want = F.cross_entropy(logits.float(), targets)
    assert abs(float(got.detach()) - float(want.detach())) < 1e-3 * float(want.detach())
    (g_got,), (g_want,) = _grads(got, [hidden]), _grads(want, [hidden])
    assert float((g_got - g_want).abs().max()) < 2e-2 * float(g_want.abs().max())


def test_chunk_rows_follow_the_hidden_size_rule() -> None:
    assert chunk_rows(2048, 256, 32000) == 256  # Liger's ceil(2048 / ceil(32000 / 256)) = 17 → 32; floor 256
    assert chunk_rows(2 ** 16, 256, 32000) == 1024  # Liger's: ceil(65536 / 125) = 525 → 1024, above the floor
    assert chunk_rows(2048, 256, 256) == 2048
    assert chunk_rows(2048, 200, 32000) == 256  # the floor is the next power of two of the hidden size
    assert chunk_rows(1, 8, 10**6) == 8


@pytest.mark.parametrize("attn", ATTENTION)
@pytest.mark.parametrize("kind", KINDS)
def test_a_decoder_step_through_hidden_states_equals_the_logits_step(kind: str, attn: str) -> None:
    """Packed rows, fp32: the task's loss on the wrapper's hidden states + its head equals the loss on its logits,
    and so does every parameter's gradient (tied embeddings included)."""
    model = _tiny(kind, attn).train()
    assert probe_causal_packing(model)[0] and probe_loss_head(model)[0]
    batch = _packed_batch(_samples())
    args = (batch["input_ids"], batch["attention_mask"])
    kw = {k: batch[k] for k in ("position_ids", "seq_index", "num_seqs")}
    task, params = task_for("causal-lm"), [p for p in model.parameters() if p.requires_grad]
    want = task.loss(model(*args, **kw), batch["labels"])
    g_want = _grads(want, params)
    model.set_chunked_loss(True)
    out = model(*args, **kw)
    assert out.shape[-1] == model.inner.config.hidden_size  # hidden states, not logits
    got = task.loss(out, batch["labels"], LossHead(model.loss_head(), torch.float32))
    assert abs(float(got.detach()) - float(want.detach())) < 1e-5
    for g, w in zip(_grads(got, params), g_want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)
    model.eval()  # evaluation keeps logits (accuracy needs them)
    assert model(*args, **kw).shape[-1] == model.spec.vocab_size


def _measure(chunked_ms: float, interval=(0.9, 1.1)):
    calls = []

    def measure(model, step, batch, device):
        calls.append(batch["input_ids"].shape)
        return {"unchunked": 10.0, "chunked": chunked_ms, "speedup": 10.0 / chunked_ms, "rounds": 5,
                "speedup_interval": list(interval), "shape": "2x16", "tokens": 32, "vocab": CAUSAL_VOCAB,
                "chunk_rows": 8}
    measure.calls = calls
    return measure


def _auto(model, measure, cache_dir=None, requested="auto", task="causal-lm"):
    import contextlib

    return decide_chunked_loss(requested, task, model, "fp32", torch.device("cpu"), cache_dir=cache_dir,
                               batch=lambda: _packed_batch(_samples()),
                               probe=lambda: contextlib.nullcontext(lambda b: None), measure=measure)


def test_auto_keeps_chunked_unless_the_step_measures_slower(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr("train.tools.env.machine_load", lambda: 0.0)  # a quiet machine: the decision is cached
    model = _tiny("llama", ATTENTION[0])
    kept = _auto(model, _measure(10.4))
    assert kept["applied"] and kept["source"] == "measured" and kept["reason"].endswith(": chunked")
    assert not _auto(model, _measure(12.0))["applied"]  # > 1.05x the unchunked step
    # within the margin at the median but its paired interval wholly below 1.0: measurably slower
    assert not _auto(model, _measure(10.3, interval=(0.93, 0.98)))["applied"]
    assert not _auto(model, None, requested="false")["applied"]
    assert _auto(model, None, requested="true")["applied"]
    # measured once per machine, model, precision and shape: the second run reads the cache
    first = _measure(12.0)
    assert _auto(model, first, tmp_path)["source"] == "measured" and len(first.calls) == 1
    again = _measure(9.0)
    cached = _auto(model, again, tmp_path)
    assert (cached["source"], cached["applied"], len(again.calls)) == ("cached", False, 0)


def test_auto_times_the_whole_training_step_both_ways() -> None:
    """The measurement is the run's step (the probe's ``step``) with the logits whole and chunked, in turn — not the
    head alone, which favoured the chunked loss where the whole step was slower with it — and the model's setting is
    restored after it."""
    from train.tasks.chunked_loss import measure_step_paths

    model = _tiny("llama", ATTENTION[0]).train()
    assert probe_causal_packing(model)[0]
    task, batch = task_for("causal-lm"), _packed_batch(_samples())
    args, kw = (batch["input_ids"], batch["attention_mask"]), {k: batch[k] for k in ("position_ids", "seq_index",
                                                                                      "num_seqs")}
    seen = []

    def step(b: dict) -> None:
        seen.append(model.chunked_loss)
        out = model(*args, **kw)
        head = model.loss_head()
        task.loss(out, b["labels"], None if head is None else LossHead(head, torch.float32)).backward()

    m = measure_step_paths(model, step, batch, torch.device("cpu"), rounds=2)
    assert sorted(set(seen)) == [False, True] and len(seen) == 2 * (1 + 2)
    assert model.chunked_loss is False
    assert m["tokens"] == batch["input_ids"].numel() and m["vocab"] == CAUSAL_VOCAB
    assert m["unchunked"] > 0 and m["chunked"] > 0 and len(m["speedup_interval"]) == 2


def test_refusals_name_the_key_and_the_fix() -> None:
    with pytest.raises(UserError, match=r"model.chunked_loss=true: model.task=classification .* set "
                                        r"model.chunked_loss=auto or false"):
        _auto(torch.nn.Linear(2, 2), None, requested="true", task="classification")
    with pytest.raises(UserError, match=r"model.chunked_loss=true: model.task=classification"):  # before any data
        load_config(None, ["model.chunked_loss=true"])
    assert not _auto(torch.nn.Linear(2, 2), None, task="classification")["applied"]
    model = _tiny("llama", ATTENTION[0])
    model.inner.set_output_embeddings(torch.nn.Sequential(model.inner.get_output_embeddings()))
    ok, why = probe_loss_head(model)
    assert not ok and "not a linear LM head" in why
    with pytest.raises(UserError, match="model.chunked_loss=true: .*not a linear LM head"):
        _auto(model, None, requested="true")
    auto = _auto(model, None)
    assert not auto["applied"] and auto["source"] == "rule"


def test_a_scaled_head_is_found_out_by_the_probe() -> None:
    """A model whose logits are not ``head(last hidden)`` (here: logits scaled after the head) is not chunked."""
    model = _tiny("llama", ATTENTION[0])
    inner_forward = model.inner.forward

    def scaled(*args, **kwargs):
        out = inner_forward(*args, **kwargs)
        out.logits = out.logits * 2.0
        return out

    model.inner.forward = scaled
    ok, why = probe_loss_head(model)
    assert not ok and "not its head applied" in why


@pytest.mark.parametrize("kind", KINDS)
def test_step_flops_count_attention_and_the_head_whatever_the_kernel_and_the_loss(kind: str) -> None:
    """The MFU's FLOPs (``perf.mfu`` is null without them), per family: where the counter cannot see the attention
    kernel (SDPA on CPU) the analytic count equals what it counts through eager attention's matmuls; the chunked
    loss counts the same head matmuls."""
    from train.perf.flops import ModuleFlops

    counts = {}
    for attn in ATTENTION:
        for chunked in (False, True):
            model = _tiny(kind, attn).train()
            probe_causal_packing(model)
            model.set_chunked_loss(chunked)
            flops = ModuleFlops(model, 64)
            assert model.chunked_loss == chunked  # restored after counting
            assert flops.attention_seen or "attention analytic" in flops.method
            counts[attn, chunked] = flops(2, 16)
    assert len(set(counts.values())) == 1, counts
    layers, dims = _tiny(kind, "eager").attention_dims
    assert (layers, dims) == (2, 64)
    assert counts["eager", False] > 2 * 12 * 16 * 16 * dims * layers  # attention and more


def test_the_chunked_loss_decision_takes_the_rule_when_the_budget_says_no() -> None:
    import contextlib

    model = _tiny("llama", ATTENTION[0])
    measure = _measure(9.0)  # would be kept chunked if it were measured

    def decide(total_steps: int) -> dict:
        budget = ProbeBudget(0.1, total_steps, lambda *a, **k: None)
        return decide_chunked_loss("auto", "causal-lm", model, "fp32", torch.device("cpu"),
                                   batch=lambda: _packed_batch(_samples()),
                                   probe=lambda: contextlib.nullcontext(lambda b: None), measure=measure, budget=budget)

    out = decide(30)  # a 30-step run: 3 probe steps allowed, 12 asked
    assert (out["applied"], out["source"], measure.calls) == (False, "rule", [])
    assert "not measured" in out["reason"] and out["reason"].endswith("as transformers computes them)")
    roomy = decide(10_000)
    assert roomy["source"] == "measured" and roomy["applied"] and len(measure.calls) == 1
