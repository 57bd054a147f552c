"""``dist.strategy=fsdp`` (FSDP2): a tiny Llama sharded over 2 Gloo ranks, each with half of a global batch, equals
the same model unsharded in one process on the whole batch — per-step loss and pre-clip gradient norm, the clipped
gradients, and every parameter after 3 AdamW steps — with and without packed rows and the chunked loss, and with
``dist.offload`` (CPUOffloadPolicy, unpinned on a CPU device); and the refusals (torch without FSDP2, a clipping
method that needs whole gradients)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.conftest import (
    STEPS,
    VOCAB,
    free_port,
    global_batch,
    half_batch,
    needs_fsdp2,
    run_steps,
    sharded_rank,
    spawn_run,
    tiny_llama,
    trainer_for,
)
from train.compat import fsdp2_api
from train.evaluation import evaluate

EVAL_SHARDS = ([(0, 10), (1, 10)], [(0, 11)])  # (half, step) of each held-out batch, per rank


def fsdp_worker(rank: int, world: int, port: int, packed: bool, chunked: bool, path: str, out: str,
                offload: bool) -> None:
    """One rank: shard the tiny Llama with the product's wrap (``offload``: FSDP2's CPUOffloadPolicy, unpinned on a
    CPU device), step on this rank's halves, write what it holds."""
    from train.compat import full_tensor, local_tensor
    from train.parallel.process_group import teardown

    ctx, device, model, trainer = sharded_rank(rank, world, port, path, chunked, offload)
    try:
        losses, norms, grads = run_steps(trainer, [half_batch(rank, s, packed) for s in range(STEPS)])
        summed = torch.stack(losses)
        torch.distributed.all_reduce(summed)  # the global batch's loss: the mean of the halves' (equal target counts)
        mean = (summed / world).tolist()
        params = {n: full_tensor(p.detach()) for n, p in model.named_parameters()}
        # uneven evaluation shards (rank 0: 2 batches, rank 1: 1): the forwards all-gather, so rank 1 must keep up
        held_out = evaluate(model, [half_batch(h, st, packed) for h, st in EVAL_SHARDS[rank]], trainer.policy,
                            VOCAB, device, ctx)
        shares = {n: [local_tensor(p).shape[0], p.shape[0]] for n, p in model.named_parameters()}
        if rank == 0:
            torch.save({"losses": mean, "norms": norms, "grads": grads, "params": params, "eval": held_out},
                       Path(out) / "fsdp.pt")
        Path(out, f"shares{rank}.json").write_text(json.dumps(shares))
        torch.distributed.barrier()  # no rank tears its group down while the other still uses it
    finally:
        teardown(ctx)


@needs_fsdp2
@pytest.mark.parametrize("packed, chunked, path, offload", [
    (False, False, "sdpa-mask", False), (True, True, "sdpa-mask", False), (True, False, "varlen", False),
    (True, False, "eager-mask", False), (False, False, "sdpa-mask", True)],
    ids=["padded", "packed-chunked", "packed-varlen", "packed-eager-mask", "padded-offload"])
def test_two_sharded_ranks_equal_one_unsharded_process(tmp_path: Path, packed: bool, chunked: bool, path: str,
                                                       offload: bool) -> None:
    """Every packed attention path of a decoder (sdpa-mask, varlen, eager-mask), the chunked loss, and CPU offload."""
    unsharded = tiny_llama()
    unsharded.set_packed_attention(path)
    ref = trainer_for(unsharded, chunked)
    losses, norms, grads = run_steps(ref, [global_batch(s, packed) for s in range(STEPS)])
    mp.spawn(fsdp_worker, args=(2, free_port(), packed, chunked, path, str(tmp_path), offload), nprocs=2, join=True)
    got = torch.load(tmp_path / "fsdp.pt")
    assert got["losses"] == pytest.approx([float(x) for x in losses], abs=1e-5)
    # the pre-clip norm of the whole gradient: not a rank's shard, not scaled by the world size
    assert got["norms"] == pytest.approx(norms, rel=1e-5)
    for name, grad in grads.items():  # the mean over ranks, clipped by the full norm
        torch.testing.assert_close(got["grads"][name], grad, atol=1e-6, rtol=1e-5, msg=name)
    for name, param in ref.model.named_parameters():
        # AdamW divides by sqrt(v): where a gradient is near zero, a last-bit difference of the sharded reduction
        # moves a weight by a visible fraction of lr (1.2e-5 seen on an AVX2-only CPU, one element of 2048)
        torch.testing.assert_close(got["params"][name], param.detach(), atol=5e-5, rtol=0,
                                   msg=lambda m, n=name: f"{n}: {m}")
    everything = [half_batch(h, st, packed) for shard in EVAL_SHARDS for h, st in shard]
    single = evaluate(ref.model, everything, ref.policy, VOCAB, torch.device("cpu"))
    assert got["eval"]["loss"] == pytest.approx(single["loss"], abs=1e-4) and single["loss"] is not None
    for rank in (0, 1):  # each rank holds its half of every parameter (rounded up on rank 0)
        shares = json.loads((tmp_path / f"shares{rank}.json").read_text())
        assert set(shares) == set(grads)
        for name, (mine, whole) in shares.items():
            assert mine == ((whole + 1) // 2 if rank == 0 else whole - (whole + 1) // 2), name
    assert json.loads((tmp_path / "shares0.json").read_text())["inner.model.embed_tokens.weight"] == [51, 101]


def test_fsdp_is_refused_in_one_line_where_torch_has_no_fsdp2(monkeypatch) -> None:
    from train.config import load_config
    from train.errors import UserError
    from train.parallel import fsdp

    monkeypatch.setattr(fsdp, "fsdp2_api", lambda: (None, "torch 2.1.0 has no FSDP2 (fully_shard needs torch ≥ 2.6)"))
    fsdp.check_fsdp(load_config(None, []))  # ddp, the default: nothing to refuse
    refusal = r"dist.strategy=fsdp: torch 2.1.0 has no FSDP2 \(fully_shard needs torch ≥ 2.6\); use the torch2x stack"
    with pytest.raises(UserError, match=refusal) as err:
        fsdp.check_fsdp(load_config(None, ["dist.strategy=fsdp"]))
    assert "\n" not in str(err.value)


@pytest.mark.skipif(fsdp2_api()[0] is not None, reason="this torch has FSDP2")
def test_this_torch_without_fsdp2_refuses_fsdp_and_fsdp_with_offload_naming_the_torch2x_stack() -> None:
    from train.config import load_config
    from train.errors import UserError
    from train.parallel.fsdp import check_fsdp

    for extra in ([], ["dist.offload=true"]):
        with pytest.raises(UserError, match=r"^dist.strategy=fsdp: torch 2\.1\.\d+ has no FSDP2 .*; use the torch2x "
                                            r"stack, or dist.strategy=ddp$"):
            check_fsdp(load_config(None, ["dist.strategy=fsdp", *extra]))


@needs_fsdp2
def test_fsdp_refuses_a_clipping_method_that_needs_whole_gradients() -> None:
    from train.config import load_config
    from train.errors import UserError
    from train.parallel.fsdp import check_fsdp

    with pytest.raises(UserError, match="clip.method=agc needs each gradient whole"):
        check_fsdp(load_config(None, ["dist.strategy=fsdp", "clip.method=agc"]))


@needs_fsdp2
def test_a_sharded_run_resumes_its_sharded_checkpoint_exactly_as_fsdp_and_as_ddp_and_exports(tmp_path: Path) -> None:
    """2 FSDP2 ranks, a tiny Llama on packed rows: the final checkpoint.pt holds whole tensors (gathered on rank 0);
    a resume from the middle (sharded, DCP) checkpoint as fsdp reads its shards and is bit-identical to the
    uninterrupted run, as ddp it reads them whole and continues within 1e-4; the model directory is exported.
    Per-layer gradient records (rank 0 alone, which holds only shards) are off under fsdp: with them on every
    record, a run that computed them would hang in a collective rank 1 never joins."""
    from tests.conftest import assert_same_final_state, causal_overrides, synthetic_rows, write_wndb
    from train.compat import load_state
    from train.resume import list_checkpoints

    wndb = write_wndb(tmp_path / "wn", synthetic_rows())
    base = causal_overrides(wndb, tmp_path, "train.max_steps=8", "train.eval_every=8", "train.log_every=1",
                            "train.checkpoint_every=4", "tracking.grad_stats_every=1", "dist.strategy=fsdp")
    runs = tmp_path / "runs"
    spawn_run(base + ["train.run_id=ref"])
    report = json.loads((runs / "ref" / "report.json").read_text())
    assert report["status"] == "completed" and report["env"]["world_size"] == 2
    assert "error" not in (report["export"] or {}) and (runs / "ref" / "model").is_dir()
    state = load_state(str(runs / "ref" / "checkpoint.pt"))
    embed = state["model"]["inner.model.embed_tokens.weight"]
    vocab = json.loads((runs / "ref" / "model" / "config.json").read_text())["vocab_size"]
    assert type(embed) is torch.Tensor and embed.shape[0] == vocab  # whole, not rank 0's shard
    assert all(type(v) is torch.Tensor for st in state["optimizer"]["state"].values() for v in st.values())
    moments = [st["exp_avg"] for st in state["optimizer"]["state"].values()]
    assert {m.shape for m in moments} == {v.shape for v in state["model"].values()}  # whole moments too

    spawn_run(base + ["train.run_id=mid"])
    first = list_checkpoints(runs / "mid")[0]
    assert first.name == "step-00000004.dcp" and first.is_dir()
    for name in ("checkpoint.pt", "report.json"):
        (runs / "mid" / name).unlink()
    spawn_run(base + ["train.run_id=mid"], resume=first)
    assert_same_final_state(runs / "ref", runs / "mid")

    ddp = [o for o in base if o != "dist.strategy=fsdp"] + ["dist.strategy=ddp", "train.run_id=mid"]
    (runs / "mid" / "checkpoint.pt").unlink()
    (runs / "mid" / "report.json").unlink()
    spawn_run(ddp, resume=first)
    resumed = json.loads((runs / "mid" / "report.json").read_text())
    assert resumed["quality"]["final_train_loss"] == pytest.approx(report["quality"]["final_train_loss"], abs=1e-4)

    # and back: a ddp run's single-file checkpoint resumed as fsdp (its whole tensors sharded on load)
    spawn_run([o for o in ddp if o != "train.run_id=mid"] + ["train.run_id=dmid"])
    single = list_checkpoints(runs / "dmid")[0]
    assert single.name == "step-00000004.pt"
    for name in ("checkpoint.pt", "report.json"):
        (runs / "dmid" / name).unlink()
    spawn_run(base + ["train.run_id=dmid"], resume=single)
    back = json.loads((runs / "dmid" / "report.json").read_text())
    assert back["quality"]["final_train_loss"] == pytest.approx(report["quality"]["final_train_loss"], abs=1e-4)


@needs_fsdp2
def test_compile_on_a_sharded_run_compiles_each_block_and_learns_as_eager(tmp_path: Path) -> None:
    """``compile.enabled=true`` on 2 fsdp ranks: each transformer block compiled (before FSDP2 wraps it), the same
    losses as the eager sharded run (1e-5), the graphs counted in report.json; under ddp it is refused in one line."""
    from tests.conftest import causal_overrides, synthetic_rows, write_wndb

    wndb = write_wndb(tmp_path / "wn", synthetic_rows())
    base = causal_overrides(wndb, tmp_path, "train.max_steps=4", "train.eval_every=4", "dist.strategy=fsdp",
                            f"compile.cache_dir={tmp_path / 'inductor'}")
    reports = {}
    for mode in ("false", "true"):
        spawn_run(base + [f"compile.enabled={mode}", f"train.run_id=c{mode}"])
        reports[mode] = json.loads((tmp_path / "runs" / f"c{mode}" / "report.json").read_text())
    compiled = reports["true"]["compile"]
    assert compiled["enabled"] and "each transformer block compiled" in compiled["reason"]
    assert compiled["graphs_compiled_in_warmup"] == 0 and compiled["recompiles_after_warmup"] > 0  # no warm-up
    assert "dist.strategy=fsdp" in compiled["warmup_unavailable_reason"]
    assert reports["true"]["quality"]["final_train_loss"] == pytest.approx(
        reports["false"]["quality"]["final_train_loss"], abs=1e-5)
    assert reports["true"]["quality"]["evals"][-1]["loss"] == pytest.approx(
        reports["false"]["quality"]["evals"][-1]["loss"], abs=1e-5)

    with pytest.raises(Exception, match="compile.enabled=true under torchrun with dist.strategy=ddp"):
        spawn_run([o for o in base if o != "dist.strategy=fsdp"] + ["compile.enabled=true", "train.run_id=ddp"])


@needs_fsdp2
def test_bf16_on_a_sharded_built_in_encoder_keeps_the_root_in_fp32_and_learns_as_ddp(tmp_path: Path) -> None:
    """``train.precision=bf16`` on 2 fsdp ranks of the built-in encoder (whose final LayerNorm and pooling run in fp32,
    refusing bf16 weights: the run crashed when the root was gathered in bf16): the blocks gathered in bf16, the root
    in fp32; 12 steps end within 0.05 of the ddp run's training loss (the blocks' residual stream is bf16 under
    FSDP2, fp32 under autocast)."""
    from tests.conftest import synthetic_rows, tiny_overrides, write_wndb

    wndb = write_wndb(tmp_path / "wn", synthetic_rows())
    base = tiny_overrides(wndb, tmp_path, "train.max_steps=12", "train.eval_every=12", "train.precision=bf16",
                          "model.dropout=0.0")
    losses = {}
    for strategy in ("ddp", "fsdp"):
        spawn_run(base + [f"dist.strategy={strategy}", f"train.run_id={strategy}"])
        report = json.loads((tmp_path / "runs" / strategy / "report.json").read_text())
        assert report["env"]["precision"] == "bf16"
        losses[strategy] = report["quality"]["final_train_loss"]
    assert losses["fsdp"] == pytest.approx(losses["ddp"], abs=0.05)


@needs_fsdp2
def test_the_numerics_guard_skips_and_aborts_every_sharded_rank_alike(tmp_path: Path) -> None:
    """A diverging run (lr 1e36, no clipping) on 2 fsdp ranks: the norm of the whole gradient is non-finite on every
    rank alike, so both skip the same steps and abort at the same one (no rank left waiting in a collective), and
    report.json says which."""
    from tests.conftest import causal_overrides, synthetic_rows, write_wndb

    wndb = write_wndb(tmp_path / "wn", synthetic_rows())
    run = causal_overrides(wndb, tmp_path, "train.max_steps=20", "train.log_every=1", "optim.lr=1e36",
                           "optim.warmup_fraction=0", "clip.method=none", "numerics.max_bad_steps=3",
                           "dist.strategy=fsdp", "train.run_id=diverge")
    with pytest.raises(Exception, match="non-finite"):
        spawn_run(run)
    report = json.loads((tmp_path / "runs" / "diverge" / "report.json").read_text())
    assert report["status"] == "aborted-numerics"
    numerics = report["numerics"]
    assert numerics["aborted"] and numerics["longest_bad_run"] == 3 and numerics["skipped_steps"] >= 3
