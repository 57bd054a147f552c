"""Bring your own model (train/models/): tiny Hugging Face models built offline from configs (BERT, DistilBERT,
RoBERTa), a save_pretrained directory round trip, a custom python: model, exact resume on an HF model, the
wrapper's logits against the HF model's own forward, the HF flag aliases, and transformers imported lazily."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import assert_same_final_state
from train.compat import hf_attn_implementation, load_state
from train.config import load_config
from train.data import prepare_data
from train.errors import UserError
from train.models import model_supports_packing, with_model_tokenizer
from train.resume import list_checkpoints
from train.run.training import run_training
from train.setup import build_model, seed_everything

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
SIZES = {"bert": "{num_hidden_layers: 1, hidden_size: 32, num_attention_heads: 2, intermediate_size: 64}",
         "roberta": "{num_hidden_layers: 1, hidden_size: 32, num_attention_heads: 2, intermediate_size: 64}",
         "distilbert": "{n_layers: 1, dim: 32, n_heads: 2, hidden_dim: 64}",
         "albert": "{num_hidden_layers: 1, hidden_size: 32, num_attention_heads: 2, intermediate_size: 64, "
                   "embedding_size: 16}"}
CUSTOM = '''
import torch
from torch import nn

class Bag(nn.Module):
    def __init__(self, num_classes, vocab_size, max_len):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, 16)
        self.head = nn.Linear(16, num_classes)
    def forward(self, input_ids, attention_mask):
        m = attention_mask[..., None].float()
        return self.head((self.emb(input_ids) * m).sum(1) / m.sum(1).clamp_min(1))

def make(num_classes, vocab_size, max_len):
    return Bag(num_classes, vocab_size, max_len)

def wrong_shape(num_classes, vocab_size, max_len):
    return Bag(num_classes + 1, vocab_size, max_len)

def wrong_forward(num_classes, vocab_size, max_len):
    return nn.Linear(4, 3)

class Positions(Bag):
    def __init__(self, num_classes, vocab_size, max_len):
        super().__init__(num_classes, vocab_size, max_len)
        self.pos = nn.Embedding(max_len, 16)
    def forward(self, input_ids, attention_mask):
        return super().forward(input_ids, attention_mask) + self.pos(torch.arange(input_ids.shape[1])).sum() * 0

def short_positions(num_classes, vocab_size, max_len):
    return Positions(num_classes, vocab_size, 8)  # a position table of 8, whatever max_len says
'''


def hf_overrides(kind: str) -> list[str]:
    return [f"model.source=hf:{kind}", f"model.hf_overrides={SIZES[kind]}"]


def test_tiny_hf_models_train_offline_and_report_their_levers(tiny_cfg) -> None:
    for kind in ("bert", "distilbert", "roberta"):
        cfg = tiny_cfg(*hf_overrides(kind), "train.max_steps=4", "train.eval_every=4", f"train.run_id={kind}",
                       "train.precision=fp32")
        report = run_training(cfg, time.perf_counter())
        assert report["status"] == "completed"
        m = report["model"]
        assert (m["source"] == f"hf:{kind}" and m["hf_model_type"] == kind
                and m["class"].endswith("ForSequenceClassification"))
        inner = transformers.AutoConfig.for_model(kind, **{"num_labels": report["data"]["num_classes"]})
        assert inner.num_labels == report["data"]["num_classes"]
        assert 1000 < m["parameters"] < 200_000  # the tiny override, not the preset's 4 x 256
        levers = report["levers"]
        assert levers["buckets"]["applied"] and not levers["packing"]["applied"]
        packs = model_supports_packing(f"hf:{kind}")  # distilbert on transformers 4.x: no position_ids
        assert ("can run packed rows" if packs else "supports_packing is false") in levers["packing"]["reason"]
        assert levers["bench"]["applied"] and ("; not " in levers["bench"]["reason"]) != packs
        assert levers["precision"]["applied"] is False and levers["clipping"]["applied"] is True
        perf = report["perf"]  # FLOPs counted for any model: MFU filled in
        assert perf["flops_per_step_mean"] > 0 and perf["flops_method"].startswith("FlopCounterMode on one real")
        assert perf["mfu"] is not None or perf["mfu_unavailable_reason"], perf
        state = load_state(str(Path(report["run_dir"]) / "checkpoint.pt"))  # weights_only=True
        assert json.loads(state["spec"]["hf_config"])["model_type"] == kind


def test_preset_sizes_map_to_each_architectures_keys(tiny_cfg) -> None:
    from train.models.hf import preset_sizes

    assert preset_sizes("distilbert", "tiny") == {"n_layers": 4, "dim": 256, "n_heads": 4, "hidden_dim": 1024}
    assert preset_sizes("bert", "small") == {"num_hidden_layers": 6, "hidden_size": 512, "num_attention_heads": 8,
                                             "intermediate_size": 2048}
    cfg = tiny_cfg("model.source=hf:bert", "model.preset=tiny")
    bundle = prepare_data(cfg, None)
    model = build_model(cfg, bundle)
    c = model.inner.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.intermediate_size) == (4, 256, 4, 1024)
    assert (c.vocab_size, c.num_labels, c.pad_token_id) == (bundle.vocab_size, bundle.num_classes, bundle.pad_id)


def _padded_vs_alone(model, bundle, cfg) -> None:
    from train.data import make_loader

    loader = make_loader(bundle, "validation", cfg, train=False, device=torch.device("cpu"))
    model.eval()
    checked = 0
    with torch.no_grad():
        for batch in loader:
            ids, mask = batch["input_ids"], batch["attention_mask"]
            assert mask.dtype == torch.bool
            ours = model(ids, mask)  # padded to the bucket bound
            assert ours.dtype == torch.float32
            for i in range(ids.shape[0]):
                n = int(mask[i].sum())
                if n == 0:
                    continue  # a fill row of evaluation (label -100)
                own = model.inner(input_ids=ids[i:i + 1, :n]).logits  # the HF model's own forward, unpadded
                torch.testing.assert_close(ours[i:i + 1], own, rtol=0, atol=1e-6)
                checked += 1
    assert checked >= 4 and ids.shape[1] > int(mask.sum(1).min())  # some rows really were padded


@pytest.mark.parametrize("kind", ["bert", "distilbert", "roberta"])
def test_wrapper_logits_equal_the_hf_forward_on_padded_bucketed_batches(tiny_cfg, kind) -> None:
    cfg = tiny_cfg(*hf_overrides(kind), "train.precision=fp32")
    bundle = prepare_data(cfg, None)
    seed_everything(0)
    _padded_vs_alone(build_model(cfg, bundle), bundle, cfg)


def _save_tiny_bert(tmp_path: Path, tiny_cfg, num_labels: int, tokenizer: bool = True) -> tuple[Path, object]:
    """A save_pretrained directory of a tiny BERT (+ the project's trained tokenizer.json), and its model."""
    cfg = tiny_cfg()
    bundle = prepare_data(cfg, None)
    d = tmp_path / "my-bert"
    config = transformers.BertConfig(vocab_size=bundle.vocab_size, hidden_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=64, num_labels=num_labels,
                                     pad_token_id=bundle.pad_id, max_position_embeddings=64)
    torch.manual_seed(1)
    model = transformers.AutoModelForSequenceClassification.from_config(
        config, attn_implementation=hf_attn_implementation())
    model.save_pretrained(d)
    if tokenizer:
        (d / "tokenizer.json").write_text(Path(bundle.tokenizer_info["path"]).read_text())
    return d, model


def test_save_pretrained_directory_round_trip(tiny_cfg, tmp_path) -> None:
    n = prepare_data(tiny_cfg(), None).num_classes
    d, saved = _save_tiny_bert(tmp_path, tiny_cfg, n)
    cfg = tiny_cfg(f"model.source=hf:{d}", "train.max_steps=3", "train.run_id=dir", "train.precision=fp32")
    assert cfg.data.tokenizer_path is None  # reading the config reads no model file
    assert with_model_tokenizer(cfg).data.tokenizer_path == str(d / "tokenizer.json")  # the directory's tokenizer
    bundle = prepare_data(cfg, None)
    loaded = build_model(cfg, bundle)
    mine = loaded.inner.state_dict()
    theirs = saved.state_dict()
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs if "classifier" not in k)  # the saved weights
    report = run_training(cfg, time.perf_counter())
    assert report["data"]["tokenizer"]["source"] == "user"  # data.tokenizer_path, the directory's file
    assert report["model"]["source"] == f"hf:{d}"


def test_num_labels_mismatch_resizes_the_head_when_asked(tiny_cfg, tmp_path, capsys) -> None:
    d, saved = _save_tiny_bert(tmp_path, tiny_cfg, num_labels=3)
    cfg = tiny_cfg(f"model.source=hf:{d}", "model.num_labels_mismatch=resize")
    bundle = prepare_data(cfg, None)
    model = build_model(cfg, bundle)
    assert "num_labels 3 →" in capsys.readouterr().err  # a notice: stderr, like every other notice
    assert model.inner.classifier.out_features == bundle.num_classes
    assert torch.equal(model.inner.bert.embeddings.word_embeddings.weight,
                       saved.bert.embeddings.word_embeddings.weight)  # the body keeps its weights


def test_a_headless_bert_model_directory_gets_a_new_head_without_a_refusal(tiny_cfg, tmp_path, capsys) -> None:
    """A ``BertModel`` save (all-MiniLM-L6-v2's layout: no head, config num_labels 2) is not a label mismatch."""
    cfg0 = tiny_cfg()
    bundle0 = prepare_data(cfg0, None)
    d = tmp_path / "minilm-like"
    config = transformers.BertConfig(vocab_size=bundle0.vocab_size, hidden_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=64, pad_token_id=bundle0.pad_id,
                                     max_position_embeddings=64)
    torch.manual_seed(1)
    body = transformers.AutoModel.from_config(config, attn_implementation=hf_attn_implementation())
    body.save_pretrained(d)
    (d / "tokenizer.json").write_text(Path(bundle0.tokenizer_info["path"]).read_text())
    assert json.loads((d / "config.json").read_text())["architectures"] == ["BertModel"]
    cfg = tiny_cfg(f"model.source=hf:{d}")  # num_labels_mismatch left at its default (refuse)
    bundle = prepare_data(cfg, None)
    model = build_model(cfg, bundle)
    assert "has no sequence-classification head" in capsys.readouterr().err
    assert model.inner.classifier.out_features == bundle.num_classes
    assert torch.equal(model.inner.bert.embeddings.word_embeddings.weight, body.embeddings.word_embeddings.weight)


def test_custom_python_model_trains(tiny_cfg, tmp_path, monkeypatch) -> None:
    (tmp_path / "my_models.py").write_text(CUSTOM)
    monkeypatch.syspath_prepend(str(tmp_path))
    report = run_training(tiny_cfg("model.source=python:my_models:make", "train.max_steps=5", "train.run_id=py"),
                          time.perf_counter())
    assert report["model"]["class"] == "Bag" and report["model"]["parameters"] > 0
    assert report["perf"]["flops_per_step_mean"] > 0 and "FlopCounterMode" in report["perf"]["flops_method"]
    assert report["quality"]["evals"] and report["quality"]["final_train_loss"] is not None
    bundle = prepare_data(tiny_cfg(), None)
    with pytest.raises(UserError, match=rf"forward returned \(2, {bundle.num_classes + 1}\), expected float logits"):
        build_model(tiny_cfg("model.source=python:my_models:wrong_shape"), bundle)


def test_packing_is_refused_for_an_architecture_without_a_known_head(tiny_cfg) -> None:
    cfg = tiny_cfg(*hf_overrides("albert"), "batching.method=packed")  # an architecture without a known head
    with pytest.raises(UserError, match=r"model.source=hf:albert cannot run packed rows: "
                                        r"AlbertForSequenceClassification .*no known pooling path"):
        run_training(cfg, time.perf_counter())
    assert not any(Path(cfg.train.output_dir).glob("*/config.yaml"))  # refused before training: no run left behind


def test_resume_on_an_hf_model_is_bit_identical(wndb, tmp_path) -> None:
    from tests.conftest import tiny_overrides

    overrides = tiny_overrides(wndb, tmp_path, *hf_overrides("bert"), "train.max_steps=12", "train.log_every=1",
                               "train.precision=fp32")
    run_training(load_config(None, overrides + ["train.run_id=ref"]), time.perf_counter())
    cfg = load_config(None, overrides + ["train.run_id=mid", "train.checkpoint_every=5"])
    run_training(cfg, time.perf_counter())
    run_dir = tmp_path / "runs" / "mid"
    (run_dir / "checkpoint.pt").unlink()
    (run_dir / "report.json").unlink()
    report = run_training(cfg, time.perf_counter(), resume=str(list_checkpoints(run_dir)[0]))
    assert report["resumed_from"]["step"] == 5
    assert_same_final_state(tmp_path / "runs" / "ref", run_dir)


def test_hf_flag_names_map_to_project_keys_with_one_notice_each(capsys) -> None:
    cfg = load_config(None, ["bf16=true", "group_by_length=true", "per_device_train_batch_size=16",
                             "learning_rate=5e-5", "max_grad_norm=0.5", "num_train_epochs=2", "max_steps=100",
                             "report_to=none", "torch_compile=true"])
    err = capsys.readouterr().err
    assert err.count("notice: Hugging Face flag") == 9 and err.count("\n") == 9
    assert (cfg.train.precision, cfg.batching.method, cfg.batching.batch_size, cfg.batching.max_tokens) == \
        ("bf16", "optimal", 16, None)
    assert (cfg.optim.lr, cfg.clip.max_norm, cfg.train.epochs, cfg.train.max_steps) == (5e-5, 0.5, 2.0, 100)
    assert (cfg.tracking.wandb, str(cfg.compile.enabled).lower()) == ("off", "true")
    assert load_config(None, ["fp16=true", "max_grad_norm=0", "max_steps=-1"]).clip.method == "none"
    with pytest.raises(UserError, match="Did you mean the Hugging Face flag 'learning_rate'"):
        load_config(None, ["learning_rat=1e-3"])
    with pytest.raises(UserError, match="report_to=.*expected wandb or none"):
        load_config(None, ["report_to=tensorboard"])


def test_importing_train_does_not_import_transformers() -> None:
    code = ("import sys, train.cli, train.run.training, train.config, train.models; "
            "print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_bench_vs_hf_runs_both_sides_on_equal_samples(wndb, tmp_path) -> None:
    pytest.importorskip("accelerate")
    from tests.conftest import tiny_overrides
    from train.bench.vs_hf import run_bench_vs_hf

    cfg = load_config(str(ROOT / "configs" / "bench-vs-hf.yaml"), tiny_overrides(
        wndb, tmp_path, *hf_overrides("bert"), "data.max_samples=null", "batching.max_tokens=128",
        "train.max_steps=null", "bench.rounds=1", "bench.warmup_runs=1", "train.run_id=vs", "train.precision=fp32"))
    result = run_bench_vs_hf(cfg, notice=lambda *_: None)
    for s in result["sides"].values():  # the untimed warm-up run is kept apart: not in the timed runs' medians
        assert len(s["warmup_runs"]) == 1 and len(s["runs"]) == 1 and s["warmup_runs"][0] is not s["runs"][0]
        assert "peak_memory_bytes" not in s["warmup_runs"][0] and s["runs"][0]["peak_memory_bytes"] > 0
    hf, ours = (result["sides"][s]["median"] for s in ("hf-trainer", "this-project"))
    n = result["train_samples"]
    assert hf["samples_seen"] == ours["samples_seen"] == n  # one epoch each: equal samples seen
    for side in (hf, ours):
        assert side["samples_per_s"] > 0 and side["tokens_per_s"] > side["samples_per_s"]
        assert 0 <= side["eval_accuracy"] <= 1 and side["peak_memory_bytes"] > 0 and side["time_to_first_step_s"] > 0
    assert result["speedup_samples_per_s"] == pytest.approx(ours["samples_per_s"] / hf["samples_per_s"])
    assert result["speedup_median_of_rounds"] == pytest.approx(result["speedup_per_round"][0])  # one round
    assert (tmp_path / "runs" / "vs" / "bench-vs-hf.md").read_text().count("| hf-trainer |") == 1


def test_bench_vs_hf_on_a_causal_lm_runs_both_hf_configurations_warm_and_cold(wndb, tmp_path) -> None:
    """A causal LM: the HF Trainer padded (length grouping) and padding-free (DataCollatorWithFlattening), this
    project and all levers, on equal samples and equal real tokens; the held-out loss per target token for each;
    the headline against the faster HF configuration; the cold comparison in fresh processes."""
    pytest.importorskip("accelerate")
    from tests.conftest import tiny_overrides
    from train.bench.vs_hf import HF_PADDING_FREE, run_bench_vs_hf

    cfg = load_config(str(ROOT / "configs" / "bench-vs-hf-causal.yaml"), tiny_overrides(
        wndb, tmp_path, "data.max_samples=null", "batching.max_tokens=128", "train.max_steps=null", "bench.rounds=1",
        "bench.warmup_runs=0", "bench.cold_runs=1", "train.run_id=vsc", "train.precision=fp32"))
    result = run_bench_vs_hf(cfg, notice=lambda *_: None)
    sides = result["sides"]
    assert list(sides) == ["hf-trainer", HF_PADDING_FREE, "this-project", "all-levers"]
    n = result["train_samples"]
    for name, side in sides.items():
        m = side["median"]
        assert m["samples_seen"] == n, name
        assert m["eval_loss"] > 0 and 0 <= m["eval_accuracy"] <= 1 and m["tokens_per_s"] > 0, name
    headline = result["causal"]
    assert headline["faster_hf_configuration"] in ("hf-trainer", HF_PADDING_FREE)
    assert headline["all-levers"]["tokens_per_s_ratio"]["median"] > 0
    ran = sides["all-levers"]["runs"][0]  # all levers: the chunked loss where the step measures no slower (auto)
    assert result["all_levers"]["levers"]["model.chunked_loss"] == "auto" and ran["chunked_loss"] in (True, False)
    assert ran["packed_attention"] in ("sdpa-mask", "varlen", "eager-mask")  # auto: whichever measured fastest
    assert sides["this-project"]["runs"][0]["packed_attention"] is None
    cold = result["cold"]
    assert cold["repeats"] == 1 and set(cold["median_tokens_per_s"]) == set(sides)
    seen = {name: runs[0]["tokens_seen"] for name, runs in cold["runs"].items()}
    assert len(set(seen.values())) == 1, seen  # every side trains the same real tokens in its one epoch
    assert all(runs[0]["process_s"] > 0 for runs in cold["runs"].values())
    text = (tmp_path / "runs" / "vsc" / "bench-vs-hf.md").read_text()
    assert "| hf-padding-free |" in text and "(the faster HF configuration)" in text and "cold this-project" in text
    assert f"ran: packed_attention {ran['packed_attention']}, chunked_loss {ran['chunked_loss']}" in text


def _cli_error(argv: list[str], capsys) -> str:
    """``python -m train train …`` on ``argv`` through :func:`train.cli.main`: exit 2 and exactly one line on stderr."""
    from train.cli import main

    capsys.readouterr()
    code = main(["train", *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("damage", ["truncated-safetensors", "garbage-bin"])
def test_a_corrupt_weights_file_is_one_line_naming_the_file(tiny_cfg, wndb, tmp_path, capsys, damage) -> None:
    from tests.conftest import tiny_overrides

    n = prepare_data(tiny_cfg(), None).num_classes
    d, _ = _save_tiny_bert(tmp_path, tiny_cfg, n)
    weights = d / "model.safetensors"
    if damage == "garbage-bin":
        weights.unlink()
        weights = d / "pytorch_model.bin"
        weights.write_bytes(b"not a checkpoint at all" * 40)
    else:
        weights.write_bytes(weights.read_bytes()[:100])
    err = _cli_error(tiny_overrides(wndb, tmp_path, f"model.source=hf:{d}", "train.run_id=corrupt"), capsys)
    assert f"cannot read the weights file {weights}" in err and "re-save the model with save_pretrained" in err


def test_weights_of_another_shape_name_the_parameter_and_both_shapes(tiny_cfg, wndb, tmp_path, capsys) -> None:
    from tests.conftest import tiny_overrides

    bundle = prepare_data(tiny_cfg(), None)
    d, _ = _save_tiny_bert(tmp_path, tiny_cfg, bundle.num_classes)  # hidden_size 32
    raw = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**raw, "hidden_size": 48}))
    err = _cli_error(tiny_overrides(wndb, tmp_path, f"model.source=hf:{d}", "train.run_id=wmis"), capsys)
    v = bundle.vocab_size
    assert f"bert.embeddings.word_embeddings.weight is [{v}, 32] in model.safetensors but [{v}, 48] by config.json" \
        in err and "fix config.json or re-save the model with save_pretrained" in err


def test_a_base_model_without_a_head_gets_one_with_a_notice(tiny_cfg, tmp_path, capsys) -> None:
    d, with_head = _save_tiny_bert(tmp_path, tiny_cfg, prepare_data(tiny_cfg(), None).num_classes)
    with_head.bert.save_pretrained(d)  # a BertModel save: no classifier
    cfg = tiny_cfg(f"model.source=hf:{d}")
    capsys.readouterr()
    model = build_model(cfg, prepare_data(cfg, None))
    err = capsys.readouterr().err
    assert err.count("newly initialised") == 1 and "classifier.weight" in err and err.startswith("notice: ")
    emb = model.inner.bert.embeddings.word_embeddings.weight
    assert torch.equal(emb, with_head.bert.embeddings.word_embeddings.weight)  # the body keeps its weights


def test_a_slow_tokenizer_is_converted_so_token_ids_match(tiny_cfg, tmp_path, monkeypatch, capsys) -> None:
    from tokenizers import Tokenizer

    monkeypatch.chdir(tmp_path)  # the converted tokenizer.json goes to data.cache_dir's default, relative
    d, _ = _save_tiny_bert(tmp_path, tiny_cfg, 3, tokenizer=False)
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "dog", "cat", "run", "##s", "the", "a"]
    (d / "vocab.txt").write_text("\n".join(words) + "\n")  # what a 4.x BertTokenizer.save_pretrained writes
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer", "do_lower_case": True}))
    slow = transformers.BertTokenizer.from_pretrained(str(d))  # 4.x: the slow Python tokenizer itself
    capsys.readouterr()
    cfg = with_model_tokenizer(tiny_cfg(f"model.source=hf:{d}"))
    err = capsys.readouterr().err
    assert err.count("has no tokenizer.json: converted its") == 1, err
    tok = Tokenizer.from_file(cfg.data.tokenizer_path)
    assert tok.encode("the dogs run").ids == slow("the dogs run")["input_ids"] == [2, 9, 5, 8, 7, 3]
    for i, bad in enumerate(({"tokenizer_class": "NoSuchTokenizerAtAll"}, None)):  # unknown class; no vocab.txt
        d2 = d.rename(tmp_path / f"copy{i}")
        if bad:
            (d2 / "tokenizer_config.json").write_text(json.dumps(bad))
        else:
            (d2 / "vocab.txt").unlink()
        with pytest.raises(UserError, match=r"has tokenizer files but no tokenizer.json.*tokenizer.save_pretrained") \
                as e:
            with_model_tokenizer(tiny_cfg(f"model.source=hf:{d2}"))
        assert "\n" not in str(e.value)
        d = d2


def test_a_python_model_is_probed_at_the_longest_length(tiny_cfg, tmp_path, monkeypatch) -> None:
    (tmp_path / "my_models.py").write_text(CUSTOM)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = tiny_cfg("model.source=python:my_models:short_positions")  # data.max_len=32, the model takes 8
    with pytest.raises(UserError, match=r"forward\(input_ids LongTensor\[2, 32\].*failed \(IndexError") as e:
        build_model(cfg, prepare_data(cfg, None))
    assert "\n" not in str(e.value)


def test_bench_skips_rows_the_model_cannot_run_and_says_why(tiny_cfg, capsys) -> None:
    from train.bench.suite import run_bench_suite

    quick = ("bench.warmup_steps=1", "bench.rounds=1", "bench.window=1", "bench.skip_inference=true")
    cfg = tiny_cfg(*hf_overrides("albert"), "bench.configs=optimized,optimized-packed", "train.run_id=b", *quick)
    result = run_bench_suite(cfg, notice=print)
    assert [r["name"] for r in result["training"]["configs"]] == ["optimized"]
    on_disk = json.loads((Path(cfg.train.output_dir) / "b" / "bench" / "bench.json").read_text())
    assert "optimized-packed" not in {r["name"] for r in on_disk["training"]["configs"]}
    assert "supports_packing is false" in on_disk["training"]["skipped"]["optimized-packed"]
    assert capsys.readouterr().out.count("bench: skipping row optimized-packed") == 1
    with pytest.raises(UserError, match=r"row optimized-packed needs packed batches, which model.source=hf:albert "
                                        r"cannot run .*bench.configs=optimized"):
        run_bench_suite(tiny_cfg(*hf_overrides("albert"), "bench.configs=optimized-packed", "train.run_id=b2", *quick))


def test_precision_flags_false_do_not_override_the_other_and_both_true_is_refused(tiny_cfg) -> None:
    from train.bench.training import arm_config
    from train.config.hf_aliases import expand_hf_alias

    assert load_config(None, ["bf16=true", "fp16=false"]).train.precision == "bf16"
    assert load_config(None, ["fp16=true", "bf16=false"]).train.precision == "fp16"
    assert load_config(None, ["train.precision=fp32", "bf16=false"]).train.precision == "fp32"
    assert load_config(None, ["train.precision=bf16", "bf16=false"]).train.precision == "fp32"  # the command line too
    with pytest.raises(UserError, match="bf16=true was given too"):
        load_config(None, ["bf16=true", "fp16=true"])
    base = tiny_cfg("train.precision=bf16")
    assert arm_config(base, ["bf16=false"]).train.precision == "fp32"  # false of the current dtype: fp32
    assert arm_config(base, ["fp16=false"]).train.precision == "bf16"  # false of another dtype: unchanged
    with pytest.raises(UserError, match="fp16=true was given too; choose one of bf16=true or fp16=true"):
        arm_config(base, ["fp16=true", "bf16=true"])
    flags: dict = {}
    expand_hf_alias("bf16", True, {}, flags)
    with pytest.raises(UserError, match="override fp16=True .*bf16=true was given too"):
        expand_hf_alias("fp16", True, {}, flags)


def test_lever_reasons_print_null_not_none(tiny_cfg) -> None:
    from types import SimpleNamespace

    from train.bench.rows import skip_reasons
    from train.report.levers import levers_section

    cfg = tiny_cfg("batching.max_tokens=null")
    policy = SimpleNamespace(mode="fp32", source="config", reason="asked")
    levers = levers_section(cfg, torch.nn.Linear(2, 2), policy, None, SimpleNamespace(enabled=False), False,
                            skip_reasons(cfg))
    assert "batching.max_tokens=null" in levers["token_budget"]["reason"] and "None" not in str(levers)


def test_an_unknown_hf_override_key_is_refused_with_the_nearest_known_one(tiny_cfg) -> None:
    """transformers keeps an unknown config key as an attribute nothing reads: the typo would change nothing."""
    for source in ("hf:bert", "hf:distilbert"):
        cfg = tiny_cfg(f"model.source={source}", "model.hf_overrides={num_hiden_layers: 1}")
        with pytest.raises(UserError, match=r"model.hf_overrides: unknown key\(s\) for .*'num_hiden_layers'"):
            build_model(cfg, prepare_data(cfg, None))
    cfg = tiny_cfg("model.task=causal-lm", "model.source=hf:llama", "model.hf_overrides={num_hiden_layers: 1}",
                   "data.vocab_size=300")
    with pytest.raises(UserError, match=r"'num_hiden_layers': did you mean 'num_hidden_layers'\?"):
        build_model(cfg, prepare_data(cfg, None))
