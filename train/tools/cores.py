"""How many CPU cores this process may really use: the logical cores it is allowed to run on
(``os.sched_getaffinity``) and, in a container, the cgroup's CPU quota (cgroup v2 ``cpu.max``, v1
``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``), whichever is smaller. More torch threads than that oversubscribe the
cores: the threads of one parallel region wait on each other and every step gets slower, with no error."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Optional

CGROUP = Path("/sys/fs/cgroup")


def cgroup_quota(root: Path = CGROUP) -> Optional[float]:
    """The cgroup's CPU quota in cores (``quota / period``), or None where there is none (``max``) or none is read."""
    for quota_file, period_file in ((root / "cpu.max", None), (root / "cpu" / "cpu.cfs_quota_us",
                                                                root / "cpu" / "cpu.cfs_period_us"),
                                    (root / "cpu.cfs_quota_us", root / "cpu.cfs_period_us")):
        try:
            text = quota_file.read_text().split()
            quota, period = (text[0], text[1]) if period_file is None else (text[0], period_file.read_text().strip())
            if quota in ("max", "-1"):
                return None
            return int(quota) / int(period)
        except (OSError, ValueError, IndexError):
            continue
    return None


def usable_cores(root: Path = CGROUP) -> tuple[int, str]:
    """``(cores, why)``: the cores this process can use (at least 1) and one phrase saying where the number comes
    from (``"2 logical cores"``, ``"a cgroup CPU quota of 1.5 cores"``)."""
    try:
        logical = len(os.sched_getaffinity(0))
        what = f"{logical} logical cores available to the process"
    except (AttributeError, OSError):
        logical = os.cpu_count() or 1
        what = f"{logical} logical cores"
    quota = cgroup_quota(root)
    if quota is not None and math.ceil(quota) < logical:
        return max(1, math.ceil(quota)), f"a cgroup CPU quota of {quota:g} cores ({what})"
    return max(1, logical), what
