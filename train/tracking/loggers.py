"""Metric logging: a JSONL logger (the source of truth), a null logger, and a fan-out.

The training loop holds one :class:`MetricLogger` and never asks which backends are behind it.
"""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path
from typing import Any, Protocol


class MetricLogger(Protocol):
    def log(self, record: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/inf; null is explicit
    if isinstance(value, dict):  # nested tables (grad_stats layers)
        return {k: _clean(v) for k, v in value.items()}
    return value


class JsonlLogger:
    """Appends one JSON object per line to ``path`` and flushes, so a crash loses at most one record.

    Thread-safe: the system-metrics thread logs through it too.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", encoding="utf-8")
        self._lock = threading.Lock()

    def log(self, record: dict[str, Any]) -> None:
        line = json.dumps({k: _clean(v) for k, v in record.items()}) + "\n"
        with self._lock:
            if not self._f.closed:
                self._f.write(line)
                self._f.flush()

    def close(self) -> None:
        with self._lock:
            self._f.close()


class NullLogger:
    def log(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class FanOut:
    """Sends every record to each logger in turn."""

    def __init__(self, *loggers: MetricLogger) -> None:
        self.loggers = loggers

    def log(self, record: dict[str, Any]) -> None:
        for logger in self.loggers:
            logger.log(record)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()
