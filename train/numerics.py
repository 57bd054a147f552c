"""Numerics guard: skip steps with non-finite loss or gradients, count them, name the culprit, abort.

Healthy steps pay no host-device sync. Per step the guard only queues device ops:
``ok = isfinite(loss) & isfinite(global grad norm)`` (the norm the clipping computes anyway is
non-finite iff some gradient is), plus a few 0-d accumulators (finite-loss sum, norm sum, clipped
fraction, bad-step count, current and longest run of consecutive bad steps). The skip itself:

* fp16: the GradScaler skips on its own ``found_inf`` (its overflow check on the same unscaled
  gradients); the guard counts those steps through ``ok``.
* fp32/bf16 with a fused optimizer (AdamW ``fused=True``: CUDA, and CPU from torch 2.4): the guard
  hands ``found_inf = ~ok`` to the optimizer through the attribute protocol GradScaler uses
  (``optimizer.found_inf``); the fused kernel then leaves parameters, moments and step count
  untouched, decided on the device.
* otherwise (non-fused optimizer): ``if ok:`` — a host read. On CPU that is not a device sync;
  on CUDA the trainer picks the fused optimizer so this branch is not taken.

The accumulators are read once per logged step (:meth:`NumericsGuard.end_window`, one transfer),
where the loop already synchronises. If that window had bad steps and no module has been named yet,
forward hooks are attached for the next window only (``diagnose``); they check each module's output
and record the first (in execution order) that is non-finite. After ``max_bad_steps`` consecutive
bad steps :class:`NumericsAbort` is raised (the CLI exits 3); the trainer first re-runs the last
batch under the hooks so the report names the module.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch
from torch import nn

from train.clipping import ClipResult
from train.compat import local_tensor
from train.errors import RunAborted


class NumericsAbort(RunAborted):
    """Raised after too many consecutive non-finite steps (exit code 3). ``diagnosis`` goes into report.json."""

    def __init__(self, message: str, diagnosis: dict[str, Any]) -> None:
        super().__init__(message)
        self.diagnosis = diagnosis


def _finite(x: Any) -> bool:
    return not isinstance(x, torch.Tensor) or not x.is_floating_point() or bool(torch.isfinite(x).all())


def supports_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """True when ``optimizer.step`` honours ``optimizer.found_inf`` (fused Adam/AdamW/SGD)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and bool(optimizer.defaults.get("fused"))


class NumericsGuard:
    """Per-run guard. ``max_bad_steps``: consecutive bad steps before :class:`NumericsAbort`."""

    def __init__(self, model: nn.Module, device: torch.device, max_bad_steps: int = 10, diagnose: bool = True) -> None:
        self.model, self.device = model, device
        self.max_bad_steps, self.diagnose = max_bad_steps, diagnose
        z = lambda: torch.zeros((), device=device)  # noqa: E731
        self._loss, self._norm, self._clipped, self._bad = z(), z(), z(), z()
        self._run, self._longest = z(), z()  # current / longest run of consecutive bad steps
        self.skipped_steps = 0
        self.longest_bad_run = 0
        self.first_nonfinite: Optional[dict[str, Any]] = None
        self.nonfinite_grads: list[str] = []
        self._armed = False  # hooks on the next window's forwards
        self._step = 0

    # -- per step (device ops only) ------------------------------------------------------------
    def observe(self, loss: torch.Tensor, clip: ClipResult) -> torch.Tensor:
        """Record one step; returns ``ok`` (0-d bool device tensor: loss and gradients finite)."""
        self._step += 1
        norm = clip.grad_norm.to(self.device)
        ok = torch.isfinite(loss.detach().float()) & torch.isfinite(norm)
        bad = (~ok).float()
        self._loss += torch.where(ok, loss.detach().float(), torch.zeros_like(self._loss))
        self._norm += torch.where(ok, norm, torch.zeros_like(self._norm))
        self._clipped += torch.where(ok, clip.clipped_fraction.to(self.device), torch.zeros_like(self._clipped))
        self._bad += bad
        self._run.mul_(bad).add_(bad)  # run = (run + 1) if bad else 0
        torch.maximum(self._longest, self._run, out=self._longest)
        return ok

    def step(self, policy: Any, optimizer: torch.optim.Optimizer, ok: torch.Tensor) -> None:
        """Take the optimizer step unless ``ok`` is False (see the module docstring for how)."""
        if policy.scaler is not None:
            policy.step(optimizer)  # GradScaler skips on its own found_inf
        elif supports_found_inf(optimizer):
            optimizer.grad_scale = None
            # on the parameters' device: the host's under dist.offload (a copy there; the offload's copies wait anyway)
            optimizer.found_inf = (~ok).float().to(local_tensor(optimizer.param_groups[0]["params"][0]).device)
            try:
                optimizer.step()
            finally:
                del optimizer.grad_scale, optimizer.found_inf
        elif bool(ok):  # host read: not a device sync on CPU; CUDA uses the fused branch above
            optimizer.step()
        if self._armed:
            self._check_after_step(ok)

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        """Wrap the training forward: attaches output-checking hooks only while diagnosing."""
        if not self._armed:
            yield
            return
        with self.hooks():
            yield

    # -- diagnosis (syncs allowed: only after something went wrong) -------------------------------
    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        """Forward hooks on every submodule recording the first non-finite output as ``first_nonfinite``."""
        names = {m: n for n, m in self.model.named_modules() if n}

        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            if self.first_nonfinite is not None:
                return
            outs = output if isinstance(output, (tuple, list)) else (output,)
            if not all(_finite(o) for o in outs):
                self.first_nonfinite = {"module": names[module], "type": type(module).__name__,
                                        "inputs_finite": all(_finite(i) for i in inputs), "step": self._step}

        handles = [m.register_forward_hook(hook) for m in names]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _check_after_step(self, ok: torch.Tensor) -> None:
        if not bool(ok) and not self.nonfinite_grads:
            self.nonfinite_grads = [n for n, p in self.model.named_parameters()
                                    if p.grad is not None and not _finite(p.grad)][:20]
        if self.first_nonfinite is not None:
            self._armed = False

    def diagnose_batch(self, forward_backward: Callable[[], torch.Tensor]) -> None:
        """Re-run one forward/backward (no optimizer step) under the hooks; grads are cleared after.
        The RNG state is restored so the diagnosis does not change the rest of the run."""
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []), self.hooks():
            loss = forward_backward()
        if not self.nonfinite_grads:
            self.nonfinite_grads = [n for n, p in self.model.named_parameters()
                                    if p.grad is not None and not _finite(p.grad)][:20]
        if self.first_nonfinite is None and not _finite(loss):
            self.first_nonfinite = {"module": "loss (cross-entropy)", "type": "loss", "inputs_finite": True,
                                    "step": self._step}
        self.model.zero_grad(set_to_none=True)

    # -- per logged step ------------------------------------------------------------------------
    def end_window(self, steps: int) -> dict[str, Any]:
        """Read the window's accumulators (one device→host transfer), reset them, arm diagnosis if
        needed. Returns the metrics.jsonl fields: loss and grad_norm (means over the finite steps),
        clipped_fraction, skipped_steps (this window)."""
        loss, norm, clipped, bad, longest = torch.stack(
            [self._loss, self._norm, self._clipped, self._bad, self._longest]).tolist()  # sync point: once per log
        for t in (self._loss, self._norm, self._clipped, self._bad):
            t.zero_()
        self._longest.copy_(self._run)
        bad = int(bad)
        self.skipped_steps += bad
        self.longest_bad_run = max(self.longest_bad_run, int(longest))
        good = steps - bad
        if bad and self.diagnose and self.first_nonfinite is None:
            self._armed = True
        elif not bad:
            self._armed = False
        return {"loss": loss / good if good else None, "grad_norm": norm / good if good else None,
                "clipped_fraction": clipped / good if good else None, "skipped_steps": bad}

    def state_dict(self) -> dict[str, Any]:
        """The open window's accumulators and the run's counters (tensors and plain values: checkpoint-safe)."""
        return {"accumulators": torch.stack([self._loss, self._norm, self._clipped, self._bad, self._run,
                                             self._longest]).detach().cpu().clone(),
                "skipped_steps": self.skipped_steps, "longest_bad_run": self.longest_bad_run, "step": self._step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        acc = state["accumulators"].to(self.device)
        for t, v in zip((self._loss, self._norm, self._clipped, self._bad, self._run, self._longest), acc):
            t.copy_(v)
        self.skipped_steps, self.longest_bad_run = int(state["skipped_steps"]), int(state["longest_bad_run"])
        self._step = int(state["step"])

    def should_abort(self) -> bool:
        return self.longest_bad_run >= self.max_bad_steps

    def abort(self, step: int) -> NumericsAbort:
        where = self.first_nonfinite["module"] if self.first_nonfinite else "not identified"
        msg = (f"{self.longest_bad_run} consecutive steps with non-finite loss or gradients (limit "
               f"numerics.max_bad_steps={self.max_bad_steps}) by step {step}; first non-finite output: {where}. "
               "Try a lower optim.lr, train.precision=fp32 or bf16, or clip.method=global-norm")
        return NumericsAbort(msg, {**self.report(), "aborted_at_step": step})

    def report(self) -> dict[str, Any]:
        """The ``numerics`` section of report.json."""
        return {"skipped_steps": self.skipped_steps, "longest_bad_run": self.longest_bad_run,
                "max_bad_steps": self.max_bad_steps, "first_nonfinite": self.first_nonfinite,
                "nonfinite_grads": self.nonfinite_grads, "aborted": False}
