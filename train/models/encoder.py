"""BERT-style encoder classifier (Devlin et al. 2019), in plain torch.nn. No training logic here.

Token + learned position embeddings → LayerNorm → N pre-LN encoder layers (multi-head
self-attention through ``F.scaled_dot_product_attention`` with a bool key-padding mask, then a
GELU FFN) → final LayerNorm → pooling over real tokens → linear head.

Padding never changes a sample's logits: padded keys are masked out of attention, positions
are absolute (padding is appended at the end), and pooling ignores padded positions.

The forward pass is split so a precision policy can run the embeddings and the loss in fp32
and only the encoder blocks under autocast: ``blocks_context`` is entered around the blocks.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(num_layers=4, hidden_size=256, num_heads=4, ffn_size=1024),
    "small": dict(num_layers=6, hidden_size=512, num_heads=8, ffn_size=2048),
    "bert-base": dict(num_layers=12, hidden_size=768, num_heads=12, ffn_size=3072),
}


@dataclass
class EncoderSpec:
    """Resolved model sizes."""

    vocab_size: int
    num_classes: int
    max_len: int
    num_layers: int
    hidden_size: int
    num_heads: int
    ffn_size: int
    dropout: float = 0.1
    pooling: str = "mean"

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")


def resolve_spec(preset: str, vocab_size: int, num_classes: int, max_len: int, dropout: float = 0.1,
                 pooling: str = "mean", **overrides: Optional[int]) -> EncoderSpec:
    """Sizes from ``PRESETS[preset]`` with non-None ``overrides`` (num_layers, hidden_size, num_heads, ffn_size)."""
    sizes = dict(PRESETS[preset])
    sizes.update({k: v for k, v in overrides.items() if v is not None})
    return EncoderSpec(vocab_size=vocab_size, num_classes=num_classes, max_len=max_len, dropout=dropout,
                       pooling=pooling, **sizes)


class SelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.dropout = dropout

    def forward(self, x: torch.Tensor, attn_mask: Union[torch.Tensor, Callable[..., torch.Tensor]]) -> torch.Tensor:
        """x: [B, S, H]; attn_mask: bool [B, 1, 1, S] or [B, 1, S, S], True = attend, or (packed rows with
        ``packed_attention=flex``) a FlexAttention call ``attend(q, k, v)`` holding its block mask. Returns
        [B, S, H]."""
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)  # 3×[B, nh, S, hs]
        if isinstance(attn_mask, torch.Tensor):
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                               dropout_p=self.dropout if self.training else 0.0)
        else:  # FlexAttention has no attention-probability dropout
            y = attn_mask(q, k, v)
        return self.out(y.transpose(1, 2).reshape(b, s, h))


class EncoderLayer(nn.Module):
    """Pre-LN transformer encoder layer: x + Attn(LN(x)), then x + FFN(LN(x))."""

    def __init__(self, hidden: int, heads: int, ffn: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = SelfAttention(hidden, heads, dropout)
        self.ln2 = nn.LayerNorm(hidden)
        self.ffn = nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x), attn_mask))
        return x + self.drop(self.ffn(self.ln2(x)))


class EncoderClassifier(nn.Module):
    """Sequence classifier.

    forward(input_ids: LongTensor[B, S], attention_mask: BoolTensor[B, S] (True = real token))
    → logits FloatTensor[B, num_classes] (fp32 whatever the blocks ran in).
    """

    def __init__(self, spec: EncoderSpec) -> None:
        super().__init__()
        self.spec = spec
        self.tok_emb = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.pos_emb = nn.Embedding(spec.max_len, spec.hidden_size)
        self.emb_norm = nn.LayerNorm(spec.hidden_size)
        self.emb_drop = nn.Dropout(spec.dropout)
        self.layers = nn.ModuleList(
            EncoderLayer(spec.hidden_size, spec.num_heads, spec.ffn_size, spec.dropout) for _ in range(spec.num_layers))
        self.final_norm = nn.LayerNorm(spec.hidden_size)
        self.head = nn.Linear(spec.hidden_size, spec.num_classes)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        # BERT's initialisation: N(0, 0.02) weights, zero biases.
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, S] ids → [B, S, H] fp32 embeddings (token + position, LayerNorm, dropout)."""
        s = input_ids.shape[1]
        if s > self.spec.max_len:
            raise ValueError(f"sequence length {s} exceeds the position table ({self.spec.max_len})")
        pos = torch.arange(s, device=input_ids.device)
        return self.emb_drop(self.emb_norm(self.tok_emb(input_ids) + self.pos_emb(pos)))

    def encode(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[B, S, H] → [B, S, H] through the encoder layers (the part that runs under autocast)."""
        attn_mask = attention_mask[:, None, None, :]  # [B, 1, 1, S], broadcast over heads and queries
        for layer in self.layers:
            x = layer(x, attn_mask)
        return x

    def pool_and_classify(self, h: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[B, S, H] → fp32 logits [B, C]; pooling and the head run in fp32."""
        h = self.final_norm(h.float())
        if self.spec.pooling == "cls":
            pooled = h[:, 0]
        else:
            m = attention_mask.unsqueeze(-1).to(h.dtype)  # [B, S, 1]
            pooled = (h * m).sum(1) / m.sum(1).clamp_min(1.0)
        return self.head(pooled).float()

    supports_packing = True
    """Packed rows (``position_ids`` + ``seq_index``) run exactly: see :meth:`forward`."""
    packed_attention = "sdpa-mask"
    """Packed rows' attention path: ``sdpa-mask`` (``scaled_dot_product_attention`` with a block-diagonal bool mask,
    every torch) or ``flex`` (FlexAttention with a document block mask, torch ≥ 2.5); see
    :meth:`set_packed_attention`."""
    packed_attention_paths = ("sdpa-mask", "flex")
    _flex: Optional[tuple[Callable, Callable]] = None

    def set_packed_attention(self, path: str, flex: Optional[tuple[Callable, Callable]] = None) -> None:
        """Run packed rows through ``path`` (``sdpa-mask`` | ``flex``); ``flex`` takes ``(flex_attention,
        create_block_mask)`` from :func:`train.compat.flex_attention_functions` (``flex_attention`` possibly
        compiled)."""
        if path not in ("sdpa-mask", "flex"):
            raise ValueError(f"unknown packed attention path {path!r}")
        if path == "flex" and flex is None:
            raise ValueError("packed attention flex needs (flex_attention, create_block_mask)")
        self.packed_attention, self._flex = path, (flex if path == "flex" else None)

    def packed_mask(self, seq_index: torch.Tensor) -> Union[torch.Tensor, Callable[..., torch.Tensor]]:
        """What the layers attend through for packed rows ``seq_index`` [R, C]: the block-diagonal bool mask
        [R, 1, C, C] (``sdpa-mask``), or a FlexAttention call with the same predicate as a document block mask
        (``flex``). Padding (−1) attends to padding in both, as its own document: no query row is fully masked
        (no NaN forward or backward), and real tokens never see padding."""
        if self.packed_attention != "flex" or self._flex is None:
            return (seq_index[:, :, None] == seq_index[:, None, :])[:, None]
        flex_attention, create_block_mask = self._flex

        def same_sample(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            return seq_index[b, q] == seq_index[b, kv]

        rows, c = seq_index.shape
        block_mask = create_block_mask(same_sample, rows, None, c, c, device=seq_index.device)
        return functools.partial(flex_attention, block_mask=block_mask)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                blocks_context: Callable[[], ContextManager] = contextlib.nullcontext,
                position_ids: Optional[torch.Tensor] = None, seq_index: Optional[torch.Tensor] = None,
                num_seqs: Optional[int] = None) -> torch.Tensor:
        """Logits FloatTensor[B, num_classes]; or, for packed rows (``position_ids``, ``seq_index`` LongTensor[R, C],
        ``num_seqs`` int), logits FloatTensor[num_seqs, num_classes], one row per packed sample, equal to its
        unpacked logits: positions restart at each sample, attention is block-diagonal (:meth:`packed_mask`: a bool
        mask [R, 1, C, C] where ``seq_index`` is equal, or FlexAttention's block mask; padding attends to padding, so no
        query row is fully masked: ``scaled_dot_product_attention`` works on torch 2.1), pooling runs per sample
        (Krell et al. 2021, arXiv:2107.02027)."""
        if position_ids is None:
            x = self.embed(input_ids)
            with blocks_context():
                h = self.encode(x, attention_mask)
            return self.pool_and_classify(h, attention_mask)
        if seq_index is None or num_seqs is None:
            raise ValueError("packed rows need position_ids, seq_index and num_seqs")
        x = self.emb_drop(self.emb_norm(self.tok_emb(input_ids) + self.pos_emb(position_ids)))  # [R, C, H]
        block_mask = self.packed_mask(seq_index)
        with blocks_context():
            for layer in self.layers:
                x = layer(x, block_mask)
        h = self.final_norm(x.float()).reshape(-1, x.shape[-1])  # [R·C, H]
        idx = seq_index.reshape(-1)
        # padding (−1) goes to an extra slot num_seqs, dropped below: no data-dependent indexing, no host sync
        slot = torch.where(idx >= 0, idx, torch.full_like(idx, num_seqs))
        if self.spec.pooling == "cls":
            first = (idx >= 0) & (position_ids.reshape(-1) == 0)
            slot = torch.where(first, slot, torch.full_like(idx, num_seqs))
            pooled = torch.zeros(num_seqs + 1, h.shape[1], dtype=h.dtype, device=h.device).index_add(0, slot, h)
        else:
            sums = torch.zeros(num_seqs + 1, h.shape[1], dtype=h.dtype, device=h.device).index_add(0, slot, h)
            counts = torch.bincount(slot, minlength=num_seqs + 1).clamp_min(1).to(h.dtype)
            pooled = sums / counts[:, None]
        return self.head(pooled[:num_seqs]).float()


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: decay on matrices of Linear layers; none on biases, LayerNorm and embeddings. A parameter shared
    by two modules (a decoder's LM head tied to its token embedding) goes where its first module puts it. Frozen
    parameters (``requires_grad`` false: an adapter run's base) get no group, so AdamW keeps no state for them."""
    decay, no_decay, seen = [], [], set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) not in seen and p.requires_grad:
                seen.add(id(p))
                (decay if isinstance(module, nn.Linear) and name == "weight" else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
