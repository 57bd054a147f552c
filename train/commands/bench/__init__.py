"""Every benchmark command: ``make bench``'s suite (``suite.py``: the training rows of ``training.py`` and the
inference benchmark of ``inference.py``, one report), ``batching.py``, ``precision_modes.py``, ``compilation.py``,
``tracking.py``, ``vs_hf.py`` and the regression gate (``gate.py``), each a module of its own. This package re-exports
the suite.
"""

from train.commands.bench.suite import markdown, run_bench_suite, write_outputs
from train.commands.bench.training import CONFIGS

__all__ = ["CONFIGS", "run_bench_suite", "markdown", "write_outputs"]
