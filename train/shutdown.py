"""Clean shutdown: SIGTERM/SIGINT become a flag the loop reads after each step.

Before the loop (start-up: data preparation, model, warm-up), when there is nothing to checkpoint yet, a signal
raises :class:`~train.errors.Interrupted` at once, naming the phase (``phase``); :meth:`ShutdownRequest.defer`
switches to the flag when the loop starts.

The run then finishes the step it is in, writes a checkpoint and a partial ``report.json``
(``"status": "interrupted"``) and exits 0 for SIGTERM (preemption: the scheduler will restart it
with ``--resume``) or 130 for SIGINT. A watchdog bounds the whole thing: if the process has not
finished ``timeout_s`` after the signal (a hung step or collective), it exits with 128 + signal
number without waiting further. A second Ctrl-C stops at once (``KeyboardInterrupt``).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType
from typing import Any, Optional

from train.errors import Interrupted

SIGNALS = (signal.SIGTERM, signal.SIGINT)


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
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
        if self._watchdog is not None:  # the block (loop, checkpoint, report) is done: no need to force an exit
            self._watchdog.cancel()
