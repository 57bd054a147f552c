"""Precision policy: the only place that creates ``autocast`` contexts and ``GradScaler``s.

Layered mixed precision: parameters and optimizer state stay fp32 (master weights); the model
runs its embeddings, pooling, head and the loss in fp32 and only its encoder blocks inside
:meth:`PrecisionPolicy.blocks_autocast` (see ``EncoderClassifier.forward``). fp16 gets a GradScaler;
bf16 never does (its exponent range equals fp32's).

``auto`` chooses:

* CUDA with bf16 → bf16; CUDA without → fp16 + GradScaler (rules, from the device's capability);
* CPU without native bf16 instructions (no AVX512-BF16 / AMX in ``/proc/cpuinfo``) → fp32 (a rule:
  bf16 autocast would be emulated);
* CPU with native bf16 → a measurement on the run's own shape: the FFN's first matmul
  ``[tokens, hidden] @ [hidden, ffn]`` at the run's token budget (:class:`ProbeShape`), fp32 against
  bf16 autocast, interleaved, median of :data:`PROBE_REPEATS` repeats; bf16 only when it is at least
  :data:`BF16_MARGIN` × faster, so a ratio near 1 does not flip the decision from run to run.
  The measured decision is cached per machine (CPU model + flags, torch version, torch threads,
  probe shape) in ``<data.cache_dir>/decisions/``: later runs reuse it and say so. A measurement taken
  while the machine is busy (1-minute load average above the core count) is used but not cached.

The choice, its reason and its source (``requested``, ``rule``, ``measured``, ``cached``,
``checkpoint``) go into report.json; a resumed run continues in its checkpoint's precision.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from train.compat import make_grad_scaler
from train.errors import UserError
from train.perf.ab import Arm, interleave
from train.tools import decisions
from train.tools.env import cpuinfo as _cpuinfo
from train.tools.env import machine_load

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BF16_MARGIN = 1.25
"""bf16 must run the probe at least this many times faster than fp32 for ``auto`` to pick it on a CPU."""
PROBE_REPEATS = 9
PROBE_MAX_TOKENS = 2048
DECISION_FORMAT = 2  # 2: the record names its fingerprint "fingerprint" (train/tools/decisions.py)


def cpu_native_bf16() -> bool:
    """True when /proc/cpuinfo lists avx512_bf16 or amx_bf16 (Linux; False elsewhere)."""
    flags = set(_cpuinfo()[1].split())
    return "avx512_bf16" in flags or "amx_bf16" in flags


@dataclass(frozen=True)
class ProbeShape:
    """The matmul ``auto`` times on a CPU: ``[tokens, hidden] @ [hidden, ffn]`` (the FFN's first linear layer)."""

    tokens: int
    hidden: int
    ffn: int

    def __str__(self) -> str:
        return f"[{self.tokens}x{self.hidden}]@[{self.hidden}x{self.ffn}]"


def probe_for(cfg) -> ProbeShape:
    """The probe for a run config: its model's hidden/FFN sizes at its token budget (``batching.max_tokens``,
    else ``batch_size × data.max_len``), capped at :data:`PROBE_MAX_TOKENS` tokens to keep the check short."""
    from train.models.encoder import PRESETS

    sizes = dict(PRESETS[cfg.model.preset])
    for key in ("hidden_size", "ffn_size"):
        if getattr(cfg.model, key) is not None:
            sizes[key] = getattr(cfg.model, key)
    budget = cfg.batching.max_tokens or cfg.batching.batch_size * cfg.data.max_len
    return ProbeShape(tokens=int(min(budget, PROBE_MAX_TOKENS)), hidden=sizes["hidden_size"], ffn=sizes["ffn_size"])


def measure_bf16_speedup(probe: ProbeShape, repeats: int = PROBE_REPEATS) -> dict[str, Any]:
    """Time ``F.linear`` at ``probe`` in fp32 and under CPU bf16 autocast (casts included, as in training).

    Through the one A/B primitive (:func:`train.perf.ab.interleave`): one untimed call of each first; then
    ``repeats`` rounds, each timing one fp32 call and one bf16 call in alternating order. Returns ``fp32_ms`` and
    ``bf16_ms`` (medians, milliseconds), ``ratio`` (fp32_ms / bf16_ms: > 1 means bf16 is faster), its paired
    ``ratio_interval`` and ``repeats``.
    """
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(probe.tokens, probe.hidden, generator=gen)
    w = torch.randn(probe.ffn, probe.hidden, generator=gen) / probe.hidden ** 0.5
    b = torch.zeros(probe.ffn)

    def arm(dtype: str) -> Arm:
        def one() -> None:
            with torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext():
                torch.nn.functional.linear(x, w, b)

        return Arm(dtype, one)

    # the one A/B primitive: an untimed call each (allocations, kernel selection), then rotated rounds
    ab = interleave([arm("fp32"), arm("bf16")], rounds=repeats, window=1, warmup=1, device=torch.device("cpu"))
    fp32_ms, bf16_ms = ab.arms["fp32"].median_step_ms(), ab.arms["bf16"].median_step_ms()
    r = ab.ratio("bf16", "fp32", "steps")
    return {"fp32_ms": fp32_ms, "bf16_ms": bf16_ms, "ratio": fp32_ms / bf16_ms, "ratio_interval": [r.low, r.high],
            "repeats": repeats}


def machine_fingerprint(probe: ProbeShape) -> dict[str, Any]:
    """What a cached CPU decision is valid for: CPU model and flags, torch version, torch threads, probe shape."""
    name, flags = _cpuinfo()
    return {"cpu": name or os.uname().machine, "flags_sha256": hashlib.sha256(flags.encode()).hexdigest()[:16],
            "torch": torch.__version__.split("+")[0], "threads": torch.get_num_threads(), "probe": str(probe)}


RESUMED = "resumed in the checkpoint's precision ({})"


def resumed_reason(saved_reason: str) -> str:
    """The reason of a resumed run's precision: the original decision's reason, said once however often the run was
    resumed (a checkpoint written by a resumed run holds an already wrapped reason)."""
    head, tail = RESUMED.split("{}")
    while saved_reason.startswith(head) and saved_reason.endswith(tail):
        saved_reason = saved_reason[len(head):-len(tail)]
    return RESUMED.format(saved_reason)


@dataclass
class PrecisionDecision:
    """A resolved precision: ``mode`` (fp32|bf16|fp16), ``reason`` (one sentence), ``source``
    (requested|rule|measured|cached|checkpoint), and the ``measurement`` behind a measured/cached one."""

    mode: str
    reason: str
    source: str
    measurement: Optional[dict[str, Any]] = None
    cache_path: Optional[str] = None


def decision_cache_path(probe: ProbeShape, cache_dir: str) -> Path:
    """Where the measured CPU decision for this machine and probe is cached under ``cache_dir``."""
    return Path(decisions.cache_path(cache_dir, "precision-cpu", machine_fingerprint(probe), DECISION_FORMAT))


def _cpu_measured(probe: ProbeShape, cache_dir: Optional[str]) -> PrecisionDecision:
    machine = machine_fingerprint(probe)
    path = str(decision_cache_path(probe, cache_dir)) if cache_dir else None
    cached = decisions.read_cached(path, machine, "mode", ("fp32", "bf16"))
    if cached is not None:
        return PrecisionDecision(cached["mode"], cached["reason"], "cached", cached["measurement"], path)
    load = machine_load()
    m = measure_bf16_speedup(probe)
    mode = "bf16" if m["ratio"] >= BF16_MARGIN else "fp32"
    verdict = (f"ran {m['ratio']:.2f}x faster in bf16" if m["ratio"] >= 1
               else f"ran {1 / m['ratio']:.2f}x slower in bf16")
    reason = (f"auto: CPU has native bf16 and the FFN matmul {probe} {verdict} "
              f"(median of {m['repeats']}: fp32 {m['fp32_ms']:.2f} ms, bf16 {m['bf16_ms']:.2f} ms; "
              f"bf16 needs >= {BF16_MARGIN}x)")
    # a busy machine skews the two dtypes differently (bf16 measured slower under load once): used, not pinned
    decision = PrecisionDecision(mode, reason + decisions.busy_note(load), "measured", m, None)
    decision.cache_path = decisions.store(path, {"mode": mode, "reason": reason, "measurement": m,
                                                 "fingerprint": machine}, load)
    return decision


def decide(mode: str, device: torch.device, probe: Optional[ProbeShape] = None,
           cache_dir: Optional[str] = None) -> PrecisionDecision:
    """Resolve ``mode`` (auto|fp32|bf16|fp16) on ``device`` (see the module docstring for ``auto``).

    ``probe`` (default: the ``tiny`` model at 2,048 tokens) and ``cache_dir`` matter only for ``auto`` on a
    CPU with native bf16; without ``cache_dir`` nothing is cached.

    Raises:
        UserError: fp16 requested on CPU, or bf16 on a CUDA device without bf16 support.
    """
    if device.type == "cuda":
        bf16_ok = torch.cuda.is_bf16_supported()
        if mode == "auto":
            if bf16_ok:
                return PrecisionDecision("bf16", "auto: CUDA device supports bf16 (no loss scaling needed)", "rule")
            return PrecisionDecision("fp16", "auto: CUDA device without bf16 support: fp16 with GradScaler", "rule")
        if mode == "bf16" and not bf16_ok:
            raise UserError(f"train.precision=bf16: {torch.cuda.get_device_name(device)} has no bf16 support; "
                            "use fp16 or auto")
        return PrecisionDecision(mode, "requested", "requested")
    if mode == "fp16":
        raise UserError("train.precision=fp16 needs a CUDA device (fp16 autocast on CPU is slow or unsupported); "
                        "use fp32 or auto")
    if mode != "auto":
        return PrecisionDecision(mode, "requested", "requested")
    if not cpu_native_bf16():
        return PrecisionDecision("fp32", "auto: this CPU has no native bf16 (no AVX512-BF16/AMX in /proc/cpuinfo), so "
                                 "bf16 autocast would be emulated: fp32 by rule", "rule")
    return _cpu_measured(probe or ProbeShape(PROBE_MAX_TOKENS, 256, 1024), cache_dir)


@dataclass
class PrecisionPolicy:
    """Resolved precision for one run. Build with :meth:`create`, :meth:`for_config` or :meth:`for_resume`."""

    mode: str
    reason: str
    device: torch.device
    scaler: Optional[Any] = None
    source: str = "requested"
    measurement: Optional[dict[str, Any]] = field(default=None, repr=False)

    @classmethod
    def from_decision(cls, d: PrecisionDecision, device: torch.device) -> "PrecisionPolicy":
        scaler = make_grad_scaler(device.type) if d.mode == "fp16" else None
        return cls(mode=d.mode, reason=d.reason, device=device, scaler=scaler, source=d.source,
                   measurement=d.measurement)

    @classmethod
    def create(cls, mode: str, device: torch.device, probe: Optional[ProbeShape] = None,
               cache_dir: Optional[str] = None) -> "PrecisionPolicy":
        """Raises UserError as :func:`decide`."""
        return cls.from_decision(decide(mode, device, probe, cache_dir), device)

    @classmethod
    def for_config(cls, cfg, device: torch.device) -> "PrecisionPolicy":
        """``train.precision`` of a run config, probed on its model and token budget, cached under
        ``data.cache_dir``."""
        return cls.create(cfg.train.precision, device, probe_for(cfg), cfg.data.cache_dir)

    @classmethod
    def for_resume(cls, saved: Optional[dict[str, Any]], cfg, device: torch.device, where: str) -> "PrecisionPolicy":
        """The precision a resumed run continues in: the checkpoint's (``saved``: its ``precision`` entry), so
        ``auto`` cannot pick another one on another machine. ``saved`` None (an older checkpoint): as
        :meth:`for_config`.

        Raises:
            UserError: the config asks for another explicit precision, or this device cannot run the saved one.
        """
        if not saved:
            return cls.for_config(cfg, device)
        mode, asked = saved["mode"], cfg.train.precision
        if asked not in ("auto", mode):
            raise UserError(f"{where} was trained in {mode} but train.precision={asked}; "
                            f"resume with train.precision=auto (or {mode}), or start a new run to change precision")
        try:
            decide(mode, device)
        except UserError as exc:
            raise UserError(f"{where} was trained in {mode}, which this device cannot continue ({exc}); resume on a "
                            f"device with {mode} support or start a new run") from None
        why = resumed_reason(saved.get("reason") or mode)
        return cls.from_decision(PrecisionDecision(mode, why, "checkpoint", saved.get("measurement")), device)

    def state(self) -> dict[str, Any]:
        """What a checkpoint records (plain values): mode, reason, source."""
        return {"mode": self.mode, "reason": self.reason, "source": self.source}

    def report(self) -> dict[str, Any]:
        """report.json ``env`` fields: ``precision``, ``precision_reason``, ``precision_source``,
        ``precision_measurement``."""
        return {"precision": self.mode, "precision_reason": self.reason, "precision_source": self.source,
                "precision_measurement": self.measurement}

    def blocks_autocast(self) -> ContextManager:
        """Context for the encoder blocks: autocast to the policy dtype, or nothing for fp32."""
        if self.mode == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=DTYPES[self.mode])

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients to true units before clipping or logging their norm."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()
