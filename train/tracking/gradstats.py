"""Per-layer gradient statistics (norm and standard deviation per parameter tensor) for metrics.jsonl.

Computed on the device right after an optimizer step, every ``tracking.grad_stats_every`` logged
records, and read to the host in one transfer at that moment (a host-device sync on CUDA, at a step
that already syncs to log its record). The norms are *pre-clip*, in true (unscaled) units: the
trainer clips in place with ``clip_grad_norm_``, whose scale factor is
``min(1, clip_norm / (total_norm + 1e-6))`` (torch.nn.utils.clip_grad_norm_), so dividing by that
factor recovers each tensor's norm before clipping. That is what per-layer clipping is judged on.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from train.callbacks import Callback
from train.compat import foreach_norm
from train.tracking.loggers import MetricLogger


def grad_table(named_params: list[tuple[str, torch.Tensor]], clip_scale: Optional[torch.Tensor] = None
               ) -> dict[str, dict[str, Optional[float]]]:
    """``{param_name: {"norm": L2 norm, "std": population std, "numel": n}}`` of each parameter's ``.grad``.

    Args:
        named_params: ``model.named_parameters()`` as a list; parameters without a gradient are skipped.
        clip_scale: 0-d tensor, the factor clipping multiplied the gradients by (≤ 1); norms and stds are
            divided by it to report pre-clip values. None = report the gradients as they are.

    The norms come from one ``torch._foreach_norm`` (fused on CUDA); all values cross to the host in a
    single ``.tolist()`` (the only sync).
    """
    names, grads = [], []
    for name, p in named_params:
        if p.grad is not None:
            names.append(name)
            grads.append(p.grad.detach())
    if not grads:
        return {}
    norms = torch.stack([n.float() for n in foreach_norm(grads)])  # [P] fp32
    stds = torch.stack([g.float().std(correction=0) if g.numel() > 1 else g.new_zeros((), dtype=torch.float32)
                        for g in grads])  # [P] fp32
    table = torch.stack([norms, stds])  # [2, P]
    if clip_scale is not None:
        table = table / clip_scale.float().clamp_min(1e-12)
    values = table.tolist()  # host-device sync: once per grad_stats record
    return {name: {"norm": values[0][i], "std": values[1][i], "numel": grads[i].numel()}
            for i, name in enumerate(names)}


class GradStatsCallback(Callback):
    """Plugs :class:`GradStats` into the loop: ``on_log`` hands it the trainer's model, the step's pre-clip
    norm and logger (the gradients are still in ``.grad`` then)."""

    def __init__(self, stats: "GradStats", trainer) -> None:
        self.stats, self.trainer = stats, trainer

    def on_log(self, record: dict[str, Any]) -> None:
        t = self.trainer
        self.stats.after_log(record["step"], t.model, t.last_grad_norm, t.logger)


class GradStats:
    """Emits a ``{"event": "grad_stats", "step", "clip_norm", "layers": {name: {norm, std, numel}}}`` record
    every ``every`` logged records. The counter persists across trainers (benchmarks reuse one instance)."""

    def __init__(self, every: int, clip_norm: Optional[float], log_every: int = 1) -> None:
        if every < 1 or log_every < 1:
            raise ValueError("every and log_every must be ≥ 1")
        self.every, self.clip_norm, self.log_every = every, clip_norm, log_every
        self.records = 0

    def after_log(self, step: int, model: torch.nn.Module, grad_norm: Optional[torch.Tensor],
                  logger: MetricLogger) -> None:
        """Call once after each logged record, while the step's gradients are still in ``.grad``.

        ``grad_norm``: the step's pre-clip global norm (0-d device tensor) returned by ``clip_grad_norm_``,
        or None when clipping is off.
        """
        # a function of the step, not a counter, so a resumed run writes the same records
        if (step // self.log_every) % self.every:
            return
        scale = None
        if grad_norm is not None and self.clip_norm is not None:
            scale = (self.clip_norm / (grad_norm.float() + 1e-6)).clamp(max=1.0)  # clip_grad_norm_'s factor
        layers = grad_table(list(model.named_parameters()), scale)
        record: dict[str, Any] = {"step": step, "event": "grad_stats", "pre_clip": scale is not None,
                                  "clip_norm": self.clip_norm, "layers": layers}
        logger.log(record)
        self.records += 1
