"""Decoding settings chosen by measurement: the served dtype (``generate.precision=auto``) and the CPU threads of
batch-1 decoding.

**Precision.**
A decode step reads every weight (train/generate/floor.py), so a 16-bit dtype halves the bytes of a memory-bound
model. Where the device computes it natively — CUDA (bf16 where the GPU has it, else fp16), a CPU with AVX512-BF16 or
AMX (bf16) — both dtypes decode the same requests one at a time (batch 1, ``generate``'s dynamic cache), interleaved
over ``bench.rounds`` rounds with the A/B primitive (train/perf/ab.py), after a warm-up request each. The 16-bit dtype
is kept when its output tokens/s over fp32's has an interval above 1.0 (measurably faster) **and** its held-out loss
per token on the served prompts (teacher-forced, fp32 accumulation) is within 1 % of fp32's. Where it would be
emulated (a CPU without those instructions) the rule is fp32, not a measurement. Either way the greedy agreement —
per request, the tokens identical up to the first divergence — is reported when both dtypes ran.

**Threads.** A tiny model's matrix-vector products can run faster on one thread than on several (the threads'
start-up and join outweigh the work), and a memory-bound one gains nothing from a second thread once the bandwidth is
saturated. On a CPU with more than one torch thread, batch-1 decoding (the same requests, one at a time) is timed on
one thread and on all, interleaved; one thread is kept for the single-request runs only when measurably faster.
Batched runs keep every thread.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
LOSS_TOLERANCE = 0.01  # the 16-bit dtype's held-out loss may exceed fp32's by 1 % at most
REQUESTS = 4  # requests per timed window of each dtype


def half_candidate(device: torch.device) -> tuple[Optional[str], str]:
    """The 16-bit dtype ``device`` runs natively, or None, with the reason."""
    from train.precision import cpu_native_bf16

    if device.type == "cuda":
        return ("bf16", "CUDA with bf16") if torch.cuda.is_bf16_supported() else ("fp16", "CUDA without bf16")
    if device.type == "cpu" and cpu_native_bf16():
        return "bf16", "this CPU has native bf16 (AVX512-BF16/AMX)"
    return None, (f"{device.type} without native bf16 (no AVX512-BF16/AMX in /proc/cpuinfo): bf16 decoding would be "
                  "emulated")


@torch.no_grad()
def prompt_loss(model: torch.nn.Module, prompts: list[list[int]]) -> float:
    """Mean next-token cross-entropy (nats per token) of ``model`` over ``prompts`` (teacher-forced, each prompt
    alone, summed in fp32)."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for p in prompts:
        if len(p) < 2:
            continue
        ids = torch.tensor([p], device=device)
        logits = model(input_ids=ids).logits[0, :-1].float()
        total += float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum"))
        count += len(p) - 1
    return total / max(1, count)


def greedy_agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, int]:
    """Per request pair, the tokens identical before the first divergence: ``{"requests", "identical_requests",
    "tokens", "agreeing_tokens"}`` (``tokens``: the longer answer's length, summed)."""
    agreeing = identical = tokens = 0
    for x, y in zip(a, b):
        same = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        agreeing += same
        tokens += max(len(x), len(y))
        identical += int(x == y)
    return {"requests": min(len(a), len(b)), "identical_requests": identical, "tokens": tokens,
            "agreeing_tokens": agreeing}


def keep_half(ratio: Any, loss_fp32: float, loss_half: float) -> tuple[bool, str]:
    """Whether the 16-bit dtype is kept: ``ratio`` (a :class:`~train.perf.ab.Ratio` of its output tokens/s over
    fp32's) measurably above 1.0 and its loss within :data:`LOSS_TOLERANCE` of fp32's; and why, in words."""
    rel = (loss_half - loss_fp32) / loss_fp32 if loss_fp32 > 0 else 0.0
    quality = f"held-out loss {loss_half:.4f} vs {loss_fp32:.4f} ({rel:+.2%})"
    if rel > LOSS_TOLERANCE:
        return False, f"{quality}: above the {LOSS_TOLERANCE:.0%} tolerance"
    if ratio.verdict != "faster":
        return False, f"batch-1 decoding {ratio.describe()} fp32's: not measurably faster; {quality}"
    return True, f"batch-1 decoding {ratio.describe()} fp32's; {quality}"


def _batch1_arm(name: str, run) -> Any:
    """An A/B arm (train/perf/ab.py) timing ``run()``'s request timings over their span: output tokens and seconds."""
    from train.generate.figures import summarize
    from train.perf.ab import Arm

    def one() -> dict[str, float]:
        fig = summarize(run())
        return {"output_tokens": fig["output_tokens"], "seconds": fig["span_s"]}
    return Arm(name, one)


def choose_precision(model: torch.nn.Module, device: torch.device, prompts: list[list[int]], gen, rounds: int,
                     candidate: Optional[tuple[Optional[str], str]] = None) -> tuple[str, dict[str, Any]]:
    """``generate.precision=auto`` (module docstring) for the fp32 ``model`` on ``device``: ``(dtype name,
    generate.json's precision_choice)``. ``candidate``: :func:`half_candidate`'s answer (given in tests)."""
    from train.generate.engines import serve
    from train.perf.ab import Arm, interleave

    half, why = candidate if candidate is not None else half_candidate(device)
    if half is None:
        return "fp32", {"chosen": "fp32", "candidate": None, "reason": f"auto: {why}: fp32 by rule"}
    other = copy.deepcopy(model).to(DTYPES[half]).eval()
    models = {"fp32": model, half: other}
    requests = prompts[:REQUESTS]
    outputs: dict[str, list[list[int]]] = {}

    def arm(name: str) -> Arm:
        def one() -> list:
            timings = serve(models[name], "dynamic", requests, gen, 1)
            outputs[name] = [t.output_ids for t in timings]
            return timings
        return _batch1_arm(name, one)

    ab = interleave([arm("fp32"), arm(half)], rounds=max(2, rounds), window=1, warmup=1, device=device)
    ratio = ab.ratio(half, "fp32", "output_tokens")
    losses = {name: prompt_loss(m, prompts) for name, m in models.items()}
    keep, verdict = keep_half(ratio, losses["fp32"], losses[half])
    chosen = half if keep else "fp32"
    return chosen, {"chosen": chosen, "candidate": half, "reason": f"auto: {why}; {half} {verdict}: {chosen}",
                    "output_tokens_per_s": {n: ab.arms[n].median("output_tokens") for n in ("fp32", half)},
                    "ratio": ratio.as_dict(), "held_out_loss": losses, "loss_tolerance": LOSS_TOLERANCE,
                    "greedy_agreement": greedy_agreement(outputs["fp32"], outputs[half]),
                    "measured": f"{len(requests)} requests one at a time per window, {max(2, rounds)} interleaved "
                                "rounds; loss on every served prompt"}


def choose_threads(model: torch.nn.Module, device: torch.device, prompts: list[list[int]], gen,
                   rounds: int) -> tuple[Optional[int], dict[str, Any]]:
    """The torch threads of batch-1 decoding (module docstring): ``(threads, generate.json's threads_choice)``;
    ``(None, …)`` on a GPU, where host threads do not run the kernels. The thread count is restored after."""
    from train.generate.engines import serve
    from train.perf.ab import Arm, interleave

    every = torch.get_num_threads()
    if device.type != "cpu":
        return None, {"chosen": None, "reason": f"{device.type}: the kernels do not run on the host's threads"}
    if every == 1:
        return 1, {"chosen": 1, "reason": "one torch thread: nothing to choose"}
    requests = prompts[:REQUESTS]

    def arm(threads: int) -> Arm:
        def one() -> list:
            torch.set_num_threads(threads)
            try:
                return serve(model, "dynamic", requests, gen, 1)
            finally:
                torch.set_num_threads(every)
        return _batch1_arm(f"{threads} threads", one)

    ab = interleave([arm(every), arm(1)], rounds=max(2, rounds), window=1, warmup=1, device=device)
    ratio = ab.ratio("1 threads", f"{every} threads", "output_tokens")
    chosen = 1 if ratio.verdict == "faster" else every
    return chosen, {"chosen": chosen, "ratio": ratio.as_dict(),
                    "output_tokens_per_s": {str(n): ab.arms[f"{n} threads"].median("output_tokens")
                                            for n in (every, 1)},
                    "reason": f"one thread decoded {ratio.describe()} {every} threads' output tokens/s at batch 1: "
                              f"{chosen} thread{'s' if chosen > 1 else ''} for the single-request runs"}
