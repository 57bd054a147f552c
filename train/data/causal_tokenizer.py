"""Tokenizers for ``model.task=causal-lm``: a model's own ``tokenizer.json`` with its BOS/EOS/pad roles, or a byte-level
BPE trained on the training split.

* **A model's tokenizer** (``model.source=hf:<dir>``'s ``tokenizer.json``, or ``data.tokenizer_path``): the roles are
  read from the files beside it (or the model directory): ``bos_token`` / ``eos_token`` / ``pad_token`` (a string or
  an ``AddedToken`` dict) in ``tokenizer_config.json``, then ``special_tokens_map.json``, then ``bos_token_id`` /
  ``eos_token_id`` (an int or a list: its first) / ``pad_token_id`` in ``config.json``; with none of those files, EOS
  is found by name (:data:`EOS_NAMES`). No pad token (Llama) → EOS's id pads: padding is masked by position (the
  attention mask and the labels), never by id, so a real EOS stays a trained target. Samples start with BOS when
  ``add_bos_token`` says so, or, without it, when the tokenizer's own template prepends it (Llama: yes; GPT-2: no).
* **Trained** (no tokenizer given): byte-level BPE (GPT-2's recipe: the 256 bytes, ``ByteLevel`` pre-tokenizer,
  no prefix space) of ``data.vocab_size`` tokens (never fewer than its 257 base tokens), ``<|endoftext|>`` (id 0)
  as EOS and pad, no BOS (as GPT-2: the first token of a sample is context only). Deterministic (the same texts give
  a byte-identical ``tokenizer.json``: the alphabet is numbered in sorted order and merges of equal count are broken
  by pair ids) and cached under ``<cache_dir>/tokenizers/bpe-<vocab>-<key>.json`` like the WordPiece tokenizer.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from train.data.tokenizer import (
    TrainingTexts,
    cached_tokenizer,
    load_or_train,
    texts_fingerprint,
    tokenizer_fingerprint,
)
from train.errors import UserError

EOT = "<|endoftext|>"
"""The trained tokenizer's EOS (and pad) token, id 0."""
BPE_VERSION = 1
"""Bump when the BPE recipe changes, so old cached tokenizers and prepared data are not reused."""
MIN_BPE_VOCAB = 257
"""The 256 byte tokens and :data:`EOT`."""
ROLE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "config.json")
EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")
"""EOS by name, for a tokenizer given without any of :data:`ROLE_FILES`."""


@dataclass(frozen=True)
class Roles:
    """The special tokens a causal-LM sample uses: ``[BOS] + tokens + EOS`` (BOS only when ``add_bos``), padded with
    ``pad_id`` (EOS's id when the tokenizer has no pad token). ``read_from`` says where they came from."""

    eos_id: int
    pad_id: int
    bos_id: Optional[int] = None
    add_bos: bool = False
    read_from: str = ""

    @property
    def pad_is_eos(self) -> bool:
        return self.pad_id == self.eos_id

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "pad_is_eos": self.pad_is_eos}


def lm_vocab_size(tok: Tokenizer) -> int:
    """The model vocabulary a tokenizer needs: its largest id + 1 (added tokens included)."""
    return max(tok.get_vocab(with_added_tokens=True).values()) + 1


def train_bpe(texts: Sequence[str] | TrainingTexts, vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer of at most ``vocab_size`` tokens trained on ``texts`` (a list, or
    :class:`~train.data.tokenizer.TrainingTexts` streamed in batches); :data:`EOT` is id 0."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    if isinstance(texts, TrainingTexts):  # pair counts do not depend on how the texts are batched
        tok.train_from_iterator(texts.batches(), trainer=trainer)
    else:
        tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: cannot be read as JSON ({exc}); fix the file or remove it") from None
    return data if isinstance(data, dict) else {}


def _token_name(value: Any) -> Optional[str]:
    if isinstance(value, dict):  # an AddedToken: {"content": "</s>", "lstrip": false, ...}
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _first_id(value: Any) -> Optional[int]:
    if isinstance(value, list) and value:  # eos_token_id: [128001, 128009] (several stop tokens): the first
        value = value[0]
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _role_ids(tok: Tokenizer, d: Optional[Path], files: dict[str, dict], where: str) -> dict[str, Optional[int]]:
    tc, stm, conf = (files.get(name, {}) for name in ROLE_FILES)
    vocab = lm_vocab_size(tok)
    found: dict[str, Optional[int]] = {}
    for role in ("bos", "eos", "pad"):
        key = f"{role}_token"
        name = _token_name(tc.get(key)) or _token_name(stm.get(key))
        i = tok.token_to_id(name) if name is not None else None
        if name is not None and i is None and role == "eos":
            raise UserError(f"{d}: {key} {name!r} (tokenizer_config.json / special_tokens_map.json) is not in the "
                            f"vocabulary of {where}; set {key} to one of its tokens")
        if i is None:
            i = _first_id(conf.get(f"{key}_id"))
            if i is not None and not 0 <= i < vocab:
                raise UserError(f"{d}/config.json: {key}_id={i} is outside the vocabulary of {where} ([0, {vocab})); "
                                f"fix {key}_id or give the model its own tokenizer.json")
        found[role] = i
    return found


def read_roles(tok: Tokenizer, role_dir: Optional[Path], where: str) -> Roles:
    """The BOS/EOS/pad roles of ``tok`` (``where``: its file, for messages) from the files in ``role_dir`` (module
    docstring). Call ``tok.no_truncation()`` and ``tok.no_padding()`` first.

    Raises:
        UserError: no EOS; a named EOS not in the vocabulary; an id outside it; ``add_bos_token`` without a BOS;
            a role file that is not JSON.
    """
    files = {name: _json(role_dir / name) for name in ROLE_FILES} if role_dir is not None else {}
    found = _role_ids(tok, role_dir, files, where)
    read_from = ", ".join(name for name in ROLE_FILES if files.get(name)) or "token names"
    if found["eos"] is None and not any(files.values()):
        found["eos"] = next((tok.token_to_id(n) for n in EOS_NAMES if tok.token_to_id(n) is not None), None)
    if found["eos"] is None:
        looked = f"no eos_token in {role_dir}'s {' / '.join(ROLE_FILES)}" if any(files.values()) else \
            f"no {' / '.join(ROLE_FILES)} beside it and none of {', '.join(EOS_NAMES)} in its vocabulary"
        raise UserError(f"{where}: the tokenizer has no EOS token ({looked}); model.task=causal-lm ends every "
                        "sample with EOS: set eos_token in the tokenizer_config.json beside it (or eos_token_id in "
                        "config.json)")
    flag = files.get("tokenizer_config.json", {}).get("add_bos_token")
    if isinstance(flag, bool):
        if flag and found["bos"] is None:
            raise UserError(f"{role_dir}/tokenizer_config.json: add_bos_token is true but no bos_token is set; set "
                            "bos_token (or bos_token_id in config.json), or add_bos_token to false")
        add_bos = flag
    else:
        add_bos = found["bos"] is not None and _prepends(tok, found["bos"])
    eos = int(found["eos"])
    pad = found["pad"] if found["pad"] is not None else eos
    return Roles(eos_id=eos, pad_id=int(pad), bos_id=found["bos"], add_bos=add_bos, read_from=read_from)


def _prepends(tok: Tokenizer, bos_id: int) -> bool:
    """Whether ``tok``'s own template (its post-processor) puts ``bos_id`` before a text."""
    full, bare = tok.encode("a").ids, tok.encode("a", add_special_tokens=False).ids
    return len(full) > len(bare) and full[0] == bos_id


def load_or_train_lm(train_texts: Sequence[str] | TrainingTexts, vocab_size: int, cache_dir: str,
                     tokenizer_path: Optional[str] = None,
                     role_dir: Optional[Path] = None) -> tuple[Tokenizer, dict[str, Any], Roles]:
    """The tokenizer, its facts (as :func:`~train.data.tokenizer.load_or_train`'s, ``vocab_size`` its largest id + 1,
    and ``roles``: :meth:`Roles.as_dict`) and its :class:`Roles`: ``tokenizer_path``'s with the roles read from
    ``role_dir``, or the cached / trained byte-level BPE (no truncation, no padding set on either).

    Raises:
        UserError: as :func:`~train.data.tokenizer.load_or_train` and :func:`read_roles`.
    """
    if tokenizer_path is not None:
        tok, info = load_or_train(train_texts, vocab_size, cache_dir, tokenizer_path)
        tok.no_truncation()
        tok.no_padding()
        roles = read_roles(tok, role_dir, tokenizer_path)
    else:
        texts_fp = train_texts.fingerprint if isinstance(train_texts, TrainingTexts) else \
            texts_fingerprint(train_texts)
        key = hashlib.sha256(f"bpe-v{BPE_VERSION}:{vocab_size}:{texts_fp}".encode()).hexdigest()[:16]
        path = Path(cache_dir) / "tokenizers" / f"bpe-{vocab_size}-{key}.json"
        tok, source = cached_tokenizer(path, lambda: train_bpe(train_texts, vocab_size))
        tok.no_truncation()
        tok.no_padding()
        info = {"source": source, "path": str(path), "fingerprint": tokenizer_fingerprint(tok)}
        eot = tok.token_to_id(EOT)
        roles = Roles(eos_id=eot, pad_id=eot, read_from="trained byte-level BPE")
    info = {**info, "vocab_size": lm_vocab_size(tok), "roles": roles.as_dict()}
    return tok, info, roles
