"""What a batching method makes the model compute per training sample, from the lengths alone (no step is run).

Two numbers per method, both per training sample over one epoch's plan (and the samples per optimizer step):

* ``tokens``: positions the model processes (real + padding) — what the per-token work (every linear layer, the
  embeddings, the norms) scales with;
* ``scores``: attention scores per head and layer, Σ S² over the sequences the attention sees (a padded sample of
  bound B: B²; a packed row of C tokens: C², shared by the samples in it) — what the attention's S × S work scales
  with. Packing removes padding tokens but makes every row's attention C × C, so on short samples it can cost more
  scores than buckets do: the reason fitted buckets can train faster than packing where attention is a large share
  of the step (small hidden sizes, CPUs).

``make optimize``'s batching lever predicts a method's speedup from these and the profile's attention share
(Amdahl's law with two parts: ``1 / ((1 − a) · tokens_m / tokens_c + a · scores_m / scores_c)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LayoutCost:
    """Per training sample: ``tokens`` processed (float, tokens) and attention ``scores`` (float, S² summed over the
    sequences attended, per head and layer); ``real_tokens`` the sample's own tokens, for the token efficiency;
    ``samples_per_step``: training samples per batch, averaged over the epoch's batches (what a token budget changes,
    and with it the optimizer steps per sample)."""

    tokens: float
    scores: float
    real_tokens: float
    samples_per_step: float = 0.0

    @property
    def token_efficiency(self) -> float:
        return self.real_tokens / self.tokens if self.tokens else 1.0


def layout_cost(cfg, lengths: Sequence[int], bounds: Sequence[int], sample_limit: int = 16384) -> LayoutCost:
    """The :class:`LayoutCost` of ``cfg.batching`` on the training ``lengths`` (at most ``sample_limit`` of them, a
    seeded random subset: the plan's cost per sample does not depend on the split's size); ``bounds``: the bucket
    bounds ``cfg`` trains with (``setup.replan(cfg, bundle).bounds``; unused for the methods without buckets).

    Bucketed methods (``optimal``, ``quantile``, ``kmeans``, ``pad-to-max``) pad each sample to its bucket's bound,
    or with ``pad_to=batch-max`` to the longest sample of its batch (random batches within each bucket, of the token
    budget's size); ``hf-group-by-length`` and ``random`` pad to the batch's
    longest sample (their batches are drawn as training draws them); ``packed`` fills rows of ``pack_len`` tokens
    with :func:`~train.data.packing.pack_rows`.

    Raises:
        ValueError: an empty training split.
    """
    from train.data.grouping import length_grouped_batches
    from train.data.loaders import pack_layout
    from train.data.packing import pack_rows

    lengths = np.asarray(lengths, dtype=np.int64)
    if not len(lengths):
        raise ValueError("the training split is empty")
    if len(lengths) > sample_limit:
        lengths = lengths[np.random.default_rng(cfg.train.seed).choice(len(lengths), sample_limit, replace=False)]
    b, n = cfg.batching, len(lengths)
    lengths = np.minimum(lengths, cfg.data.max_len)
    real = float(lengths.mean())
    if b.method == "packed":
        layout = pack_layout(cfg, lengths)
        c = layout.capacity
        rows = len(pack_rows(lengths, c, seed=cfg.train.seed))
        return LayoutCost(tokens=rows * c / n, scores=rows * c * c / n, real_tokens=real,
                          samples_per_step=n / -(-rows // layout.rows))
    if b.method in ("hf-group-by-length", "random"):
        if b.method == "random":
            order = np.random.default_rng(cfg.train.seed).permutation(n)
            batches = [order[i:i + b.batch_size] for i in range(0, n, b.batch_size)]
        else:
            batches = length_grouped_batches(lengths.tolist(), b.batch_size, cfg.train.seed, 0)
        longest = np.array([lengths[list(x)].max() for x in batches], dtype=np.float64)
        sizes = np.array([len(x) for x in batches], dtype=np.float64)
        return LayoutCost(tokens=float((sizes * longest).sum() / n), scores=float((sizes * longest ** 2).sum() / n),
                          real_tokens=real, samples_per_step=n / len(batches))
    bound = np.asarray(sorted(bounds), dtype=np.float64)
    which = np.minimum(np.searchsorted(bound, lengths), len(bound) - 1)
    padded = bound[which]
    sizes = [max(1, b.max_tokens // int(limit)) if b.max_tokens else b.batch_size for limit in bound]
    steps = sum(-(-int(np.count_nonzero(which == k)) // size) for k, size in enumerate(sizes))
    if b.pad_to == "batch-max":  # each bucket's samples in random batches (as the bucket sampler draws them)
        rng, longest = np.random.default_rng(cfg.train.seed), np.empty(n, dtype=np.float64)
        for k, size in enumerate(sizes):
            members = rng.permutation(np.flatnonzero(which == k))
            for i in range(0, len(members), size):
                chunk = members[i:i + size]
                longest[chunk] = lengths[chunk].max()
        padded = longest
    return LayoutCost(tokens=float(padded.mean()), scores=float((padded ** 2).mean()), real_tokens=real,
                      samples_per_step=n / max(1, steps))
