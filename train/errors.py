"""User-facing errors: one clear message, exit code 2, no traceback.

Anything the user can fix (a missing file, a malformed row, an unknown config key) raises
:class:`UserError`. The CLI catches it, prints ``error: <message>`` to stderr and exits 2.
Bugs in our own code keep their traceback.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class UserError(Exception):
    """An error caused by input the user controls. ``str(err)`` names the file/line/field and the fix."""

    exit_code = 2


class RunAborted(Exception):
    """A run stopped on purpose after writing a diagnostic report (e.g. the numerics guard); the CLI exits 3."""

    exit_code = 3


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it onto ``path`` only if the block succeeds.

    Readers never see a half-written file: the rename is atomic on POSIX within one directory.
    The temporary file is removed when the block raises.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically (temp file, fsync, rename)."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
