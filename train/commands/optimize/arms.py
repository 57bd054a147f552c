"""Running arms: built configurations warmed, interleaved, trained on untimed and read for quality together
(:class:`ArmSet`, used by the search's A/Bs, ``optimize-grid``'s screening and the fresh process of its final), and
what happens when one fails — the time limit (:func:`time_limit`) and the one-line reason (:func:`failure_reason`)."""

from __future__ import annotations

import contextlib
import gc
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any, Optional, Protocol

import torch

from train.perf.ab import ABResult, Arm, interleave


class ArmHandle(Protocol):
    """One built configuration: ``warmup(samples)`` runs its one-off work (compilation) and untimed steps until it has
    seen ``samples`` and returns the one-off seconds; ``step()`` one training step's counts; ``quality()`` its held-out
    ``loss`` and ``nonfinite_steps``; ``close()`` frees it."""

    def warmup(self, samples: int) -> float: ...
    def step(self) -> dict[str, float]: ...
    def quality(self) -> dict[str, Any]: ...
    def close(self) -> None: ...


class ArmSet:
    """Arms built by ``backend.arm(name, settings)``, each counting the training samples it has seen (``seen``: the
    warm-up's target, then every step's ``samples``), so that quality is read at the same samples whatever the steps'
    sizes. A context manager: every arm is closed on exit, whatever happened."""

    def __init__(self, backend: Any, device: torch.device) -> None:
        self.backend, self.device = backend, device
        self.handles: dict[str, ArmHandle] = {}
        self.seen: dict[str, int] = {}

    def build(self, name: str, settings: dict[str, Any]) -> None:
        self.handles[name] = self.backend.arm(name, settings)

    def warm(self, name: str, samples: int) -> float:
        """``name``'s one-off work and untimed steps up to ``samples``; returns the one-off seconds."""
        one_off = self.handles[name].warmup(samples)
        self.seen[name] = samples
        return one_off

    def step(self, name: str) -> dict[str, float]:
        counts = self.handles[name].step()
        self.seen[name] += int(counts["samples"])
        return counts

    def interleave(self, rounds: int, window_samples: int,
                   on_round: Optional[Callable[[int], None]] = None) -> ABResult:
        """Every arm, ``rounds`` timed windows of ``window_samples`` samples each, the order rotating
        (:func:`~train.perf.ab.interleave`; the arms are warm already)."""
        arms = [Arm(n, lambda n=n: self.step(n)) for n in self.handles]
        return interleave(arms, rounds=rounds, window_samples=window_samples, warmup=0, device=self.device,
                          on_round=on_round)

    def train_to(self, name: str, samples: int) -> None:
        """Untimed steps of ``name`` until it has seen ``samples``."""
        while self.seen[name] < samples:
            self.step(name)

    def quality(self, name: str) -> dict[str, Any]:
        return self.handles[name].quality()

    def close(self) -> None:
        """Close every arm and give their memory back (nothing of them stays alive for what is timed next)."""
        for h in self.handles.values():
            with contextlib.suppress(Exception):
                h.close()
        self.handles.clear()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def __enter__(self) -> "ArmSet":
        return self

    def __exit__(self, *_exc: Any) -> None:
        self.close()


class ArmTimeout(Exception):
    """A candidate ran past ``optimize.arm_timeout_s``."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`ArmTimeout` in the main thread after ``seconds`` (SIGALRM; no limit off the main thread or where
    the OS has no SIGALRM). A call stuck inside C code that never returns to Python is not interruptible this way."""
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(_sig, _frame):
        raise ArmTimeout(f"ran past optimize.arm_timeout_s={seconds:g} s (a hang, or too slow to measure)")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def failure_reason(exc: BaseException) -> str:
    """One line for a failed arm: ``out of memory: …``, ``timed out: …``, ``hit the recompile limit: …`` or
    ``raised <Type>: …``."""
    text = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
    if isinstance(exc, ArmTimeout):
        return f"timed out: {text}"
    if isinstance(exc, MemoryError) or "out of memory" in text.lower() or type(exc).__name__ == "OutOfMemoryError":
        return f"out of memory: {text or type(exc).__name__}"
    if "recompile" in text.lower() and "limit" in text.lower():
        return f"hit the recompile limit: {text}"
    return f"raised {type(exc).__name__}: {text}"
