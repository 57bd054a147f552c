"""Every benchmark command: ``make bench``'s suite (``suite.py``: the training rows of ``rows.py`` run by
``training.py``, and the inference benchmark of ``inference.py``, one report), ``batching.py``,
``precision_modes.py``, ``compilation.py``, ``tracking.py``, ``vs_hf.py`` and the regression gate (``gate.py``), each a
module of its own. Import the module you need: this package imports nothing, so that ``train.bench.rows`` stays
light.
"""
