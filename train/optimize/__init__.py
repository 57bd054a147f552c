"""``python -m train optimize`` (``make optimize``): attribution-driven progressive optimisation of the user's own
config — profile, rank the lever catalogue by the evidence, A/B the most promising lever against the current best,
keep it only when its interval clears ``optimize.min_gain`` and the quality guard passes, re-profile, repeat; then
confirm baseline vs optimized in one interleaved run (docs/optimize.md).

Writes ``runs/<id>/optimize/``: ``optimized.yaml``, ``optimize.json``, ``optimize.md``, ``waterfall.png`` and the
profiles' ``profiles/<n>/summary.{json,md}``. ``python -m train optimize-grid``: grid.py.
"""

from train.optimize.command import baseline_settings, run_optimize

__all__ = ["baseline_settings", "run_optimize"]
