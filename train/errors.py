"""User-facing errors: one clear message, exit code 2, no traceback.

Anything the user can fix (a missing file, a malformed row, an unknown config key) raises
:class:`UserError`. The CLI catches it, prints ``error: <message>`` to stderr and exits 2.
Bugs in our own code keep their traceback.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional


class UserError(Exception):
    """An error caused by input the user controls. ``str(err)`` names the file/line/field and the fix."""

    exit_code = 2


class RunAborted(Exception):
    """A run stopped on purpose after writing a diagnostic report (e.g. the numerics guard); the CLI exits 3."""

    exit_code = 3


class RankFailed(Exception):
    """Another rank of a torchrun job failed where the ranks agree on errors (:func:`train.parallel.process_group.
    agreed`): this rank stops at once, with one line naming that rank and its error, instead of waiting in the next
    collective until the process group's timeout. The failed rank itself keeps its own traceback. Exit 1."""

    exit_code = 1


class Interrupted(Exception):
    """SIGTERM/SIGINT before the first training step (train/shutdown.py): nothing to checkpoint; the CLI prints the
    message as one line and exits 128 + the signal number (143 for SIGTERM, 130 for SIGINT)."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum


@dataclasses.dataclass(frozen=True)
class Allowed:
    """What one config field accepts, declared next to the field (``dataclasses.field`` metadata ``"allowed"``):
    numeric bounds (finite values only) or a tuple of choices. ``None`` passes: Optional fields mean "off/default"."""

    ge: Optional[float] = None
    gt: Optional[float] = None
    le: Optional[float] = None
    lt: Optional[float] = None
    choices: Optional[tuple] = None

    def ok(self, value: Any) -> bool:
        if self.choices is not None:
            return value in self.choices
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))

    def describe(self) -> str:
        """``one of a, b``; ``in [0, 1)``; ``≥ 1``; ``> 0``."""
        if self.choices is not None:
            return "one of " + ", ".join(map(str, self.choices))
        low = ((f"[{_num(self.ge)}" if self.ge is not None else f"({_num(self.gt)}")
               if (self.ge, self.gt) != (None, None) else None)
        high = ((f"{_num(self.le)}]" if self.le is not None else f"{_num(self.lt)})")
                if (self.le, self.lt) != (None, None) else None)
        if low and high:
            return f"in {low}, {high}"
        if low:
            return ("≥ " if self.ge is not None else "> ") + low[1:]
        return ("≤ " if self.le is not None else "< ") + (high or "")[:-1]


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


class Frozen:
    """Base of every config section: a section can be frozen (:meth:`freeze`), after which assigning a field raises
    :class:`dataclasses.FrozenInstanceError` naming the key — a resolved config is a value; a decision makes a new one
    (``RunConfig.with_values``). ``dataclasses.replace`` of a frozen section gives an unfrozen copy."""

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_frozen_", False):
            raise dataclasses.FrozenInstanceError(
                f"cannot assign {type(self).__name__}.{name}: the run's config is resolved and frozen; make a new one "
                "with cfg.with_values({'section.key': value})")
        object.__setattr__(self, name, value)

    def freeze(self) -> None:
        object.__setattr__(self, "_frozen_", True)

    @property
    def frozen(self) -> bool:
        return self.__dict__.get("_frozen_", False)


def allowed(default: Any, *, ge: Optional[float] = None, gt: Optional[float] = None, le: Optional[float] = None,
            lt: Optional[float] = None, choices: Optional[tuple] = None) -> Any:
    """A dataclass field with ``default`` whose accepted values are declared once, here (see :class:`Allowed`);
    :func:`check_fields` enforces them."""
    return dataclasses.field(default=default, metadata={"allowed": Allowed(ge, gt, le, lt, choices)})


def comma_list(text: Optional[str]) -> Optional[list[str]]:
    """The names of a comma-separated setting (``"a, b,,c"`` → ``["a", "b", "c"]``); None stays None (= all)."""
    if text is None:
        return None
    return [n.strip() for n in text.split(",") if n.strip()]


def check_fields(obj: Any, section: str) -> None:
    """Check every field of the dataclass ``obj`` that declares :func:`allowed` values.

    Raises:
        UserError: ``<section>.<field>=<value> is out of range: must be <range>`` (or ``is not one of …``).
    """
    for f in dataclasses.fields(obj):
        rule = f.metadata.get("allowed")
        value = getattr(obj, f.name)
        if rule is None or value is None or rule.ok(value):
            continue
        if rule.choices is not None:
            raise UserError(f"{section}.{f.name}={value!r} is not {rule.describe()}")
        raise UserError(f"{section}.{f.name}={value!r} is out of range: it must be {rule.describe()}")


def current_umask() -> int:
    """The process umask (read from /proc on Linux, where reading does not change it; else set and restored)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def honour_umask(path: str | os.PathLike, directory: bool = False) -> None:
    """Give ``path`` (made by ``mkstemp``/``mkdtemp``, which create 0600/0700) the mode a plain ``open``/``mkdir``
    would have under the current umask, so a teammate or a container running as another user can read it."""
    os.chmod(path, (0o777 if directory else 0o666) & ~current_umask())


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it onto ``path`` only if the block succeeds.

    Readers never see a half-written file: the rename is atomic on POSIX within one directory. The file gets the
    mode the umask gives a plain ``open`` (not ``mkstemp``'s 0600).
    The temporary file is removed when the block raises.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    honour_umask(tmp_path)  # what open() would give; mkstemp's 0600 would survive the rename
    try:
        yield tmp_path
        with open(tmp_path, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise


ATOMIC_TEMP = re.compile(r"\..+\.[a-z0-9_]{8}\.tmp")
"""The name of :func:`atomic_path`'s temporary file: ``.<name>.<mkstemp's 8 random characters>.tmp``."""


def atomic_temps(directory: str | os.PathLike) -> list[tuple[Path, int]]:
    """The temporary files of :func:`atomic_path` under ``directory`` (its subdirectories too, symlinks not followed):
    what a write killed before its rename left, or a live writer's. ``(path, bytes)`` each, sorted by path; only
    names matching :data:`ATOMIC_TEMP`."""
    found = []
    for root, _dirs, files in os.walk(directory):
        for name in files:
            path = Path(root, name)
            if ATOMIC_TEMP.fullmatch(name) and not path.is_symlink():
                try:
                    found.append((path, path.stat().st_size))
                except OSError:
                    continue
    return sorted(found)


def remove_atomic_temps(directory: str | os.PathLike) -> list[tuple[Path, int]]:
    """Remove :func:`atomic_temps` of ``directory``; returns those removed. Call it only while no other process
    writes there (a run directory's writer lock held)."""
    removed = []
    for path, size in atomic_temps(directory):
        try:
            path.unlink()
        except OSError:
            continue
        removed.append((path, size))
    return removed


def describe_temps(temps: list[tuple[Path, int]], root: Path) -> str:
    """``.checkpoint.pt.k2j4h6g8.tmp (182.4 MB), …`` (paths relative to ``root``, three named at most)."""
    shown = ", ".join(f"{p.relative_to(root)} ({size / 1e6:.1f} MB)" for p, size in temps[:3])
    return shown + (f" and {len(temps) - 3} more" if len(temps) > 3 else "")


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically (temp file, fsync, rename)."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (``kill(pid, 0)``; another user's counts as alive): how a
    leftover temporary directory tells a dead writer's from a live one's."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, as another user
        return True
    return True
