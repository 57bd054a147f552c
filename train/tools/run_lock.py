"""One writer per run directory: an exclusive ``fcntl.flock`` on ``<run_dir>/.writer.lock`` held for the life of
the process that writes the run (a fresh run, ``--overwrite`` and ``--resume`` alike; train/setup.py's
``make_run_dir`` takes it). The OS releases it when the process dies, so a killed run's lock file never blocks."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional

from train.errors import UserError

LOCK_FILE = ".writer.lock"
_LOCKS: dict[str, int] = {}  # run directory → the lock file descriptor this process holds (released when it exits)


def lock_run_dir(run_dir: Path) -> None:
    """Hold an exclusive ``fcntl.flock`` on ``<run_dir>/.writer.lock`` for the life of this process: one writer per
    run directory (a fresh run, ``--overwrite`` and ``--resume`` alike). The OS releases it when the process dies, so
    a lock file left by a killed run never blocks. The file records the holder's pid (for the refusal line).

    Raises:
        UserError: another live process holds the lock (naming its pid).
    """
    import fcntl

    key = str(run_dir.resolve())
    if key in _LOCKS:
        if (run_dir / LOCK_FILE).exists():
            return  # this process holds it already (a command that runs several phases)
        os.close(_LOCKS.pop(key))  # the directory was removed and made again: lock the new one
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)  # a bare fd, held open on purpose
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.read(fd, 64).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise UserError(f"run directory {run_dir} is being written by another process (pid {holder}); wait for it "
                        "to finish, or choose another --run-id") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    _LOCKS[key] = fd


def unlock_run_dir(run_dir: Path) -> None:
    """Release this process's lock on ``run_dir`` (a refused or finished command; exit releases it anyway)."""
    fd = _LOCKS.pop(str(run_dir.resolve()), None)
    if fd is not None:
        os.close(fd)


def discard_if_unwritten(run_dir: Path) -> bool:
    """Release this process's lock on ``run_dir`` and remove the directory when it holds nothing but the lock file
    (a command that failed before writing anything leaves nothing behind); True when it was removed."""
    unlock_run_dir(run_dir)
    if run_dir.is_dir() and all(p.name == LOCK_FILE for p in run_dir.iterdir()):
        shutil.rmtree(run_dir, ignore_errors=True)
        return True
    return False


def lock_holder(run_dir: Path) -> Optional[str]:
    """The pid (as the lock file records it) of another live process writing ``run_dir``, or None (no lock file, a
    dead holder's, or this process's own). Takes nothing: a free lock is released at once."""
    import fcntl

    if str(run_dir.resolve()) in _LOCKS or not (run_dir / LOCK_FILE).is_file():
        return None
    fd = os.open(run_dir / LOCK_FILE, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return os.read(fd, 64).decode(errors="replace").strip() or "?"
    finally:
        os.close(fd)  # closing releases a lock taken here
    return None
