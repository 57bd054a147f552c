"""Prepared data for ``model.task=causal-lm``: the classification pipeline's files (train/data/prepare.py,
train/data/cache.py), each sample a causal-LM sample (docs/models.md, "The causal-LM contract").

A sample's ids are ``[BOS] + prompt tokens + completion tokens + EOS`` (BOS when the tokenizer's roles say so:
train/data/causal_tokenizer.py; a text row has no prompt), prompt and completion tokenized apart (no special tokens),
so the completion's first token starts exactly after the prompt. Its label (``<split>.labels.npy``) is ``n_prompt``:
``len([BOS] + prompt tokens)`` for a prompt + completion row, 0 for a text row; position ``t`` is trained to predict
``ids[t + 1]`` iff ``t + 1 >= max(n_prompt, 1)`` (train/data/causal_collate.py builds the targets).

Longer than ``data.max_len``: cut to ``ids[:max_len - 1] + [EOS]`` (EOS kept; counted as ``truncated``, the tokens
cut away as ``truncated_tokens``), or with ``data.long_text=split`` a text row cut into ``max_len`` pieces, each a
sample (:func:`text_pieces`). A row a model cannot learn from (an empty text or completion: train/data/causal_rows.py;
a prompt alone longer than ``data.max_len``; a prompt + completion row none of whose completion tokens fits after
the prompt) is left out and counted by cause, or with ``data.on_bad_row=error`` refuses the data, every such row
listed (train/data/data_policy.py). Dropped rows leave the split's texts too, so texts, ids and labels stay sample
for sample.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

import train.data.cache as cache  # the modules themselves: train/data/__init__.py imports these
import train.data.prepare as prepare
from train.config import RunConfig
from train.data.causal_rows import lm_row_locations, scan_lm_source
from train.data.causal_tokenizer import BPE_VERSION, ROLE_FILES, Roles, load_or_train_lm
from train.data.chat import template_bytes
from train.data.data_policy import DropLog, drop_line, facts, long_text_line, nothing_left, refusal
from train.data.sources import SPLITS
from train.data.tokenizer import unk_id
from train.shutdown import pause_point
from train.tools.progress import progress_bar

LM_FORMAT = 2
"""Bump when a causal-LM sample's layout changes, so old prepared entries are not reused."""


def role_dir(cfg: RunConfig) -> Optional[Path]:
    """Where the tokenizer's BOS/EOS/pad roles are read (train/data/causal_tokenizer.py): the directory of
    ``data.tokenizer_path`` when it holds a role file, else the ``model.source=hf:<dir>`` directory (a tokenizer
    converted from the model's slow files lives in the cache), else that of ``data.tokenizer_path``; None without a
    tokenizer."""
    path = cfg.data.tokenizer_path
    own = Path(path).expanduser().parent if path else None
    if own is not None and any((own / f).is_file() for f in ROLE_FILES):
        return own
    src = cfg.model.source
    model_dir = Path(src[3:]).expanduser() if src.startswith("hf:") else None
    if own is not None and model_dir is not None and (model_dir / "config.json").is_file():
        return model_dir
    return own


def lm_cache_parts(cfg: RunConfig) -> dict[str, Any]:
    """What a causal-LM entry's key adds to :func:`~train.data.cache.cache_key`: the task, the row fields, the role
    files' content and the trained tokenizer's recipe."""
    d = role_dir(cfg)
    h = hashlib.sha256()
    for name in ROLE_FILES if d is not None else ():
        if (d / name).is_file():
            h.update(name.encode() + b"\0" + (d / name).read_bytes() + b"\0")
    tok_dir = Path(cfg.data.tokenizer_path).expanduser().parent if cfg.data.tokenizer_path else None
    h.update(template_bytes(tok_dir))  # chat rows are rendered with it
    parts: dict[str, Any] = {"task": "causal-lm", "lm_format": LM_FORMAT, "text_field": cfg.data.text_field,
                             "prompt_field": cfg.data.prompt_field, "completion_field": cfg.data.completion_field,
                             "messages_field": cfg.data.messages_field, "wordnet_format": cfg.data.wordnet_format,
                             "roles": h.hexdigest()[:16], "label_field": None, "num_classes": None,
                             "on_bad_row": cfg.data.on_bad_row, "long_text": cfg.data.long_text}
    if cfg.data.tokenizer_path is None:
        parts["tokenizer"] = f"bpe-v{BPE_VERSION}-{cfg.data.vocab_size}"
    return parts


@dataclass
class LMChunk:
    """One chunk of rows encoded (:func:`encode_lm_chunk`): the samples' ids back to back (int32), their lengths and
    ``n_prompt`` (int64), each sample's text, the rows left out (``(row in the chunk, cause)``) and the counts."""

    ids: np.ndarray
    lengths: np.ndarray
    n_prompt: np.ndarray
    texts: list[str]
    dropped: list[tuple[int, str]]
    truncated: int
    unks: int
    cut_tokens: int = 0
    """Tokens cut away by truncation (EOS kept)."""
    split_texts: int = 0
    chunks: int = 0
    """``long_text=split``: texts longer than ``max_len`` and the samples they became."""


def text_pieces(seq: list[int], max_len: int) -> list[list[int]]:
    """A text sample ``seq`` longer than ``max_len`` as pieces of at most ``max_len`` tokens, each overlapping the
    next by one token, so every token after the first is a target exactly once (a piece's first token is context)."""
    return [seq[a:a + max_len] for a in range(0, len(seq) - 1, max_len - 1)]


def encode_lm_chunk(tok, roles: Roles, texts: list[str], prompt_chars: np.ndarray, max_len: int,
                    split: bool = False) -> LMChunk:
    """Encode rows ``texts[k]`` (``prompt + completion``, the prompt its first ``prompt_chars[k]`` characters) into
    causal-LM samples (module docstring); ``split``: a text row longer than ``max_len`` becomes
    :func:`text_pieces` samples instead of being truncated. Call ``tok.no_truncation()`` and ``tok.no_padding()``
    first. Drop causes: ``prompt_too_long``, ``no_completion_fits``, ``no_target``."""
    batch = getattr(tok, "encode_batch_fast", None) or tok.encode_batch  # _fast (tokenizers >= 0.20): no offsets
    cuts = [int(c) for c in prompt_chars]
    with_prompt = [k for k, c in enumerate(cuts) if c > 0]
    prompts = dict(zip(with_prompt, (e.ids for e in batch([texts[k][:cuts[k]] for k in with_prompt],
                                                             add_special_tokens=False))))
    bodies = [e.ids for e in batch([t[c:] for t, c in zip(texts, cuts)], add_special_tokens=False)]
    head, eos, unk = ([roles.bos_id] if roles.add_bos else []), roles.eos_id, unk_id(tok)
    out = LMChunk(np.zeros(0, np.int32), np.zeros(0, np.int64), np.zeros(0, np.int64), [], [], 0, 0)
    seqs, n_prompt = [], []
    for k, body in enumerate(bodies):
        prompt = prompts.get(k)
        if unk is not None:
            out.unks += body.count(unk) + (prompt.count(unk) if prompt else 0)
        seq = head + (prompt or []) + body + [eos]
        first = len(head) + len(prompt) if prompt is not None else 0
        cause = None
        if first > max_len:
            cause = "prompt_too_long"
        elif len(seq) > max_len and prompt is not None and first >= max_len - 1:
            cause = "no_completion_fits"  # not one completion token fits after the prompt
        elif len(seq) > max_len and split and prompt is None:
            pieces = text_pieces(seq, max_len)
            seqs += pieces
            n_prompt += [0] * len(pieces)
            out.texts += [tok.decode(p, skip_special_tokens=True) for p in pieces]
            out.split_texts, out.chunks = out.split_texts + 1, out.chunks + len(pieces)
            continue
        elif len(seq) > max_len:
            out.cut_tokens += len(seq) - max_len
            seq, out.truncated = seq[:max_len - 1] + [eos], out.truncated + 1
        if cause is None and len(seq) - max(first, 1) < 1:  # a text that encodes to nothing, without BOS
            cause = "no_target"
        if cause is not None:
            out.dropped.append((k, cause))
            continue
        seqs.append(seq)
        n_prompt.append(first)
        out.texts.append(texts[k])
    out.lengths = np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs))
    out.ids = np.fromiter((i for s in seqs for i in s), dtype=np.int32, count=int(out.lengths.sum()))
    out.n_prompt = np.asarray(n_prompt, dtype=np.int64)
    return out


COUNTS = ("truncated", "unks", "cut_tokens", "split_texts", "chunks")


def _encode_split(cfg: RunConfig, tok, roles: Roles, g: prepare.Gathered, name: str, out: Path,
                  progress: Callable[[int], Any], log: DropLog) -> dict:
    """Encode one split into ``<name>.ids.npy`` / ``offsets`` / ``labels`` (n_prompt) and its texts again, one per
    sample (dropped rows out, a split text's pieces decoded), rows dropped recorded in ``log``; its meta facts."""
    order = g.scan.splits[name]
    prompt_chars = g.scan.labels[order]
    offsets, n_prompt = [np.zeros(1, np.int64)], []
    counts = dict.fromkeys(COUNTS, 0)
    row = total = dropped = 0
    ids = prepare.NpyAppender(out / f"{name}.ids.npy", np.int32)
    kept_texts, text_lengths = prepare.NpyAppender(out / f"{name}.texts.kept", np.uint8), array("q")
    try:
        for texts in prepare.read_texts(out / f"{name}.texts.npy", g.text_offsets[name]):
            chunk = encode_lm_chunk(tok, roles, texts, prompt_chars[row:row + len(texts)], cfg.data.max_len,
                                    cfg.data.long_text == "split")
            for k, cause in chunk.dropped:
                log.token_drop(int(order[row + k]), cause)
            ids.write(chunk.ids)
            offsets.append(total + np.cumsum(chunk.lengths))
            total += int(chunk.lengths.sum())
            n_prompt.append(chunk.n_prompt)
            for t in chunk.texts:
                b = t.encode("utf-8")
                kept_texts.write(b)
                text_lengths.append(len(b))
            counts = {key: counts[key] + getattr(chunk, key) for key in COUNTS}
            row, dropped = row + len(texts), dropped + len(chunk.dropped)
            progress(len(texts))
            pause_point("data preparation")  # a test hook (no-op): a signal while the cache entry is written
    finally:
        ids.close()
        kept_texts.close()
    (out / f"{name}.texts.kept").replace(out / f"{name}.texts.npy")
    np.save(out / f"{name}.text_offsets.npy", cache._offsets(np.frombuffer(text_lengths, np.int64)
                                                             if len(text_lengths) else []))
    np.save(out / f"{name}.offsets.npy", np.concatenate(offsets))
    np.save(out / f"{name}.labels.npy", np.concatenate(n_prompt) if n_prompt else np.zeros(0, np.int64))
    return {"rows": len(text_lengths), "truncated": counts["truncated"], "unk_only_words": counts["unks"],
            "dropped": dropped, "truncated_tokens": counts["cut_tokens"], "split_texts": counts["split_texts"],
            "split_chunks": counts["chunks"]}


def lm_data_fingerprint(texts_fp: str, prompt_chars: np.ndarray, long_text: str = "truncate") -> str:
    """The training data's fingerprint for a causal LM: its texts, where each prompt ends and, when long texts are
    split (other samples, other lengths: a bucket plan fitted on truncated ones does not apply), that."""
    h = hashlib.sha256(f"causal-lm:{texts_fp}:".encode() + (b"" if long_text == "truncate" else long_text.encode()))
    h.update(np.ascontiguousarray(prompt_chars, dtype=np.int64).tobytes())
    return h.hexdigest()[:16]


def build(cfg: RunConfig, out: Path) -> dict:
    """:func:`train.data.prepare.build` for ``model.task=causal-lm``: the configured data prepared into the empty
    directory ``out`` (``meta.json`` last, its ``data_facts`` what was dropped, cut or split:
    :func:`~train.data.data_policy.facts`; ``tokenizer_info.roles`` the tokenizer's roles); the tokenizer facts.

    Raises:
        UserError: bad input (train/data/causal_rows.py; with ``data.on_bad_row=error`` a row a model cannot learn
            from, every one listed; no training row left; the tokenizer's roles: train/data/causal_tokenizer.py).
        OSError: ``out`` cannot be written.
    """
    d = cfg.data
    log = DropLog()
    g = prepare.gather(cfg, out, lambda dc, on_text, progress=None: scan_lm_source(dc, on_text, progress, log))
    tok, tok_info, roles = load_or_train_lm(g.training, d.vocab_size, d.cache_dir, d.tokenizer_path, role_dir(cfg))
    splits: dict[str, dict] = {}
    with progress_bar(sum(map(len, g.scan.splits.values())), "tokenizing", cfg.train.progress, unit="row") as bar:
        for name in SPLITS:
            splits[name] = _encode_split(cfg, tok, roles, g, name, out, bar.update, log)
    first = log.first(lambda rows: lm_row_locations(d, rows)) if log.total else []
    if d.on_bad_row == "error" and log.total:
        raise refusal(first, log.total, d.max_len)
    if not splits["train"]["rows"]:
        raise nothing_left(log.counts, f"data.source={d.source!r}", d.max_len, first=first)
    prepare.save_tokenizer(tok, tok_info, out)
    data_fp = lm_data_fingerprint(g.training.fingerprint, g.scan.labels[g.scan.splits["train"]], d.long_text)
    meta = cache.meta_for(g.scan.name, [], tok_info, tok_info["vocab_size"], roles.pad_id, data_fp, splits)
    meta["data_facts"] = {**facts(log, first), "on_bad_row": d.on_bad_row, "long_text": d.long_text,
                          "truncated_samples": sum(s["truncated"] for s in splits.values()),
                          **{key: sum(s[key] for s in splits.values())
                             for key in ("truncated_tokens", "split_texts", "split_chunks")}}
    cache.write_meta(out, meta)
    return tok_info


def data_notices(data_facts: dict, max_len: int, pack_len: Optional[int] = None) -> list[str]:
    """The console lines for what preparation dropped (:func:`~train.data.data_policy.drop_line`) and cut or split
    (:func:`~train.data.data_policy.long_text_line`); none when nothing was."""
    f = data_facts
    lines = [drop_line(f, max_len, pack_len),
             long_text_line(f.get("long_text", "truncate"), f.get("truncated_samples", 0), f.get("truncated_tokens", 0),
                            f.get("split_texts", 0), f.get("split_chunks", 0), max_len)]
    return [line for line in lines if line]
