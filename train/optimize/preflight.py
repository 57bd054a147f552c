"""Before ``make optimize`` measures or writes anything: what the model built from the config can do
(:class:`Capabilities`), and the refusal of a lever named in ``optimize.levers`` that cannot apply on this device and
model (:func:`refuse_inapplicable`). Without the refusal such a search profiled and A/B'd the baseline for tens of
seconds, wrote a run directory and kept nothing, the reason only in optimize.md."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

import train.precision as precision  # the module, not the name: tests force cpu_native_bf16 where it lives
from train.compat import fused_adamw_supported
from train.data.attention import alternatives
from train.errors import UserError


@dataclass(frozen=True)
class Capabilities:
    """What the model of a config can do: run packed rows (``supports_packing``), how many ``nn.Dropout`` modules with
    p > 0 it has (``dropout_modules``), its packed-rows attention paths besides ``sdpa-mask`` → why each cannot run
    here ("" where it can; ``attention_paths``)."""

    supports_packing: bool = False
    dropout_modules: int = 0
    attention_paths: dict[str, str] = field(default_factory=dict)


def model_capabilities(model: nn.Module, device: torch.device) -> Capabilities:
    """The :class:`Capabilities` of ``model`` (built, not trained) on ``device``."""
    drops = sum(1 for m in model.modules() if isinstance(m, nn.Dropout) and m.p > 0)
    paths = ({path: why for path, _, why in alternatives(model, device, compiled=False)}
             if hasattr(model, "set_packed_attention") else {})
    return Capabilities(bool(getattr(model, "supports_packing", False)), drops, paths)


@dataclass(frozen=True)
class Here:
    """The facts a lever's applicability is judged on: the user's ``cfg``, the model's ``caps``, the ``device``, the
    ``named`` levers (one lever may make another apply: packing the attention lever)."""

    cfg: Any
    caps: Capabilities
    device: torch.device
    named: tuple[str, ...]


def _precision(h: Here) -> Optional[str]:
    if h.device.type == "cuda" or precision.cpu_native_bf16():
        return None
    return ("this CPU has no native bf16 (no avx512_bf16 / amx_bf16 in /proc/cpuinfo): bf16 autocast would be "
            "emulated, slower than fp32, and fp16 needs CUDA")


def _attention(h: Here) -> Optional[str]:
    if not h.caps.supports_packing:
        return f"model.source={h.cfg.model.source} cannot run packed rows, whose attention path it sets"
    if not h.caps.attention_paths:
        return "the model runs its own attention with a block-diagonal mask (no other packed-rows path)"
    if h.cfg.batching.method != "packed" and "batching" not in h.named:
        return (f"batching.method={h.cfg.batching.method}: the path is packed rows' (set batching.method=packed, or "
                "name the batching lever too)")
    return None


def _allocator(h: Here) -> Optional[str]:
    if h.device.type != "cuda":
        return f"PYTORCH_CUDA_ALLOC_CONF sets CUDA's caching allocator: nothing to set on {h.device.type}"
    return "PYTORCH_CUDA_ALLOC_CONF is process-wide: both arms of an A/B would share it (make bench twice measures it)"


CHECKS: dict[str, Callable[[Here], Optional[str]]] = {
    "precision": _precision,
    "fast_dropout": lambda h: None if h.caps.dropout_modules else (
        f"the model (model.source={h.cfg.model.source}) has no nn.Dropout module with p > 0: no dropout mask to draw"),
    "chunked_loss": lambda h: None if h.cfg.model.task == "causal-lm" else (
        f"model.task={h.cfg.model.task} has logits [N, classes]: nothing to chunk"),
    "attention": _attention,
    "fused_adamw": lambda h: None if fused_adamw_supported(h.device) else (
        f"torch {torch.__version__} has no fused AdamW on {h.device.type}"),
    "threads": lambda h: "CPU threads are not a CUDA step's bottleneck" if h.device.type == "cuda" else None,
    "allocator": _allocator,
}
"""Per lever, why it cannot apply on this device and model whatever the profile shows (None: it may). Levers whose
applicability rests on the evidence or on another lever's outcome (batching, token_budget, workers, compile) have no
check: the search says why in optimize.md."""


def refuse_inapplicable(names: list[str], cfg: Any, caps: Capabilities, device: torch.device) -> None:
    """Refuse levers named in ``optimize.levers`` (``names``) that cannot apply here (:data:`CHECKS`).

    Raises:
        UserError: one line naming each such lever and why, and the fix (leave it out).
    """
    here = Here(cfg, caps, device, tuple(names))
    why = [f"{name}: {reason}" for name in names if (reason := CHECKS.get(name, lambda _h: None)(here))]
    if why:
        them = "it" if len(why) == 1 else "them"
        raise UserError(f"optimize.levers={','.join(names)}: cannot apply here — {'; '.join(why)}; leave {them} out of "
                        "--levers (or leave optimize.levers unset: every lever that applies is tried)")
