"""Helpers for multi-process tests: tiny-run overrides, a free port, and a spawned DDP worker."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import time
from pathlib import Path

import torch


def tiny_overrides(wndb: Path, root: Path, *extra: str) -> list[str]:
    """The conftest ``tiny_cfg`` settings as ``section.key=value`` strings (for subprocesses), dropout on."""
    return [f"data.wordnet_dir={wndb}", f"data.cache_dir={root / 'cache'}", "data.vocab_size=200", "data.max_len=32",
            "model.num_layers=1", "model.hidden_size=32", "model.num_heads=2", "model.ffn_size=64", "model.dropout=0.1",
            "batching.num_buckets=3", "batching.batch_size=8", "train.max_steps=30", "train.eval_every=10",
            "train.log_every=3", "train.progress=false", f"train.output_dir={root / 'runs'}", "optim.lr=5e-3",
            "train.num_threads=1", *extra]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def interrupt_at(monkeypatch_target, step: int, signum: int = signal.SIGTERM) -> None:
    """Make this process signal itself during training step ``step`` (deterministic interruption)."""
    from train.trainer import Trainer

    original = Trainer.train_step
    calls = {"n": 0}

    def train_step(self, *args):
        calls["n"] += 1
        if self.start_step + calls["n"] == step:
            os.kill(os.getpid(), signum)
        return original(self, *args)

    monkeypatch_target.setattr(Trainer, "train_step", train_step)


class _Patch:
    def setattr(self, obj, name, value) -> None:
        setattr(obj, name, value)


def ddp_worker(rank: int, world: int, port: int, overrides: list[str], out_dir: str, resume: str | None,
               signal_rank: int | None, signal_step: int | None) -> None:
    """One rank of a Gloo DDP run (for ``torch.multiprocessing.spawn``).

    Records which training-split indices this rank's DataLoader fetched, runs ``run_training`` and
    writes ``<out_dir>/rank<r>.json`` with the indices, the report and a checksum of its parameters.
    """
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
                       "RANK": str(rank), "LOCAL_RANK": str(rank)})
    from train.config import load_config
    from train.data.collate import TokenDataset
    from train.run import run_training

    seen: list[tuple[int, int]] = []
    original = TokenDataset.__getitem__

    def getitem(self, i):
        seen.append((len(self.split), int(i)))
        return original(self, i)

    TokenDataset.__getitem__ = getitem
    from train.data.packing import RowDataset  # packed training rows index (row, sample index)

    original_row = RowDataset.__getitem__

    def getrow(self, key):
        seen.append((len(self.split), int(key[1])))
        return original_row(self, key)

    RowDataset.__getitem__ = getrow
    if signal_rank == rank and signal_step is not None:
        interrupt_at(_Patch(), signal_step)
    captured = {}
    from train import trainer as trainer_mod

    original_fit = trainer_mod.Trainer.fit

    def fit(self):
        stats = original_fit(self)
        flat = torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])
        captured["param_sum"] = float(flat.double().sum())
        captured["param_sha256"] = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
        return stats

    trainer_mod.Trainer.fit = fit
    t0 = time.perf_counter()
    report = run_training(load_config(None, overrides), t0, resume=resume)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"seen": seen, "report": report, **captured}))
