"""Precision policy: the only place that creates ``autocast`` contexts and ``GradScaler``s.

Layered mixed precision: parameters and optimizer state stay fp32 (master weights); the model
runs its embeddings, pooling, head and the loss in fp32 and only its encoder blocks inside
:meth:`PrecisionPolicy.blocks_autocast` (see ``EncoderClassifier.forward``). fp16 gets a GradScaler;
bf16 never does (its exponent range equals fp32's).

``auto`` chooses: CUDA with bf16 → bf16; CUDA without → fp16 + GradScaler; CPU → bf16 only when
the CPU has native bf16 instructions (AVX512-BF16 or AMX) *and* a short in-process matmul check
shows bf16 faster than fp32; otherwise fp32. The choice and its reason go into report.json.
"""

from __future__ import annotations

import contextlib
import time
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from train.compat import make_grad_scaler
from train.errors import UserError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def cpu_native_bf16() -> bool:
    """True when /proc/cpuinfo lists avx512_bf16 or amx_bf16 (Linux; False elsewhere)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _matmul_seconds(dtype: torch.dtype, n: int = 512, reps: int = 5) -> float:
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    a @ b  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def resolve_precision(mode: str, device: torch.device) -> tuple[str, str]:
    """Resolve ``mode`` (auto|fp32|bf16|fp16) on ``device`` to (mode, reason).

    Raises:
        UserError: fp16 requested on CPU, or bf16 on a CUDA device without bf16 support.
    """
    if device.type == "cuda":
        bf16_ok = torch.cuda.is_bf16_supported()
        if mode == "auto":
            if bf16_ok:
                return "bf16", "auto: CUDA device supports bf16 (no loss scaling needed)"
            return "fp16", "auto: CUDA device without bf16 support: fp16 with GradScaler"
        if mode == "bf16" and not bf16_ok:
            raise UserError(f"train.precision=bf16: {torch.cuda.get_device_name(device)} has no bf16 support; use fp16 or auto")
        return mode, "requested"
    if mode == "fp16":
        raise UserError("train.precision=fp16 needs a CUDA device (fp16 autocast on CPU is slow or unsupported); use fp32 or auto")
    if mode == "auto":
        if not cpu_native_bf16():
            return "fp32", ("auto: this CPU has no native bf16 (no AVX512-BF16/AMX), so bf16 autocast is emulated "
                            "and slower than fp32 (measured 20-70x on an AVX2 EPYC)")
        fp32_s, bf16_s = _matmul_seconds(torch.float32), _matmul_seconds(torch.bfloat16)
        if bf16_s < fp32_s:
            return "bf16", f"auto: CPU has native bf16 and a 512x512 matmul ran {fp32_s / bf16_s:.2f}x faster in bf16"
        return "fp32", f"auto: CPU has native bf16 but a 512x512 matmul was {bf16_s / fp32_s:.2f}x slower in bf16"
    return mode, "requested"


@dataclass
class PrecisionPolicy:
    """Resolved precision for one run. Build with :meth:`create`."""

    mode: str
    reason: str
    device: torch.device
    scaler: Optional[Any] = None

    @classmethod
    def create(cls, mode: str, device: torch.device) -> "PrecisionPolicy":
        resolved, reason = resolve_precision(mode, device)
        scaler = make_grad_scaler(device.type) if resolved == "fp16" else None
        return cls(mode=resolved, reason=reason, device=device, scaler=scaler)

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
