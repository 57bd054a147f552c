"""``make bench-vs-hf``: one Hugging Face model trained by the real Hugging Face ``Trainer`` and by this project,
interleaved in one process on the same data, for the same number of samples.

Both sides start from the same initial weights (``build_model`` under the same seed) and see ``train.epochs``
passes over the same training split (so equal samples seen, up to each side's last partial batch):

* ``hf-trainer``: ``transformers.Trainer`` with its best settings on this device: ``bf16=True`` where
  ``train.precision=auto`` picks bf16 (``fp16=True`` where it picks fp16), ``group_by_length=True``,
  ``per_device_train_batch_size=batching.batch_size``, the same learning rate, warm-up, weight decay and
  clipping; no checkpoints, no logging, no tracking;
* ``this-project``: this project's trainer with the config as given (``configs/bench-vs-hf.yaml``: the
  ``optimized`` settings: fitted buckets, a token budget, the ``auto`` precision);
* ``all-levers``: the same with every lever this project can apply to the model on top: packed rows where the
  model runs them exactly (train/models/packed.py) and the float32 dropout mask (``model.fast_dropout=true``).

Each side first trains ``bench.warmup_runs`` untimed runs (1: every batch shape meets oneDNN's primitive cache and
the allocator once, as the A/B primitive's warm-up does for steps); then they take turns for ``bench.rounds`` rounds
(the order rotates; the one A/B primitive, train/perf/ab.py), so machine noise hits them alike. Per timed run:
samples/s and real tokens/s over the steady steps (the first excluded; wall clock between the ends of steps,
batch loading included), time to first step (model build → end of step 1), peak memory (the run's window),
and accuracy on the validation split, measured for both by the same evaluation. Figures: medians over rounds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from train.callbacks import Callback
from train.config import RunConfig
from train.data import make_loader, prepare_data
from train.errors import UserError, atomic_write_text
from train.evaluation import evaluate
from train.perf.ab import CONFIDENCE, ABResult, Arm, interleave
from train.perf.memory import WindowPeakMemory
from train.precision import PrecisionPolicy
from train.setup import build_model, build_run, replan, seed_everything, start_run
from train.tools.env import collect_env, machine_facts

SIDES = ("hf-trainer", "this-project")
ALL_LEVERS = "all-levers"
"""A third side: this project with every lever it can apply to the model on top of the config (packed rows where
the model runs them exactly, the float32 dropout mask)."""


def _all_levers(cfg: RunConfig) -> dict[str, Any]:
    """The overrides of the ``all-levers`` side for ``cfg``'s model."""
    from train.models import model_supports_packing

    levers: dict[str, Any] = {"model.fast_dropout": "true"}
    if model_supports_packing(cfg.model.source, cfg.model.task):
        levers["batching.method"] = "packed"
    return levers


class _StepEnds(Callback):
    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_step_end(self, step: int, step_ms: float) -> bool:
        self.ends.append(time.perf_counter())
        return False


def _hf_side(cfg: RunConfig, bundle, device, policy, tmp: Path) -> dict[str, Any]:
    """One run of the Hugging Face Trainer; returns its figures and the trained (wrapped) model."""
    import transformers

    split = bundle.splits["train"]
    data = [{"input_ids": torch.from_numpy(np.array(split.ids[i], dtype=np.int64)), "labels": int(split.labels[i])}
            for i in range(len(split))]
    counts: list[tuple[int, int]] = []

    def collate(items: list[dict]) -> dict[str, torch.Tensor]:
        longest = max(len(x["input_ids"]) for x in items)
        ids = torch.full((len(items), longest), bundle.pad_id, dtype=torch.long)
        for r, x in enumerate(items):
            ids[r, :len(x["input_ids"])] = x["input_ids"]
        counts.append((len(items), sum(len(x["input_ids"]) for x in items)))
        return {"input_ids": ids, "attention_mask": _mask(items, longest),
                "labels": torch.tensor([x["labels"] for x in items])}

    ends: list[float] = []

    class Ends(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    b = cfg.batching.batch_size
    steps = max(1, math.ceil(cfg.train.epochs * math.ceil(len(data) / b)))
    args = transformers.TrainingArguments(
        output_dir=str(tmp), per_device_train_batch_size=b, max_steps=steps, learning_rate=cfg.optim.lr,
        weight_decay=cfg.optim.weight_decay, warmup_steps=math.ceil(cfg.optim.warmup_fraction * steps),
        lr_scheduler_type="linear", max_grad_norm=cfg.clip.max_norm if cfg.clip.method == "global-norm" else 0.0,
        bf16=policy.mode == "bf16", fp16=policy.mode == "fp16", report_to="none", **_group_by_length(transformers),
        save_strategy="no", logging_strategy="no", eval_strategy="no", disable_tqdm=True, seed=cfg.train.seed,
        dataloader_num_workers=cfg.data.num_workers, use_cpu=device.type == "cpu")
    t0 = time.perf_counter()
    seed_everything(cfg.train.seed)
    model = build_model(cfg, bundle)
    trainer = transformers.Trainer(model=model.inner, args=args, train_dataset=data, data_collator=collate,
                                   callbacks=[Ends()])
    trainer.train()
    model = model.to(device)
    return {**_figures(t0, ends, counts[:len(ends)]), "steps": len(ends), "batch_size": b}, model


def _group_by_length(transformers) -> dict[str, Any]:
    """HF's length grouping under the installed version's name (transformers 5: train_sampling_strategy)."""
    names = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    return ({"train_sampling_strategy": "group_by_length"} if "train_sampling_strategy" in names
            else {"group_by_length": True})


def _mask(items: list[dict], longest: int) -> torch.Tensor:
    mask = torch.zeros(len(items), longest, dtype=torch.long)
    for r, x in enumerate(items):
        mask[r, :len(x["input_ids"])] = 1
    return mask


def _figures(t0: float, ends: list[float], counts: list[tuple[int, int]]) -> dict[str, Any]:
    """samples/s and tokens/s over steps 2..N (wall clock between step ends), time to first step, samples seen."""
    steady_s = ends[-1] - ends[0] if len(ends) > 1 else 0.0
    steady = counts[1:]
    return {"samples_per_s": sum(n for n, _ in steady) / steady_s if steady_s else None,
            "tokens_per_s": sum(t for _, t in steady) / steady_s if steady_s else None,
            "time_to_first_step_s": ends[0] - t0 if ends else None,
            "samples_seen": sum(n for n, _ in counts), "steady_samples": sum(n for n, _ in steady),
            "steady_s": steady_s}


def _our_side(cfg: RunConfig, bundle, device, policy) -> tuple[dict[str, Any], torch.nn.Module]:
    """One run of this project's trainer (the config as given: the optimized settings), built by the one set-up."""
    t0 = time.perf_counter()
    run = build_run(cfg, bundle, device, policy)
    ends = _StepEnds()
    run.trainer.add_callback(ends)
    stats = run.trainer.fit()
    steady_s = ends.ends[-1] - ends.ends[0] if len(ends.ends) > 1 else 0.0
    out = {"samples_per_s": stats.steady_samples / steady_s if steady_s else None,
           "tokens_per_s": stats.steady_real_tokens / steady_s if steady_s else None,
           "time_to_first_step_s": ends.ends[0] - t0 if ends.ends else None, "samples_seen": stats.samples,
           "steady_samples": stats.steady_samples, "steady_s": steady_s,
           "steps": stats.steps, "batch_size": cfg.batching.batch_size, "max_tokens": cfg.batching.max_tokens,
           "batching_method": cfg.batching.method}
    return out, run.model


def run_bench_vs_hf(cfg: RunConfig, notice: Callable[[str], None] = print) -> dict[str, Any]:
    """The interleaved comparison (module docstring); writes ``<run_dir>/bench-vs-hf.{json,md}``; returns the dict.

    Raises:
        UserError: ``model.source`` is not an ``hf:`` model, transformers/accelerate missing, or bad data/config.
    """
    if not cfg.model.source.startswith("hf:"):
        raise UserError(f"bench-vs-hf compares on a Hugging Face model: set model.source=hf:<dir> or hf:<model_type> "
                        f"(got {cfg.model.source})")
    try:
        import accelerate  # noqa: F401  (the Trainer needs it)
        import transformers  # noqa: F401
    except ImportError as exc:
        raise UserError(f"bench-vs-hf needs transformers and accelerate ({exc}); "
                        "pip install -r requirements.txt") from None
    start = start_run(cfg, prefix="bench-vs-hf-")
    device, policy = start.device, start.policy
    bundle = prepare_data(cfg, None, notice=notice)
    val = make_loader(bundle, "validation", cfg, train=False, device=device)
    levers = _all_levers(cfg)
    cfg_all = cfg.with_values(levers)
    bundle_all = replan(cfg_all, bundle)
    sides = (*SIDES, ALL_LEVERS)
    every_run: dict[str, list[dict]] = {s: [] for s in sides}  # the warm-up runs first, then the timed ones
    env = {**collect_env(device), **machine_facts(device)}
    warmup = cfg.bench.warmup_runs

    def side(name: str) -> Arm:
        """One whole training run per round, self-timed over its steady steps (the A/B primitive pairs the rounds)."""
        def one() -> dict[str, float]:
            with tempfile.TemporaryDirectory() as tmp:
                fig, model = (_hf_side(cfg, bundle, device, policy, Path(tmp)) if name == "hf-trainer"
                              else _our_side(cfg_all, bundle_all, device, policy) if name == ALL_LEVERS
                              else _our_side(cfg, bundle, device, policy))
            fig["eval_accuracy"] = evaluate(model, val, policy, bundle.num_classes, device)["accuracy"]
            every_run[name].append(fig)
            if len(every_run[name]) <= warmup:
                notice(f"bench-vs-hf: warm-up run {len(every_run[name])}/{warmup} {name} (untimed): "
                       f"{_fmt(fig['samples_per_s'])} samples/s")
            return {"samples": fig["steady_samples"], "seconds": fig["steady_s"]}

        @contextlib.contextmanager
        def measure() -> Iterator[dict]:
            memory, out = WindowPeakMemory(device), {}
            memory.start()
            yield out
            fig = every_run[name][-1]
            fig.update(memory.stop())
            notice(f"bench-vs-hf: round {len(every_run[name]) - warmup}/{cfg.bench.rounds} {name}: "
                   f"{_fmt(fig['samples_per_s'])} samples/s, eval accuracy {_fmt(fig['eval_accuracy'], '.4f')}, "
                   f"{fig['samples_seen']} samples")

        return Arm(name, one, measure)

    ab = interleave([side(s) for s in sides], rounds=cfg.bench.rounds, window=1, warmup=warmup, device=device)
    result = _result(cfg, policy, len(bundle.splits["train"]), ab, every_run, levers,
                     {**env, "load_1min_at_end": machine_facts(device)["load_1min"]})
    atomic_write_text(start.run_dir / "bench-vs-hf.json", json.dumps(result, indent=2) + "\n")
    atomic_write_text(start.run_dir / "bench-vs-hf.md", markdown(result))
    notice(markdown(result))
    return result


def _result(cfg: RunConfig, policy: PrecisionPolicy, train_samples: int, ab: ABResult,
            every_run: dict[str, list[dict]], levers: dict[str, Any], env: dict[str, Any]) -> dict[str, Any]:
    """bench-vs-hf.json: each side's runs (the warm-up runs apart) and medians, the paired speed-ups of the A/B."""
    warmup = cfg.bench.warmup_runs
    runs = {s: every_run[s][warmup:] for s in every_run}
    result = {"model_source": cfg.model.source, "precision": policy.mode, "precision_reason": policy.reason,
              "epochs": cfg.train.epochs, "rounds": cfg.bench.rounds, "warmup_runs": warmup,
              "train_samples": train_samples,
              "sides": {s: {"median": _median(runs[s]), "runs": runs[s], "warmup_runs": every_run[s][:warmup]}
                        for s in every_run},
              "env": env}
    ours, theirs = (result["sides"][s]["median"] for s in ("this-project", "hf-trainer"))
    result["speedup_samples_per_s"] = (ours["samples_per_s"] / theirs["samples_per_s"]
                                       if ours["samples_per_s"] and theirs["samples_per_s"] else None)
    paired = ab.ratio("this-project", "hf-trainer")  # each round's two runs ran back to back
    result["speedup_per_round"] = paired.per_round
    result["speedup_median_of_rounds"] = paired.median
    result["speedup_interval"] = [paired.low, paired.high]
    result["speedup_verdict"] = paired.verdict
    result["eval_accuracy_delta"] = (ours["eval_accuracy"] - theirs["eval_accuracy"]
                                     if None not in (ours["eval_accuracy"], theirs["eval_accuracy"]) else None)
    every = result["sides"][ALL_LEVERS]["median"]
    result[ALL_LEVERS.replace("-", "_")] = {
        "levers": levers, "speedup_vs_hf_trainer": ab.ratio(ALL_LEVERS, "hf-trainer").as_dict(),
        "speedup_vs_this_project": ab.ratio(ALL_LEVERS, "this-project").as_dict(),
        "eval_accuracy_delta_vs_hf_trainer": (
            every["eval_accuracy"] - theirs["eval_accuracy"]
            if None not in (every["eval_accuracy"], theirs["eval_accuracy"]) else None)}
    return result


def _interval(result: dict[str, Any]) -> str:
    low, high = result.get("speedup_interval") or (None, None)
    if low is None:
        return "no interval"
    return f"{100 * CONFIDENCE:.0f}% interval [{low:.2f}, {high:.2f}]: {result['speedup_verdict']}"


def _median(runs: list[dict]) -> dict[str, Any]:
    keys = ("samples_per_s", "tokens_per_s", "time_to_first_step_s", "peak_memory_bytes", "eval_accuracy",
            "samples_seen")
    return {k: statistics.median(v) if (v := [x[k] for x in runs if x.get(k) is not None]) else None for k in keys}


def _fmt(x: Any, spec: str = ".1f") -> str:
    return "—" if x is None else format(x, spec)


def markdown(result: dict[str, Any]) -> str:
    """The comparison as a markdown table (medians over rounds) and the headline ratio."""
    env = result["env"]
    lines = [f"bench-vs-hf: {result['model_source']}, precision {result['precision']}, {result['epochs']} epoch(s) of "
             f"{result['train_samples']} samples, {result['rounds']} interleaved rounds after "
             f"{result['warmup_runs']} untimed warm-up run(s) per side; {env['device']}, "
             f"load {_fmt(env['load_1min'], '.2f')} → {_fmt(env['load_1min_at_end'], '.2f')}", "",
             "| side | samples/s | tokens/s | time to first step (s) | peak memory (MiB) | eval accuracy "
             "| samples seen |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for side in result["sides"]:
        m = result["sides"][side]["median"]
        mem = None if m["peak_memory_bytes"] is None else m["peak_memory_bytes"] / 2**20
        lines.append(f"| {side} | {_fmt(m['samples_per_s'])} | {_fmt(m['tokens_per_s'], '.0f')} | "
                     f"{_fmt(m['time_to_first_step_s'], '.2f')} | {_fmt(mem, '.0f')} | "
                     f"{_fmt(m['eval_accuracy'], '.4f')} | "
                     f"{_fmt(m['samples_seen'], '.0f')} |")
    rounds = ", ".join(_fmt(x, ".2f") for x in result["speedup_per_round"])
    lines += ["", f"this project / HF Trainer samples/s: {_fmt(result['speedup_samples_per_s'], '.2f')}x (medians); "
              f"per round {rounds} (median {_fmt(result['speedup_median_of_rounds'], '.2f')}x, "
              f"{_interval(result)}); eval accuracy "
              f"difference {_fmt(result['eval_accuracy_delta'], '+.4f')}"]
    every = result.get("all_levers")
    if every:
        r = every["speedup_vs_hf_trainer"]
        lines.append(f"{ALL_LEVERS} ({', '.join(f'{k}={v}' for k, v in every['levers'].items())}) / HF Trainer: "
                     f"{_fmt(r['median'], '.2f')}x [{_fmt(r['low'], '.2f')}, {_fmt(r['high'], '.2f')}] "
                     f"({r['verdict']}, median of paired rounds); "
                     f"vs this-project {_fmt(every['speedup_vs_this_project']['median'], '.2f')}x; eval accuracy "
                     f"difference {_fmt(every['eval_accuracy_delta_vs_hf_trainer'], '+.4f')}")
    return "\n".join(lines) + "\n"

