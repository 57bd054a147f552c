"""How the ranks of a torchrun job agree: one prepared data set (rank 0's tokenizer,
checked on every rank), and job totals from per-rank counters. Single-process, each is the plain call."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from train.config import RunConfig
from train.data import DataBundle, prepare_data
from train.errors import UserError
from train.parallel.process_group import DistContext, agreed, all_reduce_sum, broadcast_from_main
from train.trainer import TrainStats


def reduce_stats(stats: TrainStats, ctx: DistContext) -> None:
    """Turn this rank's counters into job totals (sums over ranks; shapes: union). No-op single-process."""
    if not ctx.enabled:
        return
    names = ("samples", "real_tokens", "padded_tokens", "steady_samples", "steady_real_tokens", "target_tokens",
             "steady_target_tokens", "truncated_in_collate")
    totals = all_reduce_sum(torch.tensor([getattr(stats, n) for n in names], dtype=torch.float64), ctx)
    for name, value in zip(names, totals.tolist()):
        setattr(stats, name, int(value))
    shapes = [None] * ctx.world_size
    torch.distributed.all_gather_object(shapes, (stats.seq_lens, stats.batch_shapes), group=ctx.control_group)
    stats.seq_lens = set().union(*(a for a, _ in shapes))
    stats.batch_shapes = set().union(*(b for _, b in shapes))


def prepare_data_on_ranks(cfg: RunConfig, run_dir: Path, buckets_force: bool, ctx: DistContext, say) -> DataBundle:
    """``prepare_data`` on every rank, consistently.

    Rank 0 goes first (it may train and cache the tokenizer and the prepared data); the other ranks then
    load rank 0's tokenizer rather than train their own (training is deterministic, see
    train/data/tokenizer.py, but a per-node cache may hold an older entry). Finally every rank checks that
    it holds rank 0's data, tokenizer and bucket bounds.

    Raises:
        UserError: bad input on any rank, or ranks that disagree (e.g. a per-node data copy that differs).
    """
    if not ctx.enabled:
        return prepare_data(cfg, run_dir, buckets_force, notice=say)
    bundle = agreed(lambda: prepare_data(cfg, run_dir, buckets_force, notice=say) if ctx.is_main else None, ctx)
    tok_json = None
    if ctx.is_main:
        tok_file = Path(bundle.tokenizer_info["path"])
        tok_json = tok_file.read_text(encoding="utf-8") if tok_file.is_file() else None
    tok_json = broadcast_from_main(tok_json, ctx)

    def follow() -> DataBundle:
        if ctx.is_main:
            return bundle
        with tempfile.TemporaryDirectory() as tmp:
            local = cfg
            if tok_json is not None:
                local = cfg.with_values({"data.tokenizer_path": os.path.join(tmp, "tokenizer.json")})
                Path(local.data.tokenizer_path).write_text(tok_json, encoding="utf-8")
            return prepare_data(local, None, buckets_force, notice=lambda *a, **k: None)

    bundle = agreed(follow, ctx)
    facts = (bundle.data_fingerprint, bundle.tokenizer_info["fingerprint"], list(bundle.bounds))
    main_facts = broadcast_from_main(facts, ctx)

    def check() -> None:
        if facts != main_facts:
            raise UserError(f"rank {ctx.rank} prepared other data than rank 0 (data, tokenizer, buckets: {facts} vs "
                            f"{main_facts}); give every node the same data.source and a shared data.cache_dir "
                            "(or data.tokenizer_path and batching.boundaries_file)")

    agreed(check, ctx)
    return bundle
