"""Sharded checkpoints (``torch.distributed.checkpoint``) of ``dist.strategy=fsdp`` runs: each rank writes its shards;
a resume on 2 ranks continues exactly; the same checkpoint resharded onto 1 process continues within 1e-4 of the
uninterrupted 2-rank run; a set whose write was cut short is never taken for a checkpoint."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.conftest import free_port, global_batch, half_batch, needs_fsdp2, sharded_rank, tiny_llama, trainer_for

FIRST, THEN = 3, 3  # steps before the checkpoint, steps after it


def reshard_worker(rank: int, world: int, port: int, out: str) -> None:
    """One of 2 ranks: 3 steps on this rank's halves, a sharded checkpoint, 3 more steps; rank 0 writes the global
    batch's losses of the last 3."""
    from train.parallel.process_group import teardown
    from train.parallel.sharded_checkpoint import save_sharded

    ctx, _, model, trainer = sharded_rank(rank, world, port)
    try:
        for step in range(FIRST):
            trainer.step(half_batch(rank, step, packed=True))
        meta = {"scheduler": trainer.scheduler.state_dict()} if ctx.is_main else None
        save_sharded(Path(out) / "step-00000003.dcp", model, trainer.optimizer, meta, ctx)
        losses = torch.stack([trainer.step(half_batch(rank, FIRST + s, packed=True)).loss.detach()
                              for s in range(THEN)])
        torch.distributed.all_reduce(losses)
        if rank == 0:
            torch.save((losses / world).tolist(), Path(out) / "continued.pt")
        torch.distributed.barrier()  # no rank tears its group down while the other still uses it (a gloo abort once)
    finally:
        teardown(ctx)


@needs_fsdp2
def test_a_two_rank_sharded_checkpoint_resharded_onto_one_process_continues_within_1e_4(tmp_path: Path) -> None:
    """The checkpoint holds each rank's shards (one file per rank); read whole in one process (no process group), it
    loads into the unsharded model and its AdamW, and 3 steps on the whole batches give the 2-rank run's losses."""
    from train.parallel.sharded_checkpoint import load_whole

    mp.spawn(reshard_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    ckpt = tmp_path / "step-00000003.dcp"
    assert sorted(p.name for p in ckpt.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "trainer.pt"]
    sizes = [(ckpt / f"__{r}_0.distcp").stat().st_size for r in (0, 1)]
    assert max(sizes) < 0.6 * sum(sizes)  # each rank wrote about half, not rank 0 everything

    whole = load_whole(ckpt)
    model = tiny_llama()
    model.load_state_dict(whole["model"])
    trainer = trainer_for(model, chunked=False)
    trainer.optimizer.load_state_dict(whole["optimizer"])
    trainer.scheduler.load_state_dict(whole["scheduler"])
    assert int(trainer.optimizer.state[next(iter(model.parameters()))]["step"]) == FIRST
    losses = [float(trainer.step(global_batch(FIRST + s, packed=True)).loss) for s in range(THEN)]
    assert losses == pytest.approx(torch.load(tmp_path / "continued.pt"), abs=1e-4)


@needs_fsdp2
def test_a_sharded_run_checkpoints_per_rank_and_ignores_a_set_cut_short(tmp_path: Path) -> None:
    """A 2-rank fsdp run writes ``step-*.dcp`` directories (trainer.pt without tensors); a set whose write was cut
    short (its temporary directory) is not a checkpoint: a resume takes the previous complete one, and the next
    checkpoint prunes the leftover; ``python -m train export --checkpoint`` reads a middle sharded checkpoint whole."""
    from tests.conftest import causal_overrides, spawn_run, synthetic_rows, write_wndb
    from train.compat import load_state
    from train.parallel.sharded_checkpoint import load_any
    from train.resume import find_resume_checkpoint, list_checkpoints, prune_checkpoints

    wndb = write_wndb(tmp_path / "wn", synthetic_rows())
    base = causal_overrides(wndb, tmp_path, "train.max_steps=6", "train.eval_every=6", "train.checkpoint_every=2",
                            "train.keep_checkpoints=3", "dist.strategy=fsdp", "train.run_id=r")
    spawn_run(base)
    run = tmp_path / "runs" / "r"
    found = list_checkpoints(run)
    assert [p.name for p in found] == ["step-00000002.dcp", "step-00000004.dcp"]
    meta = load_state(str(found[-1] / "trainer.pt"))
    assert "model" not in meta and "optimizer" not in meta and meta["step"] == 4 and len(meta["ranks"]) == 2

    cut = run / "checkpoints" / ".step-00000006.dcp.tmp"  # a kill after the shards, before trainer.pt and the rename
    shutil.copytree(found[-1], cut)
    (cut / "trainer.pt").unlink()
    assert list_checkpoints(run) == found
    (run / "checkpoint.pt").unlink()
    assert find_resume_checkpoint(str(run))[1] == found[-1]
    prune_checkpoints(run, keep=3)
    assert not cut.exists() and list_checkpoints(run) == found

    middle = load_any(found[0])  # whole tensors, as a single-file checkpoint's
    moments = [st["exp_avg"] for st in middle["optimizer"]["state"].values()]
    assert middle["step"] == 2 and {m.shape for m in moments} == {v.shape for v in middle["model"].values()}
    out = tmp_path / "exported"
    done = subprocess.run([sys.executable, "-m", "train", "export", str(run), "--checkpoint", str(found[0]),
                           "--out", str(out)], capture_output=True, text=True, cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()


@needs_fsdp2
def test_a_lora_adapter_trains_sharded_as_under_ddp_resumes_exactly_and_exports(tmp_path: Path) -> None:
    """LoRA adapters (peft) on a 2-rank fsdp run: the adapter equals the ddp run's (same ranks, same batches), its
    checkpoints are single files holding the whole adapter (gathered: rank 0 holds only shards), a resume from the
    middle one is bit-identical, and the model directory is peft's layout."""
    from tests.conftest import assert_same_final_state, causal_overrides, spawn_run, synthetic_rows, write_wndb
    from train.compat import load_state
    from train.resume import list_checkpoints

    wndb = write_wndb(tmp_path / "wn", synthetic_rows())
    base = causal_overrides(wndb, tmp_path, "train.max_steps=6", "train.eval_every=6", "train.checkpoint_every=3",
                            "model.adapter={type: lora, r: 4, alpha: 8, dropout: 0.0, targets: auto}")
    runs = tmp_path / "runs"
    spawn_run(base + ["dist.strategy=ddp", "train.run_id=ddp"])
    spawn_run(base + ["dist.strategy=fsdp", "train.run_id=fsdp"])
    ddp, fsdp = (load_state(str(runs / r / "checkpoint.pt")) for r in ("ddp", "fsdp"))
    assert set(fsdp["model"]) == set(ddp["model"]) and all("lora_" in k for k in fsdp["model"])
    for name, tensor in ddp["model"].items():
        assert type(fsdp["model"][name]) is torch.Tensor, name  # whole, not a DTensor shard
        torch.testing.assert_close(fsdp["model"][name], tensor, atol=1e-5, rtol=0, msg=name)
    report = json.loads((runs / "fsdp" / "report.json").read_text())
    assert report["export"]["format"] == "peft-adapter"
    assert (runs / "fsdp" / "model" / "adapter_model.safetensors").is_file()

    middle = list_checkpoints(runs / "fsdp")[0]
    assert middle.name == "step-00000003.pt"
    spawn_run(base + ["dist.strategy=fsdp", "train.run_id=again"])
    for name in ("checkpoint.pt", "report.json"):
        (runs / "again" / name).unlink()
    spawn_run(base + ["dist.strategy=fsdp", "train.run_id=again"], resume=list_checkpoints(runs / "again")[0])
    assert_same_final_state(runs / "fsdp", runs / "again")
