"""LoRA (``model.adapter``, peft) vs full fine-tuning of the same decoder on the same packed batch: steady training
step time through the A/B primitive (interleaved, warmed, paired ratio with its interval) → real tokens/s, and the
training step's peak memory in a fresh process per arm (peak RSS ``VmHWM`` above the RSS before the first step, and
the whole process's peak; alternated, repeated).

    python scripts/bench_lora.py [--layers 8] [--hidden 512] [--vocab 8192] [--r 16] [--rows 16] [--capacity 64]

The model: the tiny Llama preset scaled by ``--layers`` / ``--hidden`` (8 heads, 4 key-value heads, FFN 2.75×
hidden), random init, ``--r`` on every attention and MLP projection (``targets: auto``). The step is the run's:
autocast in the precision ``auto`` picks here (bf16 where the CPU has it natively, else fp32), packed rows on
``--attention`` (eager-mask: what ``auto`` keeps for configs/causal-cpu.yaml on this CPU), the chunked loss,
backward, AdamW over ``param_groups`` (the adapter's matrices alone for LoRA), fused where torch has it. Held-out loss
at equal samples comes from two real runs (docs/models.md). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.bench_chunked_loss import packed_batch, step_peak  # noqa: E402
from train.compat import fused_adamw_supported  # noqa: E402
from train.config.adapter import AdapterSettings  # noqa: E402
from train.models.adapter import attach_adapter, hold_frozen_base  # noqa: E402
from train.models.causal import ExternalCausalLM  # noqa: E402
from train.models.causal_build import causal_preset  # noqa: E402
from train.models.causal_probe import probe_causal_packing  # noqa: E402
from train.models.encoder import param_groups  # noqa: E402
from train.models.wrap import ExternalSpec  # noqa: E402
from train.precision import DTYPES, cpu_native_bf16  # noqa: E402
from train.tasks import task_for  # noqa: E402
from train.tasks.base import LossHead  # noqa: E402


def build(args: argparse.Namespace, lora: bool) -> ExternalCausalLM:
    import transformers

    torch.manual_seed(0)
    over = {"num_hidden_layers": args.layers, "hidden_size": args.hidden, "num_attention_heads": 8,
            "num_key_value_heads": 4, "head_dim": args.hidden // 8, "intermediate_size": int(args.hidden * 2.75)}
    kw = causal_preset(transformers, "llama", "tiny", args.vocab, args.capacity, 0, over, bos_id=1, eos_id=2)
    inner = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model("llama", **kw))
    model = ExternalCausalLM(inner, ExternalSpec("hf:llama", 0, args.vocab, args.capacity, task="causal-lm"), "hf")
    if lora:
        attach_adapter(model, AdapterSettings(r=args.r, alpha=2.0 * args.r), "llama")
    assert probe_causal_packing(model)[0]
    model.set_packed_attention(args.attention)
    model.set_chunked_loss(True)
    return model.train()


def make_step(model: ExternalCausalLM, batch: dict, dtype: torch.dtype):
    task = task_for("causal-lm")
    fused = fused_adamw_supported(torch.device("cpu"))
    opt = torch.optim.AdamW(param_groups(model, 0.01), lr=1e-4, fused=fused or None)
    hold_frozen_base(model, dtype)  # what the Trainer does: the adapter's frozen base in the compute dtype
    kw = {k: batch[k] for k in ("position_ids", "seq_index", "num_seqs")}

    def autocast():
        return torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32)

    def step() -> dict:
        out = model(batch["input_ids"], batch["attention_mask"], autocast, **kw)
        loss = task.loss(out, batch["labels"], LossHead(model.loss_head(), dtype))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return {"samples": batch["num_seqs"], "real_tokens": int(batch["attention_mask"].sum())}

    return step


def memory_child(args: argparse.Namespace, lora: bool) -> dict:
    model = build(args, lora)
    return step_peak(make_step(model, packed_batch(args.vocab, args.rows, args.capacity), DTYPES[args.precision]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("--layers", 8), ("--hidden", 512), ("--vocab", 8192), ("--r", 16), ("--rows", 16),
                          ("--capacity", 64), ("--rounds", 9), ("--memory-repeats", 3)):
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="bf16" if cpu_native_bf16() else "fp32")
    p.add_argument("--attention", choices=("sdpa-mask", "eager-mask", "varlen"), default="eager-mask",
                   help="packed rows' attention path, both arms (default: what auto keeps for configs/causal-cpu.yaml "
                        "on a CPU with native bf16)")
    p.add_argument("--memory-child", choices=("full", "lora"))
    args = p.parse_args()
    if args.memory_child:
        print(json.dumps(memory_child(args, args.memory_child == "lora")))
        return
    from train.perf.ab import Arm, interleave

    batch = packed_batch(args.vocab, args.rows, args.capacity)
    models = {name: build(args, name == "lora") for name in ("full", "lora")}
    dtype = DTYPES[args.precision]
    arms = [Arm(name, make_step(m, batch, dtype)) for name, m in models.items()]
    ab = interleave(arms, rounds=args.rounds, window=2, warmup=2, device=torch.device("cpu"))
    ratio = ab.ratio("lora", "full", "real_tokens")
    memory: dict[str, list[dict]] = {"full": [], "lora": []}
    flags = [str(v) for k in ("layers", "hidden", "vocab", "r", "rows", "capacity")
             for v in (f"--{k}", getattr(args, k))]
    for _ in range(args.memory_repeats):
        for name in memory:
            cmd = [sys.executable, __file__, "--memory-child", name, "--precision", args.precision,
                   "--attention", args.attention, *flags]
            memory[name].append(json.loads(subprocess.run(cmd, check=True, capture_output=True,
                                                          text=True).stdout.strip().splitlines()[-1]))

    def med(name: str, key: str) -> float:
        vals = sorted(m[key] for m in memory[name])
        return float(vals[len(vals) // 2])

    tokens = int(batch["attention_mask"].sum())
    step_ms = {n: ab.arms[n].median_step_ms() for n in models}
    step_peak = {n: med(n, "step_peak_above_before_bytes") for n in memory}
    whole = {n: med(n, "peak_rss_bytes") for n in memory}
    out = {"shape": list(batch["input_ids"].shape), "real_tokens": tokens, "samples": batch["num_seqs"],
           "layers": args.layers, "hidden": args.hidden, "vocab": args.vocab, "r": args.r,
           "precision": args.precision, "attention": args.attention, "threads": torch.get_num_threads(),
           "parameters": {n: sum(q.numel() for q in m.parameters()) for n, m in models.items()},
           "trainable": {n: sum(q.numel() for q in m.parameters() if q.requires_grad) for n, m in models.items()},
           "step_ms_median": step_ms, "tokens_per_s_median": {n: tokens / (ms / 1e3) for n, ms in step_ms.items()},
           "speed_lora_vs_full": {"median": ratio.median, "interval": [ratio.low, ratio.high],
                                  "verdict": ratio.verdict},
           "step_peak_memory_bytes_median": step_peak, "peak_rss_bytes_median": whole,
           "step_peak_memory_ratio_lora_vs_full": step_peak["lora"] / step_peak["full"],
           "peak_rss_ratio_lora_vs_full": whole["lora"] / whole["full"],
           "memory_runs": memory, "load_1min": [ab.load_start, ab.load_end]}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
