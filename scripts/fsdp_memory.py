"""Per-rank training state under ``dist.strategy=ddp``, ``fsdp`` (FSDP2) and ``fsdp`` with ``dist.offload``: the bytes
each rank holds in parameters + gradients + AdamW state after training steps, split by where they are (``device``:
the accelerator; ``host``: CPU memory), counted from the tensors each rank owns (a DTensor's local shard under fsdp,
whole tensors under ddp); the losses, and the steady step time (median of ``--steps``).

    python scripts/fsdp_memory.py [--device cpu|cuda] [--nproc 2] [--precision fp32|bf16]
        [--strategies ddp,fsdp,fsdp-offload] [--layers 8] [--hidden 512] [--vocab 32000] [--rows 4] [--seq 128]
        [--steps 5] [--checkpoint-blocks] [--out FILE]

The model: a random-init Llama (8 heads, 4 key-value heads, FFN 2.75× hidden) in the causal-LM wrapper, built
identically on each rank; ddp wraps it in ``DistributedDataParallel``, fsdp shards it with the product's
:func:`train.parallel.fsdp.shard_model` (``fsdp-offload``: its ``offload=True``, FSDP2's ``CPUOffloadPolicy``). Each
rank steps on its own random batch (``--rows`` × ``--seq`` tokens) through the product's :class:`train.trainer.Trainer`
(loss, global-norm clipping, the numerics guard, AdamW as a run builds it). ``--nproc`` ranks are spawned here
(``--device cuda``: one GPU each, NCCL, with Gloo beside it for offloaded host tensors, as ``dist.offload`` runs do;
CPU: Gloo, ``OMP_NUM_THREADS=1`` per rank); a single rank gets a process group of one, so fsdp and offload still
apply. Prints (and with ``--out`` writes) one JSON object: per strategy, a record per rank; the ratios of the worst
rank's bytes to ddp's — all bytes, and bytes on the device (null on a CPU, where device and host memory are one).

``--checkpoint-blocks``: each strategy also runs with ``memory.checkpoint_blocks`` (every decoder layer recomputed in
the backward, applied before the wrap as the product does; keys ``<strategy>+checkpoint_blocks``), and
``saved_for_backward_bytes`` gives the bytes one rank's forward saves for the backward without and with it
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
from typing import Any, Optional

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from train.compat import local_tensor  # noqa: E402

STRATEGIES = ("ddp", "fsdp", "fsdp-offload")
SAME_MEMORY = "the device is the CPU: device and host memory are one, so offload moves nothing"


def build(args: argparse.Namespace) -> torch.nn.Module:
    import transformers

    from train.compat import hf_attn_implementation
    from train.models.causal import ExternalCausalLM
    from train.models.wrap import ExternalSpec

    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        "llama", vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=8,
        num_key_value_heads=4, intermediate_size=int(2.75 * args.hidden), max_position_embeddings=args.seq)
    inner = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=hf_attn_implementation())
    return ExternalCausalLM(inner.float(), ExternalSpec("hf:llama", 0, args.vocab, args.seq, task="causal-lm"),
                            "hf").train()


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> dict[str, Any]:
    """Bytes this rank holds: parameters, gradients, optimizer state (local shards of DTensors), and their total on
    the device and on the host (``device``: null where ``device`` is the CPU)."""
    where = {"device": 0, "host": 0}

    def nbytes(t: torch.Tensor) -> int:
        t = local_tensor(t)
        n = t.numel() * t.element_size()
        where["host" if t.device.type == "cpu" else "device"] += n
        return n

    params = sum(nbytes(p) for p in model.parameters())
    grads = sum(nbytes(p.grad) for p in model.parameters() if p.grad is not None)
    opt = sum(nbytes(v) for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.dim())
    on_cpu = device.type == "cpu"
    return {"params": params, "grads": grads, "optimizer": opt, "total": params + grads + opt,
            "on_device": None if on_cpu else where["device"], "on_host": where["host"],
            "on_device_reason": SAME_MEMORY if on_cpu else None}


def join(rank: int, world: int, port: int, device: torch.device, offload: bool) -> tuple[Any, torch.device]:
    """This rank's process group (the product's :func:`~train.parallel.process_group.init_distributed` for 2+ ranks;
    a group of one otherwise, which the product leaves out) and device."""
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
                       "RANK": str(rank), "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1"})
    from train.parallel.process_group import DistContext, init_distributed

    if world > 1:
        return init_distributed(device, host_collectives=offload)
    if device.type == "cuda":
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    backend = ("cuda:nccl,cpu:gloo" if offload else "nccl") if device.type == "cuda" else "gloo"
    torch.distributed.init_process_group(backend=backend, world_size=1, rank=0)
    return DistContext(), device


def saved_bytes(args: argparse.Namespace, checkpointed: bool) -> int:
    """Bytes rank 0's forward saves for the backward (one process, no wrap)."""
    from train.models.block_checkpoint import saved_tensor_bytes, set_checkpoint_blocks

    model = build(args)
    set_checkpoint_blocks(model, checkpointed)
    ids = torch.randint(1, args.vocab, (args.rows, args.seq), generator=torch.Generator().manual_seed(0))
    return saved_tensor_bytes(lambda: model(ids, torch.ones_like(ids, dtype=torch.bool)), list(model.parameters()))[0]


def worker(rank: int, world: int, strategy: str, port: int, args: argparse.Namespace, out: str,
           checkpointed: bool) -> None:
    if args.device == "cpu":
        torch.set_num_threads(1)
    from train.config import load_config
    from train.parallel.fsdp import shard_model
    from train.perf.memory import peak_memory, reset_peak
    from train.precision import PrecisionPolicy
    from train.trainer import Trainer

    offload = strategy == "fsdp-offload"
    ctx, device = join(rank, world, port, torch.device(args.device), offload)
    try:
        from train.models.block_checkpoint import set_checkpoint_blocks

        model = build(args).to(device)
        set_checkpoint_blocks(model, checkpointed)  # before the wrap, as train/setup.py's build_run
        if strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            step_model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        else:
            step_model = shard_model(model, world, device, args.precision, offload)
        cfg = load_config(None, ["model.task=causal-lm", f"train.max_steps={args.steps}", "optim.lr=0.0001",
                                 f"train.precision={args.precision}", f"dist.strategy={strategy.split('-')[0]}",
                                 f"dist.offload={str(offload).lower()}"])
        policy = PrecisionPolicy(mode=args.precision, reason="fsdp_memory.py", device=device)
        trainer = Trainer(cfg=cfg, model=model, policy=policy, device=device, train_loader=[None],
                          num_classes=args.vocab, dist_ctx=ctx, train_model=step_model)
        gen = torch.Generator().manual_seed(rank)
        reset_peak(device)
        times, losses = [], []
        for _ in range(args.steps):
            ids = torch.randint(1, args.vocab, (args.rows, args.seq), generator=gen)
            labels = torch.cat([ids[:, 1:], torch.full((args.rows, 1), -100)], dim=1)
            batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids, dtype=torch.bool), "labels": labels,
                     "real_tokens": ids.numel(), "target_tokens": int((labels != -100).sum())}
            t0 = time.perf_counter()
            losses.append(float(trainer.step(batch).loss))  # a host read: the step is done
            times.append(time.perf_counter() - t0)
        peak = peak_memory(device) if device.type == "cuda" else {}
        result = {**state_bytes(model, trainer.optimizer, device), "losses": losses,
                  "peak_device_allocated_bytes": peak.get("peak_memory_bytes"),
                  "step_s": statistics.median(times[1:] or times)}
        Path(out, f"{strategy}{'+checkpoint_blocks' if checkpointed else ''}{rank}.json").write_text(json.dumps(result))
    finally:
        torch.distributed.destroy_process_group()


def ratios(report: dict[str, Any], key: str) -> Optional[dict[str, float]]:
    """The worst rank's ``key`` bytes under each strategy over ddp's worst (None: ddp not run, or no device)."""
    ddp = report.get("ddp")
    if not ddp or any(r[key] is None for r in ddp):
        return None
    base = max(r[key] for r in ddp)
    return {s: round(max(r[key] for r in report[s]) / base, 4) for s in STRATEGIES[1:] if s in report and base}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("layers", 8), ("hidden", 512), ("vocab", 32000), ("rows", 4), ("seq", 128), ("steps", 5),
                          ("nproc", 2)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--out", help="also write the JSON here")
    p.add_argument("--checkpoint-blocks", action="store_true", help="also run each strategy with every block "
                   "checkpointed, and count the bytes saved for the backward with and without")
    args = p.parse_args()
    strategies = [s for s in args.strategies.split(",") if s]
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        p.error(f"--strategies: {', '.join(unknown)} not among {', '.join(STRATEGIES)}")
    if args.device == "cuda" and torch.cuda.device_count() < args.nproc:
        p.error(f"--nproc {args.nproc} needs as many GPUs; {torch.cuda.device_count()} visible")
    from tests.conftest import free_port

    report: dict[str, Any] = {"parameters": sum(t.numel() for t in build(args).parameters()), "device": args.device,
                              "ranks": args.nproc, "precision": args.precision}
    with tempfile.TemporaryDirectory() as out:
        for checkpointed in (False, True)[:1 + args.checkpoint_blocks]:
            for strategy in strategies:
                mp.spawn(worker, args=(args.nproc, strategy, free_port(), args, out, checkpointed), nprocs=args.nproc,
                         join=True)
                name = f"{strategy}{'+checkpoint_blocks' if checkpointed else ''}"
                report[name] = [json.loads(Path(out, f"{name}{r}.json").read_text()) for r in range(args.nproc)]
    if args.checkpoint_blocks:
        report["saved_for_backward_bytes"] = {"plain": saved_bytes(args, False),
                                              "checkpoint_blocks": saved_bytes(args, True)}
    report["over_ddp_per_rank"] = ratios(report, "total")
    report["on_device_over_ddp_per_rank"] = ratios(report, "on_device")
    if report["on_device_over_ddp_per_rank"] is None and args.device == "cpu":
        report["on_device_reason"] = SAME_MEMORY
    if "fsdp" in report and "fsdp-offload" in report:  # the same sharded steps, the state elsewhere
        report["offload_max_loss_difference"] = max(abs(a - b) for a, b in zip(report["fsdp"][0]["losses"],
                                                                                report["fsdp-offload"][0]["losses"]))
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
