"""Hugging Face models through transformers' Auto classes, offline only (never a download).

``hf:<dir>`` loads ``<dir>/config.json`` (+ ``model.safetensors`` / ``pytorch_model.bin`` when present) with
``local_files_only=True``; ``hf:<model_type>`` builds ``AutoConfig.for_model(model_type, …)`` sized by
``model.preset`` (:data:`PRESET_KEYS` maps the preset's sizes to the architecture's own key names) and
``model.hf_overrides``, randomly initialised from torch's RNG. ``num_labels`` must equal the data's classes, or
``model.num_labels_mismatch=resize`` re-initialises the head with a notice; a directory whose weights have no
classification head (:func:`headless`: a ``BertModel``) gets a new one for the data's classes, with a notice.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

from train.compat import hf_attn_implementation
from train.config.source import missing_dir
from train.errors import UserError
from train.models.encoder import PRESETS
from train.models.library import import_transformers
from train.models.wrap import ExternalClassifier, ExternalSpec

PRESET_KEYS: dict[str, tuple[str, str, str, str]] = {
    "default": ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size"),
    "distilbert": ("n_layers", "dim", "n_heads", "hidden_dim"),
    "gpt2": ("n_layer", "n_embd", "n_head", "n_inner"),
}
"""The architecture's config keys for (num_layers, hidden_size, num_heads, ffn_size), per model_type."""

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json",
                "pytorch_model.bin.index.json")


def preset_sizes(model_type: str, preset: str) -> dict[str, int]:
    """``model.preset``'s sizes under ``model_type``'s config key names (see :data:`PRESET_KEYS`)."""
    keys = PRESET_KEYS.get(model_type, PRESET_KEYS["default"])
    p = PRESETS[preset]
    return dict(zip(keys, (p["num_layers"], p["hidden_size"], p["num_heads"], p["ffn_size"])))


def hf_model_config(cfg, bundle, kind: str, hf_config: Optional[str]):
    """The transformers config for this run (from the checkpoint's JSON, the directory, or the model type)."""
    tf = import_transformers()
    src = cfg.model.source
    if hf_config:
        import json

        raw = json.loads(hf_config)
        return tf.AutoConfig.for_model(raw.pop("model_type"), **raw)
    if kind == "hf-dir":
        d = Path(src[3:]).expanduser()
        if not d.is_dir():
            raise missing_dir(src, d)
        if not (d / "config.json").is_file():
            raise UserError(f"model.source={src}: {d / 'config.json'} is missing (save the model with "
                            "save_pretrained, or use hf:<model_type> for a random init)")
        try:
            config = tf.AutoConfig.from_pretrained(str(d), local_files_only=True)
        except (ValueError, KeyError, OSError) as exc:
            raise UserError(f"model.source={src}: {d / 'config.json'} is not a config transformers can read "
                            f"({str(exc).splitlines()[0][:160]})") from None
        check_hf_overrides(cfg.model.hf_overrides, config, src)
        config.update(dict(cfg.model.hf_overrides or {}))
        return config
    model_type = src[3:]
    if model_type not in tf.CONFIG_MAPPING:
        raise UserError(f"model.source={src}: {model_type!r} is neither a directory nor a transformers model_type "
                        "(e.g. hf:bert, hf:distilbert, hf:roberta)")
    kwargs: dict[str, Any] = {**preset_sizes(model_type, cfg.model.preset), "vocab_size": bundle.vocab_size,
                              "pad_token_id": bundle.pad_id, "num_labels": bundle.num_classes}
    check_hf_overrides(cfg.model.hf_overrides, tf.AutoConfig.for_model(model_type), src)
    kwargs.update(dict(cfg.model.hf_overrides or {}))
    try:
        return tf.AutoConfig.for_model(model_type, **kwargs)
    except (ValueError, TypeError) as exc:
        raise UserError(f"model.source={src}: cannot build its config ({str(exc).splitlines()[0][:160]})") from None


def check_hf_overrides(overrides: Optional[dict], config: Any, src: str) -> None:
    """Every key of ``model.hf_overrides`` must be one ``config`` (a transformers config of the model's family)
    has, or one of its aliases (``attribute_map``, e.g. GPT-2's ``hidden_size``): transformers keeps an unknown key as
    a plain attribute that nothing reads, so a typo would silently change nothing.

    Raises:
        UserError: naming the unknown keys, the closest known ones, and the family."""
    import difflib

    known = set(config.to_dict()) | set(getattr(config, "attribute_map", {}) or {})
    unknown = [k for k in (overrides or {}) if k not in known]
    if unknown:
        near = {k: difflib.get_close_matches(k, sorted(known), n=1) for k in unknown}
        hints = "; ".join(f"{k!r}: did you mean {v[0]!r}?" if v else f"{k!r}" for k, v in near.items())
        raise UserError(f"model.hf_overrides: unknown key(s) for {getattr(config, 'model_type', '?')} "
                        f"(model.source={src}): {hints} (a key transformers does not know would change nothing)")


def _check_fits(cfg, bundle, config) -> None:
    """Raises UserError: no sequence-classification head, labels or vocabulary or positions that do not fit."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES as heads

    src = cfg.model.source
    if config.model_type not in heads:
        raise UserError(f"model.source={src}: architecture {config.model_type!r} has no sequence-classification head "
                        "(AutoModelForSequenceClassification does not support it); use an encoder such as bert, "
                        "distilbert or roberta")
    n = bundle.num_classes
    if headless(config) and config.num_labels != n:  # a BertModel directory: the head is new anyway (said at load)
        config.num_labels = n
    if config.num_labels != n:
        if cfg.model.num_labels_mismatch != "resize":
            raise UserError(f"model.source={src}: the model has num_labels={config.num_labels} but the data has {n} "
                            f"classes; set model.num_labels_mismatch=resize to re-initialise the head for {n} classes")
        print(f"notice: model.source={src}: num_labels {config.num_labels} → {n} (the data's classes): the "
              "classification head is re-initialised (model.num_labels_mismatch=resize)", file=sys.stderr, flush=True)
        config.num_labels = n
    config.id2label = dict(enumerate(bundle.corpus.label_names))
    config.label2id = {v: k for k, v in config.id2label.items()}
    if config.vocab_size < bundle.vocab_size:
        raise UserError(f"model.source={src}: the model's vocabulary ({config.vocab_size}) is smaller than the "
                        f"tokenizer's ({bundle.vocab_size}); give the model directory its tokenizer.json or set "
                        "data.tokenizer_path to the model's tokenizer")
    positions = getattr(config, "max_position_embeddings", None)
    offset = config.pad_token_id + 1 if "roberta" in config.model_type and config.pad_token_id is not None else 0
    if positions is not None and max(bundle.bounds) + offset > positions:
        raise UserError(f"model.source={src}: max_position_embeddings={positions} is below the longest batch "
                        f"({max(bundle.bounds)} tokens{f' + offset {offset}' if offset else ''}); lower data.max_len")


def headless(config) -> bool:
    """Whether a model directory's config says its weights carry no sequence-classification head: its
    ``architectures`` (what ``save_pretrained`` recorded) name no ``…ForSequenceClassification`` class (a
    ``BertModel`` such as all-MiniLM-L6-v2, or a masked-LM checkpoint). Its ``num_labels`` (2 by default) then
    means nothing, and the head is built for the data's classes."""
    archs = list(getattr(config, "architectures", None) or [])
    return bool(archs) and not any(a.endswith("ForSequenceClassification") for a in archs)


def _weight_file(d: Path) -> Path:
    """The weights file transformers reads in ``d`` (safetensors first, as ``from_pretrained`` does)."""
    return next((d / f for f in WEIGHT_FILES if (d / f).is_file()), d / WEIGHT_FILES[0])


def _file_error(exc: BaseException) -> bool:
    """True for an error about the weights file itself (truncated, corrupt, not a checkpoint)."""
    import pickle

    return isinstance(exc, (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError)) or \
        "safetensor" in type(exc).__name__.lower()


def _checkpoint_shape(path: Path, key: str, prefix: str) -> Optional[tuple[int, ...]]:
    """The shape of parameter ``key`` (a model key; also tried without / with the ``prefix.`` of the base model)
    in the weights file ``path``, read without loading the tensors; None when it cannot be read."""
    names = [key, key[len(prefix) + 1:] if prefix and key.startswith(prefix + ".") else f"{prefix}.{key}"]
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), "pt") as f:
                found = next((n for n in names if n in f.keys()), None)
                return tuple(f.get_slice(found).get_shape()) if found else None
        import torch

        sd = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
        found = next((n for n in names if n in sd), None)
        return tuple(sd[found].shape) if found else None
    except Exception:  # noqa: BLE001 - the shape is only for the message
        return None


def _mismatch(model, info: dict, path: Path, resize: bool) -> Optional[str]:
    """``name: checkpoint shape vs config shape`` of the first parameter (in the model's order) whose shape in the
    weights differs from the config's, ignoring the head when ``resize``; None when none does.

    ``info["mismatched_keys"]`` is a set of ``(name, checkpoint shape, model shape)`` (transformers 5) or a list of
    names (4.x: the checkpoint's shape is then read from ``path``)."""
    head = ("classifier", "score", "pre_classifier")
    ckpt = {m: None for m in info.get("mismatched_keys", []) if isinstance(m, str)}
    ckpt.update({m[0]: tuple(m[1]) for m in info.get("mismatched_keys", []) if not isinstance(m, str)})
    if resize:
        ckpt = {k: v for k, v in ckpt.items() if not any(h in k for h in head)}
    if not ckpt:
        return None
    state = model.state_dict()
    name = next((k for k in state if k in ckpt), sorted(ckpt)[0])
    shape = ckpt[name] or _checkpoint_shape(path, name, getattr(model, "base_model_prefix", ""))
    want = list(state[name].shape) if name in state else "?"
    more = f" (and {len(ckpt) - 1} more)" if len(ckpt) > 1 else ""
    return f"{name} is {list(shape) if shape else '?'} in {path.name} but {want} by config.json{more}"


def load_hf_model(cfg, config, kind: str, fresh: bool, auto_class: str = "AutoModelForSequenceClassification"):
    """The transformers model (``auto_class``: the Auto class that builds it; ``AutoModelForCausalLM`` for
    ``model.task=causal-lm``): weights from the directory when it has them (and not ``fresh``), else random.

    Raises:
        UserError: a weights file that cannot be read (truncated, corrupt), or weights of the body missing or of
            another shape than config.json says (naming the first parameter with both shapes).
    """
    tf = import_transformers()
    auto = getattr(tf, auto_class)
    src = cfg.model.source
    d = Path(src[3:]).expanduser()
    attn = {"attn_implementation": hf_attn_implementation()}
    if fresh or kind != "hf-dir" or not any((d / f).is_file() for f in WEIGHT_FILES):
        return auto.from_config(config, **attn)
    resize = cfg.model.num_labels_mismatch == "resize" and auto_class == "AutoModelForSequenceClassification"
    path = _weight_file(d)
    fix = "fix config.json or re-save the model with save_pretrained"
    try:  # mismatched sizes are collected (not raised) so that the message can name the first one and its shapes
        model, info = auto.from_pretrained(str(d), config=config, local_files_only=True, output_loading_info=True,
                                           ignore_mismatched_sizes=True, **attn)
    except Exception as exc:  # noqa: BLE001 - filtered by _file_error; anything else keeps its traceback
        if not _file_error(exc):
            raise
        text = str(exc).strip()
        first = next((ln.strip() for ln in text.splitlines() if "size mismatch" in ln), None)
        if first:
            raise UserError(f"model.source={src}: the weights in {d} do not match its config.json ({first[:200]}); "
                            f"{fix}") from None
        why = f"{type(exc).__name__}: {text.splitlines()[0].split('. ')[0][:160]}" if text else type(exc).__name__
        raise UserError(f"model.source={src}: cannot read the weights file {path} ({why}); it is truncated or not "
                        "a checkpoint: re-save the model with save_pretrained (or remove the file for a random "
                        "init)") from None
    mismatch = _mismatch(model, info, path, resize)
    if mismatch:
        raise UserError(f"model.source={src}: the weights in {d} do not match its config.json ({mismatch}); {fix}")
    head = ("classifier", "score", "pre_classifier", "pooler")
    missing = [k for k in info.get("missing_keys", []) if not any(h in k for h in head)]
    if missing:
        raise UserError(f"model.source={src}: the weights in {d} do not match its config.json ({len(missing)} "
                        f"parameters missing from {path.name}, e.g. {sorted(missing)[0]}); {fix}")
    new_head = sorted(k for k in info.get("missing_keys", []) if any(h in k for h in head[:3]))
    if new_head:
        print(f"notice: model.source={src}: {path.name} has no sequence-classification head ({', '.join(new_head)} "
              "missing): the head is newly initialised from train.seed", file=sys.stderr, flush=True)
    return model


def build_hf(cfg, bundle, kind: str, hf_config: Optional[str] = None) -> ExternalClassifier:
    """The wrapped transformers model (see :func:`train.models.build_external`). Raises UserError (bad input)."""
    config = hf_model_config(cfg, bundle, kind, hf_config)
    _check_fits(cfg, bundle, config)
    from train.models.adapter import attach_configured_adapter, seed_adapter_base, skips_directory_weights

    seed_adapter_base(cfg)
    inner = load_hf_model(cfg, config, kind, fresh=skips_directory_weights(cfg, hf_config))
    size = {k: int(getattr(config, k, 0) or 0) for k in ("hidden_size", "num_hidden_layers")}
    spec = ExternalSpec(source=cfg.model.source, num_classes=bundle.num_classes, vocab_size=int(config.vocab_size),
                        max_len=cfg.data.max_len, hidden_size=size["hidden_size"], num_layers=size["num_hidden_layers"],
                        hf_config=config_json(inner.config))
    model = ExternalClassifier(inner, spec, "hf")
    attach_configured_adapter(cfg, model)
    return model


def config_json(config) -> str:
    """A transformers config as sorted JSON with ``model_type`` (enough to rebuild it with ``AutoConfig.for_model``)."""
    import json

    d = config.to_dict()
    for k in ("transformers_version", "_name_or_path", "architectures", "dtype", "torch_dtype",
              "_attn_implementation_autoset"):
        d.pop(k, None)
    d["model_type"] = config.model_type
    d["id2label"] = {str(k): v for k, v in d.get("id2label", {}).items()}
    return json.dumps(d, sort_keys=True, default=str)
