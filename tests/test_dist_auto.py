"""``dist.strategy=auto`` (train/parallel/strategy.py): the rule with forced inputs — fits → ddp, does not fit → fsdp,
no FSDP2 or a clipping method that needs whole gradients → ddp with why, a single process → nothing to decide —
and whole runs: single-process (the decisions block and report.json say so) and 2 Gloo ranks forced not to fit
(they shard). Nothing here depends on this machine's memory."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from tests.conftest import free_port, tiny_overrides
from train.compat import fsdp2_api
from train.parallel.strategy import HEADROOM, choose_strategy, training_state_bytes

GIB = 2**30
NO_FSDP2 = "torch 2.1.0 has no FSDP2 (fully_shard needs torch ≥ 2.6)"


def test_the_training_state_is_16_bytes_a_parameter_and_4_for_a_frozen_one() -> None:
    assert training_state_bytes(1000, 1000) == 16_000
    assert training_state_bytes(1000, 10) == 4000 + 120  # an adapter: gradients and moments of the trainable only


def test_a_state_within_the_headroom_stays_ddp() -> None:
    params = int(HEADROOM * 16 * GIB) // 16  # exactly half of a 16 GiB device
    d = choose_strategy(params, params, 16 * GIB, world_size=2)
    assert d.chosen == "ddp" and "fits 0.5 of the device's 16.00 GiB: ddp" in d.reason
    assert d.as_report()["state_bytes"] == 8 * GIB and d.as_report()["headroom"] == HEADROOM


def test_a_state_over_the_headroom_is_sharded_with_fsdp() -> None:
    params = 7 * 10**8  # 11.2 GB of state on a 16 GiB device
    d = choose_strategy(params, params, 16 * GIB, world_size=4)
    assert d.chosen == "fsdp", d.reason
    assert d.reason.startswith("training state 10.43 GiB (16 bytes a parameter, 700.0M parameters)")
    assert d.reason.endswith("would not fit 0.5 of the device's 16.00 GiB: fsdp, 2.61 GiB a rank over 4 ranks")


def test_an_adapter_counts_only_its_trainable_parameters_beyond_the_weights() -> None:
    params = 7 * 10**8  # 2.8 GB of frozen fp32 weights + a small adapter: fits
    d = choose_strategy(params, 10**6, 16 * GIB, world_size=2)
    assert d.chosen == "ddp" and "1.0M trainable" in d.reason


def test_without_fsdp2_a_state_that_does_not_fit_stays_ddp_and_says_why() -> None:
    d = choose_strategy(10**9, 10**9, 16 * GIB, world_size=2, fsdp2_missing=NO_FSDP2)
    assert d.chosen == "ddp"
    assert f"would not fit 0.5 of the device's 16.00 GiB, but {NO_FSDP2}: ddp (the torch2x stack shards it)" in d.reason


def test_a_clipping_method_that_needs_whole_gradients_stays_ddp() -> None:
    d = choose_strategy(10**9, 10**9, 16 * GIB, world_size=2, clip_method="agc")
    assert d.chosen == "ddp" and "clip.method=agc needs whole gradients" in d.reason


def test_a_single_process_has_no_ranks_to_shard_over() -> None:
    d = choose_strategy(10**9, 10**9, 16 * GIB, world_size=1)
    assert d.chosen is None and d.reason == "a single process: no ranks to shard over (dist.strategy is ignored)"


def test_an_unknown_device_memory_stays_ddp() -> None:
    d = choose_strategy(10, 10, None, world_size=2)
    assert d.chosen == "ddp" and "memory is unknown" in d.reason


def test_a_single_process_run_with_auto_says_so_in_the_decisions_and_the_report(wndb: Path, tmp_path: Path,
                                                                              capsys) -> None:
    from train.cli import main

    assert main(["train", *tiny_overrides(wndb, tmp_path, "train.max_steps=2", "train.eval_every=2",
                                          "train.run_id=auto", "dist.strategy=auto")]) == 0
    out = capsys.readouterr().out
    assert "  strategy   none: a single process: no ranks to shard over (dist.strategy is ignored)" in out
    report = json.loads((tmp_path / "runs" / "auto" / "report.json").read_text())
    assert report["dist"]["strategy"] is None and report["dist"]["auto"]["chosen"] is None
    assert report["dist"]["auto"]["state_bytes"] > 0


def auto_worker(rank: int, port: int, overrides: list[str]) -> None:
    """One rank of a run whose device is forced to hold 1 KiB: the training state cannot fit it."""
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "RANK": str(rank),
                       "LOCAL_RANK": str(rank)})
    from train.config import load_config
    from train.parallel import strategy
    from train.run.training import run_training

    strategy.device_memory_bytes = lambda *_a, **_k: 1024
    run_training(load_config(None, overrides), time.perf_counter())


@pytest.mark.skipif(fsdp2_api()[0] is None, reason=fsdp2_api()[1])
def test_two_ranks_whose_state_does_not_fit_are_sharded_and_config_yaml_keeps_fsdp(wndb: Path, tmp_path: Path) -> None:
    overrides = tiny_overrides(wndb, tmp_path, "train.max_steps=2", "train.eval_every=2", "train.run_id=auto2",
                               "dist.strategy=auto", "tracking.grad_stats_every=0")
    mp.spawn(auto_worker, args=(free_port(), overrides), nprocs=2, join=True)
    run = tmp_path / "runs" / "auto2"
    report = json.loads((run / "report.json").read_text())
    assert report["status"] == "completed" and report["dist"]["strategy"] == "fsdp"
    auto = report["dist"]["auto"]
    assert auto["chosen"] == "fsdp" and auto["device_bytes"] == 1024 and "a rank over 2 ranks" in auto["reason"]
    assert "strategy: fsdp" in (run / "config.yaml").read_text()
