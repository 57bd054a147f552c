"""Where matplotlib and W&B write beneath ``$HOME``, and a writable place when those directories cannot be written
(a read-only ``HOME`` in a container or on a cluster, ``HOME`` pointing at a file). Without it both still work, but
each says so on stderr on every run: matplotlib ``mkdir -p failed …`` and ``Matplotlib created a temporary cache
directory …``; W&B's service ``ERROR main: failed to get logger path … read-only file system`` followed by its INFO
log lines (about 20 lines in all), none of which the user can act on.

:func:`redirect_home_caches` runs once at the start of ``python -m train`` (train/cli.py), before either library is
imported: for each directory it cannot write, and whose variable the user has not set, it sets the variable to a
directory of its own under ``$TMPDIR/deep-model-perf-<uid>/`` (kept between runs, so matplotlib's font cache is
built once) and returns the one ``notice:`` line that says so. Child processes inherit the variables.

Redirected (what a run writes): ``MPLCONFIGDIR`` (matplotlib's config and cache: ``$XDG_CONFIG_HOME/matplotlib``,
``$XDG_CACHE_HOME/matplotlib``), ``WANDB_CACHE_DIR`` (W&B's service logs and cache: ``$XDG_CACHE_HOME/wandb``),
``WANDB_DATA_DIR`` (W&B's staging area: ``$XDG_DATA_HOME/wandb``). Not redirected: ``WANDB_CONFIG_DIR``
(``~/.config/wandb``, only read by a run: moving it would hide the user's W&B settings) and ``WANDB_DIR`` (a run's
W&B files go to its run directory already).
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import MutableMapping
from pathlib import Path
from typing import Optional


def home_dirs(env: MutableMapping[str, str]) -> list[tuple[str, str, list[Path]]]:
    """``(variable, fallback subdirectory, the directories it defaults to)`` for each place matplotlib and W&B write
    under ``HOME`` (Linux layout: ``XDG_*_HOME`` when set)."""
    home = Path(env.get("HOME") or os.path.expanduser("~"))
    config = Path(env.get("XDG_CONFIG_HOME") or home / ".config")
    cache = Path(env.get("XDG_CACHE_HOME") or home / ".cache")
    data = Path(env.get("XDG_DATA_HOME") or home / ".local" / "share")
    return [("MPLCONFIGDIR", "matplotlib", [config / "matplotlib", cache / "matplotlib"]),
            ("WANDB_CACHE_DIR", "wandb-cache", [cache / "wandb"]),
            ("WANDB_DATA_DIR", "wandb-data", [data / "wandb"])]


def writable_dir(path: Path) -> bool:
    """True when ``path`` is a directory this process can write, or could create (its nearest existing ancestor is
    one). Nothing is created. ``os.access`` sees a read-only mount and an immutable directory (``chattr +i``), which
    stop root too."""
    p = path
    while not os.path.lexists(p):
        if p.parent == p:
            return False
        p = p.parent
    return p.is_dir() and os.access(p, os.W_OK | os.X_OK)


def fallback_root() -> Path:
    """``$TMPDIR/deep-model-perf-<uid>`` (0700, this user's own; reused, so caches persist), or a fresh temporary
    directory when that name is taken by something else.

    Raises:
        OSError: no writable temporary directory at all.
    """
    base = Path(tempfile.gettempdir()) / f"deep-model-perf-{os.getuid()}"
    try:
        base.mkdir(mode=0o700, exist_ok=True)
        st = base.lstat()
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and os.access(base, os.W_OK | os.X_OK):
            return base
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix="deep-model-perf-"))


def redirect_home_caches(env: Optional[MutableMapping[str, str]] = None) -> Optional[str]:
    """Set each variable of :func:`home_dirs` whose directories are not all writable (and that is not set) to a
    directory under :func:`fallback_root`, in ``env`` (default ``os.environ``). Returns the ``notice:`` line saying
    so, or None when nothing moved (or no writable temporary directory exists: then the libraries fall back as they
    do)."""
    env = os.environ if env is None else env
    moved = [(var, sub) for var, sub, paths in home_dirs(env)
             if not env.get(var) and not all(writable_dir(p) for p in paths)]
    if not moved:
        return None
    try:
        root = fallback_root()
        for _var, sub in moved:
            (root / sub).mkdir(mode=0o700, exist_ok=True)
    except OSError:
        return None
    for var, sub in moved:
        env[var] = str(root / sub)
    home = env.get("HOME") or "~"
    return (f"notice: HOME={home} is not a writable directory, so matplotlib's and W&B's cache files go to {root} "
            f"({', '.join(f'{var}={root / sub}' for var, sub in moved)}); set those variables to choose another place")
