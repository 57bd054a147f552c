"""report.json: built from one :class:`ReportInputs` (keys are a contract: add, never rename), the
efficiency fields (MFU, energy), and the summary lines a run prints at the end.

``build.py`` builds report.json (and the aborted run's), ``summary.py`` the end-of-run lines, ``levers.py`` its
``model`` and ``levers`` sections; this package re-exports the first two.
"""

from __future__ import annotations

from train.report.build import (
    ReportInputs,
    build_report,
    clip_report,
    efficiency_fields,
    sampler_counts,
    write_aborted_report,
)
from train.report.summary import summary_lines

__all__ = ["ReportInputs", "build_report", "clip_report", "efficiency_fields", "sampler_counts", "summary_lines",
           "write_aborted_report"]
