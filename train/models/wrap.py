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
    """What a checkpoint records about an external model (checked on resume, field by field).

    ``hf_config``: the Hugging Face config as a JSON string ("" for ``python:`` models), so a resume rebuilds the
    same architecture; ``hidden_size`` / ``num_layers``: 0 where the model does not say.
    """

    source: str
    num_classes: int
    vocab_size: int
    max_len: int
    hidden_size: int = 0
    num_layers: int = 0
    hf_config: str = ""


class ExternalClassifier(nn.Module):
    """A sequence classifier from outside this project, called like :class:`~train.model.EncoderClassifier`.

    forward(input_ids LongTensor[B, S], attention_mask BoolTensor[B, S] (True = real token), blocks_context)
    → logits FloatTensor[B, num_classes], fp32 whatever precision the forward ran in. ``blocks_context`` (the
    precision policy's autocast) is entered around the inner model's whole forward: its parameters stay fp32,
    autocast runs the matmuls in bf16/fp16, and the loss (computed by the trainer) stays outside, in fp32.

    ``kind``: ``hf`` (``inner(input_ids=, attention_mask=)`` returns an object with ``.logits``) or ``python``
    (``inner(input_ids, attention_mask)`` returns the logits tensor). Packed rows are not supported
    (``supports_packing = False``): such models take no per-sample positions or block mask.
    """

    supports_packing = False

    def __init__(self, inner: nn.Module, spec: ExternalSpec, kind: str) -> None:
        super().__init__()
        self.inner = inner
        self.spec = spec
        self.kind = kind

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                blocks_context: Callable[[], ContextManager] = contextlib.nullcontext,
                position_ids: Optional[torch.Tensor] = None, seq_index: Optional[torch.Tensor] = None,
                num_seqs: Optional[int] = None) -> torch.Tensor:
        """Logits FloatTensor[B, num_classes]. Raises ValueError for packed rows (``position_ids`` given)."""
        if position_ids is not None:
            raise ValueError(f"{self.spec.source}: packed rows are not supported by this model")
        with blocks_context():
            if self.kind == "hf":
                out = self.inner(input_ids=input_ids, attention_mask=attention_mask.to(torch.long)).logits
            else:
                out = self.inner(input_ids, attention_mask)
        return out.float()
