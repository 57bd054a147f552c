"""``model.fast_dropout``: a cheaper dropout mask for any model, swapped in module by module, measured and said.

``torch.nn.Dropout`` draws its mask with ``bernoulli_`` in the input's dtype, one generator draw per element; under
CPU bf16 autocast that is a bf16 ``bernoulli_``, the top op of ``make profile`` on the built-in model and on a
Hugging Face BERT (docs/models.md). :class:`FastDropout` keeps inverted dropout (Srivastava et al. 2014: each
element kept with probability 1 - p, scaled by 1 / (1 - p)) but draws the mask from **16-bit uniform integers, four
to each full-width 64-bit draw** (``random_(-2**63, None)`` on int64, viewed as int16) compared with a threshold: a
quarter of the generator calls and no float conversion. The keep probability is then a multiple of 2^-16: p is
rounded to ``p' = round(p * 65536) / 65536`` (|p' - p| <= 2^-17; 0.1 -> 0.100006) and the kept values are scaled by
1 / (1 - p'), so the output's expectation is still exactly the input (docs/models.md has its timing against
``F.dropout`` and a float32-uniform mask). Inside a graph traced by ``torch.compile`` a float32-uniform mask
(``torch.rand(...) >= p``) is used instead: the compiler fuses it with the multiply.

It draws from the same global torch generator (so checkpoints' RNG snapshot still makes resume bit-exact), but
consumes it differently: the random stream, and so the training trajectory, is not the same as with ``nn.Dropout``
— a lever that is checked for quality before it is called a gain.

Dropout that does not run through an ``nn.Dropout`` module cannot be swapped and is said so: attention-probability
dropout handed to ``scaled_dot_product_attention`` (``dropout_p``: the built-in encoder, Hugging Face models with the
``sdpa`` attention), ``F.dropout`` called in a forward.

``auto`` times one training step of the run's model on one real batch with each mask through the one A/B primitive
(a probe trainer, restored after) and swaps only when the paired ratio's interval lies above 1.0; the decision is
cached under ``data.cache_dir/decisions/`` like the other ``auto`` decisions.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from typing import Any, Optional

import torch
from torch import nn

from train.compat import is_compiling
from train.perf.switch_ab import switch_ab
from train.tools import decisions
from train.tools.env import machine_load

DECISION_FORMAT = 1


MASK_BITS = 16
"""Bits of each uniform integer the mask compares: the keep probability is a multiple of 2^-MASK_BITS."""


def quantized_p(p: float) -> float:
    """The drop probability :class:`FastDropout` draws with: ``p`` rounded to a multiple of 2^-16 (at most
    1 - 2^-16, so something is always kept)."""
    return min(round(p * (1 << MASK_BITS)), (1 << MASK_BITS) - 1) / (1 << MASK_BITS)


def keep_mask(shape: torch.Size, p: float, device: torch.device) -> torch.Tensor:
    """A bool tensor of ``shape`` on ``device``, each element True with probability ``1 - quantized_p(p)``,
    independently: 16-bit uniform integers, four per full-width int64 draw of the global torch generator, compared
    with ``quantized_p(p) * 2^16 - 2^15``."""
    n = math.prod(shape)
    words = torch.empty((n + 3) // 4, dtype=torch.int64, device=device).random_(-(1 << 63), None)
    threshold = round(quantized_p(p) * (1 << MASK_BITS)) - (1 << (MASK_BITS - 1))
    return (words.view(torch.int16)[:n] >= threshold).view(shape)


class FastDropout(nn.Module):
    """Inverted dropout with a 16-bit mask (module docstring): ``x * keep / (1 - p')`` in training, identity in eval.

    Input and output: any shape and floating dtype (the output keeps the input's dtype). ``p`` in [0, 1); the drop
    probability drawn is ``p' = quantized_p(p)`` (|p' - p| <= 2^-17).

    Raises:
        ValueError: ``p`` outside [0, 1).
    """

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        if not 0 <= p < 1:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p = float(p)
        self.scale = 1.0 / (1.0 - quantized_p(self.p))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        if is_compiling():  # traced: the compiler fuses a float32-uniform mask into the multiply
            return x * (torch.rand(x.shape, device=x.device, dtype=torch.float32) >= self.p).to(x.dtype) \
                * (1.0 / (1.0 - self.p))
        return x * keep_mask(x.shape, self.p, x.device).to(x.dtype).mul_(self.scale)

    def extra_repr(self) -> str:
        return f"p={self.p}"


def set_fast_dropout(model: nn.Module, fast: bool) -> int:
    """Swap every ``nn.Dropout`` with p > 0 for :class:`FastDropout` (``fast``) or back (``not fast``), in place.
    Returns the number of modules swapped."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if fast and type(child) is nn.Dropout and child.p > 0:
                setattr(parent, name, FastDropout(child.p))
                swapped += 1
            elif not fast and isinstance(child, FastDropout):
                setattr(parent, name, nn.Dropout(child.p))
                swapped += 1
    return swapped


def unswappable(model: nn.Module) -> list[str]:
    """Dropout this swap cannot reach, in words (attention dropout inside a fused SDPA kernel)."""
    out = []
    spec = getattr(model, "spec", None)
    if getattr(spec, "dropout", 0) and hasattr(model, "layers"):  # the built-in encoder
        out.append(f"attention dropout ({spec.dropout}) runs inside scaled_dot_product_attention (dropout_p): "
                   "fused, not swapped")
    config = getattr(getattr(model, "inner", None), "config", None)
    attn_p = getattr(config, "attention_probs_dropout_prob", 0) or getattr(config, "attention_dropout", 0)
    if config is not None and attn_p and getattr(config, "_attn_implementation", "eager") != "eager":
        out.append(f"attention dropout ({attn_p}) runs inside the {config._attn_implementation} attention kernel: "
                   "not swapped")
    return out


def measure(model: nn.Module, step: Callable[[dict], Any], batch: dict, device: torch.device,
            rounds: int = 5) -> dict[str, Any]:
    """One training step (``step(batch)``) with ``nn.Dropout`` vs :class:`FastDropout`, interleaved; the model is
    left with ``nn.Dropout``. Returns ``{"speedup": fast ÷ torch steps/s, "low", "high", "verdict", "torch_ms",
    "fast_ms", "rounds"}``."""
    ab = switch_ab(step, batch, lambda fast: set_fast_dropout(model, fast), {"torch": False, "fast": True},
                   restore=False, rounds=rounds, device=device)
    r = ab.ratio("fast", "torch", "steps")
    return {"speedup": r.median, "low": r.low, "high": r.high, "verdict": r.verdict, "rounds": rounds,
            "torch_ms": ab.arms["torch"].median_step_ms(), "fast_ms": ab.arms["fast"].median_step_ms(),
            "load_1min_start": ab.load_start, "load_1min_end": ab.load_end}


def decide_fast_dropout(model: nn.Module, requested: str, precision: str, cache_dir: Optional[str],
                        batch: Callable[[], dict], device: torch.device,
                        probe: Callable[[], ContextManager[Callable[[dict], Any]]],
                        measure_fn: Optional[Callable[..., dict[str, Any]]] = None) -> dict[str, Any]:
    """Resolve ``model.fast_dropout`` for this run (the model is left as it is: the caller swaps with
    :func:`set_fast_dropout` when ``applied``); returns report.json's ``levers.fast_dropout``: ``applied``,
    ``reason``, ``source`` (requested | rule | measured | cached), ``modules`` (to swap), ``not_swapped`` (what
    cannot be) and the ``measurement`` behind a measured/cached one. ``batch()``: one real training batch (asked for
    only when measuring or fingerprinting); ``probe()``: a context giving the run's training step and restoring the
    model after it."""
    dropouts = sum(1 for m in model.modules() if type(m) is nn.Dropout and m.p > 0)
    out: dict[str, Any] = {"requested": requested, "not_swapped": unswappable(model), "measurement": None}
    if requested == "false" or dropouts == 0:
        why = "model.fast_dropout=false" if requested == "false" else "the model has no nn.Dropout with p > 0"
        return {**out, "applied": False, "modules": 0, "source": "requested" if requested == "false" else "rule",
                "reason": why}
    if requested == "true":
        return {**out, "applied": True, "modules": dropouts, "source": "requested",
                "reason": f"requested (model.fast_dropout=true): {dropouts} nn.Dropout modules swapped"}
    batch = batch()
    fp = decisions.step_fingerprint(model, precision, batch)
    path = decisions.cache_path(cache_dir, "fast-dropout", fp, DECISION_FORMAT)
    cached = decisions.read_cached(path, fp, "fast", (True, False))
    if cached is not None:
        m, source, reason = cached["measurement"], "cached", cached["reason"]
        fast = cached["fast"]
    else:
        load = machine_load()
        with probe() as step:
            m = (measure_fn or measure)(model, step, batch, device)
        fast = m["low"] is not None and m["low"] > 1.0
        interval = "no interval" if m["low"] is None else f"{m['low']:.2f}, {m['high']:.2f}"
        reason = (f"auto: one training step ran {m['speedup']:.2f}x [{interval}] (median of {m['rounds']} paired "
                  f"rounds) with the 16-bit mask (median step {m['fast_ms']:.1f} vs {m['torch_ms']:.1f} ms, "
                  f"{precision}): "
                  + ("swapped" if fast else "kept nn.Dropout (no measurable gain)"))
        source = "measured"
        decisions.store(path, {"fast": fast, "reason": reason, "measurement": m, "fingerprint": fp}, load)
        reason += decisions.busy_note(load)
    return {**out, "applied": bool(fast), "modules": dropouts if fast else 0, "source": source, "reason": reason,
            "measurement": m}
