"""Running arms: built configurations warmed, interleaved, trained on untimed and read for quality together
(:class:`ArmSet`, used by the search's A/Bs, ``optimize-grid``'s screening and the fresh process of its final), and
what happens when one fails — the time limit (:func:`time_limit`) and the one-line reason (:func:`failure_reason`)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Optional, Protocol

import torch

from train.optimize.deadline import Deadline, OutOfTime, budget_reason
from train.perf.ab import ABResult, Arm, ArmResult, Window, interleave, load_1min


class ArmHandle(Protocol):
    """One built configuration: ``warmup(samples)`` runs its one-off work (compilation) and untimed steps until it has
    seen ``samples`` and returns the one-off seconds (:class:`ArmSet` asks ``warmup(0)`` and takes the steps itself,
    so that the deadline is asked between them); ``step()`` one training step's counts; ``quality()`` its held-out
    ``loss`` and ``nonfinite_steps``; ``close()`` frees it."""

    def warmup(self, samples: int) -> float: ...
    def step(self) -> dict[str, float]: ...
    def quality(self) -> dict[str, Any]: ...
    def close(self) -> None: ...


class ArmSet:
    """Arms built by ``backend.arm(name, settings)``, each counting the training samples it has seen (``seen``: the
    warm-up's target, then every step's ``samples``), so that quality is read at the same samples whatever the steps'
    sizes. A context manager: every arm is closed on exit, whatever happened.

    With a ``deadline`` (:class:`~train.optimize.deadline.Deadline`) no timed window starts unless the rest
    of its round and ``tail()`` fit before it, at the arms' measured seconds per sample (a round cut short is dropped:
    its windows would be unpaired), no warm-up step starts once it has passed (:class:`OutOfTime`), and training on
    untimed stops once it has passed; ``stopped`` then says why
    (:func:`~train.optimize.deadline.budget_reason`). ``hold(rounds so far)``, asked after every round, may
    return an earlier deadline that holds from then on (the search: time for the final confirmation, once its
    candidate clears ``optimize.min_gain``). :meth:`timings` gives what the estimates of later work are made of."""

    def __init__(self, backend: Any, device: torch.device, deadline: Optional[Deadline] = None,
                 hold: Optional[Callable[[ABResult], Optional[Deadline]]] = None) -> None:
        self.backend, self.device, self.deadline, self.hold = backend, device, deadline, hold
        self.clock: Callable[[], float] = deadline.clock if deadline is not None else time.perf_counter
        self.handles: dict[str, ArmHandle] = {}
        self.seen: dict[str, int] = {}
        self.stopped: Optional[str] = None
        self.tail: Callable[[], float] = lambda: 0.0
        """Seconds of the work that must follow the timed rounds (quality reads not yet done): a round starts only
        when it and this fit the deadline."""
        self.quality_s: list[float] = []
        self._t0 = self.clock()
        self._closed_s: Optional[float] = None
        self._stepping_s = 0.0  # seconds spent in training steps (warm-up less its one-off work, windows, train_to)
        self._rate: dict[str, tuple[float, float]] = {}  # name → (seconds, samples) of its timed windows
        self._warm_rate: dict[str, float] = {}  # name → seconds per sample of its warm-up steps

    def build(self, name: str, settings: dict[str, Any]) -> None:
        self.handles[name] = self.backend.arm(name, settings)

    def warm(self, name: str, samples: int) -> float:
        """``name``'s one-off work (``warmup(0)``), then untimed steps up to ``samples``; returns the one-off seconds.

        Raises:
            OutOfTime: the deadline passed before the warm-up's steps were done (no step starts after it).
        """
        one_off = self.handles[name].warmup(0)
        t0, done = self.clock(), 0
        while done < samples:
            if self.deadline is not None and self.deadline.expired():
                raise OutOfTime(budget_reason(self.deadline, f"warming {name} up ({done} of {samples} samples)",
                                              1e-9) or "")
            done += int(self.handles[name].step()["samples"])
        steps_s = self.clock() - t0
        self._stepping_s += steps_s
        if done:
            self._warm_rate[name] = steps_s / done
        self.seen[name] = samples
        return one_off

    def step(self, name: str) -> dict[str, float]:
        counts = self.handles[name].step()
        self.seen[name] += int(counts["samples"])
        return counts

    def seconds_per_sample(self, name: str) -> Optional[float]:
        """``name``'s measured seconds per training sample: over its timed windows, else its warm-up's steps."""
        if name in self._rate and self._rate[name][1]:
            return self._rate[name][0] / self._rate[name][1]
        return self._warm_rate.get(name)

    def _no_time(self, rest: list[str], window_samples: int, r: int, rounds: int) -> Optional[str]:
        """Why the windows ``rest`` of round ``r`` do not start (None: they fit the deadline, or there is none)."""
        if self.deadline is None:
            return None
        need = sum(window_samples * (self.seconds_per_sample(n) or 0.0) for n in rest) + self.tail()
        what = f"round {r + 1} of {rounds}" + ("" if len(rest) == len(self.handles) else
                                                f" ({len(rest)} of its {len(self.handles)} windows)")
        return budget_reason(self.deadline, what, need)

    def interleave(self, rounds: int, window_samples: int,
                   on_round: Optional[Callable[[int], None]] = None) -> ABResult:
        """Every arm, ``rounds`` timed windows of ``window_samples`` samples each, the order rotating by one arm per
        round as in :func:`~train.perf.ab.interleave` (the arms are warm already). Each window is one call of that
        primitive, so that the deadline is asked before every window: a round whose remaining windows do not fit is
        dropped and the result holds the rounds completed (``stopped`` says why)."""
        names = list(self.handles)
        arms = {n: Arm(n, lambda n=n: self.step(n)) for n in names}
        out = {n: ArmResult(n, []) for n in names}
        load_start, done = load_1min(), 0
        for r in range(rounds):
            k = r % len(names) if names else 0
            order = names[k:] + names[:k]
            got: dict[str, Window] = {}
            for i, n in enumerate(order):
                why = self._no_time(order[i:], window_samples, r, rounds)
                if why is not None:
                    self.stopped = why
                    break
                one = interleave([arms[n]], rounds=1, window_samples=window_samples, warmup=0, device=self.device)
                got[n] = dataclasses.replace(one.arms[n].windows[0], round=r)
            self._stepping_s += sum(w.seconds for w in got.values())  # a dropped round's windows were spent too
            if self.stopped is not None:
                break
            for n, w in got.items():
                out[n].windows.append(w)
                spent, samples = self._rate.get(n, (0.0, 0.0))
                self._rate[n] = (spent + w.seconds, samples + w.counts.get("samples", 0))
            done += 1
            if self.hold is not None and self.deadline is not None:
                tighter = self.hold(ABResult(out, done, load_start, None))
                self.deadline = tighter if tighter is not None else self.deadline
            if on_round is not None:
                on_round(r)
        return ABResult(out, done, load_start, load_1min())

    def train_to(self, name: str, samples: int) -> bool:
        """Untimed steps of ``name`` until it has seen ``samples``; with a deadline, not started when that training
        does not fit it at ``name``'s measured speed, and stopped when it passes: False then (``stopped`` says
        why)."""
        t0, t0_seen = self.clock(), self.seen[name]
        try:
            while self.seen[name] < samples:
                if self.deadline is not None and (self.seen[name] == t0_seen or self.deadline.expired()):
                    need = (samples - self.seen[name]) * (self.seconds_per_sample(name) or 0.0)
                    why = budget_reason(self.deadline, f"training {name} on to {samples} samples", max(need, 1e-9))
                    if why is not None:
                        self.stopped = why
                        return False
                self.step(name)
            return True
        finally:
            self._stepping_s += self.clock() - t0

    def quality(self, name: str) -> dict[str, Any]:
        t0 = self.clock()
        try:
            return self.handles[name].quality()
        finally:
            self.quality_s.append(self.clock() - t0)

    def timings(self) -> dict[str, Any]:
        """``per_sample``: each arm's measured seconds per training sample; ``quality_s``: the median quality read's
        seconds; ``fixed_s``: the seconds of everything but training steps (builds, one-off work, quality reads,
        closing), once closed (else None)."""
        return {"per_sample": {n: self.seconds_per_sample(n) for n in self.seen},
                "quality_s": sorted(self.quality_s)[len(self.quality_s) // 2] if self.quality_s else None,
                "fixed_s": None if self._closed_s is None else max(0.0, self._closed_s - self._stepping_s)}

    def close(self) -> None:
        """Close every arm and give their memory back (nothing of them stays alive for what is timed next)."""
        for h in self.handles.values():
            with contextlib.suppress(Exception):
                h.close()
        self.handles.clear()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self._closed_s = self.clock() - self._t0

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
    """One line for a failed arm: ``out of memory: …``, ``timed out: …``, ``hit the recompile limit: …``,
    ``budget: …`` (:class:`OutOfTime`) or ``raised <Type>: …``."""
    text = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
    if isinstance(exc, OutOfTime):
        return text
    if isinstance(exc, ArmTimeout):
        return f"timed out: {text}"
    if isinstance(exc, MemoryError) or "out of memory" in text.lower() or type(exc).__name__ == "OutOfMemoryError":
        return f"out of memory: {text or type(exc).__name__}"
    if "recompile" in text.lower() and "limit" in text.lower():
        return f"hit the recompile limit: {text}"
    return f"raised {type(exc).__name__}: {text}"
