"""Packed rows for Hugging Face encoders and python: models (train/models/packed.py): a packed sample's logits equal
its unpacked logits (fp32, 1e-5) per architecture, training and reporting, and the refusals."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from train.data.packing import PackCollate, pack_rows
from train.errors import UserError
from train.models.packed import HEADS, probe_packing, takes_position_ids
from train.models.wrap import ExternalClassifier, ExternalSpec

transformers = pytest.importorskip("transformers")

SIZES = {"distilbert": dict(n_layers=2, dim=32, n_heads=2, hidden_dim=64)}
DEFAULT = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64)


def _model(kind: str) -> ExternalClassifier:
    from train.compat import hf_attn_implementation

    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(kind, vocab_size=120, max_position_embeddings=80, num_labels=4,
                                            pad_token_id=0, **SIZES.get(kind, DEFAULT))
    inner = transformers.AutoModelForSequenceClassification.from_config(
        cfg, attn_implementation=hf_attn_implementation())
    return ExternalClassifier(inner, ExternalSpec(f"hf:{kind}", 4, 120, 64), "hf")


@pytest.mark.parametrize("kind", sorted(HEADS))
def test_packed_logits_equal_unpacked_per_architecture(kind) -> None:
    model = _model(kind)
    ok, reason = probe_packing(model)
    if takes_position_ids(kind) is not None:  # e.g. DistilBERT on transformers 4.x
        assert not ok and "position_ids" in reason
        return
    assert ok, reason
    rng = np.random.default_rng(1)
    samples = [rng.integers(3, 120, size=int(n)) for n in rng.integers(2, 20, size=12)]
    rows = pack_rows([len(s) for s in samples], 32, seed=0)
    batch = PackCollate(0, 32, len(rows), max_seqs=14)([[(samples[i], 0) for i in row] for row in rows])
    model.eval()
    with torch.no_grad():
        packed = model(batch["input_ids"], batch["attention_mask"], position_ids=batch["position_ids"],
                       seq_index=batch["seq_index"], num_seqs=len(batch["labels"]))
        order = [i for row in rows for i in row]  # label slots in packing order
        for slot, i in enumerate(order):
            ids = torch.from_numpy(samples[i].astype(np.int64))[None]
            alone = model(ids, torch.ones_like(ids, dtype=torch.bool))
            torch.testing.assert_close(packed[slot], alone[0], rtol=0, atol=1e-5, msg=f"{kind} sample {i}")
    assert packed.shape == (14, 4) and torch.equal(packed[len(order):], packed[len(order):] * 0 + packed[-1])


def test_an_hf_model_trains_packed_rows_with_high_token_efficiency(tiny_cfg) -> None:
    from train.run.training import run_training

    over = ["model.source=hf:bert", "model.hf_overrides={num_hidden_layers: 1, hidden_size: 32, "
            "num_attention_heads: 2, intermediate_size: 64}"]
    report = run_training(tiny_cfg(*over, "batching.method=packed", "train.max_steps=4", "train.run_id=hfp",
                                   "train.precision=fp32"), time.perf_counter())
    b = report["batching"]
    assert report["status"] == "completed" and b["method"] == "packed" and b["token_efficiency"] > 0.9
    assert report["levers"]["packing"]["applied"] and "first token" in report["levers"]["packing"]["reason"]
    assert b["attention_path"] == "sdpa-mask" and "own attention" in b["attention_reason"]


PY_PACKED = '''
import torch
from torch import nn

class Bag(nn.Module):
    supports_packing = True
    def __init__(self, num_classes, vocab_size, max_len, rows=None):
        super().__init__()
        self.emb, self.head, self.rows = nn.Embedding(vocab_size, 8), nn.Linear(8, num_classes), rows
    def forward(self, input_ids, attention_mask, position_ids=None, seq_index=None, num_seqs=None):
        x = self.emb(input_ids)
        if seq_index is None:
            return self.head(x.mean(1))
        n = self.rows if self.rows is not None else num_seqs  # wrong_rows: one row whatever the slots
        return self.head(x.new_zeros(n, x.shape[-1]))

def good(num_classes, vocab_size, max_len):
    return Bag(num_classes, vocab_size, max_len)

def wrong_rows(num_classes, vocab_size, max_len):
    return Bag(num_classes, vocab_size, max_len, rows=1)
'''


def test_python_models_declare_packing_and_wrong_rows_are_one_line(tiny_cfg, tmp_path, monkeypatch) -> None:
    from train.data import prepare_data
    from train.setup import build_model

    (tmp_path / "packed_models.py").write_text(PY_PACKED)
    monkeypatch.syspath_prepend(str(tmp_path))
    bundle = prepare_data(tiny_cfg(), None, notice=lambda *a, **k: None)
    model = build_model(tiny_cfg("model.source=python:packed_models:good"), bundle)
    assert model.supports_packing and "declared" in model.packing_reason
    with pytest.raises(UserError, match=r"python:packed_models:wrong_rows: declares supports_packing but returned "
                                        r"\(1, \d+\) for a packed batch of 3 label slots") as info:
        build_model(tiny_cfg("model.source=python:packed_models:wrong_rows"), bundle)
    assert "\n" not in str(info.value)


def test_a_forward_that_rejects_position_ids_is_refused_with_the_reason() -> None:
    model = _model("bert")
    real = model.inner.bert.forward

    def no_positions(*args, position_ids=None, **kwargs):
        if position_ids is not None:
            raise TypeError("forward() got an unexpected keyword argument 'position_ids'")
        return real(*args, **kwargs)

    model.inner.bert.forward = no_positions
    ok, reason = probe_packing(model)
    assert (not ok and "not exact here" in reason and "position_ids" in reason
            and "BertForSequenceClassification" in reason)
