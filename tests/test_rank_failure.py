"""A rank that fails where the ranks agree on errors (``agreed``) ends every rank within seconds: an injected
``OSError`` on rank 0 while its periodic checkpoint is pruned — rank 0 keeps its own exception, rank 1 stops with
:class:`~train.errors.RankFailed` naming rank 0 and the error. Before, rank 1 got Gloo's "Connection closed by
peer" from its next collective once rank 0's process had exited (and would wait for the process group's 30-minute
timeout while it lived on). Two Gloo ranks on the CPU, the real ``run_training``."""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path

import torch.multiprocessing as mp

from tests.conftest import free_port, tiny_overrides


def _worker(rank: int, world: int, port: int, overrides: list[str], out: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
                       "RANK": str(rank), "LOCAL_RANK": str(rank)})
    import train.resume
    from train.config import load_config
    from train.run.training import run_training

    if rank == 0:
        def broken(*_args, **_kwargs) -> None:
            raise OSError(errno.EIO, "Input/output error", "checkpoints")

        train.resume.prune_checkpoints = broken
    t0 = time.monotonic()
    try:
        run_training(load_config(None, overrides), time.perf_counter())
        result: dict = {"error": None}
    except Exception as exc:  # noqa: BLE001 - what each rank ended with is the test's subject
        result = {"error": type(exc).__name__, "message": str(exc)}
    result["seconds"] = time.monotonic() - t0
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def test_an_oserror_on_rank_0_during_a_checkpoint_ends_every_rank_in_seconds(wndb: Path, tmp_path: Path) -> None:
    overrides = tiny_overrides(wndb, tmp_path, "train.max_steps=6", "train.checkpoint_every=2",
                               "train.keep_checkpoints=1", "train.run_id=fail")
    out = tmp_path / "out"
    out.mkdir()
    procs = mp.spawn(_worker, args=(2, free_port(), overrides, str(out)), nprocs=2, join=False)
    deadline = time.monotonic() + 120
    while not procs.join(timeout=1):
        if time.monotonic() > deadline:  # the old code: rank 1 waits in the next collective
            for p in procs.processes:
                p.kill()
            raise AssertionError("a rank still waits 120 s after rank 0 failed")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["error"] == "OSError" and "Input/output error" in ranks[0]["message"], ranks
    assert ranks[1]["error"] == "RankFailed", ranks
    assert ranks[1]["message"].startswith("rank 0 failed: OSError: [Errno 5] Input/output error"), ranks
    assert "rank 1 stops with it" in ranks[1]["message"]
