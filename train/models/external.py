"""Models from outside this project (``model.source`` other than ``builtin``): what kind a source is, whether it can
run packed rows, the model directory's tokenizer (converted once from a slow one), and :func:`build_external`, which
builds and wraps it (:class:`~train.models.wrap.ExternalClassifier`). transformers is imported lazily, only when a
``hf:`` source is built or its tokenizer converted."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional, Union

from train.config.source import missing_dir, source_kind
from train.errors import UserError
from train.models.wrap import ExternalClassifier

if TYPE_CHECKING:
    from train.config import RunConfig
    from train.models.causal import ExternalCausalLM


TOKENIZER_FILES = ("tokenizer_config.json", "vocab.txt", "vocab.json", "merges.txt", "spiece.model",
                   "sentencepiece.bpe.model", "tokenizer.model", "special_tokens_map.json")
"""Files of a "slow" (Python) tokenizer: a model directory with any of them but no tokenizer.json gets it converted."""

DEFAULT_CACHE_DIR = ".cache/deep-model-perf"
"""``data.cache_dir``'s default (train/config/sections.py; not imported: train.config imports this package)."""

_CONVERTED: dict[str, str] = {}  # model directory → its converted tokenizer.json (one conversion and notice a process)


def with_model_tokenizer(cfg: "RunConfig") -> "RunConfig":
    """``cfg`` with ``data.tokenizer_path`` set to the ``model.source=hf:<dir>`` directory's tokenizer
    (:func:`model_dir_tokenizer`) where the user gave none and the directory has one; otherwise ``cfg`` itself.
    Called where data is prepared (train/data/bundle.py), not while the config is parsed: the look-up reads files
    and may convert a slow tokenizer.

    Raises:
        UserError: see :func:`model_dir_tokenizer`.
    """
    if cfg.data.tokenizer_path is not None:
        return cfg
    path = model_dir_tokenizer(cfg.model.source, cfg.data.cache_dir)
    return cfg if path is None else cfg.with_values({"data.tokenizer_path": path}, "the model directory's tokenizer")


def model_dir_tokenizer(source: str, cache_dir: Optional[str] = None) -> Optional[str]:
    """The ``tokenizer.json`` of a ``hf:<dir>`` source, or None (the project's own tokenizer is trained).

    A directory with ``tokenizer.json`` gives that file. One with only a slow tokenizer's files
    (:data:`TOKENIZER_FILES`, e.g. ``vocab.txt``) is converted once with transformers' ``AutoTokenizer`` (local
    files only, offline) to its fast backend, written to ``<cache_dir>/tokenizers/converted-<hash>.json``
    (``cache_dir``: ``data.cache_dir``'s default when None), with one ``notice:`` line on stderr: the pretrained
    embeddings keep their token ids. A directory without tokenizer files gives None.

    Raises:
        UserError: no such directory (with how to get one, for a hub id); the directory has tokenizer files that
            cannot be converted to a fast tokenizer (unknown class, no fast version, no vocabulary beyond the special
            tokens).
    """
    if not source.startswith("hf:") or source_kind(source) != "hf-dir":
        return None
    d = Path(source[3:]).expanduser()
    if not d.exists():
        raise missing_dir(source, d)
    tok = d / "tokenizer.json"
    if tok.is_file():
        return str(tok)
    if not d.is_dir() or not any((d / f).is_file() for f in TOKENIZER_FILES):
        return None
    key = str(d.resolve())
    if key not in _CONVERTED:
        _CONVERTED[key] = _convert_tokenizer(source, d, cache_dir)
    return _CONVERTED[key]


def _convert_tokenizer(source: str, d: Path, cache_dir: Optional[str]) -> str:
    """The path of ``d``'s slow tokenizer converted to a tokenizers JSON file (see :func:`model_dir_tokenizer`)."""
    import hashlib
    import sys

    from tokenizers import Tokenizer

    from train.errors import atomic_write_text
    from train.models.library import import_transformers

    tf = import_transformers()
    fix = ("save the tokenizer with tokenizer.save_pretrained(dir) (a fast tokenizer writes tokenizer.json), or set "
           "data.tokenizer_path")
    try:
        slow = tf.AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - whatever transformers raises for these files: one line
        text = str(exc).strip()
        why = f"{type(exc).__name__}: {text.splitlines()[0][:160]}" if text else type(exc).__name__
        raise UserError(f"model.source={source}: {d} has tokenizer files but no tokenizer.json, and transformers "
                        f"cannot convert them ({why}); {fix}") from None
    if not getattr(slow, "is_fast", False) or getattr(slow, "backend_tokenizer", None) is None:
        raise UserError(f"model.source={source}: {d} has tokenizer files but no tokenizer.json, and its tokenizer "
                        f"({type(slow).__name__}) has no fast version to convert to; {fix}")
    backend = Tokenizer.from_str(slow.backend_tokenizer.to_str())  # a copy: padding and truncation off
    if backend.get_vocab_size() <= len(set(getattr(slow, "all_special_tokens", []))):  # e.g. vocab.txt missing
        raise UserError(f"model.source={source}: {d} has tokenizer files but no tokenizer.json, and its "
                        f"{type(slow).__name__} has no vocabulary beyond its special tokens (a vocab file is missing); "
                        f"{fix}")
    backend.no_padding()
    backend.no_truncation()
    text = backend.to_str()
    out = Path(cache_dir or DEFAULT_CACHE_DIR).absolute() / "tokenizers" / \
        f"converted-{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"
    if not out.is_file():
        atomic_write_text(out, text)
    print(f"notice: model.source={source}: {d} has no tokenizer.json: converted its {type(slow).__name__} "
          f"({backend.get_vocab_size()} tokens) to {out} (data.tokenizer_path), so the pretrained embeddings keep "
          "their token ids", file=sys.stderr, flush=True)
    return str(out)


def has_pretrained_weights(source: str) -> bool:
    """Whether ``model.source`` starts from trained weights: a ``hf:<dir>`` holding a weights file (not a config
    alone, not ``hf:<model_type>``, not the built-in encoder: those are a random init)."""
    from train.models.hf import WEIGHT_FILES

    if not source.startswith("hf:") or source_kind(source) != "hf-dir":
        return False
    d = Path(source[3:]).expanduser()
    return any((d / f).is_file() for f in WEIGHT_FILES)


def model_supports_packing(source: str, task: str = "classification") -> bool:
    """Whether the model ``model.source`` names can run packed rows (per-sample positions, block-diagonal mask),
    as far as is known without building it: the built-in encoder; a Hugging Face architecture with a known head
    whose base model takes ``position_ids`` (train/models/packed.py; exactness is checked when it is built);
    a ``python:`` model only once built (it declares ``supports_packing`` itself): False here.
    ``task="causal-lm"``: a decoder-only Hugging Face causal LM whose base model takes ``position_ids``
    (train/models/causal.py; exactness is checked when it is built)."""
    kind = source_kind(source)
    if task == "causal-lm":
        if kind not in ("hf-dir", "hf-type"):
            return False
        from train.models.causal_build import decoder_only
        from train.models.library import import_transformers
        from train.models.packed import takes_position_ids

        model_type = _hf_model_type(source, kind)
        return model_type is not None and decoder_only(import_transformers(), model_type) is None and \
            takes_position_ids(model_type) is None
    if kind == "builtin":
        from train.models.encoder import EncoderClassifier

        return bool(EncoderClassifier.supports_packing)
    if kind == "python":
        return False
    from train.models.packed import HEADS, takes_position_ids

    model_type = _hf_model_type(source, kind)
    return model_type in HEADS and takes_position_ids(model_type) is None


def _hf_model_type(source: str, kind: str) -> Optional[str]:
    if kind == "hf-type":
        return source[3:]
    import json

    try:
        return json.loads((Path(source[3:]).expanduser() / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError):
        return None


def build_external(cfg, bundle, hf_config: Optional[str] = None) -> Union[ExternalClassifier, "ExternalCausalLM"]:
    """The wrapped model for ``cfg.model.source`` sized to ``bundle`` (vocabulary, classes, ``data.max_len``).

    ``model.task=causal-lm``: a Hugging Face decoder wrapped as :class:`~train.models.causal.ExternalCausalLM`
    (:func:`train.models.causal_build.build_causal_lm`: logits [B, T, V], its own refusals); otherwise a classifier:

    ``hf_config``: a checkpoint's ``spec["hf_config"]`` (JSON): rebuild exactly that architecture (resume).
    Weights come from the model directory when it has them, else from torch's RNG (seeded by the run).

    Raises:
        UserError: missing directory, no sequence-classification head, ``num_labels`` ≠ the data's classes
            (unless ``model.num_labels_mismatch=resize``), weights that do not fit the config, a vocabulary
            smaller than the tokenizer's, a ``python:`` factory that does not import or whose forward does not fit,
            or a ``python:`` model that declares packed rows but returns the wrong number of them.
    """
    from train.models.packed import probe_packing

    if getattr(cfg.model, "task", "classification") == "causal-lm":
        from train.models.causal_build import build_causal_lm

        return build_causal_lm(cfg, bundle, source_kind(cfg.model.source), hf_config)
    kind = source_kind(cfg.model.source)
    if kind == "python":
        from train.models.custom import build_custom

        model = build_custom(cfg, bundle)
    else:
        from train.models.hf import build_hf

        model = build_hf(cfg, bundle, kind, hf_config)
    probe_packing(model)  # packed rows only where they are exact (supports_packing + packing_reason)
    return model
