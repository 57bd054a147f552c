"""Chat rows (TRL's ``messages``) for ``model.task=causal-lm``: rendered with the model's chat template, the loss on
the final assistant turn only, packed like prompt/completion rows; WordNet as chat; the refusals and drops."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from tests.conftest import WORDS, assert_clean_error, run_cli, write_jsonl
from tests.conftest import causal_cfg as cfg_for
from train.compat import hf_attn_implementation
from train.data.causal_collate import IGNORE_INDEX
from train.errors import UserError

pytest.importorskip("transformers")
pytest.importorskip("jinja2")

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|im_start|>", "<|im_end|>", "<pad>"]
ROLE_WORDS = ["system", "user", "assistant", "define"]


def chat_model_dir(d: Path, template: str | None = CHATML) -> Path:
    """A model directory's tokenizer files: a word-level tokenizer with ChatML's specials, EOS ``<|im_end|>``."""
    d.mkdir(parents=True, exist_ok=True)
    vocab = {w: i for i, w in enumerate([*SPECIALS, "[UNK]", *ROLE_WORDS, *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(d / "tokenizer.json"))
    conf = {"eos_token": "<|im_end|>", "pad_token": "<pad>", "tokenizer_class": "PreTrainedTokenizerFast"}
    if template is not None:
        conf["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(conf))
    return d / "tokenizer.json"


def ids_of(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def conversation(w: str, answer: str = "the answer") -> dict:
    return {"messages": [{"role": "user", "content": f"what is {w}"}, {"role": "assistant", "content": answer}]}


def test_chat_rows_train_the_assistant_turn_only_and_pack_exactly(tmp_path: Path) -> None:
    from train.data import make_loader, prepare_data

    path = chat_model_dir(tmp_path / "m")
    rows = [conversation(w) for w in WORDS[:8] for _ in range(6)]
    rows += [{"messages": [{"role": "system", "content": "a b"}, {"role": "user", "content": "two"},
                           {"role": "assistant", "content": "c"}, {"role": "user", "content": "what is four"},
                           {"role": "assistant", "content": "four plus d"}]}] * 12
    rows += [{"messages": [{"role": "user", "content": "q"}]},  # no assistant turn
             {"messages": [{"role": "tool", "content": "q"}, {"role": "assistant", "content": "a"}]}]  # unknown role
    src = write_jsonl(tmp_path / "chat.jsonl", rows)
    said: list[str] = []
    over = [f"data.source={src}", f"data.tokenizer_path={path}", "data.max_len=40"]
    bundle = prepare_data(cfg_for(tmp_path, *over), notice=said.append)
    assert bundle.data_facts["dropped_rows"] == {"no_assistant_turn": 1, "unknown_role": 1}
    assert any("a conversation without an assistant turn" in line for line in said)
    tok = Tokenizer.from_file(str(path))
    eos = tok.token_to_id("<|im_end|>")
    split = bundle.splits["train"]
    assert len(split)
    for ids, n_prompt, text in zip(split.ids, split.labels, bundle.corpus.train.texts):
        ids = ids.tolist()
        assert ids[-1] == eos and ids.count(eos) == text.count("<|im_end|>") + 1  # the end-of-turn once, as EOS
        answer = "the answer" if text.endswith("the answer") else "four plus d"
        assert ids[n_prompt:-1] == ids_of(tok, answer)  # only the final assistant answer after the prompt
        assert ids[:n_prompt] == ids_of(tok, text[:len(text) - len(answer)])  # the rendered prompt, as rendered
    cfg = cfg_for(tmp_path, *over, "batching.method=packed", "batching.max_tokens=80")
    batch = next(iter(make_loader(bundle, "train", cfg, True, torch.device("cpu"))))
    targets = batch["labels"][batch["labels"] != IGNORE_INDEX]
    answers = {tuple(ids_of(tok, "the answer")), tuple(ids_of(tok, "four plus d"))}
    allowed = {t for a in answers for t in a} | {eos}
    assert targets.numel() > 0 and set(targets.tolist()) <= allowed  # no prompt token is ever a target


def test_a_model_without_a_chat_template_is_refused_in_one_line(tmp_path: Path) -> None:
    from train.data import prepare_data

    path = chat_model_dir(tmp_path / "plain", template=None)
    src = write_jsonl(tmp_path / "chat.jsonl", [conversation(w) for w in WORDS[:6]])
    with pytest.raises(UserError, match=r"chat rows \(messages\) need the model's chat template.*has none"):
        prepare_data(cfg_for(tmp_path, f"data.source={src}", f"data.tokenizer_path={path}"), notice=lambda _m: None)
    proc = run_cli("train", "model.task=causal-lm", f"data.source={src}", f"data.cache_dir={tmp_path / 'c'}",
                   "model.source=hf:llama", "train.max_steps=1")  # the project's own BPE: no template either
    assert_clean_error(proc, "need the model's chat template", "the tokenizer trained on the data")


def test_a_row_with_messages_and_a_text_is_refused(tmp_path: Path) -> None:
    from train.data import prepare_data

    path = chat_model_dir(tmp_path / "m")
    src = write_jsonl(tmp_path / "chat.jsonl", [{**conversation("two"), "text": "a b"}])
    with pytest.raises(UserError, match=r"chat\.jsonl:1: both a conversation \('messages'\) and a text"):
        prepare_data(cfg_for(tmp_path, f"data.source={src}", f"data.tokenizer_path={path}"), notice=lambda _m: None)


def test_wordnet_as_chat_asks_for_the_definition(tmp_path: Path, wndb: Path) -> None:
    from train.config import DataConfig
    from train.data.causal_rows import lm_rows_for

    path = chat_model_dir(tmp_path / "m")
    rows = list(lm_rows_for(DataConfig(wordnet_dir=str(wndb), wordnet_format="chat", tokenizer_path=str(path)))[1])
    text_rows = list(lm_rows_for(DataConfig(wordnet_dir=str(wndb)))[1])
    assert len(rows) == len(text_rows)
    for (key, prompt, completion, _loc, cause), (key2, _p, gloss, _l, _c) in zip(rows, text_rows):
        assert key == key2 and cause is None and completion == gloss.strip()  # the same split, the gloss answered
        assert prompt.startswith("<|im_start|>user\nDefine ") and prompt.endswith("<|im_start|>assistant\n")


def pretrained_chat_llama(d: Path) -> Path:
    """A tiny Llama saved with save_pretrained beside a ChatML tokenizer: a "pretrained" chat model directory."""
    import transformers

    path = chat_model_dir(d)
    vocab = Tokenizer.from_file(str(path)).get_vocab_size()
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256,
                                      eos_token_id=1, pad_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=hf_attn_implementation())
    model.save_pretrained(d)
    return d


@pytest.mark.parametrize("adapter", [False, True])
def test_a_chat_run_on_a_pretrained_dir_reports_before_and_after_and_exports_for_publishing(
        tmp_path: Path, wndb: Path, adapter: bool) -> None:
    import time

    from train.config import load_config
    from train.run.training import run_training

    d = pretrained_chat_llama(tmp_path / "chat-llama")
    src = write_jsonl(tmp_path / "chat.jsonl", [conversation(f"{a} {b}", f"the answer {a}") for a in WORDS
                                                for b in WORDS])
    lora = ["model.adapter={type: lora, r: 4, alpha: 8, dropout: 0.0, targets: auto}"] if adapter else []
    cfg = load_config(None, ["model.task=causal-lm", f"model.source=hf:{d}", f"data.source={src}",
                             f"data.cache_dir={tmp_path / 'cache'}", "data.max_len=40", "data.val_fraction=0.2",
                             "data.max_eval_samples=16", "batching.method=packed",
                             "batching.max_tokens=160", "model.packed_attention=sdpa-mask", "model.chunked_loss=false",
                             "train.max_steps=3", "train.eval_every=3", "train.progress=false", "train.run_id=chat",
                             f"train.output_dir={tmp_path / 'runs'}", "train.precision=fp32", *lora])
    report = run_training(cfg, time.perf_counter())
    q = report["quality"]
    assert q["eval_loss_before"] is not None and q["eval_loss"] is not None  # the base evaluated before step 1
    assert report["quality"]["evals"][0]["step"] == 0
    for when in ("before", "after"):
        answers = q["answers"][when]["answers"]
        assert answers and all(a["prompt"].rstrip().endswith("<|im_start|> assistant") for a in answers)  # words
        assert all(a["reference"].startswith("the answer") for a in answers)
    out = Path(report["export"]["path"])
    tc = json.loads((out / "tokenizer_config.json").read_text())
    assert tc["model_max_length"] == 256  # the model's own, not data.max_len
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    rendered = tok.apply_chat_template([{"role": "user", "content": "what is two"}], tokenize=False,
                                       add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")  # the chat template travels with the export
    card = (out / "README.md").read_text()
    assert f"{q['eval_loss_before']:.4f} → {q['eval_loss']:.4f}" in card and "config.yaml" in card
    if adapter:
        base = json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]
        assert base == str(d) and report["export"]["base"] == str(d)  # as given, here tmp_path's absolute path
    else:
        assert report["export"]["dtype"] == "fp32"
