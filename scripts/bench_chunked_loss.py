"""Chunked vs unchunked LM loss (``model.chunked_loss``) on one packed batch of a tiny Llama at a large vocabulary:
step time through the A/B primitive (interleaved, warmed, paired ratio with its interval) and the training step's
peak memory in a fresh process per arm (peak RSS, ``VmHWM``, above the RSS before the first step; alternated,
repeated).

    python scripts/bench_chunked_loss.py [--vocab 32000] [--rows 16] [--capacity 128] [--rounds 9] [--memory-repeats 3]

The step is the run's: autocast in the precision auto picks here (bf16 where the CPU has it natively), the task's
loss outside autocast, backward, AdamW. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from train.models.causal import ExternalCausalLM  # noqa: E402
from train.models.causal_build import causal_preset  # noqa: E402
from train.models.causal_probe import probe_causal_packing  # noqa: E402
from train.models.wrap import ExternalSpec  # noqa: E402
from train.precision import DTYPES, cpu_native_bf16  # noqa: E402
from train.tasks import task_for  # noqa: E402
from train.tasks.base import LossHead  # noqa: E402
from train.tasks.chunked_loss import IGNORE_INDEX, chunk_rows  # noqa: E402


def build(vocab: int, capacity: int):
    import transformers

    torch.manual_seed(0)
    kw = causal_preset(transformers, "llama", "tiny", vocab, capacity, 0, bos_id=1, eos_id=2)
    inner = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model("llama", **kw))
    model = ExternalCausalLM(inner, ExternalSpec("hf:llama", 0, vocab, capacity, task="causal-lm"), "hf")
    assert probe_causal_packing(model)[0]
    return model.train()


def packed_batch(vocab: int, rows: int, capacity: int) -> dict:
    gen = torch.Generator().manual_seed(1)
    ids = torch.zeros(rows, capacity, dtype=torch.long)
    pos, seq = torch.zeros_like(ids), torch.full_like(ids, -1)
    labels = torch.full_like(ids, IGNORE_INDEX)
    slot = 0
    for r in range(rows):
        at = 0
        while True:
            n = int(torch.randint(8, 41, (1,), generator=gen))
            if at + n > capacity:
                break
            s = torch.randint(3, vocab, (n,), generator=gen)
            ids[r, at:at + n], pos[r, at:at + n], seq[r, at:at + n] = s, torch.arange(n), slot
            labels[r, at:at + n - 1] = s[1:]
            at, slot = at + n, slot + 1
    return {"input_ids": ids, "attention_mask": seq >= 0, "position_ids": pos, "seq_index": seq, "labels": labels,
            "num_seqs": slot}


def make_step(model: ExternalCausalLM, batch: dict, dtype: torch.dtype, chunked: bool):
    task = task_for("causal-lm")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    kw = {k: batch[k] for k in ("position_ids", "seq_index", "num_seqs")}

    def autocast():
        return torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32)

    def step() -> dict:
        model.set_chunked_loss(chunked)
        out = model(batch["input_ids"], batch["attention_mask"], autocast, **kw)
        head = LossHead(model.loss_head(), dtype) if chunked else None
        loss = task.loss(out, batch["labels"], head)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return {"samples": batch["num_seqs"]}

    return step


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()


def hwm_bytes() -> int:
    """This process's peak RSS (``VmHWM``: per address space, so a fresh exec starts from zero; ``ru_maxrss``
    would carry the forking parent's peak across the exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def step_peak(step) -> dict:
    """Two training steps in this fresh process: the RSS before them, the process's peak, and the step's peak above
    the RSS before it (bytes)."""
    before = rss_bytes()
    for _ in range(2):
        step()
    peak = hwm_bytes()
    return {"rss_before_step_bytes": before, "peak_rss_bytes": peak, "step_peak_above_before_bytes": peak - before}


def memory_child(args: argparse.Namespace, chunked: bool) -> dict:
    dtype = DTYPES[args.precision]
    model = build(args.vocab, args.capacity)
    return step_peak(make_step(model, packed_batch(args.vocab, args.rows, args.capacity), dtype, chunked))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--capacity", type=int, default=128)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--memory-repeats", type=int, default=3)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="bf16" if cpu_native_bf16() else "fp32")
    p.add_argument("--memory-child", choices=("chunked", "unchunked"))
    args = p.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    if args.memory_child:
        print(json.dumps(memory_child(args, args.memory_child == "chunked")))
        return
    from train.perf.ab import Arm, interleave

    model = build(args.vocab, args.capacity)
    batch = packed_batch(args.vocab, args.rows, args.capacity)
    dtype = DTYPES[args.precision]
    arms = [Arm(name, make_step(model, batch, dtype, name == "chunked")) for name in ("unchunked", "chunked")]
    ab = interleave(arms, rounds=args.rounds, window=2, warmup=2, device=torch.device("cpu"))
    ratio = ab.ratio("chunked", "unchunked", "steps")
    tokens = int(batch["attention_mask"].sum())
    memory: dict[str, list[dict]] = {"unchunked": [], "chunked": []}
    for _ in range(args.memory_repeats):
        for name in memory:
            cmd = [sys.executable, __file__, "--memory-child", name, "--vocab", str(args.vocab), "--rows",
                   str(args.rows), "--capacity", str(args.capacity), "--precision", args.precision]
            memory[name].append(json.loads(subprocess.run(cmd, check=True, capture_output=True,
                                                          text=True).stdout.strip().splitlines()[-1]))

    def med(name: str, key: str) -> float:
        vals = sorted(m[key] for m in memory[name])
        return float(vals[len(vals) // 2])

    step_peak = {n: med(n, "step_peak_above_before_bytes") for n in memory}
    out = {"shape": list(batch["input_ids"].shape), "real_tokens": tokens, "samples": batch["num_seqs"],
           "vocab": args.vocab, "precision": args.precision, "threads": torch.get_num_threads(),
           "chunk_rows": chunk_rows(args.rows * args.capacity, model.inner.config.hidden_size, args.vocab),
           "step_ms_median": {n: ab.arms[n].median_step_ms() for n in ("unchunked", "chunked")},
           "speed_chunked_vs_unchunked": {"median": ratio.median, "interval": [ratio.low, ratio.high],
                                          "verdict": ratio.verdict},
           "step_peak_memory_bytes_median": step_peak,
           "peak_rss_bytes_median": {n: med(n, "peak_rss_bytes") for n in memory},
           "step_peak_memory_ratio_chunked_vs_unchunked": step_peak["chunked"] / step_peak["unchunked"],
           "memory_runs": memory, "load_1min": [ab.load_start, ab.load_end]}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
