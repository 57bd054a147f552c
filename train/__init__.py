"""deep-model-perf: a BERT-style classifier on real data, and the levers that make it fast. Run as
``python -m train``."""

__version__ = "0.1.0"
