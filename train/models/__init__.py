"""Bring your own model: ``model.source`` other than ``builtin``.

* ``hf:<dir>``: a local Hugging Face model directory (``config.json``, optional ``model.safetensors`` /
  ``pytorch_model.bin``, optional ``tokenizer.json``), loaded with transformers' Auto classes, offline;
* ``hf:<model_type>`` (``hf:bert``, ``hf:distilbert``, ``hf:roberta``, …): a randomly initialised model from
  ``AutoConfig.for_model``, sized by ``model.preset`` unless ``model.hf_overrides`` says otherwise;
* ``python:package.module:function``: any ``nn.Module`` factory (train/models/custom.py states the contract).

Every such model is wrapped (:class:`~train.models.wrap.ExternalClassifier`) so the trainer calls it like the
built-in encoder: ``forward(input_ids, attention_mask, blocks_context)`` → fp32 logits. transformers is imported
only here, lazily, when a ``hf:`` source is built: ``import train`` never imports it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from train.errors import UserError
from train.models.wrap import ExternalClassifier, ExternalSpec

__all__ = ["ExternalClassifier", "ExternalSpec", "build_external", "source_kind", "model_dir_tokenizer"]


def source_kind(source: str) -> str:
    """``builtin``, ``hf-dir``, ``hf-type`` or ``python`` for a ``model.source`` value.

    A ``hf:`` value is a directory when it names an existing path or looks like one (contains ``/`` or starts
    with ``.`` or ``~``); otherwise a model type.

    Raises:
        UserError: a value of none of these forms.
    """
    if source == "builtin":
        return "builtin"
    if source.startswith("hf:") and len(source) > 3:
        rest = source[3:]
        path_like = "/" in rest or rest.startswith((".", "~")) or Path(rest).expanduser().exists()
        return "hf-dir" if path_like else "hf-type"
    if source.startswith("python:") and source.count(":") == 2 and all(source.split(":")[1:]):
        return "python"
    raise UserError(f"model.source={source!r}: expected builtin, hf:<model dir>, hf:<model_type> (e.g. hf:bert) or "
                    "python:package.module:function")


def model_dir_tokenizer(source: str) -> Optional[str]:
    """The ``tokenizer.json`` of a ``hf:<dir>`` source when the directory has one, else None."""
    if not source.startswith("hf:") or source_kind(source) != "hf-dir":
        return None
    tok = Path(source[3:]).expanduser() / "tokenizer.json"
    return str(tok) if tok.is_file() else None


def build_external(cfg, bundle, hf_config: Optional[str] = None) -> ExternalClassifier:
    """The wrapped model for ``cfg.model.source`` sized to ``bundle`` (vocabulary, classes, ``data.max_len``).

    ``hf_config``: a checkpoint's ``spec["hf_config"]`` (JSON): rebuild exactly that architecture (resume).
    Weights come from the model directory when it has them, else from torch's RNG (seeded by the run).

    Raises:
        UserError: missing directory, no sequence-classification head, ``num_labels`` ≠ the data's classes
            (unless ``model.num_labels_mismatch=resize``), weights that do not fit the config, a vocabulary
            smaller than the tokenizer's, a ``python:`` factory that does not import or whose forward does not fit.
    """
    kind = source_kind(cfg.model.source)
    if kind == "python":
        from train.models.custom import build_custom

        return build_custom(cfg, bundle)
    from train.models.hf import build_hf

    return build_hf(cfg, bundle, kind, hf_config)
