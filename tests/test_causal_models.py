"""Causal language models (train/models/causal.py, causal_build.py, ``model.task=causal-lm``): tiny Llama, Qwen2
and GPT-2 built
offline; each packed sample's per-token loss equals its loss alone (fp32, 1e-5), padded batches likewise; the
encoder-directory, vocabulary and position refusals; random-init sizing per preset; a directory's weights and a
checkpoint's config rebuilt. Runs on transformers 5.x (torch 2.13, sdpa) and 4.55 (torch 2.1, eager)."""

from __future__ import annotations

from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import (
    CAUSAL_ATTENTION as ATTENTION,
)
from tests.conftest import (
    CAUSAL_CAPACITY,
    CAUSAL_LENGTHS,
    CAUSAL_ROWS,
    CAUSAL_TINY,
    CAUSAL_VOCAB,
)
from tests.conftest import (
    CAUSAL_KINDS as KINDS,
)
from tests.conftest import (
    causal_samples as _samples,
)
from tests.conftest import (
    packed_causal_batch as _packed_batch,
)
from tests.conftest import (
    tiny_causal_lm as _tiny,
)
from train.compat import hf_attn_implementation, load_state
from train.config import load_config
from train.errors import UserError
from train.models import build_external, model_supports_packing
from train.models.causal import ExternalCausalLM, causal_block_mask
from train.models.causal_build import causal_preset
from train.models.causal_probe import probe_causal_packing

transformers = pytest.importorskip("transformers")

IGNORE = -100
TINY, VOCAB, LENGTHS, ROWS, CAPACITY = CAUSAL_TINY, CAUSAL_VOCAB, CAUSAL_LENGTHS, CAUSAL_ROWS, CAUSAL_CAPACITY


def _alone(model: ExternalCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """Per-token loss [len - 1] of one sample alone (no padding): position t predicts ids[t + 1]."""
    logits = model(ids[None], torch.ones(1, len(ids), dtype=torch.bool))[0]
    return F.cross_entropy(logits[:-1], ids[1:], reduction="none")


def test_block_causal_mask_is_causal_within_samples_and_padding_sees_itself() -> None:
    seq = torch.tensor([[0, 0, 1, 1, 1, -1]])
    m = causal_block_mask(seq)[0]
    assert m[1, 0] and m[1, 1] and not m[0, 1] and not m[2, 1] and m[4, 2] and not m[2, 4]
    assert m[5].tolist() == [False] * 5 + [True] and m.sum(-1).min() >= 1  # no empty softmax row
    assert not causal_block_mask(seq, window=2)[0, 4, 2] and causal_block_mask(seq, window=2)[0, 4, 3]


@pytest.mark.parametrize("adapter", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("path", ["sdpa-mask", "varlen", "eager-mask"])
@pytest.mark.parametrize("attn", ATTENTION)
@pytest.mark.parametrize("kind", KINDS)
def test_packed_per_token_loss_equals_unpacked(kind: str, attn: str, path: str, adapter: bool) -> None:
    model = _tiny(kind, attn)
    if adapter:  # a LoRA adapter (peft) on every projection, B moved off zero so that it changes the logits
        pytest.importorskip("peft")
        from train.config.adapter import AdapterSettings
        from train.models.adapter import attach_adapter

        attach_adapter(model, AdapterSettings(r=4, alpha=8.0), kind)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    ok, reason = probe_causal_packing(model)
    assert ok, reason
    assert kind in reason and attn in reason and ("boolean" if attn == "sdpa" else "additive float") in reason
    assert model.path_available("varlen") is None, model.varlen_reason  # the probe found varlen exact too
    if path == "eager-mask" and attn == "eager":  # the model's own attention is eager: sdpa-mask is that path
        assert "eager already" in model.path_available(path)
        with pytest.raises(ValueError, match="eager already"):
            model.set_packed_attention(path)
        return
    assert model.path_available(path) is None, model.eager_reason
    model.set_packed_attention(path)
    samples = _samples()
    batch = _packed_batch(samples)
    with torch.no_grad():
        logits = model(batch["input_ids"], batch["attention_mask"], position_ids=batch["position_ids"],
                       seq_index=batch["seq_index"], num_seqs=batch["num_seqs"])
        assert logits.shape == (len(ROWS), CAPACITY, VOCAB) and logits.dtype == torch.float32
        every = []
        for r, row in enumerate(ROWS):
            at = 0
            for i in row:
                n = LENGTHS[i]
                got = F.cross_entropy(logits[r, at:at + n - 1], batch["labels"][r, at:at + n - 1], reduction="none")
                want = _alone(model, samples[i])
                torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=f"{kind}/{attn}/{path} sample {i}")
                every.append(want)
                at += n
        # the task's loss (mean over trained targets) over the packed batch = the mean of the unpacked per-token losses
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE)
        torch.testing.assert_close(loss, torch.cat(every).mean(), rtol=0, atol=1e-5)
        assert torch.isfinite(logits).all()  # padding rows included: no NaN


@pytest.mark.parametrize("attn", ATTENTION)
@pytest.mark.parametrize("kind", KINDS)
def test_padded_per_token_loss_equals_unpacked(kind: str, attn: str) -> None:
    model = _tiny(kind, attn)
    samples = _samples()
    t = max(LENGTHS)
    with torch.no_grad():
        for side in ("right", "left"):
            ids = torch.zeros(len(samples), t, dtype=torch.long)
            mask = torch.zeros(len(samples), t, dtype=torch.bool)
            for b, s in enumerate(samples):
                at = 0 if side == "right" else t - len(s)
                ids[b, at:at + len(s)], mask[b, at:at + len(s)] = s, True
            logits = model(ids, mask)
            assert logits.shape == (len(samples), t, VOCAB) and logits.dtype == torch.float32
            for b, s in enumerate(samples):
                at = 0 if side == "right" else t - len(s)
                got = F.cross_entropy(logits[b, at:at + len(s) - 1], s[1:], reduction="none")
                torch.testing.assert_close(got, _alone(model, s), rtol=0, atol=1e-5, msg=f"{kind}/{attn} {side} {b}")


@pytest.mark.parametrize("attn", ATTENTION)
def test_sliding_window_layers_are_packed_with_their_window(attn: str) -> None:
    model = _tiny("qwen2", attn, use_sliding_window=True, sliding_window=4, max_window_layers=1)
    assert model.sliding_window == 4 and "sliding_attention" in model.layer_types
    ok, reason = probe_causal_packing(model)
    assert ok and "sliding window" in reason, reason
    assert "sliding window" in model.path_available("varlen")  # varlen has no window: the block mask only
    with pytest.raises(ValueError, match="varlen"):
        model.set_packed_attention("varlen")
    samples = _samples()
    batch = _packed_batch(samples)
    for path in ("sdpa-mask", "eager-mask") if attn != "eager" else ("sdpa-mask",):
        model.set_packed_attention(path)  # the eager path gets the window in its additive mask too
        with torch.no_grad():
            logits = model(batch["input_ids"], batch["attention_mask"], position_ids=batch["position_ids"],
                           seq_index=batch["seq_index"], num_seqs=batch["num_seqs"])
        for r, row in enumerate(ROWS):
            at = 0
            for i in row:
                n = LENGTHS[i]
                got = F.cross_entropy(logits[r, at:at + n - 1], samples[i][1:], reduction="none")
                with torch.no_grad():
                    want = _alone(model, samples[i])
                torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=path)
                at += n


def test_forward_runs_inside_blocks_context_and_never_passes_labels() -> None:
    model = _tiny("llama", hf_attn_implementation())
    entered, seen = [], {}
    real = model.inner.forward

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    model.inner.forward = spy

    class Ctx:
        def __enter__(self):
            entered.append(True)

        def __exit__(self, *exc):
            return False

    ids = _samples()[0][None]
    model(ids, torch.ones_like(ids, dtype=torch.bool), Ctx)
    assert entered and "labels" not in seen and seen["use_cache"] is False
    model.set_packing(False, "no")
    with pytest.raises(ValueError, match="packed rows are not supported by this model"):
        model(ids, torch.ones_like(ids, dtype=torch.bool), position_ids=torch.arange(ids.shape[1])[None],
              seq_index=torch.zeros_like(ids), num_seqs=1)


# -- building from the run's config (build_external dispatches on model.task) --------------------------------------

def _cfg(*overrides: str):
    return load_config(None, ["model.task=causal-lm", "data.max_len=64", *overrides])


def _bundle(vocab: int = 300) -> SimpleNamespace:
    return SimpleNamespace(vocab_size=vocab, pad_id=0, bounds=[64], num_classes=0)


def test_random_init_is_sized_by_the_preset_per_family() -> None:
    want = {"tiny": (4, 256, 4, 1024, 2), "small": (6, 512, 8, 2048, 4)}
    for preset, (layers, hidden, heads, ffn, kv) in want.items():
        for kind in ("llama", "qwen2"):
            k = causal_preset(transformers, kind, preset, 300, 64, 0)
            assert (k["num_hidden_layers"], k["hidden_size"], k["num_attention_heads"], k["intermediate_size"],
                    k["num_key_value_heads"], k["head_dim"], k["max_position_embeddings"], k["vocab_size"],
                    k["tie_word_embeddings"]) == (layers, hidden, heads, ffn, kv, hidden // heads, 64, 300, True)
        k = causal_preset(transformers, "gpt2", preset, 300, 64, 0)
        assert (k["n_layer"], k["n_embd"], k["n_head"], k["n_inner"], k["n_positions"], k["vocab_size"]) == \
            (layers, hidden, heads, ffn, 64, 300) and "num_key_value_heads" not in k
    # overrides win, and the derived keys follow them
    k = causal_preset(transformers, "llama", "tiny", 300, 64, 0, {"num_attention_heads": 8, "hidden_size": 128})
    assert (k["num_key_value_heads"], k["head_dim"]) == (4, 16)

    torch.manual_seed(0)
    for kind in KINDS:
        model = build_external(_cfg(f"model.source=hf:{kind}", "model.preset=tiny"), _bundle())
        c = model.inner.config
        assert isinstance(model, ExternalCausalLM)
        assert type(model.inner).__name__.endswith(("ForCausalLM", "LMHeadModel"))
        assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.vocab_size) == (4, 256, 4, 300)
        assert c.max_position_embeddings == 64 and c.tie_word_embeddings
        assert model.inner.get_output_embeddings().weight is model.inner.get_input_embeddings().weight
        if kind != "gpt2":
            assert (c.num_key_value_heads, c.head_dim, c.intermediate_size) == (2, 64, 1024)
            assert model.inner.model.layers[0].self_attn.k_proj.out_features == 2 * 64  # grouped-query attention
        else:
            assert c.n_inner == 1024 and model.inner.transformer.h[0].mlp.c_fc.nf == 1024
        assert model.supports_packing, model.packing_reason
        assert model.spec.task == "causal-lm" and (model.spec.hidden_size, model.spec.num_layers) == (256, 4)
        assert model_supports_packing(f"hf:{kind}", task="causal-lm")
        ids = torch.randint(0, 300, (2, 9))
        out = model(ids, torch.ones_like(ids, dtype=torch.bool))
        assert out.shape == (2, 9, 300) and out.dtype == torch.float32


def _save(tmp_path, kind: str, name: str, **config) -> str:
    torch.manual_seed(0)
    c = transformers.AutoConfig.for_model(kind, **config)
    auto = transformers.AutoModelForCausalLM if kind != "bert" else transformers.AutoModelForMaskedLM
    d = tmp_path / name
    auto.from_config(c, attn_implementation=hf_attn_implementation()).save_pretrained(str(d))
    return str(d)


def test_a_model_directory_loads_its_weights_and_a_checkpoint_config_rebuilds_it(tmp_path) -> None:
    d = _save(tmp_path, "llama", "llama-dir", vocab_size=VOCAB, **TINY["llama"])
    ref = transformers.AutoModelForCausalLM.from_pretrained(d, attn_implementation=hf_attn_implementation()).eval()
    cfg = _cfg(f"model.source=hf:{d}")
    model = build_external(cfg, _bundle(VOCAB)).eval()
    assert model.supports_packing, model.packing_reason
    ids = _samples()[2][None]
    with torch.no_grad():
        torch.testing.assert_close(model(ids, torch.ones_like(ids, dtype=torch.bool)), ref(ids).logits,
                                   rtol=0, atol=1e-5)
    torch.save({"spec": asdict(model.spec)}, tmp_path / "ckpt.pt")
    spec = load_state(str(tmp_path / "ckpt.pt"))["spec"]  # weights_only=True: plain fields
    assert spec == asdict(model.spec)
    again = build_external(cfg, _bundle(VOCAB), hf_config=spec["hf_config"])  # resume: same architecture
    assert asdict(again.spec) == spec
    assert {k: v.shape for k, v in again.state_dict().items()} == {k: v.shape for k, v in model.state_dict().items()}


def test_an_encoder_directory_is_refused_in_one_line(tmp_path) -> None:
    d = _save(tmp_path, "bert", "bert-dir", vocab_size=VOCAB, num_hidden_layers=1, hidden_size=32,
              num_attention_heads=2, intermediate_size=64)
    with pytest.raises(UserError) as info:
        build_external(_cfg(f"model.source=hf:{d}"), _bundle(VOCAB))
    text = str(info.value)
    assert "\n" not in text and d in text and "model_type 'bert'" in text and "an encoder" in text
    assert "model.task=causal-lm needs a decoder-only" in text and "model.task=classification" in text
    with pytest.raises(UserError, match=r"model_type 'bert' is an encoder .*hf:llama") as info:
        build_external(_cfg("model.source=hf:bert"), _bundle(VOCAB))
    assert "\n" not in str(info.value) and not model_supports_packing("hf:bert", task="causal-lm")


def test_a_small_vocabulary_or_position_table_is_refused_in_one_line(tmp_path) -> None:
    d = _save(tmp_path, "gpt2", "gpt2-dir", vocab_size=50, **TINY["gpt2"])
    with pytest.raises(UserError, match=r"vocabulary \(50\) is smaller than the tokenizer's \(300\)") as info:
        build_external(_cfg(f"model.source=hf:{d}"), _bundle(300))
    assert "\n" not in str(info.value)
    with pytest.raises(UserError, match=r"n_positions=64 is below data.max_len=128") as info:
        build_external(_cfg(f"model.source=hf:{d}", "data.max_len=128"), _bundle(50))
    assert "\n" not in str(info.value)
    with pytest.raises(UserError, match="runs Hugging Face decoders only"):
        build_external(_cfg("model.source=python:some.module:make"), _bundle())
