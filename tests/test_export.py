"""The model leaves in its ecosystem's format (train/models/export.py) and LoRA adapters train through peft
(train/models/adapter.py): round trips through transformers' and peft's own loaders, logits within 1e-5 in fp32,
the tokenizer's ids, and a whole adapter run (only the adapter trains and is checkpointed, exact resume, export)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import (
    CAUSAL_ATTENTION,
    assert_same_final_state,
    run_cli,
    synthetic_rows,
    tiny_causal_lm,
    tiny_overrides,
    write_wndb,
)
from train.compat import hf_attn_implementation
from train.config import load_config
from train.config.adapter import AdapterSettings, parse_adapter
from train.errors import UserError

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

ATOL = 1e-5
ATTN = {"attn_implementation": hf_attn_implementation()}  # torch 2.1.0: eager (transformers refuses SDPA)
TEXTS = ["a small domesticated carnivorous mammal", "the act of running quickly", "an instrument for writing"]
IDS = {"bos_id": 1, "eos_id": 2, "pad_id": 0}


def _perturb(model: torch.nn.Module, seed: int = 1) -> None:
    """Stand in for training: every trainable tensor moved off its initial value (LoRA's B starts at zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, vocab, (2, 9), generator=g)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, 6:] = False  # right padding on the second row
    return ids, mask


def _theirs(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, causal: bool) -> torch.Tensor:
    kwargs = {"input_ids": ids, "attention_mask": mask.long()}
    if causal:  # the wrapper's positions: real tokens counted (the model's own for right padding)
        kwargs["position_ids"] = (mask.long().cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        return model.eval()(**kwargs).logits.float()


def _bpe_tokenizer(path: Path) -> Path:
    from train.data.causal_tokenizer import train_bpe

    tok = train_bpe(TEXTS * 20, 300)
    tok.save(str(path))
    return path


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
def test_an_exported_decoder_loads_with_auto_classes_and_gives_the_runs_logits_and_ids(kind, tmp_path) -> None:
    from train.models.export import export_model

    model = tiny_causal_lm(kind, CAUSAL_ATTENTION[0])
    _perturb(model)
    tok = _bpe_tokenizer(tmp_path / "tokenizer.json")
    block = export_model(model, tmp_path / "model", tok, IDS)
    assert block["format"] == "transformers"
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= set(block["files"])
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "model"), **ATTN)
    ids, mask = _batch(100)
    with torch.no_grad():
        ours = model.eval()(ids, mask)
    assert (ours - _theirs(loaded, ids, mask, True))[mask].abs().max() <= ATOL
    assert loaded.generation_config.eos_token_id == 2 and loaded.generation_config.pad_token_id == 0
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "model"))
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(str(tok))
    for text in TEXTS:
        assert hf_tok(text)["input_ids"] == backend.encode(text).ids
    assert hf_tok.eos_token_id == 2 and hf_tok.pad_token_id == 0 and hf_tok.bos_token_id == 1


def _tiny_bert_classifier(tmp_path: Path, adapter: AdapterSettings | None = None):
    from train.data.tokenizer import train_wordpiece
    from train.models.adapter import attach_adapter
    from train.models.wrap import ExternalClassifier, ExternalSpec

    tok = train_wordpiece(TEXTS * 20, 200)
    tok.save(str(tmp_path / "tokenizer.json"))
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model("bert", vocab_size=tok.get_vocab_size(), hidden_size=32,
                                               num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                               max_position_embeddings=64, num_labels=3, pad_token_id=0)
    inner = transformers.AutoModelForSequenceClassification.from_config(config, **ATTN)
    wrapper = ExternalClassifier(inner, ExternalSpec("hf:bert", 3, tok.get_vocab_size(), 32), "hf")
    if adapter is not None:
        wrapper.adapter_info = attach_adapter(wrapper, adapter, "bert")
    _perturb(wrapper)
    return wrapper.eval(), tok


def test_an_exported_bert_classifier_gives_the_runs_logits_and_the_tokenizers_ids(tmp_path) -> None:
    from train.models.export import export_model

    model, tok = _tiny_bert_classifier(tmp_path)
    export_model(model, tmp_path / "model", tmp_path / "tokenizer.json", {"pad_id": tok.token_to_id("[PAD]")})
    loaded = transformers.AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "model"), **ATTN)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "model"))
    enc = hf_tok(TEXTS, padding=True, return_tensors="pt")
    assert enc["input_ids"][0].tolist()[: len(tok.encode(TEXTS[0]).ids)] == tok.encode(TEXTS[0]).ids
    assert hf_tok.cls_token == "[CLS]" and hf_tok.pad_token_id == tok.token_to_id("[PAD]")
    mask = enc["attention_mask"].bool()
    with torch.no_grad():
        ours = model(enc["input_ids"], mask)
    assert (ours - _theirs(loaded, enc["input_ids"], mask, False)).abs().max() <= ATOL


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_lora_adapter_loads_with_peft_and_merges_to_the_same_logits(kind, tmp_path) -> None:
    from train.models.adapter import attach_adapter
    from train.models.export import export_model

    model = tiny_causal_lm(kind, CAUSAL_ATTENTION[0])
    info = attach_adapter(model, AdapterSettings(r=4, alpha=8.0), kind)
    assert 0 < info["trainable_parameters"] < info["total_parameters"] and info["modules_wrapped"] > 0
    assert all(("lora_" in n) == p.requires_grad for n, p in model.named_parameters())
    _perturb(model)
    ids, mask = _batch(100)
    with torch.no_grad():
        ours = model.eval()(ids, mask)
    block = export_model(model, tmp_path / "adapter", None, IDS)
    assert block["format"] == "peft-adapter" and "adapter_config.json" in block["files"]
    base = transformers.AutoModelForCausalLM.from_pretrained(block["base"], **ATTN)
    loaded = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    assert (ours - _theirs(loaded, ids, mask, True))[mask].abs().max() <= ATOL
    merged = export_model(model, tmp_path / "merged", None, IDS, merged=True)
    assert merged["format"] == "merged" and "adapter_config.json" not in merged["files"]
    plain = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), **ATTN)
    assert (ours - _theirs(plain, ids, mask, True))[mask].abs().max() <= ATOL
    with torch.no_grad():  # the live model is untouched by the export (unload / merge ran on copies)
        assert torch.equal(model(ids, mask), ours)


def test_a_bert_classifier_adapter_trains_its_head_whole_and_round_trips_through_peft(tmp_path) -> None:
    from train.models.export import export_model

    model, tok = _tiny_bert_classifier(tmp_path, AdapterSettings(r=4, alpha=8.0))
    assert model.adapter_info["heads_trained"] == ["classifier"]
    ids = torch.tensor([tok.encode(TEXTS[0]).ids])
    mask = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        ours = model(ids, mask)
    block = export_model(model, tmp_path / "model", tmp_path / "tokenizer.json", {})
    saved = json.loads((tmp_path / "model" / "adapter_config.json").read_text())["modules_to_save"]
    assert "classifier" in saved and len(saved) == len(set(saved)), saved  # each head listed once
    loaded = peft.PeftModel.from_pretrained(
        transformers.AutoModelForSequenceClassification.from_pretrained(block["base"], **ATTN), str(tmp_path / "model"))
    assert (ours - _theirs(loaded, ids, mask, False)).abs().max() <= ATOL


def test_auto_targets_are_the_familys_projections_and_named_targets_are_checked() -> None:
    from train.models.adapter import resolve_targets

    model = tiny_causal_lm("llama", CAUSAL_ATTENTION[0])
    auto = resolve_targets(AdapterSettings(), model.inner, "llama", "hf:llama")
    assert auto == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    with pytest.raises(UserError, match=r"targets: qkv not in the model .*its Linear modules: .*q_proj"):
        resolve_targets(AdapterSettings(targets=("q_proj", "qkv")), model.inner, "llama", "hf:llama")
    with pytest.raises(UserError, match="no known projections for model_type 'mamba'.*list the module names"):
        resolve_targets(AdapterSettings(), model.inner, "mamba", "hf:mamba")


@pytest.mark.parametrize("raw,match", [
    ("lora", "expected a mapping"), ({"type": "ia3"}, r"model.adapter.type='ia3': supported: lora"),
    ({"rank": 8}, r"model.adapter.rank: unknown key"), ({"r": 0}, r"model.adapter.r=0: expected an integer"),
    ({"dropout": 1.5}, r"model.adapter.dropout=1.5"), ({"targets": []}, r"model.adapter.targets=\[\]"),
    ({"alpha": -1}, "model.adapter.alpha=-1")])
def test_a_malformed_adapter_setting_is_refused_naming_its_key(raw, match) -> None:
    with pytest.raises(UserError, match=match):
        parse_adapter(raw)


def test_an_adapter_rank_above_a_target_or_the_memory_is_refused_before_peft_builds_it() -> None:
    """r=100000 on the tiny Llama used to build a ~2.25G-parameter adapter and die in the allocator."""
    from train.models.adapter import check_adapter_size

    model = torch.nn.Module()
    model.q_proj, model.o_proj = torch.nn.Linear(32, 16), torch.nn.Linear(16, 32)
    with pytest.raises(UserError, match=r"model.adapter.r=100000: above min\(in, out\) = 16 of q_proj \[16, 32\].*"
                                        r"set model.adapter.r ≤ 16"):
        check_adapter_size(AdapterSettings(r=100000), model, ("q_proj", "o_proj"), "hf:x", None)
    assert check_adapter_size(AdapterSettings(r=16), model, ("q_proj", "o_proj"), "hf:x", None) == 2 * 16 * 48
    with pytest.raises(UserError, match=r"need about .* GiB .*lower model.adapter.r"):
        check_adapter_size(AdapterSettings(r=8), model, ("q_proj", "o_proj"), "hf:x", available=8 * 48 * 2 * 16 - 1)
    check_adapter_size(AdapterSettings(r=8), model, ("q_proj", "o_proj"), "hf:x", available=8 * 48 * 2 * 16)


def test_an_adapter_on_the_builtin_encoder_is_refused_when_the_config_loads() -> None:
    with pytest.raises(UserError, match="the built-in encoder cannot take a peft adapter.*hf:"):
        load_config(None, ["model.adapter={r: 8}"])


def test_frozen_parameters_get_no_optimizer_group() -> None:
    from train.models.encoder import param_groups

    layer = torch.nn.Linear(4, 4)
    layer.weight.requires_grad_(False)
    groups = param_groups(layer, 0.01)
    assert [len(g["params"]) for g in groups] == [0, 1]


# --- a whole adapter run ------------------------------------------------------------------------------------------

LLAMA = "model.hf_overrides={num_hidden_layers: 1, hidden_size: 32, num_attention_heads: 4, intermediate_size: 64}"
ADAPTER = "model.adapter={type: lora, r: 4, alpha: 8, dropout: 0.0, targets: auto}"


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> tuple[Path, list[str], dict]:
    """(root, overrides, report) of an uninterrupted 8-step LoRA run ``root/runs/ref`` (a tiny Llama, packed rows).
    The attention path and the chunked loss are pinned: ``auto`` measures, and two runs on a busy machine may choose
    differently (the chunked loss with a frozen head: no weight gradient)."""
    from train.run.training import run_training

    root = tmp_path_factory.mktemp("lora")
    wndb = write_wndb(root / "wn", synthetic_rows())
    overrides = tiny_overrides(wndb, root, "model.task=causal-lm", "model.source=hf:llama", LLAMA,
                               "data.vocab_size=300", "batching.method=packed", "batching.max_tokens=128",
                               "model.dropout=0.0", "model.packed_attention=sdpa-mask", "model.chunked_loss=true",
                               ADAPTER, "optim.lr=1e-2", "train.max_steps=8", "train.eval_every=4", "train.log_every=1")
    report = run_training(load_config(None, overrides + ["train.run_id=ref"]), time.perf_counter())
    return root, overrides, report


def test_an_adapter_run_trains_and_checkpoints_the_adapter_alone_and_exports_it(lora_run) -> None:
    from train.checkpoint import load_checkpoint
    from train.models.export import model_from_checkpoint

    root, _, report = lora_run
    a = report["model"]["adapter"]
    assert a["type"] == "lora" and a["r"] == 4 and "q_proj" in a["targets"] and 0 < a["trainable_share"] < 0.5
    mem = report["model"]["memory"]
    assert mem["trainable_weights_bytes"] < mem["frozen_weights_bytes"]
    assert mem["optimizer_state_bytes"] == 2 * mem["trainable_weights_bytes"]  # AdamW: two moments per weight
    assert report["quality"]["evals"][-1]["loss"] < report["quality"]["evals"][0]["loss"]
    run_dir = root / "runs" / "ref"
    state = load_checkpoint(run_dir / "checkpoint.pt")
    assert state["model"] and all("lora_" in k for k in state["model"])
    assert state["spec"]["base_fingerprint"] and json.loads(state["spec"]["adapter"])["r"] == 4
    assert report["export"]["format"] == "peft-adapter" and (run_dir / "model" / "adapter_config.json").is_file()
    model = model_from_checkpoint(state, "test")
    base = transformers.AutoModelForCausalLM.from_pretrained(report["export"]["base"], **ATTN)
    loaded = peft.PeftModel.from_pretrained(base, str(run_dir / "model"))
    ids, mask = _batch(300)
    with torch.no_grad():
        ours = model(ids, mask)
    assert (ours - _theirs(loaded, ids, mask, True))[mask].abs().max() <= ATOL
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(run_dir / "model"))
    assert hf_tok.eos_token_id == state["special_tokens"]["eos_id"]


def test_an_adapter_run_resumes_from_a_middle_checkpoint_bit_identically(lora_run) -> None:
    from tests.conftest import resume_from_first_checkpoint

    root, overrides, _ = lora_run
    cfg = load_config(None, overrides + ["train.run_id=mid", "train.checkpoint_every=4"])
    run_dir = root / "runs" / "mid"
    report, first = resume_from_first_checkpoint(cfg, run_dir)
    assert report["resumed_from"]["step"] == 4
    assert_same_final_state(root / "runs" / "ref", run_dir)
    out = run_cli("export", str(run_dir), "--checkpoint", str(first), "--out", str(root / "mid-export"))
    assert out.returncode == 0, out.stderr
    assert (root / "mid-export" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("change", ["model.adapter=null",
                                    "model.adapter={type: lora, r: 8, alpha: 8, dropout: 0.0, targets: auto}",
                                    "model.adapter={type: lora, r: 4, alpha: 8, dropout: 0.0, targets: [q_proj]}"])
def test_resuming_an_adapter_run_otherwise_is_refused_in_one_line(lora_run, change) -> None:
    from train.run.training import run_training

    root, overrides, _ = lora_run
    with pytest.raises(UserError, match=r"cannot change mid-run.*model.adapter"):
        run_training(load_config(None, overrides + ["train.run_id=ref", change]), time.perf_counter(),
                     resume=str(root / "runs" / "ref"))


def test_resuming_an_adapter_on_another_base_is_refused_by_its_fingerprint(lora_run, monkeypatch) -> None:
    """A real other base: the resumed run builds its random-init base from another seed (every setting the same),
    so its weights differ; the resume is refused by the base fingerprint, before a step."""
    from train.run.training import run_training

    root, overrides, _ = lora_run
    monkeypatch.setattr("train.models.adapter.seed_adapter_base", lambda cfg: torch.manual_seed(cfg.train.seed + 1))
    with pytest.raises(UserError, match="adapter was trained on another base"):
        run_training(load_config(None, overrides + ["train.run_id=ref"]), time.perf_counter(),
                     resume=str(root / "runs" / "ref"))


def test_export_of_a_directory_without_a_complete_checkpoint_is_one_line_and_exit_2(tmp_path) -> None:
    from tests.conftest import assert_clean_error

    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    proc = run_cli("export", str(tmp_path / "run"))
    assert_clean_error(proc, "no complete checkpoint")
    assert not (tmp_path / "run" / "model").exists()


def test_two_ranks_train_an_adapter(lora_run, tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    from tests.conftest import ddp_worker, free_port

    root, overrides, _ = lora_run
    over = [o for o in overrides if not o.startswith(("train.output_dir", "train.max_steps", "train.eval_every"))]
    over += [f"train.output_dir={tmp_path / 'runs'}", "train.max_steps=4", "train.eval_every=4",
             "train.run_id=ddp-lora"]
    out = tmp_path / "out"
    out.mkdir()
    mp.spawn(ddp_worker, args=(2, free_port(), over, str(out), None, None, None), nprocs=2, join=True)
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    report = results[0]["report"]
    assert report["env"]["world_size"] == 2 and report["status"] == "completed"
    assert report["model"]["adapter"]["r"] == 4
    # what DDP does not guarantee: every rank built the base one process builds (the seeded random init), and the
    # adapter trained (LoRA's B starts at zero) and was checkpointed alone
    from train.checkpoint import load_checkpoint

    two = load_checkpoint(tmp_path / "runs" / "ddp-lora" / "checkpoint.pt")
    one = load_checkpoint(root / "runs" / "ref" / "checkpoint.pt")
    assert two["spec"]["base_fingerprint"] == one["spec"]["base_fingerprint"]
    lora_b = [v for k, v in two["model"].items() if "lora_B" in k]
    assert lora_b and all(float(v.abs().sum()) > 0 for v in lora_b)
    assert set(two["model"]) == set(one["model"])  # the adapter's tensors alone, as one process saves them


def test_the_chunked_loss_takes_no_weight_gradient_for_a_frozen_head() -> None:
    from train.tasks.chunked_loss import chunked_cross_entropy

    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=False)
    hidden = torch.randn(12, 8, requires_grad=True)
    targets = torch.randint(0, 50, (12,))
    ref = torch.nn.functional.cross_entropy(head(hidden), targets)
    (want,) = torch.autograd.grad(ref, hidden)
    head.weight.requires_grad_(False)
    loss = chunked_cross_entropy(hidden, head, targets, rows=4)
    loss.backward()
    assert head.weight.grad is None and torch.allclose(hidden.grad, want, atol=1e-6)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)


def test_a_bf16_adapter_run_holds_its_frozen_base_in_bf16_with_the_same_numerics_under_autocast() -> None:
    from train.models.adapter import attach_adapter, hold_frozen_base

    model = tiny_causal_lm("llama", CAUSAL_ATTENTION[0])
    attach_adapter(model, AdapterSettings(r=4, alpha=8.0), "llama")
    _perturb(model)
    ids, mask = _batch(100)

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16)

    with torch.no_grad():
        before = model(ids, mask, autocast)
        assert hold_frozen_base(model, torch.bfloat16) == 14  # 7 projections x 2 layers, no bias
        after = model(ids, mask, autocast)
        plain = model(ids, mask)  # outside autocast: the held layers take and give back fp32
    assert torch.equal(before, after)
    assert plain.dtype == torch.float32 and torch.isfinite(plain).all()
    q = model.inner.model.layers[0].self_attn.q_proj
    assert q.base_layer.weight.dtype == torch.bfloat16 and q.lora_A["default"].weight.dtype == torch.float32
    assert hold_frozen_base(model, torch.bfloat16) == 0  # once


def test_bench_vs_hf_with_an_adapter_trains_the_same_adapter_on_every_side(tmp_path) -> None:
    """configs/bench-vs-hf-lora.yaml: the HF Trainer gets peft's PeftModel (padded and padding-free), this project
    its own adapter run and all levers; every side trains the adapter alone, the same number of parameters."""
    pytest.importorskip("accelerate")
    from train.bench.vs_hf import run_bench_vs_hf

    root = Path(__file__).resolve().parent.parent
    wndb = write_wndb(tmp_path / "wn", synthetic_rows())
    cfg = load_config(str(root / "configs" / "bench-vs-hf-lora.yaml"), tiny_overrides(
        wndb, tmp_path, "model.hf_overrides={num_hidden_layers: 1, hidden_size: 32, num_attention_heads: 4, "
        "intermediate_size: 64}", "data.max_samples=null", "batching.max_tokens=128", "train.max_steps=null",
        "bench.rounds=1", "bench.warmup_runs=0", "bench.cold_runs=0", "train.run_id=vsl", "train.precision=fp32"))
    result = run_bench_vs_hf(cfg, notice=lambda *_: None)
    trained = {name: side["runs"][0]["trainable_parameters"] for name, side in result["sides"].items()}
    assert len(trained) == 4 and len(set(trained.values())) == 1, trained
    total = result["sides"]["this-project"]["runs"][0]
    assert 0 < trained["hf-trainer"] and total["samples_seen"] == result["train_samples"]


# --- bad input to export and to the adapter (each one line, exit 2, nothing written or replaced) -------------------

def test_export_never_replaces_what_is_not_an_earlier_export(lora_run, tmp_path) -> None:
    from tests.conftest import assert_clean_error

    root, _, _ = lora_run
    run_dir = root / "runs" / "ref"
    keep = tmp_path / "precious"
    keep.mkdir()
    (keep / "important.txt").write_text("keep")
    assert_clean_error(run_cli("export", str(run_dir), "--out", str(keep)), "is not an earlier export")
    assert (keep / "important.txt").read_text() == "keep" and len(list(keep.iterdir())) == 1
    assert_clean_error(run_cli("export", str(run_dir), "--out", str(run_dir / "config.yaml")), "is a file")
    assert (run_dir / "config.yaml").is_file() and not list(run_dir.glob(".config.yaml*"))
    assert_clean_error(run_cli("export", str(run_dir), "--out", str(run_dir / "report.json" / "sub")),
                       "cannot write")
    again = run_cli("export", str(run_dir))  # over the run's own earlier export: replaced
    assert again.returncode == 0, again.stderr
    weights = run_dir / "model" / "adapter_model.safetensors"
    umask = os.umask(0)
    os.umask(umask)
    assert weights.stat().st_mode & 0o777 == 0o666 & ~umask  # readable as the umask says (safetensors writes 0600)


def test_export_names_a_missing_or_foreign_checkpoint_and_a_missing_tokenizer(lora_run, tmp_path) -> None:
    import shutil

    from tests.conftest import assert_clean_error

    root, _, _ = lora_run
    run_dir = root / "runs" / "ref"
    assert_clean_error(run_cli("export", str(run_dir), "--checkpoint", str(run_dir)), "is a directory",
                       "checkpoint.pt")
    assert_clean_error(run_cli("export", str(run_dir), "--checkpoint", str(run_dir / "config.yaml")),
                       "is not a checkpoint (not a file written by torch.save)")
    weird = tmp_path / "weird.pt"
    for state in ({"spec": 5, "model": {}}, {"spec": {"hf_config": "{}", "source": "hf:llama"}, "model": {}}):
        torch.save(state, weird)
        assert_clean_error(run_cli("export", str(run_dir), "--checkpoint", str(weird), "--out", str(tmp_path / "o")),
                           "export:")
        assert not (tmp_path / "o").exists()
    bare = tmp_path / "bare"
    shutil.copytree(run_dir, bare, ignore=shutil.ignore_patterns("model", "tokenizer.json"))
    assert_clean_error(run_cli("export", str(bare)), "tokenizer.json is missing")
    assert not (bare / "model").exists()


def test_equal_adapter_settings_written_differently_are_the_same_setting() -> None:
    a = load_config(None, ["model.source=hf:llama", "model.task=causal-lm", "model.adapter={r: 16, alpha: 32.0}"])
    b = load_config(None, ["model.source=hf:llama", "model.task=causal-lm",
                           "model.adapter={type: lora, r: 16, alpha: 32, dropout: 0, targets: auto}"])
    assert a.model.adapter == b.model.adapter == AdapterSettings().as_dict()


def test_an_adapter_on_the_lm_head_is_refused_naming_it() -> None:
    from train.models.adapter import resolve_targets

    model = tiny_causal_lm("llama", CAUSAL_ATTENTION[0])
    with pytest.raises(UserError, match="lm_head is the model's output layer"):
        resolve_targets(AdapterSettings(targets=("q_proj", "lm_head")), model.inner, "llama", "hf:llama")


def test_a_bf16_adapter_run_exports_the_fp32_base_its_fingerprint_names(lora_run, tmp_path) -> None:
    """The end-of-run export of a bf16 run (its frozen base held rounded to bf16) writes the base the export command
    rebuilds from the checkpoint: the fp32 tensors the fingerprint hashed, not the live bf16 ones upcast."""
    from safetensors.torch import load_file

    from train.run.training import run_training

    root, overrides, _ = lora_run
    over = [o for o in overrides if not o.startswith(("train.max_steps", "train.eval_every"))]
    report = run_training(load_config(None, over + ["train.run_id=bf16", "train.precision=bf16", "train.max_steps=2",
                                                    "train.eval_every=2"]), time.perf_counter())
    assert report["env"]["precision"] == "bf16" and report["export"]["format"] == "peft-adapter"
    a, mem = report["model"]["adapter"], report["model"]["memory"]
    assert mem["frozen_weights_bytes"] < 4 * (a["total_parameters"] - a["trainable_parameters"])  # projections bf16
    run_dir = root / "runs" / "bf16"
    out = run_cli("export", str(run_dir), "--out", str(tmp_path / "again"))
    assert out.returncode == 0, out.stderr
    ends, again = (load_file(str(d / "base" / "model.safetensors")) for d in (run_dir / "model", tmp_path / "again"))
    assert ends.keys() == again.keys() and all(torch.equal(ends[k], again[k]) for k in ends)
    assert all(t.dtype == torch.float32 for t in ends.values())


def test_what_a_killed_export_left_is_removed_or_restored_by_the_next(tmp_path) -> None:
    """A kill between the export's renames used to hide the previous export in ``.model.old-<pid>`` and leave
    ``.model.<random>.tmp`` directories forever; a live process's are left alone."""
    import subprocess
    import sys

    from train.models.export import recover_dead_exports

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    out = tmp_path / "model"
    (tmp_path / f".model.{dead}.x1y2.tmp").mkdir()
    (tmp_path / f".model.old-{dead}").mkdir()
    (tmp_path / f".model.old-{dead}" / "config.json").write_text("{}")
    live = tmp_path / f".model.{os.getpid()}.z9.tmp"
    live.mkdir()
    done = recover_dead_exports(out)
    assert (out / "config.json").is_file() and not (tmp_path / f".model.old-{dead}").exists()  # put back
    assert not (tmp_path / f".model.{dead}.x1y2.tmp").exists() and live.exists() and len(done) == 2
    (tmp_path / f".model.old-{dead}").mkdir()  # an export replaced it after the kill: the stale copy goes
    recover_dead_exports(out)
    assert not (tmp_path / f".model.old-{dead}").exists() and (out / "config.json").is_file()
