"""The FSDP2 test harness shared by tests/test_fsdp.py and tests/test_sharded_checkpoint.py: a tiny Llama with uneven
dimension-0 sizes, the halves of a global batch (one per rank) and the whole batch, the product's Trainer on it, and
a whole ``python -m train train`` run on 2 spawned Gloo ranks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.conftest import free_port, packed_causal_batch
from train.compat import fsdp2_api

needs_fsdp2 = pytest.mark.skipif(fsdp2_api()[0] is None, reason=fsdp2_api()[1])
VOCAB, STEPS, ROW = 101, 3, 16  # 101 and intermediate_size 75: dimension 0 does not split evenly over 2 ranks
LENGTHS = (7, 3, 12, 5)
EVAL_SHARDS = ([(0, 10), (1, 10)], [(0, 11)])  # (half, step) of each held-out batch, per rank


def tiny_llama() -> torch.nn.Module:
    """A random-init Llama with uneven dimension-0 sizes (vocabulary 101, MLP 75), fp32, packing probed."""
    import transformers

    from train.compat import hf_attn_implementation
    from train.models.causal import ExternalCausalLM
    from train.models.causal_probe import probe_causal_packing
    from train.models.wrap import ExternalSpec

    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model("llama", vocab_size=VOCAB, pad_token_id=0, num_hidden_layers=2,
                                               hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                               intermediate_size=75, max_position_embeddings=64, attention_dropout=0.0)
    inner = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=hf_attn_implementation())
    model = ExternalCausalLM(inner.float(), ExternalSpec("hf:llama", 0, VOCAB, 64, task="causal-lm"), "hf").train()
    assert probe_causal_packing(model)[0]
    return model


def half_batch(half: int, step: int, packed: bool) -> dict:
    """Rank ``half``'s half of step ``step``'s global batch: 2 rows of 16 tokens with the same number of target tokens
    on either half (so the mean of the halves' per-token losses is the global batch's)."""
    gen = torch.Generator().manual_seed(100 * step + half)
    if packed:
        samples = [torch.randint(1, VOCAB, (n,), generator=gen) for n in LENGTHS]
        batch = packed_causal_batch(samples)
        batch["samples"] = len(samples)
    else:
        ids = torch.randint(1, VOCAB, (2, ROW), generator=gen)
        labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
        batch = {"input_ids": ids, "attention_mask": torch.ones(2, ROW, dtype=torch.bool), "labels": labels}
    batch["real_tokens"] = int(batch["attention_mask"].sum())
    batch["target_tokens"] = int((batch["labels"] != -100).sum())
    return batch


def global_batch(step: int, packed: bool) -> dict:
    """Both halves of step ``step``'s batch as one (rank 0's rows first; packed slots renumbered)."""
    a, b = half_batch(0, step, packed), half_batch(1, step, packed)
    out = {k: torch.cat([a[k], b[k]]) for k in ("input_ids", "attention_mask", "labels")}
    if packed:
        out["position_ids"] = torch.cat([a["position_ids"], b["position_ids"]])
        out["seq_index"] = torch.cat([a["seq_index"], torch.where(b["seq_index"] >= 0, b["seq_index"] + a["num_seqs"],
                                                                  b["seq_index"])])
        out["num_seqs"], out["samples"] = a["num_seqs"] + b["num_seqs"], a["samples"] + b["samples"]
    for k in ("real_tokens", "target_tokens"):
        out[k] = a[k] + b[k]
    return out


def trainer_for(model: torch.nn.Module, chunked: bool, ctx=None):
    from train.config import load_config
    from train.precision import PrecisionPolicy
    from train.trainer import Trainer

    model.set_chunked_loss(chunked)
    # max_norm below the gradients' norm: the clip scales every step, so a per-rank norm would show. lr 1e-3: AdamW
    # divides by sqrt(v), so at 10x that the last-bit differences of near-zero gradients (summed in another order
    # over shards) move a few weights past 1e-5, while the gradients themselves agree to float rounding
    cfg = load_config(None, ["model.task=causal-lm", "train.max_steps=100", "optim.warmup_fraction=0.0",
                             "optim.lr=0.001", "clip.max_norm=0.5", "dist.strategy=fsdp"])
    cpu = torch.device("cpu")
    return Trainer(cfg=cfg, model=model, policy=PrecisionPolicy(mode="fp32", reason="test", device=cpu), device=cpu,
                   train_loader=[None], num_classes=VOCAB, dist_ctx=ctx)


def run_worker(rank: int, world: int, port: int, overrides: list[str], resume: str | None) -> None:
    """One rank of a whole ``python -m train train`` run (for ``torch.multiprocessing.spawn``)."""
    import time

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
                       "RANK": str(rank), "LOCAL_RANK": str(rank)})
    from train.commands.train import run_training
    from train.config import load_config

    run_training(load_config(None, overrides), time.perf_counter(), resume=resume)


def spawn_run(overrides: list[str], resume: Path | None = None) -> None:
    mp.spawn(run_worker, args=(2, free_port(), overrides, str(resume) if resume else None), nprocs=2, join=True)
