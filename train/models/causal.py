"""Causal language models (``model.task=causal-lm``): Hugging Face decoders built offline and wrapped for the trainer.

* ``hf:<dir>``: a local ``AutoModelForCausalLM`` directory (``config.json`` + weights), loaded offline;
* ``hf:<model_type>`` (``hf:llama``, ``hf:qwen2``, ``hf:gpt2``, …): a random init from ``AutoConfig.for_model``
  sized by ``model.preset`` (:func:`causal_preset`: the family's own key names, grouped-query attention, head_dim,
  tied embeddings, positions = ``data.max_len``), the vocabulary sized to the tokenizer, then ``model.hf_overrides``.

An encoder (BERT, RoBERTa, …: a masked-LM architecture, or an encoder-decoder) is refused in one line.

:class:`ExternalCausalLM` gives the trainer the contract's forward (docs/models.md, "The causal-LM contract"):
``forward(input_ids, attention_mask, blocks_context, position_ids=None, seq_index=None, num_seqs=None)`` → fp32
logits [B, T, V]; the loss is the task's (train/tasks/causal_lm.py), never the model's (no labels are passed).

**Packed rows** run exactly like the samples one by one: each sample's own positions (``position_ids`` restart at 0)
and a block-causal mask built from ``seq_index`` — token i attends to token j iff both belong to the same sample and
j ≤ i (a padding token attends only to itself, so no softmax row is empty) — given to the model as a 4-D mask
[R, 1, C, C], which transformers (4.53+ ``masking_utils``, 5.x alike) passes to every layer as it is. Its form
depends on the attention implementation (:func:`packed_attention_mask`): ``sdpa`` takes a boolean mask, ``eager``
(torch 2.1, where transformers refuses SDPA) adds the mask to the scores, so it gets an additive float mask (0 or
the dtype's minimum). Sliding-window layers (Qwen2 with ``use_sliding_window``) get their own mask with the window
applied, as a ``{layer type: mask}`` dict. Whether it is exact is not assumed: ``probe_causal_packing``
(train/models/causal_probe.py) runs short samples packed and one by one and enables packing only when the logits
agree; otherwise ``supports_packing = False`` with a one-line ``packing_reason`` naming the architecture.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from typing import Any, Optional

import torch
from torch import nn

from train.models.varlen import attention_implementation, packed_forward
from train.models.wrap import ExternalSpec

EXACT_ATOL = 1e-5
"""Packed vs one-by-one logits: the largest gap allowed, relative to the logits' scale (at least 1)."""
KNOWN_LAYER_TYPES = ("full_attention", "sliding_attention")
"""``config.layer_types`` values whose masks :class:`ExternalCausalLM` builds for packed rows."""


def causal_block_mask(seq_index: torch.Tensor, window: Optional[int] = None) -> torch.Tensor:
    """BoolTensor[R, C, C]: True where query i may attend to key j — the same sample (``seq_index`` ≥ 0) and
    j ≤ i (and i - j < ``window`` when given); a padding token (``seq_index`` -1) attends to itself only."""
    c = seq_index.shape[1]
    idx = torch.arange(c, device=seq_index.device)
    causal = idx[None, :] <= idx[:, None]  # [C(query), C(key)]
    if window is not None:
        causal = causal & (idx[:, None] - idx[None, :] < window)
    same = (seq_index[:, :, None] == seq_index[:, None, :]) & (seq_index[:, None, :] >= 0)
    eye = torch.eye(c, dtype=torch.bool, device=seq_index.device)
    return (same & causal) | (eye & (seq_index[:, :, None] < 0))


# --- version / implementation differences: the one place ---------------------------------------------------------
def packed_attention_mask(allowed: torch.Tensor, attn_implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """The 4-D mask [R, 1, C, C] a Hugging Face decoder takes as is for ``allowed`` [R, C, C] (True = attend).

    transformers 4.53+ and 5.x both return a 4-D ``attention_mask`` unchanged from ``create_causal_mask`` (and the
    sliding-window variant) and hand it to the attention function of ``config._attn_implementation``:

    * ``sdpa`` (torch ≥ 2.1.1; transformers 4.55 and 5.x): ``F.scaled_dot_product_attention(attn_mask=…)`` takes a
      boolean mask, True = attend (no dtype to match under autocast);
    * ``eager`` (torch 2.1.0, where transformers 4.55 refuses SDPA; or asked for): ``scores + attention_mask``, so an
      additive float mask: 0 where allowed, ``finfo(dtype).min`` where blocked (GPT-2's eager path in 4.55 also
      applies its own causal buffer on top: the intersection is the same mask).

    Without a mask, transformers 5.x (torch ≥ 2.6) would infer packed rows from restarting ``position_ids``; 4.55
    under torch 2.1 does not, so the explicit mask is used everywhere (and verified by :func:`probe_causal_packing`).
    """
    if attn_implementation == "sdpa":
        return allowed[:, None]
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed[:, None], zero, torch.finfo(dtype).min)
# ------------------------------------------------------------------------------------------------------------------


class ExternalCausalLM(nn.Module):
    """A Hugging Face causal LM called as the causal-LM task expects (docs/models.md, "The causal-LM contract").

    forward(input_ids LongTensor[B, T], attention_mask BoolTensor[B, T] (True = real token), blocks_context,
    position_ids=None, seq_index=None, num_seqs=None) → logits FloatTensor[B, T, V], fp32 whatever precision the
    forward ran in. ``blocks_context`` (the precision policy's autocast) is entered around the inner model's whole
    forward. Padded batches: positions count real tokens (``cumsum(attention_mask) - 1``: 0, 1, … for right padding,
    left padding alike) and the model's own causal + padding mask. Packed rows (``position_ids``, ``seq_index``
    given; ``num_seqs`` is not needed): the block-causal mask (module docstring), where :func:`probe_causal_packing`
    found it exact (``supports_packing``; ``packing_reason`` says why or why not). The model is never given labels:
    the loss is the task's.
    """

    supports_packing = False  # the class default; probe_causal_packing sets it per instance
    chunked_loss = False  # training forward returns hidden states for the task's chunked loss (set_chunked_loss)
    packed_attention = "sdpa-mask"  # or "varlen" (train/models/varlen.py) or "eager-mask", set by set_packed_attention
    packed_attention_paths = ("sdpa-mask", "varlen", "eager-mask")
    varlen_reason = "not checked"  # probe_causal_packing says whether the varlen path is exact here
    eager_reason = "not checked"  # … and whether the eager-mask path is

    def __init__(self, inner: nn.Module, spec: ExternalSpec, kind: str = "hf") -> None:
        super().__init__()
        self.inner = inner
        self.spec = spec
        self.kind = kind
        self.packing_reason = "not checked"
        config = inner.config
        self.attn_implementation = str(getattr(config, "_attn_implementation", None) or "eager")
        types = getattr(config, "layer_types", None)
        self.layer_types = tuple(dict.fromkeys(types or ("full_attention",)))
        window = getattr(config, "sliding_window", None)
        # a window on some layers (config.layer_types: Qwen2, Gemma 2/3, …) or, without layer types, on every layer
        # (Mistral): the packed mask applies it where the model's own mask would
        self.sliding_window = window if window and ("sliding_attention" in self.layer_types or not types) else None
        self.window_per_layer_type = bool(types)

    def set_packing(self, supported: bool, reason: str) -> tuple[bool, str]:
        self.supports_packing, self.packing_reason = supported, reason
        return supported, reason

    def path_available(self, path: str) -> Optional[str]:
        """None where packed rows can run attention ``path`` (``sdpa-mask`` always; ``varlen`` / ``eager-mask``
        where :func:`probe_causal_packing` found them exact), else why not (one line)."""
        reason = {"varlen": self.varlen_reason, "eager-mask": self.eager_reason}.get(path, "exact")
        return None if reason.startswith("exact") else reason

    def set_packed_attention(self, path: str, fns: Any = None) -> None:
        """Run packed rows through ``path``: ``sdpa-mask`` (the 4-D block-causal mask in the model's own attention),
        ``varlen`` (each sample attends over itself only: train/models/varlen.py) or ``eager-mask`` (the mask added
        to the scores in transformers' eager attention: :meth:`_run_packed`). ``fns`` is unused (the encoder's
        FlexAttention pair).

        Raises:
            ValueError: an unknown path, or one :func:`probe_causal_packing` did not find exact."""
        if path not in self.packed_attention_paths:
            raise ValueError(f"packed attention {path!r}: one of {', '.join(self.packed_attention_paths)}")
        why = self.path_available(path)
        if why is not None:
            raise ValueError(f"packed attention {path}: {why}")
        self.packed_attention = path

    @property
    def attention_dims(self) -> tuple[int, int]:
        """``(layers, query heads × head dim)`` of the decoder: what an attention kernel's score and value matmuls
        scale with (the FLOP count adds them where the counter cannot see the kernel)."""
        c = self.inner.config
        layers = int(getattr(c, "num_hidden_layers", 0) or getattr(c, "n_layer", 0) or 0)
        heads = int(getattr(c, "num_attention_heads", 0) or getattr(c, "n_head", 0) or 0)
        hidden = int(getattr(c, "hidden_size", 0) or getattr(c, "n_embd", 0) or 0)
        head_dim = int(getattr(c, "head_dim", 0) or (hidden // heads if heads else 0))
        return layers, heads * head_dim

    def loss_head(self) -> Optional[nn.Linear]:
        """The LM head (an ``nn.Linear`` hidden → vocabulary) where the chunked loss runs, else None."""
        return self.inner.get_output_embeddings() if self.chunked_loss else None

    def set_chunked_loss(self, on: bool) -> None:
        """``model.chunked_loss`` resolved: while training, forward returns the final hidden states [B, T, H] and
        the task applies :meth:`loss_head` chunk by chunk (train/tasks/chunked_loss.py); evaluation keeps logits."""
        self.chunked_loss = bool(on)

    def _run(self, hidden: bool, **kwargs: Any) -> torch.Tensor:
        if hidden:  # the decoder without its head: the head runs inside the chunked loss
            return self.inner.base_model(**kwargs, use_cache=False).last_hidden_state
        return self.inner(**kwargs, use_cache=False).logits

    def packed_mask(self, seq_index: torch.Tensor, implementation: Optional[str] = None) -> Any:
        """The attention mask for packed rows in the form ``implementation`` takes (default: the model's own): one
        4-D mask (with the sliding window when every layer has it), or ``{layer type: mask}`` when only some layers
        have a sliding window."""
        dtype = next(self.inner.parameters()).dtype
        impl = implementation or self.attn_implementation
        if self.sliding_window is None or self.window_per_layer_type:
            full = packed_attention_mask(causal_block_mask(seq_index), impl, dtype)
            if self.sliding_window is None:
                return full
        window = packed_attention_mask(causal_block_mask(seq_index, int(self.sliding_window)), impl, dtype)
        return {"full_attention": full, "sliding_attention": window} if self.window_per_layer_type else window

    def _run_packed(self, hidden: bool, path: str, input_ids: torch.Tensor, position_ids: torch.Tensor,
                    seq_index: torch.Tensor) -> torch.Tensor:
        if path == "varlen":  # no mask: the plan says which tokens form each sample
            with packed_forward(self.inner.config, seq_index):
                return self._run(hidden, input_ids=input_ids, attention_mask=None, position_ids=position_ids)
        if path == "eager-mask":
            # transformers' eager attention: score matmul + the additive mask, softmax in fp32, value matmul. On
            # rows of tens of tokens it beats torch's CPU flash kernel in bf16 (per-block overhead; docs/models.md)
            with attention_implementation(self.inner.config, "eager"):
                return self._run(hidden, input_ids=input_ids, attention_mask=self.packed_mask(seq_index, "eager"),
                                 position_ids=position_ids)
        return self._run(hidden, input_ids=input_ids, attention_mask=self.packed_mask(seq_index),
                         position_ids=position_ids)

    def packed_logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor, seq_index: torch.Tensor,
                      path: str = "sdpa-mask") -> torch.Tensor:
        """The inner model's logits for packed rows through attention ``path`` (no autocast entered, no dtype
        change, no support check)."""
        return self._run_packed(False, path, input_ids, position_ids, seq_index)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                blocks_context: Callable[[], ContextManager] = contextlib.nullcontext,
                position_ids: Optional[torch.Tensor] = None, seq_index: Optional[torch.Tensor] = None,
                num_seqs: Optional[int] = None) -> torch.Tensor:
        """Logits FloatTensor[B, T, V] (packed rows: [R, C, V]); while training with the chunked loss, the final
        hidden states [B, T, H] in the forward's dtype instead. Raises ValueError for packed rows on a model without
        them (``supports_packing`` false)."""
        hidden = self.chunked_loss and self.training
        if position_ids is not None:
            if not self.supports_packing:
                raise ValueError(f"{self.spec.source}: packed rows are not supported by this model "
                                 f"({self.packing_reason})")
            if seq_index is None:
                raise ValueError(f"{self.spec.source}: packed rows need seq_index (the sample of each token, -1 on "
                                 "padding) for the block-causal mask")
            with blocks_context():
                out = self._run_packed(hidden, self.packed_attention, input_ids, position_ids, seq_index)
            return out if hidden else out.float()
        mask = attention_mask.to(torch.long)
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        with blocks_context():
            out = self._run(hidden, input_ids=input_ids, attention_mask=mask, position_ids=positions)
        return out if hidden else out.float()
