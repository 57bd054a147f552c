"""Building a causal LM (``model.task=causal-lm``) from ``model.source``: the architecture's config (a local
``AutoModelForCausalLM`` directory, or ``hf:<model_type>`` sized by ``model.preset``), the checks that it fits the
data, and the weights; wrapped as :class:`~train.models.causal.ExternalCausalLM` with its packing probed."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from train.errors import UserError
from train.models.causal import ExternalCausalLM
from train.models.causal_probe import probe_causal_packing

POSITION_KEYS = {"gpt2": "n_positions"}
"""model_type → the config key of its position table size (default ``max_position_embeddings``)."""
FIX_DECODER = ("model.task=causal-lm needs a decoder-only language model (AutoModelForCausalLM: e.g. llama, qwen2, "
               "gpt2): point model.source at such a directory or use hf:llama / hf:qwen2 / hf:gpt2 for a random init")
FIX_ENCODER = f"{FIX_DECODER}, or set model.task=classification to fine-tune this encoder as a classifier"


def fix_for(what: str) -> str:
    return FIX_ENCODER if what.startswith("an encoder (") else FIX_DECODER



def decoder_only(tf, model_type: str, config: Any = None) -> Optional[str]:
    """None when ``model_type`` is a decoder-only causal LM in the installed transformers, else what it is instead
    (``an encoder``, ``an encoder-decoder``, ``not a causal language model``)."""
    from transformers.models.auto import modeling_auto as auto

    causal = getattr(auto, "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", {})
    masked = getattr(auto, "MODEL_FOR_MASKED_LM_MAPPING_NAMES", {})
    if config is not None and getattr(config, "is_encoder_decoder", False):
        return "an encoder-decoder"
    if model_type in masked:  # BERT, RoBERTa, …: a causal head exists (as a decoder) but the model is an encoder
        return "an encoder (a masked-language model)"
    if model_type not in causal:
        return "not a causal language model (transformers has no AutoModelForCausalLM for it)"
    return None


def causal_preset(tf, model_type: str, preset: str, vocab_size: int, max_len: int, pad_id: Optional[int],
                  overrides: Optional[dict] = None, bos_id: Optional[int] = None,
                  eos_id: Optional[int] = None) -> dict[str, Any]:
    """The ``AutoConfig.for_model`` keywords of a random-init causal LM: ``model.preset``'s sizes under the family's
    key names (:func:`train.models.hf.preset_sizes`: GPT-2's ``n_layer`` / ``n_embd`` / ``n_head`` / ``n_inner``),
    the vocabulary, the position table (``max_position_embeddings``, GPT-2's ``n_positions``) = ``max_len``, tied
    input/output embeddings, and for families with grouped-query attention (a ``num_key_value_heads`` key: Llama,
    Qwen2, Mistral, …) two query heads per key/value head (all heads when their number is odd) and ``head_dim`` =
    hidden / heads — computed after ``overrides`` (``model.hf_overrides``, applied last) unless they set them."""
    from train.models.hf import PRESET_KEYS, check_hf_overrides, preset_sizes

    overrides = dict(overrides or {})
    defaults = tf.AutoConfig.for_model(model_type)
    check_hf_overrides(overrides, defaults, f"hf:{model_type}")
    kwargs: dict[str, Any] = {**preset_sizes(model_type, preset), "vocab_size": vocab_size,
                              POSITION_KEYS.get(model_type, "max_position_embeddings"): max_len,
                              "tie_word_embeddings": True, "pad_token_id": pad_id, "bos_token_id": bos_id,
                              "eos_token_id": eos_id}
    kwargs.update(overrides)
    if hasattr(defaults, "num_key_value_heads"):
        _, hidden_key, heads_key, _ = PRESET_KEYS.get(model_type, PRESET_KEYS["default"])
        heads, hidden = int(kwargs[heads_key]), int(kwargs[hidden_key])
        kwargs.setdefault("num_key_value_heads", heads // 2 if heads % 2 == 0 else heads)
        kwargs.setdefault("head_dim", hidden // heads)
    return kwargs


def _causal_config(cfg, bundle, kind: str, hf_config: Optional[str]):
    """The transformers config of this run's causal LM (the checkpoint's JSON, the directory, or the model type)."""
    from train.models.hf import hf_model_config
    from train.models.library import import_transformers

    tf = import_transformers()
    src = cfg.model.source
    if hf_config or kind == "hf-dir":
        return hf_model_config(cfg, bundle, kind, hf_config)
    model_type = src[3:]
    if model_type not in tf.CONFIG_MAPPING:
        raise UserError(f"model.source={src}: {model_type!r} is neither a directory nor a transformers model_type "
                        "(e.g. hf:llama, hf:qwen2, hf:gpt2)")
    what = decoder_only(tf, model_type)
    if what is not None:
        raise UserError(f"model.source={src}: model_type {model_type!r} is {what}; {fix_for(what)}")
    kwargs = causal_preset(tf, model_type, cfg.model.preset, bundle.vocab_size, cfg.data.max_len, bundle.pad_id,
                           cfg.model.hf_overrides, getattr(bundle, "bos_id", None), getattr(bundle, "eos_id", None))
    try:
        return tf.AutoConfig.for_model(model_type, **kwargs)
    except (ValueError, TypeError) as exc:
        raise UserError(f"model.source={src}: cannot build its config ({str(exc).splitlines()[0][:160]})") from None


def _check_causal_fits(cfg, bundle, config, kind: str) -> None:
    """Raises UserError: an encoder (or encoder-decoder, or no causal head), a vocabulary smaller than the
    tokenizer's, a position table shorter than ``data.max_len``."""
    from train.models.library import import_transformers

    src = cfg.model.source
    what = decoder_only(import_transformers(), config.model_type, config)
    if what is not None:
        where = f"{Path(src[3:]).expanduser()} holds" if kind == "hf-dir" else "the config is"
        raise UserError(f"model.source={src}: {where} a {type(config).__name__.removesuffix('Config')} model "
                        f"(model_type {config.model_type!r}), {what}; {fix_for(what)}")
    if config.vocab_size < bundle.vocab_size:
        raise UserError(f"model.source={src}: the model's vocabulary ({config.vocab_size}) is smaller than the "
                        f"tokenizer's ({bundle.vocab_size}); give the model directory its tokenizer.json or set "
                        "data.tokenizer_path to the model's tokenizer")
    key = POSITION_KEYS.get(config.model_type, "max_position_embeddings")
    positions = getattr(config, key, None)
    if positions is not None and positions < cfg.data.max_len:
        raise UserError(f"model.source={src}: {key}={positions} is below data.max_len={cfg.data.max_len}; lower "
                        f"data.max_len to {positions} or less")


def build_causal_lm(cfg, bundle, kind: str, hf_config: Optional[str] = None) -> ExternalCausalLM:
    """The wrapped causal LM for ``cfg.model.source`` sized to ``bundle`` (``vocab_size``, ``pad_id``; ``bos_id`` /
    ``eos_id`` when it has them) and ``cfg.data.max_len``, its packing probed (:func:`probe_causal_packing`).

    ``hf_config``: a checkpoint's ``spec["hf_config"]`` (JSON): rebuild exactly that architecture (resume), weights
    from torch's RNG (the checkpoint's are loaded after). Otherwise weights come from the model directory when it has
    them, else from torch's RNG (seeded by the run).

    Raises:
        UserError: a ``builtin`` or ``python:`` source (not yet a causal LM here), a missing directory or config, an
            encoder / encoder-decoder / architecture without a causal-LM head, a vocabulary smaller than the
            tokenizer's, a position table shorter than ``data.max_len``, weights that do not fit the config.
    """
    from train.models.adapter import attach_configured_adapter, seed_adapter_base, skips_directory_weights
    from train.models.hf import config_json, load_hf_model
    from train.models.wrap import ExternalSpec

    src = cfg.model.source
    if kind not in ("hf-dir", "hf-type"):
        raise UserError(f"model.source={src}: model.task=causal-lm runs Hugging Face decoders only: use "
                        "hf:<model dir> (an AutoModelForCausalLM directory) or hf:llama / hf:qwen2 / hf:gpt2")
    config = _causal_config(cfg, bundle, kind, hf_config)
    _check_causal_fits(cfg, bundle, config, kind)
    seed_adapter_base(cfg)
    inner = load_hf_model(cfg, config, kind, fresh=skips_directory_weights(cfg, hf_config),
                          auto_class="AutoModelForCausalLM")
    c = inner.config
    size = {k: int(getattr(c, k, 0) or 0) for k in ("hidden_size", "num_hidden_layers")}
    spec = ExternalSpec(source=src, num_classes=0, vocab_size=int(c.vocab_size), max_len=cfg.data.max_len,
                        hidden_size=size["hidden_size"], num_layers=size["num_hidden_layers"],
                        hf_config=config_json(c), task="causal-lm")
    model = ExternalCausalLM(inner, spec, "hf")
    attach_configured_adapter(cfg, model)
    probe_causal_packing(model)
    return model

