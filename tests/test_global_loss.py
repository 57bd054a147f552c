"""One loss normalisation (train/accumulation.py): a step's loss is the sum of per-target losses over every
micro-batch on every rank divided by their global number of targets. Checked, fp32, on every parameter after 3 AdamW
steps (within 1e-5, clipping on): 4 accumulated micro-batches of unequal sizes = one batch of their union (a causal
LM, logits whole and the chunked loss; a classifier with unequal samples), and 2 ranks whose halves hold 1:3 target
tokens = one process on the union (DDP and FSDP2). Each fails when a micro-batch or rank is weighted by its mean."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.conftest import VOCAB, free_port, needs_fsdp2, tiny_llama, trainer_for

STEPS = 3


def causal_micro(step: int, part: int, rows: int, length: int, keep: int) -> dict:
    """A padded causal-LM batch of ``rows`` × ``length`` tokens whose first ``keep`` targets (row-major) are
    trained, the rest masked: micro-batches of unequal sizes and unequal target counts."""
    gen = torch.Generator().manual_seed(1000 * step + part)
    ids = torch.randint(1, VOCAB, (rows, length), generator=gen)
    labels = torch.cat([ids[:, 1:], torch.full((rows, 1), -100)], dim=1)
    flat = labels.flatten()
    trained = (flat != -100).nonzero().flatten()
    flat[trained[keep:]] = -100
    return {"input_ids": ids, "attention_mask": torch.ones(rows, length, dtype=torch.bool),
            "labels": flat.view(rows, length), "real_tokens": rows * length, "target_tokens": min(keep, len(trained))}


def union(batches: list[dict]) -> dict:
    """The batches as one: right-padded to the longest (pad id 0, masked out, no target), rows concatenated."""
    width = max(b["input_ids"].shape[1] for b in batches)

    def pad(t: torch.Tensor, value) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

    out = {"input_ids": torch.cat([pad(b["input_ids"], 0) for b in batches]),
           "attention_mask": torch.cat([pad(b["attention_mask"], False) for b in batches]),
           "labels": torch.cat([pad(b["labels"], -100) for b in batches])}
    return {**out, **{k: sum(b[k] for b in batches) for k in ("real_tokens", "target_tokens")}}


# 4 micro-batches: rows, length, trained targets — unequal in every way (5 : 2 : 40 : 9 targets)
MICRO = [(1, 9, 5), (2, 5, 2), (3, 16, 40), (2, 12, 9)]


def _params(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("chunked", [False, True], ids=["logits", "chunked-loss"])
def test_accumulated_micro_batches_of_unequal_sizes_equal_one_batch_of_their_union(chunked: bool) -> None:
    whole, accumulated = trainer_for(tiny_llama(), chunked), trainer_for(tiny_llama(), chunked)
    for step in range(STEPS):
        micro = [causal_micro(step, i, *shape) for i, shape in enumerate(MICRO)]
        one = whole.step(union(micro))
        four = accumulated.step(micro)
        assert float(four.loss) == pytest.approx(float(one.loss), abs=1e-5)
        assert float(four.grad_norm) == pytest.approx(float(one.grad_norm), rel=1e-5)
        assert four.samples == one.samples and four.real_tokens == one.real_tokens
    want, got = _params(whole), _params(accumulated)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_a_classifier_accumulates_micro_batches_of_unequal_samples_as_one_batch() -> None:
    from train.config import load_config
    from train.models.encoder import EncoderClassifier, resolve_spec
    from train.precision import PrecisionPolicy
    from train.trainer import Trainer

    cpu = torch.device("cpu")
    cfg = load_config(None, ["train.max_steps=100", "optim.warmup_fraction=0.0", "optim.lr=0.001",
                             "clip.max_norm=0.5", "model.dropout=0.0"])
    spec = resolve_spec("tiny", 60, 5, 32, 0.0, num_layers=2, hidden_size=32, num_heads=2, ffn_size=64)

    def trainer() -> Trainer:
        torch.manual_seed(0)
        policy = PrecisionPolicy(mode="fp32", reason="test", device=cpu)
        return Trainer(cfg=cfg, model=EncoderClassifier(spec), policy=policy,
                       device=cpu, train_loader=[None], num_classes=5)

    whole, accumulated = trainer(), trainer()
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        micro = []
        for rows, length in ((1, 9), (6, 5), (3, 16)):  # 1 : 6 : 3 samples
            ids = torch.randint(1, 60, (rows, length), generator=gen)
            micro.append({"input_ids": ids, "attention_mask": torch.ones(rows, length, dtype=torch.bool),
                          "labels": torch.randint(0, 5, (rows,), generator=gen), "real_tokens": rows * length})
        width = max(m["input_ids"].shape[1] for m in micro)
        one = {"input_ids": torch.cat([torch.nn.functional.pad(m["input_ids"], (0, width - m["input_ids"].shape[1]))
                                       for m in micro]),
               "attention_mask": torch.cat([torch.nn.functional.pad(m["attention_mask"],
                                                                    (0, width - m["attention_mask"].shape[1]))
                                            for m in micro]),
               "labels": torch.cat([m["labels"] for m in micro]), "real_tokens": sum(m["real_tokens"] for m in micro)}
        a, b = whole.step(one), accumulated.step(micro)
        assert float(b.loss) == pytest.approx(float(a.loss), abs=1e-5)
    want, got = _params(whole), _params(accumulated)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


# rank 0 holds 8 trained targets of its step, rank 1 holds 24 (1 : 3), in batches of the same shape; accumulated:
# each rank's step is 2 micro-batches of unequal sizes besides (rank 0: 3 + 8 targets, rank 1: 24 + 11)
HALVES = [(2, 12, 8), (2, 12, 24)]
EXTRA = [(1, 7, 3), (3, 9, 11)]


def rank_micro(step: int, rank: int, accumulate: bool) -> list[dict]:
    """Rank ``rank``'s micro-batches of step ``step``."""
    first = [causal_micro(step, 10 + rank, *EXTRA[rank])] if accumulate else []
    return first + [causal_micro(step, rank, *HALVES[rank])]


def rank_worker(rank: int, world: int, port: int, strategy: str, accumulate: bool, out: str) -> None:
    """One Gloo rank: the tiny Llama wrapped by the product (DDP or FSDP2), a Trainer on it, 3 steps on this rank's
    half; rank 0 writes the losses and every parameter (gathered whole)."""
    import os

    from train.compat import full_tensor
    from train.parallel.process_group import init_distributed, teardown, wrap_model

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
                       "RANK": str(rank), "LOCAL_RANK": str(rank)})
    torch.set_num_threads(1)
    ctx, device = init_distributed(torch.device("cpu"))
    try:
        model = tiny_llama()
        forward = wrap_model(model, ctx, device, strategy, "fp32", False)
        trainer = trainer_for(model, False, ctx)
        trainer.train_model = forward
        losses = []
        for step in range(STEPS):
            rec = trainer.step(rank_micro(step, rank, accumulate))
            summed = rec.loss.clone()
            torch.distributed.all_reduce(summed)
            losses.append(float(summed) / world)  # the logged loss: the mean over ranks of their step losses
        params = {n: full_tensor(p.detach()) for n, p in model.named_parameters()}
        if rank == 0:
            torch.save({"losses": losses, "params": params}, Path(out) / "ranks.pt")
        torch.distributed.barrier()
    finally:
        teardown(ctx)


@pytest.mark.parametrize("strategy, accumulate", [("ddp", False), ("ddp", True),
                                                  pytest.param("fsdp", False, marks=needs_fsdp2),
                                                  pytest.param("fsdp", True, marks=needs_fsdp2)],
                         ids=["ddp", "ddp-accumulated", "fsdp", "fsdp-accumulated"])
def test_two_ranks_with_unequal_targets_equal_one_process_on_the_union(tmp_path: Path, strategy: str,
                                                                       accumulate: bool) -> None:
    """Accumulated: the ranks exchange gradients on the last micro-batch only (DDP ``no_sync``, FSDP2
    ``set_requires_gradient_sync``), the union is every micro-batch of both ranks."""
    ref = trainer_for(tiny_llama(), False)
    losses = [float(ref.step(union([m for r in (0, 1) for m in rank_micro(step, r, accumulate)])).loss)
              for step in range(STEPS)]
    mp.spawn(rank_worker, args=(2, free_port(), strategy, accumulate, str(tmp_path)), nprocs=2, join=True)
    got = torch.load(tmp_path / "ranks.pt")
    assert got["losses"] == pytest.approx(losses, abs=1e-5)
    for name, param in ref.model.named_parameters():
        torch.testing.assert_close(got["params"][name], param.detach(), atol=1e-5, rtol=0,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_non_final_micro_batches_skip_the_gradient_exchange() -> None:
    import contextlib

    from train.accumulation import gradient_sync, sync_owner

    calls: list[str] = []

    class DDPLike(torch.nn.Module):
        @contextlib.contextmanager
        def no_sync(self):
            calls.append("no_sync in")
            yield
            calls.append("no_sync out")

    class FSDPLike(torch.nn.Module):
        def set_requires_gradient_sync(self, on: bool) -> None:
            calls.append(f"sync {on}")

    class Compiled:  # a compiled forward keeps its module as .model
        def __init__(self, model) -> None:
            self.model = model

    ddp, fsdp, plain = DDPLike(), FSDPLike(), torch.nn.Linear(1, 1)
    assert sync_owner(Compiled(ddp), plain) is ddp and sync_owner(plain, fsdp) is fsdp
    assert sync_owner(plain, Compiled(plain)) is None
    for owner in (ddp, fsdp):
        for last in (False, True):
            with gradient_sync(owner, last):
                calls.append("backward")
    assert calls == ["no_sync in", "backward", "no_sync out", "backward",
                     "sync False", "backward", "sync True", "backward"]
