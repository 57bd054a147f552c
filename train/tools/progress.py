"""Progress bars, one rule for every command: a tqdm bar on stderr, shown only when ``train.progress`` is true and
stderr is a terminal; otherwise silent (a disabled bar), so logs, pipes and tests stay clean.

Used by training (:meth:`train.trainer.Trainer.fit`), ``warmup`` and every ``bench*`` command.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from tqdm import tqdm


def shown(enabled: bool) -> bool:
    """Whether a bar asked for with ``enabled`` (normally ``cfg.train.progress``) is drawn: only on a terminal."""
    return bool(enabled) and sys.stderr.isatty()


def progress_bar(total: int, desc: str, enabled: bool, **kwargs: Any) -> tqdm:
    """A tqdm bar of ``total`` units, drawn when :func:`shown` (else disabled: updates cost nothing).

    Use it as a context manager and call ``bar.update(n)`` outside timed regions. ``kwargs`` go to tqdm
    (``unit``, ``initial``, …)."""
    opts: dict[str, Any] = {"dynamic_ncols": True, "mininterval": 0.5, "unit": "step", **kwargs}
    return tqdm(total=total, desc=desc, disable=not shown(enabled), **opts)


def beside(bar: tqdm, notice: Callable[[str], None]) -> Callable[[str], None]:
    """``notice`` that does not tear a drawn bar: the bar is cleared while the line is printed, then redrawn."""
    if bar.disable:
        return notice

    def say(message: str) -> None:
        with bar.external_write_mode():
            notice(message)

    return say
