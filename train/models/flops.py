"""A model's FLOPs per training step (:func:`step_flops_for`): the built-in encoder's counted by ``FlopCounterMode``
on its own spec, any other module's measured by :class:`~train.perf.flops.ModuleFlops` (train/perf/flops.py holds the
counting rules and imports no model).

The encoder's only ``bmm``/SDPA ops are attention, so those are replaced by the analytic count
(:func:`~train.perf.flops.attention_training_flops`). :class:`StepFlops` counts once on the meta device (no compute)
and extrapolates exactly: without attention, a step's FLOPs are ``α·B·S + β·B`` (per-token layers, per-sample head).
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from train.models.encoder import EncoderClassifier, EncoderSpec
from train.perf.flops import ModuleFlops, attention_training_flops

STEP_FLOPS_METHOD = ("FlopCounterMode on the meta device at two lengths (per-token and per-sample layers), attention "
                     "analytic: 12·B·S²·H per layer")


def _counted_without_attention(model: EncoderClassifier, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> int:
    counter = FlopCounterMode(display=False)
    with counter:
        logits = model(input_ids, attention_mask)
        logits.float().sum().backward()
    counts = counter.get_flop_counts().get("Global", {})
    attention = sum(v for op, v in counts.items() if "scaled_dot_product" in str(op) or "bmm" in str(op))
    return int(counter.get_total_flops() - attention)


def training_step_flops(model: EncoderClassifier, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> int:
    """FLOPs of one forward + backward on this batch (input_ids: LongTensor[B, S]), run for real.

    Elementwise ops, norms and the optimizer are not counted, by the usual MFU convention.
    Gradients produced here are discarded.
    """
    was_training = model.training
    model.train()
    flops = _counted_without_attention(model, input_ids, attention_mask)
    model.zero_grad(set_to_none=True)
    model.train(was_training)
    b, s = input_ids.shape
    return flops + attention_training_flops(b, s, model.spec.hidden_size, model.spec.num_layers)


class StepFlops:
    """``StepFlops(spec)(batch, seq)`` → training FLOPs of one step of that shape, without computing anything.

    Counts the model built from ``spec`` on the meta device at two shapes with FlopCounterMode and
    solves for the per-token (α) and per-sample (β) coefficients; attention is added analytically.
    """

    def __init__(self, spec: EncoderSpec) -> None:
        self.spec = spec
        with torch.device("meta"):
            model = EncoderClassifier(spec)
        s1, s2 = 2, min(4, spec.max_len)
        f1, f2 = (self._count(model, s) for s in (s1, s2))
        self.per_token = (f2 - f1) // (s2 - s1)
        self.per_sample = f1 - self.per_token * s1

    @staticmethod
    def _count(model: EncoderClassifier, seq: int) -> int:
        ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
        mask = torch.ones(1, seq, dtype=torch.bool, device="meta")
        return _counted_without_attention(model, ids, mask)

    def __call__(self, batch: int, seq: int) -> int:
        spec = self.spec
        return (batch * (self.per_token * seq + self.per_sample)
                + attention_training_flops(batch, seq, spec.hidden_size, spec.num_layers))


def step_flops_for(model: torch.nn.Module) -> tuple:
    """``(flops(batch, seq), method)`` for this run's model: :class:`StepFlops` for the built-in encoder (its spec,
    no compute), :class:`~train.perf.flops.ModuleFlops` for any other module."""
    if isinstance(getattr(model, "spec", None), EncoderSpec):
        return StepFlops(model.spec), STEP_FLOPS_METHOD
    flops = ModuleFlops(model, int(getattr(getattr(model, "spec", None), "max_len", 0) or 16))
    return flops, flops.method
