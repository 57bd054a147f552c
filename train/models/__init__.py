"""Models: the built-in encoder (encoder.py) and, for ``model.source`` other than ``builtin``, your own.

* ``hf:<dir>``: a local Hugging Face model directory (``config.json``, optional ``model.safetensors`` /
  ``pytorch_model.bin``, optional ``tokenizer.json``), loaded with transformers' Auto classes, offline;
* ``hf:<model_type>`` (``hf:bert``, ``hf:distilbert``, ``hf:roberta``, …): a randomly initialised model from
  ``AutoConfig.for_model``, sized by ``model.preset`` unless ``model.hf_overrides`` says otherwise;
* ``python:package.module:function``: any ``nn.Module`` factory (train/models/custom.py states the contract).

Every such model is wrapped (:class:`~train.models.wrap.ExternalClassifier`) so the trainer calls it like the
built-in encoder: ``forward(input_ids, attention_mask, blocks_context)`` → fp32 logits. With ``model.task=causal-lm``
a ``hf:`` decoder (``hf:llama``, ``hf:qwen2``, ``hf:gpt2``, or an ``AutoModelForCausalLM`` directory) is wrapped as
:class:`~train.models.causal.ExternalCausalLM` instead: logits [B, T, V] per token (``causal.py``).
transformers is imported only lazily, when a ``hf:`` source is built: ``import train`` never imports it.

``external.py`` holds the logic (the model directory's tokenizer, :func:`build_external`); this package re-exports
it. ``model.source``'s forms are parsed by train/config/source.py.
"""

from __future__ import annotations

from train.models.causal import ExternalCausalLM
from train.models.external import (
    DEFAULT_CACHE_DIR,
    TOKENIZER_FILES,
    build_external,
    model_dir_tokenizer,
    model_supports_packing,
    with_model_tokenizer,
)
from train.models.wrap import ExternalClassifier, ExternalSpec

__all__ = ["ExternalClassifier", "ExternalSpec", "ExternalCausalLM", "build_external", "with_model_tokenizer",
           "model_dir_tokenizer", "model_supports_packing", "TOKENIZER_FILES", "DEFAULT_CACHE_DIR"]
