"""Clean shutdown: SIGTERM/SIGINT become a flag the loop reads after each step.

Before the loop (start-up: data preparation, model, warm-up), when there is nothing to checkpoint yet, a signal
raises :class:`~train.errors.Interrupted` at once, naming the phase (``phase``); :meth:`ShutdownRequest.defer`
switches to the flag when the loop starts.

The run then finishes the step it is in, writes a checkpoint and a partial ``report.json``
(``"status": "interrupted"``) and exits 143 for SIGTERM (128 + the signal: non-zero, so a scheduler restarts it,
with ``--resume``) or 130 for SIGINT. A watchdog bounds the whole thing: if the process has not
finished ``timeout_s`` after the signal (a hung step or collective), it exits with 128 + signal
number without waiting further. A second Ctrl-C stops at once (``KeyboardInterrupt``).

A signal during an evaluation (periodic or final) abandons it: :func:`stop_requested` is what
``train.evaluation.evaluate`` reads between batches. :func:`pause_point` is a test hook: with
``DMP_PAUSE_AT=<phase>`` the process writes ``$DMP_PAUSE_FILE`` on reaching that phase and waits there
(at most 120 s) for a signal, so a test can signal a phase deterministically.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any, Optional

from train.errors import Interrupted

SIGNALS = (signal.SIGTERM, signal.SIGINT)
PAUSE_ENV, PAUSE_FILE_ENV = "DMP_PAUSE_AT", "DMP_PAUSE_FILE"
_ACTIVE: list["ShutdownRequest"] = []  # the installed request (innermost last)


def stop_requested() -> bool:
    """True once SIGTERM/SIGINT reached the installed :class:`ShutdownRequest` (False when none is installed)."""
    return bool(_ACTIVE) and _ACTIVE[-1].requested


def requested_signal() -> str:
    """The name of the signal that was received (``"signal"`` when none is known)."""
    return (_ACTIVE[-1].signal_name if _ACTIVE else None) or "signal"


def pause_point(phase: str) -> None:
    """Test hook (a no-op unless ``$DMP_PAUSE_AT`` equals ``phase``): write the pid to ``$DMP_PAUSE_FILE`` and wait
    until a signal arrives (a signal before the first step raises :class:`~train.errors.Interrupted` from here) or
    120 s pass."""
    if os.environ.get(PAUSE_ENV) != phase:
        return
    Path(os.environ.get(PAUSE_FILE_ENV) or "dmp-pause").write_text(f"{os.getpid()}\n")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not stop_requested():
        time.sleep(0.01)


class ShutdownRequest:
    """Context manager installing the handlers (main thread only; elsewhere it does nothing)."""

    def __init__(self, timeout_s: float = 60.0, immediate: bool = False) -> None:
        self.timeout_s = timeout_s
        self.immediate = immediate
        self.phase = "start-up"
        self.signum: Optional[int] = None
        self._previous: dict[int, Any] = {}
        self._watchdog: Optional[threading.Timer] = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def signal_name(self) -> Optional[str]:
        return signal.Signals(self.signum).name if self.signum is not None else None

    def defer(self) -> None:
        """From now on a signal only sets the flag (the loop finishes its step, checkpoints and stops)."""
        self.immediate = False

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        if self.immediate:
            self.signum = signum
            self._start_watchdog()
            raise Interrupted(f"{signal.Signals(signum).name} during {self.phase}, before the first training step: "
                              "nothing was trained", signum)
        if self.signum is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt  # second Ctrl-C: stop now
            return
        self.signum = signum
        print(f"\n{signal.Signals(signum).name}: finishing the current step, then checkpoint and stop "
              f"(at most {self.timeout_s:.0f} s)", file=sys.stderr, flush=True)
        self._start_watchdog()

    def _start_watchdog(self) -> None:
        if self._watchdog is None:
            self._watchdog = threading.Timer(self.timeout_s, self._expire)
            self._watchdog.daemon = True
            self._watchdog.start()

    def _expire(self) -> None:
        print(f"shutdown did not finish within {self.timeout_s:.0f} s; exiting without a final checkpoint",
              file=sys.stderr, flush=True)
        os._exit(128 + (self.signum or signal.SIGTERM))

    def __enter__(self) -> "ShutdownRequest":
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
            _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        if self._watchdog is not None:  # the block (loop, checkpoint, report) is done: no need to force an exit
            self._watchdog.cancel()
