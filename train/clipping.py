"""Gradient clipping strategies, applied to gradients in true (unscaled) units.

``clip_gradients(params, cfg)`` dispatches on ``clip.method``:

* ``global-norm`` — scale all gradients by ``min(1, max_norm / ‖g‖₂)`` where ‖g‖₂ is the L2 norm of
  all gradients concatenated (as ``torch.nn.utils.clip_grad_norm_``; Pascanu et al. 2013).
* ``per-layer-std`` — clamp each parameter's gradient elementwise to ``±k·σ``, σ the population
  standard deviation of that gradient's elements (the project's original design, k = 2.5).
  Tensors with fewer than 2 elements or σ = 0 are left alone.
* ``agc`` — adaptive gradient clipping, unit-wise (Brock et al. 2021, "High-Performance Large-Scale
  Image Recognition Without Normalization", §4.1): for each unit i (row of a weight matrix, the whole
  tensor for 1-D parameters) with ‖Gᵢ‖ / max(‖Wᵢ‖, ε) > λ, set Gᵢ ← λ · max(‖Wᵢ‖, ε) / ‖Gᵢ‖ · Gᵢ.
  The unit-wise norm follows timm's ``timm/utils/agc.py``.
* ``none`` — no change.

Every method returns the pre-clip global L2 norm (fp32, true units; non-finite when any gradient is)
and the fraction of gradient elements the clipping changed, both as 0-d device tensors: nothing here
reads a value back to the host, so clipping adds no host-device sync. FSDP2-sharded gradients (DTensors,
``dist.strategy=fsdp``): each rank clips its shards with the norm of the whole gradients (one all-reduce of the
squared local norms); ``per-layer-std`` and ``agc`` need whole gradients and are refused there (train/parallel/fsdp.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from train.compat import is_dtensor, local_tensor

METHODS = ("global-norm", "per-layer-std", "agc", "none")


@dataclass
class ClipResult:
    """grad_norm: 0-d fp32 tensor, pre-clip global L2 norm of all gradients (true units).
    clipped_fraction: 0-d fp32 tensor in [0, 1], fraction of gradient elements changed by clipping."""

    grad_norm: torch.Tensor
    clipped_fraction: torch.Tensor


def global_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm of all ``grads`` together, as a 0-d fp32 tensor (one fused ``_foreach_norm``, no sync).

    inf or NaN in any gradient makes the result non-finite, which the numerics guard relies on.
    """
    if not grads:
        return torch.zeros(())
    norms = torch._foreach_norm(grads)
    return torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))


def clip_global_norm_(grads: list[torch.Tensor], total: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Scale ``grads`` in place so their global norm is at most ``max_norm``. Returns the fraction
    of elements changed: 1.0 when the norm exceeded ``max_norm`` (every element scaled), else 0.0."""
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_(grads, coef.to(grads[0].dtype))
    return (total > max_norm).float()


def clip_per_layer_std_(grads: list[torch.Tensor], k: float) -> torch.Tensor:
    """Clamp each gradient elementwise to ``±k·σ`` (σ: population std of that gradient). Returns the
    fraction of all elements clamped."""
    clipped = torch.zeros((), device=grads[0].device)
    total = 0
    for g in grads:
        total += g.numel()
        if g.numel() < 2:
            continue
        std = g.float().std(correction=0)
        thr = torch.where(std > 0, k * std, torch.full_like(std, float("inf"))).to(g.dtype)
        clipped += (g.abs() > thr).sum()
        torch.clamp(g, min=-thr, max=thr, out=g)
    return clipped / max(total, 1)


def unitwise_norm(x: torch.Tensor) -> torch.Tensor:
    """L2 norm per output unit: over all dims but the first (keepdim) for ≥2-D tensors, whole tensor for 1-D."""
    if x.ndim <= 1:
        return torch.linalg.vector_norm(x.float())
    return torch.linalg.vector_norm(x.float(), dim=tuple(range(1, x.ndim)), keepdim=True)


def clip_agc_(params: list[torch.Tensor], grads: list[torch.Tensor], clip_factor: float, eps: float) -> torch.Tensor:
    """Adaptive gradient clipping (Brock et al. 2021) in place. Returns the fraction of elements in clipped units."""
    clipped = torch.zeros((), device=grads[0].device)
    total = 0
    for p, g in zip(params, grads):
        total += g.numel()
        max_norm = unitwise_norm(p.detach()).clamp(min=eps) * clip_factor
        g_norm = unitwise_norm(g)
        over = g_norm > max_norm
        scale = torch.where(over, max_norm / g_norm.clamp(min=1e-6), torch.ones_like(g_norm))
        g.mul_(scale.to(g.dtype))
        clipped += over.float().sum() * (g.numel() // max(over.numel(), 1))
    return clipped / max(total, 1)


def clip_gradients(params: Iterable[torch.nn.Parameter], method: str = "global-norm", max_norm: float = 1.0,
                   std_k: float = 2.5, agc_lambda: float = 0.01, agc_eps: float = 1e-3) -> ClipResult:
    """Clip the ``.grad`` of ``params`` in place with ``method`` (one of :data:`METHODS`).

    Call after ``GradScaler.unscale_`` so thresholds and the returned norm are in true units.
    Parameters without a gradient are ignored. Raises ValueError for an unknown method, or ``per-layer-std`` /
    ``agc`` on FSDP2-sharded gradients.
    """
    if method not in METHODS:
        raise ValueError(f"unknown clipping method {method!r}; expected one of {METHODS}")
    with_grad = [p for p in params if p.grad is not None]
    grads = [p.grad for p in with_grad]
    if not grads:
        zero = torch.zeros(())
        return ClipResult(zero, zero.clone())
    sharded = is_dtensor(grads[0])
    if sharded and method in ("per-layer-std", "agc"):
        raise ValueError(f"clip.method={method} needs whole gradients; these are FSDP2 shards")
    grads = [local_tensor(g) for g in grads]  # in place on the shards: DTensor's own ops would add collectives
    total = global_grad_norm(grads)
    if sharded:  # the norm over all ranks' shards: sqrt of the summed squares
        total = total.square()
        torch.distributed.all_reduce(total)
        total = total.sqrt()
    if method == "global-norm":
        fraction = clip_global_norm_(grads, total, max_norm)
    elif method == "per-layer-std":
        fraction = clip_per_layer_std_(grads, std_k)
    elif method == "agc":
        fraction = clip_agc_(with_grad, grads, agc_lambda, agc_eps)
    else:
        fraction = torch.zeros((), device=total.device)
    return ClipResult(total, fraction.float())
