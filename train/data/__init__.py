"""From a data source to DataLoaders: read → split → tokenize → bucket plan → sampler + collate.

``bundle.py`` prepares the data (:func:`prepare_data` → :class:`DataBundle`), ``loaders.py`` builds the DataLoaders
(:func:`make_loader`); this package re-exports their names. The steps themselves: ``sources``/``readers`` (rows,
labels, splits), ``prepare`` and ``cache`` (the prepared, memory-mapped data), ``tokenizer``, ``buckets``, ``sampler``,
``packing``, ``collate``.
"""

from __future__ import annotations

from train.data.bundle import (
    BUCKETED,
    DataBundle,
    bucket_plan,
    check_token_budget,
    fit_bucket_plan,
    prepare_data,
    prepare_splits,
)
from train.data.loaders import PackLayout, eval_batch_rows, make_loader, pack_layout

__all__ = ["BUCKETED", "DataBundle", "PackLayout", "bucket_plan", "check_token_budget", "eval_batch_rows",
           "fit_bucket_plan", "make_loader", "pack_layout", "prepare_data", "prepare_splits"]
