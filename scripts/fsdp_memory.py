"""Per-rank training state under ``dist.strategy=ddp`` vs ``fsdp`` (FSDP2), 2 Gloo ranks on this CPU: the bytes each
rank holds in parameters + gradients + AdamW state after a training step (counted from the tensors each rank owns:
a DTensor's local shard under fsdp, whole tensors under ddp), and the steady step time (median of ``--steps``).

    python scripts/fsdp_memory.py [--layers 8] [--hidden 512] [--vocab 32000] [--rows 4] [--seq 128] [--steps 5]
                                  [--checkpoint-blocks]

The model: a random-init Llama (8 heads, 4 key-value heads, FFN 2.75× hidden) in the causal-LM wrapper, fp32, built
identically on each rank; ddp wraps it in ``DistributedDataParallel``, fsdp shards it with the product's
:func:`train.parallel.fsdp.shard_model`. Each rank steps on its own random batch (``--rows`` × ``--seq`` tokens) with
the trainer's loss, global-norm clipping and AdamW. ``OMP_NUM_THREADS=1`` per rank. Prints one JSON object.

``--checkpoint-blocks``: each strategy also runs with ``memory.checkpoint_blocks`` (every decoder layer recomputed in
the backward, applied before the wrap as the product does; keys ``ddp+checkpoint_blocks``, ``fsdp+checkpoint_blocks``),
and ``saved_for_backward_bytes`` gives the bytes one rank's forward saves for the backward without and with it
(``train.models.block_checkpoint.saved_tensor_bytes``: autograd's saved tensors, weights left out, in one process on
one rank's batch — the activations do not depend on the strategy). Run it alone on the machine: the step times are
only comparable between variants measured in the same invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from train.clipping import clip_gradients  # noqa: E402
from train.compat import local_tensor  # noqa: E402


def build(args: argparse.Namespace) -> torch.nn.Module:
    import transformers

    from train.models.causal import ExternalCausalLM
    from train.models.wrap import ExternalSpec

    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        "llama", vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=8,
        num_key_value_heads=4, intermediate_size=int(2.75 * args.hidden), max_position_embeddings=args.seq)
    inner = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()
    return ExternalCausalLM(inner, ExternalSpec("hf:llama", 0, args.vocab, args.seq, task="causal-lm"), "hf").train()


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds: parameters, gradients, optimizer state (local shards of DTensors)."""
    def nbytes(t: torch.Tensor) -> int:
        t = local_tensor(t)
        return t.numel() * t.element_size()

    params = sum(nbytes(p) for p in model.parameters())
    grads = sum(nbytes(p.grad) for p in model.parameters() if p.grad is not None)
    opt = sum(nbytes(v) for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.dim())
    return {"params": params, "grads": grads, "optimizer": opt, "total": params + grads + opt}


def batch(args: argparse.Namespace, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rank)
    return torch.randint(1, args.vocab, (args.rows, args.seq), generator=gen)


def saved_bytes(args: argparse.Namespace, checkpointed: bool) -> int:
    """Bytes rank 0's forward saves for the backward (one process, no wrap)."""
    from train.models.block_checkpoint import saved_tensor_bytes, set_checkpoint_blocks

    model = build(args)
    set_checkpoint_blocks(model, checkpointed)
    ids = batch(args, 0)
    return saved_tensor_bytes(lambda: model(ids, torch.ones_like(ids, dtype=torch.bool)), list(model.parameters()))[0]


def worker(rank: int, strategy: str, port: int, args: argparse.Namespace, out: str, checkpointed: bool) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "RANK": str(rank),
                       "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1"})
    torch.set_num_threads(1)
    from train.distributed import init_distributed, teardown, wrap_model

    ctx, device = init_distributed(torch.device("cpu"))
    try:
        from train.models.block_checkpoint import set_checkpoint_blocks

        model = build(args)
        set_checkpoint_blocks(model, checkpointed)  # before the wrap, as train/setup.py's build_run
        step_model = wrap_model(model, ctx, device, strategy, "fp32")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ids = batch(args, rank)
        mask = torch.ones_like(ids, dtype=torch.bool)
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            logits = step_model(ids, mask)
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            clip_gradients(model.parameters())
            optimizer.step()
            times.append(time.perf_counter() - t0)
        result = {**state_bytes(model, optimizer), "step_s": statistics.median(times[1:] or times)}
        Path(out, f"{strategy}{'+checkpoint_blocks' if checkpointed else ''}{rank}.json").write_text(json.dumps(result))
    finally:
        teardown(ctx)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("layers", 8), ("hidden", 512), ("vocab", 32000), ("rows", 4), ("seq", 128), ("steps", 5)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--checkpoint-blocks", action="store_true", help="also run each strategy with every block "
                   "checkpointed, and count the bytes saved for the backward with and without")
    args = p.parse_args()
    from tests.conftest import free_port

    report: dict = {"parameters": sum(t.numel() for t in build(args).parameters())}
    variants = [(s, c) for c in (False, True)[:1 + args.checkpoint_blocks] for s in ("ddp", "fsdp")]
    with tempfile.TemporaryDirectory() as out:
        for strategy, checkpointed in variants:
            mp.spawn(worker, args=(strategy, free_port(), args, out, checkpointed), nprocs=2, join=True)
            name = f"{strategy}{'+checkpoint_blocks' if checkpointed else ''}"
            report[name] = [json.loads(Path(out, f"{name}{r}.json").read_text()) for r in range(2)]
    if args.checkpoint_blocks:
        report["saved_for_backward_bytes"] = {"plain": saved_bytes(args, False),
                                              "checkpoint_blocks": saved_bytes(args, True)}
    worst = max(r["total"] for r in report["fsdp"]) / max(r["total"] for r in report["ddp"])
    report["fsdp_over_ddp_per_rank"] = round(worst, 3)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
