"""Prepared data for ``model.task=causal-lm``: the classification pipeline's files (train/data/prepare.py,
train/data/cache.py), each sample a causal-LM sample (``/work/contract/causal-lm.md``).

A sample's ids are ``[BOS] + prompt tokens + completion tokens + EOS`` (BOS when the tokenizer's roles say so:
train/data/causal_tokenizer.py; a text row has no prompt), prompt and completion tokenized apart (no special tokens),
so the completion's first token starts exactly after the prompt. Its label (``<split>.labels.npy``) is ``n_prompt``:
``len([BOS] + prompt tokens)`` for a prompt + completion row, 0 for a text row; position ``t`` is trained to predict
``ids[t + 1]`` iff ``t + 1 >= max(n_prompt, 1)`` (train/data/causal_collate.py builds the targets).

Longer than ``data.max_len``: cut to ``ids[:max_len - 1] + [EOS]`` (EOS kept; counted as ``truncated``). A prompt +
completion row none of whose completion tokens fits after the prompt is left out (counted as ``dropped``, said once
in one line by :func:`drop_notice`); a prompt alone longer than ``data.max_len`` is bad input (one line naming the
row). Dropped rows leave the split's texts too, so texts, ids and labels stay row for row.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

import train.data.cache as cache  # the modules themselves: train/data/__init__.py imports these
import train.data.prepare as prepare
from train.config import RunConfig
from train.data.causal_rows import lm_row_location, scan_lm_source
from train.data.causal_tokenizer import BPE_VERSION, ROLE_FILES, Roles, load_or_train_lm
from train.data.sources import SPLITS
from train.data.tokenizer import TokenizedSplit, unk_id
from train.errors import UserError
from train.shutdown import pause_point
from train.tools.progress import progress_bar

LM_FORMAT = 1
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
    parts: dict[str, Any] = {"task": "causal-lm", "lm_format": LM_FORMAT, "text_field": cfg.data.text_field,
                             "prompt_field": cfg.data.prompt_field, "completion_field": cfg.data.completion_field,
                             "roles": h.hexdigest()[:16], "label_field": None, "num_classes": None}
    if cfg.data.tokenizer_path is None:
        parts["tokenizer"] = f"bpe-v{BPE_VERSION}-{cfg.data.vocab_size}"
    return parts


@dataclass
class LMChunk:
    """One chunk of rows encoded (:func:`encode_lm_chunk`): the kept samples' ids back to back (int32), their lengths
    and ``n_prompt`` (int64), which rows are kept (bool, by row), and the counts."""

    ids: np.ndarray
    lengths: np.ndarray
    n_prompt: np.ndarray
    keep: np.ndarray
    truncated: int
    unks: int
    too_long: Optional[tuple[int, int]] = None
    """The first row whose prompt alone exceeds ``max_len``: ``(row in the chunk, its n_prompt)``."""


def encode_lm_chunk(tok, roles: Roles, texts: list[str], prompt_chars: np.ndarray, max_len: int) -> LMChunk:
    """Encode rows ``texts[k]`` (``prompt + completion``, the prompt its first ``prompt_chars[k]`` characters) into
    causal-LM samples (module docstring). Call ``tok.no_truncation()`` and ``tok.no_padding()`` first."""
    batch = getattr(tok, "encode_batch_fast", None) or tok.encode_batch  # _fast (tokenizers >= 0.20): no offsets
    cuts = [int(c) for c in prompt_chars]
    with_prompt = [k for k, c in enumerate(cuts) if c > 0]
    prompts = dict(zip(with_prompt, (e.ids for e in batch([texts[k][:cuts[k]] for k in with_prompt],
                                                             add_special_tokens=False))))
    bodies = [e.ids for e in batch([t[c:] for t, c in zip(texts, cuts)], add_special_tokens=False)]
    head, eos, unk = ([roles.bos_id] if roles.add_bos else []), roles.eos_id, unk_id(tok)
    seqs, n_prompt, keep = [], [], np.ones(len(texts), dtype=bool)
    truncated = unks = 0
    for k, body in enumerate(bodies):
        prompt = prompts.get(k)
        if unk is not None:
            unks += body.count(unk) + (prompt.count(unk) if prompt else 0)
        seq = head + (prompt or []) + body + [eos]
        first = len(head) + len(prompt) if prompt is not None else 0
        if first > max_len:
            return LMChunk(np.zeros(0, np.int32), np.zeros(0, np.int64), np.zeros(0, np.int64), keep, 0, 0,
                           too_long=(k, first))
        if len(seq) > max_len:
            if prompt is not None and first >= max_len - 1:  # not one completion token fits after the prompt
                keep[k] = False
                continue
            seq, truncated = seq[:max_len - 1] + [eos], truncated + 1
        if len(seq) - max(first, 1) < 1:  # no target at all (a text that encodes to nothing, without BOS)
            keep[k] = False
            continue
        seqs.append(seq)
        n_prompt.append(first)
    lengths = np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs))
    flat = np.fromiter((i for s in seqs for i in s), dtype=np.int32, count=int(lengths.sum()))
    return LMChunk(flat, lengths, np.asarray(n_prompt, dtype=np.int64), keep, truncated, unks)


def _encode_split(cfg: RunConfig, tok, roles: Roles, g: prepare.Gathered, name: str, out: Path,
                  progress: Callable[[int], Any]) -> dict:
    """Encode one split into ``<name>.ids.npy`` / ``offsets`` / ``labels`` (n_prompt), dropped rows removed from its
    texts; its meta facts."""
    prompt_chars = g.scan.labels[g.scan.splits[name]]
    offsets, n_prompt, keep = [np.zeros(1, np.int64)], [], []
    truncated = unks = row = total = 0
    ids = prepare.NpyAppender(out / f"{name}.ids.npy", np.int32)
    try:
        for texts in prepare.read_texts(out / f"{name}.texts.npy", g.text_offsets[name]):
            chunk = encode_lm_chunk(tok, roles, texts, prompt_chars[row:row + len(texts)], cfg.data.max_len)
            if chunk.too_long is not None:
                k, first = chunk.too_long
                where = lm_row_location(cfg.data, int(g.scan.splits[name][row + k]))
                raise UserError(f"{where}: the prompt is {first} tokens{' with BOS' if roles.add_bos else ''}, "
                                f"longer than data.max_len={cfg.data.max_len}; shorten the prompt or raise "
                                "data.max_len (its completion needs room after it)")
            ids.write(chunk.ids)
            offsets.append(total + np.cumsum(chunk.lengths))
            total += int(chunk.lengths.sum())
            n_prompt.append(chunk.n_prompt)
            keep.append(chunk.keep)
            truncated, unks, row = truncated + chunk.truncated, unks + chunk.unks, row + len(texts)
            progress(len(texts))
            pause_point("data preparation")  # a test hook (no-op): a signal while the cache entry is written
    finally:
        ids.close()
    kept = np.concatenate(keep) if keep else np.zeros(0, dtype=bool)
    np.save(out / f"{name}.offsets.npy", np.concatenate(offsets))
    np.save(out / f"{name}.labels.npy", np.concatenate(n_prompt) if n_prompt else np.zeros(0, np.int64))
    if not kept.all():
        _keep_texts(out, name, g.text_offsets[name], kept)
    return {"rows": int(kept.sum()), "truncated": truncated, "unk_only_words": unks, "dropped": int((~kept).sum())}


def _keep_texts(out: Path, name: str, text_offsets: np.ndarray, kept: np.ndarray) -> None:
    """Rewrite ``<name>.texts.npy`` / ``text_offsets.npy`` with the rows ``kept`` only."""
    src, dst = out / f"{name}.texts.npy", out / f"{name}.texts.kept"
    w = prepare.NpyAppender(dst, np.uint8)
    lengths, row = [], 0
    try:
        for texts in prepare.read_texts(src, text_offsets):
            for t in (t for t, k in zip(texts, kept[row:row + len(texts)]) if k):
                b = t.encode("utf-8")
                w.write(b)
                lengths.append(len(b))
            row += len(texts)
    finally:
        w.close()
    dst.replace(src)
    np.save(out / f"{name}.text_offsets.npy", cache._offsets(lengths))


def lm_data_fingerprint(texts_fp: str, prompt_chars: np.ndarray) -> str:
    """The training data's fingerprint for a causal LM: its texts and where each prompt ends."""
    h = hashlib.sha256(f"causal-lm:{texts_fp}:".encode())
    h.update(np.ascontiguousarray(prompt_chars, dtype=np.int64).tobytes())
    return h.hexdigest()[:16]


def build(cfg: RunConfig, out: Path) -> dict:
    """:func:`train.data.prepare.build` for ``model.task=causal-lm``: the configured data prepared into the empty
    directory ``out`` (``meta.json`` last; ``tokenizer_info.roles`` the tokenizer's roles); the tokenizer facts.

    Raises:
        UserError: bad input (train/data/causal_rows.py; a prompt longer than ``data.max_len``; the tokenizer's
            roles: train/data/causal_tokenizer.py).
        OSError: ``out`` cannot be written.
    """
    d = cfg.data
    g = prepare.gather(cfg, out, scan_lm_source)
    tok, tok_info, roles = load_or_train_lm(g.training, d.vocab_size, d.cache_dir, d.tokenizer_path, role_dir(cfg))
    splits: dict[str, dict] = {}
    with progress_bar(sum(map(len, g.scan.splits.values())), "tokenizing", cfg.train.progress, unit="row") as bar:
        for name in SPLITS:
            splits[name] = _encode_split(cfg, tok, roles, g, name, out, bar.update)
    prepare.save_tokenizer(tok, tok_info, out)
    data_fp = lm_data_fingerprint(g.training.fingerprint, g.scan.labels[g.scan.splits["train"]])
    cache.write_meta(out, cache.meta_for(g.scan.name, [], tok_info, tok_info["vocab_size"], roles.pad_id, data_fp,
                                         splits))
    return tok_info


def drop_notice(splits: dict[str, TokenizedSplit], max_len: int) -> Optional[str]:
    """The one line saying how many samples were dropped (a completion that does not fit after its prompt), or
    None when none was."""
    dropped = {name: s.dropped for name, s in splits.items()}
    total = sum(dropped.values())
    if not total:
        return None
    per = ", ".join(f"{name} {n}" for name, n in dropped.items())
    return (f"warning: {total} prompt + completion samples dropped ({per}): not one completion token fits after "
            f"the prompt in data.max_len={max_len}; raise data.max_len or shorten those prompts")
