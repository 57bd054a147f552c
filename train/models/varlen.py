"""Variable-length attention for packed rows (``model.packed_attention=varlen``): attention that skips other samples.

A packed row [C] holding samples of lengths L₁…Lₖ pays C² attention scores under the block-causal mask (the mask
only hides scores it still computes); the samples alone need Σ Lᵢ². This path computes only those: the samples of a
batch are gathered out of their rows into groups of similar length (each group a right-padded [n, L] batch, L the
group's longest sample), each group runs ``F.scaled_dot_product_attention(is_causal=True)`` — with no mask, so the
CPU and CUDA fused kernels apply — and the outputs are put back in row order. It is exact: right padding sits after
every real key, so under the causal mask no real query sees it, and a padding token of a row gets a zero output
(it feeds only padding positions, which no loss reads). The same idea as FlashAttention's ``flash_attn_varlen_func``
(Dao 2023: sequences given by cumulative lengths instead of a mask) and transformers' padding-free path
(``DataCollatorWithFlattening`` + FlashAttention-2), built here from SDPA so it runs on CPU and on torch 2.1.

Samples are grouped by their length rounded up to :data:`GROUP_ROUND` tokens: fewer SDPA calls per layer against a
few padded scores per group. The plan (:func:`varlen_plan`) is built once per batch from ``seq_index``; Hugging Face
decoders call :func:`varlen_attention_forward` as a registered attention implementation (:data:`ATTN_IMPLEMENTATION`),
switched on, with the batch's plan, for the packed forward only (:func:`packed_forward`). The plan is held for the
forward rather than passed as a keyword argument because not every decoder forwards its keyword arguments to its
attention (GPT-2 in transformers 4.55 does not); backward needs no plan (autograd keeps the indices). Shapes change
with every batch, so a compiled model would recompile: the attention choice keeps this path for eager runs
(train/data/attention.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

GROUP_ROUND = 16
"""Samples whose lengths round up to the same multiple of this many tokens share one SDPA call."""
ATTN_IMPLEMENTATION = "dmp_varlen"
"""The name this attention function is registered under in transformers' ``AttentionInterface``."""
_ACTIVE: list[VarlenPlan] = []  # the plan of the packed forward running now (packed_forward)


@dataclass(frozen=True)
class VarlenGroup:
    """Samples of similar length attended together: ``gather`` LongTensor[n·L] (the token of each slot of the
    right-padded [n, L] group in the flattened rows; slots past a sample's end repeat a valid token and are never
    attended), ``count`` n, ``length`` L (the group's longest sample)."""

    gather: torch.Tensor
    count: int
    length: int


@dataclass(frozen=True)
class VarlenPlan:
    """How one packed batch [R, C] is attended sample by sample: its ``groups`` and ``scatter`` LongTensor[R·C] (for
    each token, its slot in the groups' outputs laid end to end; padding tokens point one past the end, at a zero
    row). ``pairs``: Σ n·L² over the groups, the query–key pairs the kernels compute per head (the row-dense mask
    computes R·C²)."""

    groups: tuple[VarlenGroup, ...]
    scatter: torch.Tensor
    rows: int
    capacity: int

    @property
    def pairs(self) -> int:
        return sum(g.count * g.length * g.length for g in self.groups)

    def to(self, device: torch.device) -> VarlenPlan:
        groups = tuple(VarlenGroup(g.gather.to(device), g.count, g.length) for g in self.groups)
        return VarlenPlan(groups, self.scatter.to(device), self.rows, self.capacity)


def segments(seq_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(starts, lengths)`` LongTensor[S] of the samples of packed rows: ``seq_index`` LongTensor[R, C] holds each
    token's sample number (-1 on padding); a sample is a run of equal numbers within one row."""
    r, c = seq_index.shape
    flat = seq_index.reshape(-1).to("cpu", torch.long)
    real = torch.nonzero(flat >= 0).squeeze(1)
    if real.numel() == 0:
        return real, real
    key = (real // c) * (c + 1) + flat[real]  # (row, sample): a sample number may repeat in another row
    new = torch.ones_like(real, dtype=torch.bool)
    new[1:] = (key[1:] != key[:-1]) | (real[1:] != real[:-1] + 1)
    starts = real[new]
    lengths = torch.bincount(torch.cumsum(new.long(), 0) - 1)
    return starts, lengths


def _grouped(lengths: torch.Tensor, round_to: int) -> list[tuple[torch.Tensor, int]]:
    """``[(member indices, group length)]``: the samples whose ``lengths`` round up to the same multiple of
    ``round_to``, and the longest of them."""
    keys = torch.div(lengths + round_to - 1, round_to, rounding_mode="floor")
    out = []
    for key in torch.unique(keys).tolist():
        members = torch.nonzero(keys == key).squeeze(1)
        out.append((members, int(lengths[members].max())))
    return out


def plan_pairs(seq_index: torch.Tensor, round_to: int = GROUP_ROUND) -> int:
    """:attr:`VarlenPlan.pairs` of :func:`varlen_plan` for ``seq_index`` without building the plan: the per-head
    query–key pairs its kernels compute (what the FLOP count charges the varlen path)."""
    return sum(int(m.numel()) * n * n for m, n in _grouped(segments(seq_index)[1], round_to))


def varlen_plan(seq_index: torch.Tensor, round_to: int = GROUP_ROUND) -> VarlenPlan:
    """The :class:`VarlenPlan` for packed rows ``seq_index`` LongTensor[R, C] (on any device; the plan is built on
    the CPU and moved to ``seq_index``'s device). Samples are grouped by ``ceil(L / round_to)``."""
    r, c = seq_index.shape
    starts, lengths = segments(seq_index)
    total = r * c
    scatter = torch.full((total,), 0, dtype=torch.long)
    groups: list[VarlenGroup] = []
    offset = 0
    for members, length in _grouped(lengths, round_to):
        g_starts, g_lengths = starts[members], lengths[members]
        slot = torch.arange(length)
        gather = (g_starts[:, None] + slot[None, :]).clamp_max(total - 1)  # [n, L]
        real = slot[None, :] < g_lengths[:, None]
        scatter[gather[real]] = offset + torch.nonzero(real.reshape(-1)).squeeze(1)
        groups.append(VarlenGroup(gather.reshape(-1), int(members.numel()), length))
        offset += int(members.numel()) * length
    padding = seq_index.reshape(-1).cpu() < 0
    scatter[padding] = offset  # the zero row after every group's outputs
    return VarlenPlan(tuple(groups), scatter, r, c).to(seq_index.device)


def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: VarlenPlan,
                     scale: Optional[float] = None, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention of each sample over itself only. ``query`` [R, Hq, C, D], ``key`` / ``value``
    [R, Hkv, C, D] (Hq a multiple of Hkv: grouped-query attention repeats each key/value head Hq/Hkv times, as
    transformers' ``repeat_kv``); returns [R, C, Hq, D] (the layout transformers' attention functions return),
    padding tokens 0. ``scale``: the score scale (default 1/√D); ``dropout_p``: attention-probability dropout."""
    r, hq, c, d = query.shape
    hkv = key.shape[1]
    q = query.transpose(1, 2).reshape(r * c, hq, d)
    k = key.transpose(1, 2).reshape(r * c, hkv, d)
    v = value.transpose(1, 2).reshape(r * c, hkv, d)
    outs = []
    for g in plan.groups:
        qg = q.index_select(0, g.gather).view(g.count, g.length, hq, d).transpose(1, 2)
        kg = k.index_select(0, g.gather).view(g.count, g.length, hkv, d).transpose(1, 2)
        vg = v.index_select(0, g.gather).view(g.count, g.length, hkv, d).transpose(1, 2)
        if hkv != hq:
            kg, vg = kg.repeat_interleave(hq // hkv, dim=1), vg.repeat_interleave(hq // hkv, dim=1)
        og = F.scaled_dot_product_attention(qg, kg, vg, dropout_p=dropout_p, is_causal=True, scale=scale)
        outs.append(og.transpose(1, 2).reshape(g.count * g.length, hq, d))
    outs.append(q.new_zeros(1, hq, d))
    return torch.cat(outs).index_select(0, plan.scatter).view(r, c, hq, d)


def varlen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: Any, dropout: float = 0.0, scaling: Optional[float] = None,
                             **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature (``AttentionInterface``) over :func:`varlen_attention`, with the
    plan of the running :func:`packed_forward`; ``attention_mask`` is ignored.

    Raises:
        ValueError: called outside :func:`packed_forward` (no plan).
    """
    if not _ACTIVE:
        raise ValueError(f"{ATTN_IMPLEMENTATION} attention runs inside packed_forward only (no plan)")
    return varlen_attention(query, key, value, _ACTIVE[-1], scale=scaling, dropout_p=dropout), None


def register() -> None:
    """Register :func:`varlen_attention_forward` with transformers (idempotent; 4.48+ and 5.x:
    ``transformers.AttentionInterface``)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, varlen_attention_forward)


@contextlib.contextmanager
def attention_implementation(config: Any, name: str) -> Iterator[None]:
    """For the block, the decoder whose ``config`` this is runs attention implementation ``name`` (every layer reads
    ``config._attn_implementation`` at call time, transformers 4.48+ and 5.x); its own is put back after."""
    before = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before


@contextlib.contextmanager
def packed_forward(config: Any, seq_index: torch.Tensor) -> Iterator[VarlenPlan]:
    """For the block: the decoder whose ``config`` this is runs :data:`ATTN_IMPLEMENTATION` with the plan of
    ``seq_index`` [R, C] (:func:`attention_implementation`)."""
    plan = varlen_plan(seq_index)
    _ACTIVE.append(plan)
    try:
        with attention_implementation(config, ATTN_IMPLEMENTATION):
            yield plan
    finally:
        _ACTIVE.pop()


class ReplayAttention:
    """``context_fn`` for ``torch.utils.checkpoint`` (non-reentrant) around a decoder layer of the model whose
    ``config`` this is: called as the layer's forward starts, it returns ``(nullcontext, replay)``, ``replay``
    re-entering, for the layer's recomputation in the backward pass (``memory.checkpoint_blocks``), the attention
    implementation and :func:`packed_forward` plan in force now — by then the packed forward's own contexts have
    exited, and the layer would recompute through another attention than the one its forward ran. A class, not a
    closure, so a deep copy of the model (export) copies the config it points at."""

    def __init__(self, config: Any) -> None:
        self.config = config

    def __call__(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        return contextlib.nullcontext(), _replay(self.config, self.config._attn_implementation,
                                                 _ACTIVE[-1] if _ACTIVE else None)


@contextlib.contextmanager
def _replay(config: Any, name: str, plan: Optional[VarlenPlan]) -> Iterator[None]:
    if plan is not None:
        _ACTIVE.append(plan)
    try:
        with attention_implementation(config, name):
            yield
    finally:
        if plan is not None:
            _ACTIVE.pop()
