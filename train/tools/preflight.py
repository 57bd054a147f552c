"""Container preflight, run by the image's entrypoint before the command (docker/entrypoint.sh).

    python -m train.tools.preflight [COMMAND ...]

Checks, cheapest first, without importing torch:

* triton matches torch's own pin (``Requires-Dist: triton==X`` in torch's metadata) — a mismatch imports
  but miscompiles or crashes in ``torch.compile``; hard failure;
* the ``pynvml`` module comes from ``nvidia-ml-py`` (the official NVML bindings) and ``nvidia-ml-py3`` (an
  unmaintained 2017 fork that overwrites the same module and lacks the energy counter) is absent; hard failure;
* ``/dev/shm`` is large enough for ``data.num_workers`` read from the command's ``--config``/overrides; warning.

The cache-directory fallback lives in the entrypoint (it must export the variable to the command).
Exit 0 when the command may run, 1 on a hard failure (one ``preflight:`` line per problem, with the fix).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from importlib import metadata
from typing import Optional

SHM_PER_WORKER_BYTES = 256 << 20  # generous for this job's batches (≤ 64k tokens of int64 + masks)


def triton_pin_problem() -> Optional[str]:
    """None when triton is absent from torch's requirements or matches the pinned version; else the problem."""
    try:
        requires = metadata.requires("torch") or []
    except metadata.PackageNotFoundError:
        return "torch is not installed"
    pins = [m.group(1) for r in requires if (m := re.match(r"triton\s*==\s*([\w.+-]+)", r))]
    if not pins:
        return None
    try:
        have = metadata.version("triton")
    except metadata.PackageNotFoundError:
        return f"torch {metadata.version('torch')} pins triton=={pins[0]} but triton is not installed"
    if have != pins[0]:
        return (f"triton {have} installed but torch {metadata.version('torch')} pins triton=={pins[0]}; "
                f"rebuild the image from the lock (make lock build)")
    return None


def pynvml_problem() -> Optional[str]:
    """None when pynvml is provided by nvidia-ml-py only (or NVML bindings are absent); else the problem."""
    providers = metadata.packages_distributions().get("pynvml", [])
    if "nvidia-ml-py3" in {p.lower() for p in providers}:
        return ("pynvml is provided by nvidia-ml-py3 (unmaintained, no energy counter); "
                "pip uninstall -y nvidia-ml-py3 && pip install nvidia-ml-py")
    if providers and "nvidia-ml-py" not in {p.lower() for p in providers}:
        return f"pynvml comes from {', '.join(providers)}, expected nvidia-ml-py"
    return None


def num_workers_from(argv: Sequence[str]) -> int:
    """data.num_workers of the command's config (``--config FILE`` + ``section.key=value`` overrides); 0 if none."""
    args = list(argv)
    config = None
    if "--config" in args and args.index("--config") + 1 < len(args):
        config = args[args.index("--config") + 1]
    overrides = [a for a in args if re.match(r"^[a-z_]+\.[a-z_]+=", a)]
    if config is None and not any(o.startswith("data.num_workers=") for o in overrides):
        return 0
    try:
        from train.config import load_config

        return load_config(config, overrides).data.num_workers
    except Exception:  # the command itself reports a bad config, with its own message
        return 0


def shm_problem(num_workers: int, path: str = "/dev/shm") -> Optional[str]:
    if num_workers <= 0:
        return None
    try:
        st = os.statvfs(path)
    except OSError:
        return f"{path} is missing but data.num_workers={num_workers}"
    size = st.f_frsize * st.f_blocks
    need = num_workers * SHM_PER_WORKER_BYTES
    if size < need:
        return (f"{path} is {size >> 20} MiB, data.num_workers={num_workers} wants ≥ {need >> 20} MiB: workers may die "
                f"with 'bus error'; run with --ipc=host (make does) or --shm-size, or lower data.num_workers")
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    hard = [p for p in (triton_pin_problem(), pynvml_problem()) if p]
    for problem in hard:
        print(f"preflight: error: {problem}", file=sys.stderr)
    warning = shm_problem(num_workers_from(argv))
    if warning:
        print(f"preflight: warning: {warning}", file=sys.stderr)
    return 1 if hard else 0


if __name__ == "__main__":
    sys.exit(main())
