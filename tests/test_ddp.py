"""DDP with Gloo on CPU: exactly-once epoch coverage, reduced evaluation, exact resume, two simulated nodes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.conftest import ddp_worker, free_port, tiny_overrides
from train.compat import load_state
from train.config import load_config
from train.data import make_loader, prepare_data
from train.errors import UserError
from train.evaluation import evaluate
from train.parallel.process_group import compile_cache_dirs
from train.precision import PrecisionPolicy
from train.run.training import run_training
from train.setup import build_model

ROOT = Path(__file__).resolve().parent.parent


def spawn_ddp(out: Path, overrides: list[str], world: int = 2, resume: str | None = None,
              signal_rank: int | None = None, signal_step: int | None = None) -> list[dict]:
    out.mkdir(parents=True)
    mp.spawn(ddp_worker, args=(world, free_port(), overrides, str(out), resume, signal_rank, signal_step),
             nprocs=world, join=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def test_two_ranks_cover_an_epoch_exactly_once_and_reduce_eval(wndb: Path, tmp_path: Path) -> None:
    overrides = tiny_overrides(wndb, tmp_path, "train.max_steps=null", "train.epochs=1", "train.run_id=ddp",
                               "train.eval_every=1000")
    results = spawn_ddp(tmp_path / "out", overrides)
    report = results[0]["report"]
    n, n_val = report["data"]["train_samples"], report["data"]["validation_samples"]
    repeated = report["batching"]["repeated_samples"]
    assert report["env"]["world_size"] == 2 and report["env"]["distributed_backend"] == "gloo"

    train_seen = Counter(i for r in results for size, i in r["seen"] if size == n)
    assert set(train_seen) == set(range(n))  # every training sample, on one rank or the other
    assert sum(train_seen.values()) == n + repeated  # ... exactly once, plus the counted repeats that even out ranks
    assert repeated < 2 * 8  # at most one batch per missing rank slot
    assert report["perf"]["train_samples_seen"] == n + repeated  # the report sums over ranks
    val_seen = Counter(i for r in results for size, i in r["seen"] if size == n_val)
    assert set(val_seen.values()) == {1} and len(val_seen) == n_val  # evaluation shards: each sample once, no repeats
    assert results[0]["param_sha256"] == results[1]["param_sha256"]  # DDP kept the replicas identical

    # the reduced evaluation equals a single-process evaluation of the same final weights
    cfg = load_config(None, overrides)
    bundle = prepare_data(cfg, notice=lambda *_: None)
    model = build_model(cfg, bundle)
    model.load_state_dict(load_state(str(tmp_path / "runs" / "ddp" / "checkpoint.pt"))["model"])
    cpu = torch.device("cpu")
    single = evaluate(model, make_loader(bundle, "validation", cfg, train=False, device=cpu),
                      PrecisionPolicy.create("fp32", cpu), bundle.num_classes, cpu)
    assert report["quality"]["eval_accuracy"] == single["accuracy"]
    assert report["quality"]["eval_macro_f1"] == pytest.approx(single["macro_f1"], abs=1e-6)
    assert report["quality"]["eval_loss"] == pytest.approx(single["loss"], rel=1e-5)
    # only rank 0 wrote the run directory; one metrics stream
    run_dir = tmp_path / "runs" / "ddp"
    assert sorted(p.name for p in run_dir.iterdir()) == [".writer.lock", "buckets.json", "checkpoint.pt", "config.yaml",
                                                          "metrics.jsonl", "report.json", "tokenizer.json"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "step" in r]  # "system" records are timed, not stepped
    assert steps == sorted(steps)


def test_two_ranks_train_packed_rows_covering_an_epoch_exactly_once(wndb: Path, tmp_path: Path) -> None:
    """batching.method=packed under DDP (Gloo): every training sample in one packed row of one rank, plus counted
    repeats; the replicas stay identical."""
    overrides = tiny_overrides(wndb, tmp_path, "train.max_steps=null", "train.epochs=1", "train.run_id=ddp-packed",
                               "train.eval_every=1000", "batching.method=packed")
    results = spawn_ddp(tmp_path / "out", overrides)
    report = results[0]["report"]
    n, repeated = report["data"]["train_samples"], report["batching"]["repeated_samples"]
    assert report["batching"]["method"] == "packed" and report["batching"]["distinct_shapes"] == 1
    train_seen = Counter(i for r in results for size, i in r["seen"] if size == n)
    assert set(train_seen) == set(range(n)) and sum(train_seen.values()) == n + repeated
    assert report["perf"]["train_samples_seen"] == n + repeated
    assert results[0]["param_sha256"] == results[1]["param_sha256"]


def test_per_rank_compile_cache_dirs() -> None:
    a, b = compile_cache_dirs(0, {}), compile_cache_dirs(1, {})
    assert a["TORCHINDUCTOR_CACHE_DIR"] != b["TORCHINDUCTOR_CACHE_DIR"]
    assert compile_cache_dirs(1, {"TORCHINDUCTOR_CACHE_DIR": "/c"}) == {"TORCHINDUCTOR_CACHE_DIR": "/c/rank1",
                                                                       "TRITON_CACHE_DIR": "/c/rank1/triton"}


@pytest.mark.skipif(__import__("shutil").which("make") is None, reason="needs GNU make (not in the image)")
def test_make_train_nproc_launches_torchrun() -> None:
    def dry(*args: str) -> str:
        out = subprocess.run(["make", "-n", "--no-print-directory", *args], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout
        return out.strip().splitlines()[-1]

    assert dry("train").startswith(".venv/bin/python -m train train")
    assert dry("train", "NPROC=2").startswith(".venv/bin/python -m train.tools.launch --standalone --nproc_per_node=2 "
                                              "-m train train")
    multi = dry("smoke", "NNODES=2", "NODE_RANK=1", "MASTER_ADDR=10.0.0.1")
    assert "--nnodes=2 --node_rank=1" in multi and "--master_addr=10.0.0.1" in multi


@pytest.mark.slow
def test_signal_on_one_rank_then_resume_is_bit_identical(wndb: Path, tmp_path: Path) -> None:
    overrides = tiny_overrides(wndb, tmp_path, "train.max_steps=24", "train.checkpoint_every=100")
    ref = spawn_ddp(tmp_path / "ref", overrides + ["train.run_id=ref"])
    part = spawn_ddp(tmp_path / "part", overrides + ["train.run_id=b"], signal_rank=1, signal_step=9)
    for r in part:  # the signal reached rank 1 only; both ranks stopped after the same step
        assert r["report"]["status"] == "interrupted" and r["report"]["interrupted"]["step"] == 9
        assert r["report"]["interrupted"]["resume_command"].startswith("make train NPROC=2 ARGS=")
    with pytest.raises(UserError, match="written by 2 processes, this run has 1"):
        run_training(load_config(None, overrides + ["train.run_id=b"]), 0.0, resume=str(tmp_path / "runs" / "b"))
    resumed = spawn_ddp(tmp_path / "resumed", overrides + ["train.run_id=b"], resume=str(tmp_path / "runs" / "b"))
    assert resumed[0]["param_sha256"] == ref[0]["param_sha256"] == resumed[1]["param_sha256"]
    assert resumed[0]["report"]["quality"]["final_train_loss"] == ref[0]["report"]["quality"]["final_train_loss"]
    a = load_state(str(tmp_path / "runs" / "ref" / "checkpoint.pt"))
    b = load_state(str(tmp_path / "runs" / "b" / "checkpoint.pt"))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


@pytest.mark.slow
def test_two_simulated_nodes_over_loopback(wndb: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PY": sys.executable, "MASTER_PORT": str(free_port()), "NPROC": "1"}
    proc = subprocess.run([str(ROOT / "scripts" / "simulate_2node.sh"),
                           *tiny_overrides(wndb, tmp_path, "train.max_steps=6", "train.run_id=nodes")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "runs" / "nodes" / "report.json").read_text())
    assert report["env"]["world_size"] == 2 and report["perf"]["steps"] == 6
