"""``python -m train bench-precision``: the same model on the same batches in several precisions.

Rows: ``fp32`` and the ``auto`` choice; on CUDA also ``bf16`` (where supported) and ``fp16``; on a CPU
also a short ``bf16`` row (``bench_precision.bf16_cpu_steps`` steps, timing only) that shows why
``auto`` avoids it. Every row starts from the same initial weights and RNG state and is fed the same
batches; the rows run interleaved step by step (the order rotates each step), so a shared, noisy
machine slows them alike. Step times are synchronised, the first ``bench_precision.warmup`` steps are
dropped (a row shorter than that drops only its first step), medians are reported with the ratio to fp32's median
on the same steps. After training, each full-length row is evaluated on the validation split.

Writes ``bench-precision.json`` and ``bench-precision.md`` into the run directory.
"""

from __future__ import annotations

import itertools
import json
from typing import Any, Optional

import numpy as np
import torch

from train.checkpoint import rng_state, set_rng_state
from train.config import RunConfig
from train.data import make_loader, prepare_data
from train.data.batch import epochs
from train.errors import atomic_write_text
from train.evaluation import evaluate
from train.perf.ab import Arm, interleave
from train.precision import PrecisionPolicy, probe_for
from train.setup import build_run, start_run
from train.tools.env import collect_env
from train.tools.progress import beside, progress_bar

ACCURACY_PARITY_POINTS = 1.0  # target: low-precision eval accuracy within 1.0 point of fp32 (CUDA)


def _rows(device: torch.device, steps: int, bf16_cpu_steps: int) -> list[tuple[str, int]]:
    """(requested mode, steps) per row."""
    rows = [("fp32", steps), ("auto", steps)]
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            rows.append(("bf16", steps))
        rows.append(("fp16", steps))
    elif bf16_cpu_steps > 0:
        rows.append(("bf16", min(bf16_cpu_steps, steps)))
    return rows


class _Row:
    def __init__(self, cfg: RunConfig, mode: str, steps: int, bundle: Any, device: torch.device) -> None:
        self.requested, self.steps = mode, steps
        self.policy = PrecisionPolicy.create(mode, device, probe_for(cfg), cfg.data.cache_dir)
        self.run = build_run(cfg, bundle, device, self.policy, splits=())  # same seed → same initial weights
        self.trainer = self.run.trainer
        self.trainer.model.train()
        self.rng = rng_state()
        self.losses: list[float] = []
        self.peak: Optional[int] = None

    def arm(self, batches: list[dict], device: torch.device, warmup: int) -> Arm:
        """This row as an A/B arm: its k-th step trains on ``batches[k]`` (the same batches in every row)."""

        def step() -> None:
            set_rng_state(self.rng)  # each row has its own dropout RNG stream
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            rec = self.trainer.step(batches[len(self.losses)], count=False)
            self.losses.append(float(rec.loss))  # sync point (a benchmark, not the training loop)
            self.rng = rng_state()
            if device.type == "cuda":
                self.peak = max(self.peak or 0, int(torch.cuda.max_memory_allocated(device)))

        first = warmup if self.steps > warmup else 1  # a short row: all but its first (cold) step
        return Arm(self.requested, step, warmup=first, rounds=self.steps - first)


def _gap(a: list[float], b: list[float]) -> dict[str, Optional[float]]:
    n = min(len(a), len(b))
    if n == 0:
        return {"mean_abs": None, "max_abs": None}
    d = np.abs(np.asarray(a[:n]) - np.asarray(b[:n]))
    return {"mean_abs": float(d.mean()), "max_abs": float(d.max())}


def run_precision_bench(cfg: RunConfig) -> dict[str, Any]:
    """Train every row for ``bench_precision.steps`` steps in lockstep, evaluate, write JSON + markdown.
    Returns the JSON dict."""
    bp = cfg.bench_precision
    steps, bf16_cpu_steps, warmup = bp.steps, bp.bf16_cpu_steps, bp.warmup
    start = start_run(cfg.with_values({"train.max_steps": steps}), prefix="bench-precision-")  # one LR schedule
    cfg = start.cfg
    run_dir, device = start.run_dir, start.device
    bundle = prepare_data(cfg, run_dir)
    loader = make_loader(bundle, "train", cfg, train=True, device=device)
    val_loader = make_loader(bundle, "validation", cfg, train=False, device=device)
    rows = [_Row(cfg, mode, n, bundle, device) for mode, n in _rows(device, steps, bf16_cpu_steps)]
    print(f"bench-precision {run_dir}: {steps} steps; rows " +
          ", ".join(f"{r.requested}→{r.policy.mode} ({r.steps} steps)" for r in rows), flush=True)

    batches = [b for _, b in itertools.islice(epochs(loader), steps)]
    first = warmup if steps > warmup else 1
    with progress_bar(steps, "bench-precision", cfg.train.progress) as bar:
        say = beside(bar, lambda m: print(m, flush=True))

        def done(i: int) -> None:
            bar.update(1)
            if (i + 1) % max(1, (steps - first) // 10) == 0:
                say(f"step {first + i + 1}/{steps}: " + ", ".join(f"{r.requested} loss {r.losses[-1]:.4f}" for r in rows
                                                                  if len(r.losses) == first + i + 1))

        bar.update(first)
        ab = interleave([r.arm(batches, device, warmup) for r in rows], rounds=steps - first, window=1, device=device,
                        on_round=done)

    ref = rows[0]
    results = []
    for r in rows:
        full = r.steps == steps
        ms = [1e3 * w.seconds for w in ab.arms[r.requested].windows]
        ref_ms = [1e3 * w.seconds for w in ab.arms[ref.requested].windows][: len(ms)]  # fp32 on the same steps
        p50 = float(np.median(ms)) if ms else None
        ref_p50 = float(np.median(ref_ms)) if ms else None
        speedup = ab.ratio(r.requested, ref.requested, "steps")  # paired per step, with its interval
        ev = evaluate(r.trainer.model, val_loader, r.policy, bundle.num_classes, device) if full else {}
        row: dict[str, Any] = {
            "requested": r.requested, "precision": r.policy.mode, "precision_reason": r.policy.reason,
            "steps": r.steps, "timed_steps": len(ms), "step_time_ms_p50": p50,
            "step_time_ratio_vs_fp32": p50 / ref_p50 if p50 and ref_p50 else None,
            "step_times_ms": ms, "speedup_vs_fp32": speedup.as_dict() if r is not ref else None,
            "peak_memory_bytes": r.peak,
            "eval_accuracy": ev.get("accuracy"), "eval_loss": ev.get("loss"),
            "final_train_loss": float(np.mean(r.losses[-10:])), "loss_gap_vs_fp32": _gap(r.losses, ref.losses),
            "skipped_steps": r.trainer.guard.end_window(len(r.losses))["skipped_steps"],  # non-finite steps
        }
        if r.peak is None:
            row["peak_memory_unavailable_reason"] = ("CPU: only the process-wide peak RSS is measurable, and all rows "
                                                     "run interleaved in one process")
        if not full:
            row["eval_unavailable_reason"] = f"timing-only row: {r.steps} steps (bf16 on this CPU is too slow to train)"
        if r is not ref:
            same = r.losses == ref.losses[: len(r.losses)] and all(
                torch.equal(a, b) for a, b in zip(r.trainer.model.state_dict().values(),
                                                  ref.trainer.model.state_dict().values()))
            row["identical_to_fp32"] = bool(same) if full else None
            if full and row["eval_accuracy"] is not None and results[0]["eval_accuracy"] is not None:
                gap = 100 * (row["eval_accuracy"] - results[0]["eval_accuracy"])
                row["accuracy_gap_points"] = gap
                row["accuracy_parity_met"] = abs(gap) <= ACCURACY_PARITY_POINTS
        results.append(row)
    out = {"run_dir": str(run_dir), "steps": steps, "warmup_steps_excluded": warmup,
           "model": cfg.model.preset, "batching": {"method": cfg.batching.method, "batch_size": cfg.batching.batch_size,
                                                   "max_tokens": cfg.batching.max_tokens},
           "accuracy_parity_points": ACCURACY_PARITY_POINTS, "env": collect_env(device),
           "num_threads": torch.get_num_threads(), "rows": results}
    atomic_write_text(run_dir / "bench-precision.json", json.dumps(out, indent=2) + "\n")
    atomic_write_text(run_dir / "bench-precision.md", markdown(out))
    return out


def markdown(out: dict[str, Any]) -> str:
    """The result as a markdown table (what README quotes)."""

    def f(x: Any, fmt: str) -> str:
        return "n/a" if x is None else format(x, fmt)

    lines = [f"bench-precision: {out['model']} model, {out['steps']} steps on the same batches "
             f"({out['env']['device']}, torch {out['env']['torch']}); step time = median after "
             f"{out['warmup_steps_excluded']} warm-up steps", "",
             "| row | precision | steps | step_time_ms p50 | × fp32 | peak_memory_bytes | eval accuracy | "
             "final train loss | loss gap vs fp32 (mean / max abs) | identical to fp32 |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in out["rows"]:
        g = r["loss_gap_vs_fp32"]
        lines.append(
            f"| {r['requested']} | {r['precision']} | {r['steps']} | {f(r['step_time_ms_p50'], '.1f')} | "
            f"{f(r['step_time_ratio_vs_fp32'], '.2f')} | {f(r['peak_memory_bytes'], 'd')} | "
            f"{f(r['eval_accuracy'], '.4f')} | {f(r['final_train_loss'], '.4f')} | "
            f"{f(g['mean_abs'], '.2e')} / {f(g['max_abs'], '.2e')} | {r.get('identical_to_fp32', '—')} |")
    lines += ["", "Why auto chose what it chose: " + out["rows"][1]["precision_reason"]]
    return "\n".join(lines) + "\n"

