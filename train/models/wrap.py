"""The adapter between any classifier module and this project's trainer (no transformers import here).

The trainer, evaluation, compile wrapper, DDP and checkpoints call a model as
``model(input_ids, attention_mask, blocks_context)`` and read ``model.spec`` (a dataclass, stored in checkpoints)
and ``model.supports_packing``. :class:`ExternalClassifier` gives a Hugging Face model or a ``python:`` factory's
module exactly that.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn


@dataclass
class ExternalSpec:
    """What a checkpoint records about a model from outside this project, classifier or causal LM alike (checked on
    resume, field by field; plain fields only, so a ``weights_only`` load reads it).

    ``num_classes``: the classifier's classes (0 for a causal LM); ``hf_config``: the Hugging Face config as a JSON
    string ("" for ``python:`` models), so a resume rebuilds the same architecture; ``hidden_size`` /
    ``num_layers``: 0 where the model does not say; ``task``: ``classification`` or ``causal-lm``; ``adapter``: the
    ``model.adapter`` settings as JSON ("" for full fine-tuning) and ``base_fingerprint`` the frozen base's content
    hash (train/models/adapter.py), which a resume of an adapter checkpoint (the adapter alone) must match.
    """

    source: str
    num_classes: int
    vocab_size: int
    max_len: int
    hidden_size: int = 0
    num_layers: int = 0
    hf_config: str = ""
    task: str = "classification"
    adapter: str = ""
    base_fingerprint: str = ""


class ExternalClassifier(nn.Module):
    """A sequence classifier from outside this project, called like :class:`~train.models.encoder.EncoderClassifier`.

    forward(input_ids LongTensor[B, S], attention_mask BoolTensor[B, S] (True = real token), blocks_context)
    → logits FloatTensor[B, num_classes], fp32 whatever precision the forward ran in. ``blocks_context`` (the
    precision policy's autocast) is entered around the inner model's whole forward: its parameters stay fp32,
    autocast runs the matmuls in bf16/fp16, and the loss (computed by the trainer) stays outside, in fp32.

    ``kind``: ``hf`` (``inner(input_ids=, attention_mask=)`` returns an object with ``.logits``) or ``python``
    (``inner(input_ids, attention_mask)`` returns the logits tensor). Packed rows (``position_ids``, ``seq_index``,
    ``num_seqs`` given) run where :func:`train.models.packed.probe_packing` found them exact
    (``supports_packing``; ``packing_reason`` says why or why not): logits [num_seqs, num_classes].
    """

    supports_packing = False  # the class default; probe_packing sets it per instance

    def __init__(self, inner: nn.Module, spec: ExternalSpec, kind: str) -> None:
        super().__init__()
        self.inner = inner
        self.spec = spec
        self.kind = kind
        self.packing_reason = "not checked"
        self.mask_dim = 4

    def set_packing(self, supported: bool, reason: str) -> tuple[bool, str]:
        self.supports_packing, self.packing_reason = supported, reason
        return supported, reason

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                blocks_context: Callable[[], ContextManager] = contextlib.nullcontext,
                position_ids: Optional[torch.Tensor] = None, seq_index: Optional[torch.Tensor] = None,
                num_seqs: Optional[int] = None) -> torch.Tensor:
        """Logits FloatTensor[B, num_classes] ([num_seqs, num_classes] for packed rows). Raises ValueError for packed
        rows on a model without them (``supports_packing`` false)."""
        if position_ids is not None:
            if not self.supports_packing:
                raise ValueError(f"{self.spec.source}: packed rows are not supported by this model "
                                 f"({self.packing_reason})")
            with blocks_context():
                if self.kind == "hf":
                    from train.models.packed import hf_packed_logits

                    out = hf_packed_logits(self.inner, self.inner.config.model_type, self.mask_dim, input_ids,
                                           position_ids, seq_index, num_seqs)
                else:
                    out = self.inner(input_ids, attention_mask, position_ids=position_ids, seq_index=seq_index,
                                     num_seqs=num_seqs)
            return out.float()
        with blocks_context():
            if self.kind == "hf":
                out = self.inner(input_ids=input_ids, attention_mask=attention_mask.to(torch.long)).logits
            else:
                out = self.inner(input_ids, attention_mask)
        return out.float()
