"""The sides of ``make bench-vs-hf`` (train/bench/vs_hf.py): one whole training run each — the Hugging Face
``Trainer`` padded with length grouping (``hf-trainer``) or padding-free with ``DataCollatorWithFlattening``
(``hf-padding-free``, causal LMs), this project with the config as given (``this-project``) or with every lever it
can apply on top (``all-levers``) — with their figures (samples/s and real tokens/s over the steady steps, time to
first step, samples and real tokens seen); and the cold comparison, each side's run in a fresh process.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from train.callbacks import Callback
from train.config import RunConfig
from train.data import prepare_data
from train.errors import UserError
from train.setup import build_model, build_run, replan, seed_everything, start_run

SIDES = ("hf-trainer", "this-project")
ALL_LEVERS = "all-levers"
"""A third side: this project with every lever it can apply to the model on top of the config (packed rows where
the model runs them exactly, the 16-bit dropout mask, a causal LM's chunked loss where its step measures no slower
with it: ``auto``)."""
CAUSAL_LM = "causal-lm"
HF_PADDING_FREE = "hf-padding-free"
"""A causal LM's fourth side: the Trainer with ``DataCollatorWithFlattening`` (Hugging Face's padding-free mode)."""


def all_levers(cfg: RunConfig) -> dict[str, Any]:
    """The overrides of the ``all-levers`` side for ``cfg``'s model."""
    from train.models import model_supports_packing

    levers: dict[str, Any] = {"model.fast_dropout": "true"}
    if model_supports_packing(cfg.model.source, cfg.model.task):
        levers["batching.method"] = "packed"
    if cfg.model.task == CAUSAL_LM:
        levers["model.chunked_loss"] = "auto"  # where the step is slower with it (a small vocabulary), not applied
    return levers


class StepEnds(Callback):
    """The wall-clock end of every step (this project's side)."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_step_end(self, step: int, step_ms: float) -> bool:
        self.ends.append(time.perf_counter())
        return False


def hf_trainer_run(cfg: RunConfig, bundle, device, policy, tmp: Path,
                   padding_free: bool = False) -> tuple[dict[str, Any], Any]:
    """One run of the Hugging Face Trainer (``padding_free``: with ``DataCollatorWithFlattening``, causal LMs only);
    returns its figures and the trained (wrapped) model."""
    import transformers

    split = bundle.splits["train"]
    causal = cfg.model.task == CAUSAL_LM
    data = [hf_example(split.ids[i], int(split.labels[i]), causal) for i in range(len(split))]
    counts: list[tuple[int, int]] = []
    flatten = transformers.DataCollatorWithFlattening(return_position_ids=True) if padding_free else None

    def collate(items: list[dict]) -> dict[str, torch.Tensor]:
        counts.append((len(items), sum(len(x["input_ids"]) for x in items)))
        if flatten is not None:
            return flatten([{k: v.tolist() for k, v in x.items()} for x in items])
        longest = max(len(x["input_ids"]) for x in items)
        ids = torch.full((len(items), longest), bundle.pad_id, dtype=torch.long)
        labels = torch.full((len(items), longest), -100, dtype=torch.long)
        for r, x in enumerate(items):
            ids[r, :len(x["input_ids"])] = x["input_ids"]
            if causal:
                labels[r, :len(x["labels"])] = x["labels"]
        return {"input_ids": ids, "attention_mask": padding_mask(items, longest),
                "labels": labels if causal else torch.tensor([x["labels"] for x in items])}

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
        bf16=policy.mode == "bf16", fp16=policy.mode == "fp16", report_to="none",
        **({} if padding_free else group_by_length(transformers)),
        save_strategy="no", logging_strategy="no", eval_strategy="no", disable_tqdm=True, seed=cfg.train.seed,
        dataloader_num_workers=cfg.data.num_workers, use_cpu=device.type == "cpu")
    t0 = time.perf_counter()
    seed_everything(cfg.train.seed)
    model = build_model(cfg, bundle)
    # an adapter run: the Trainer gets peft's PeftModel, as TRL / peft users hand it (the same LoraConfig as ours)
    trainer = transformers.Trainer(model=getattr(model, "peft_model", None) or model.inner, args=args,
                                   train_dataset=data, data_collator=collate, callbacks=[Ends()])
    trainer.train()
    model = model.to(device)
    return {**figures(t0, ends, counts[:len(ends)]), "steps": len(ends), "batch_size": b,
            "trainable_parameters": trainable(model)}, model


def hf_example(ids: np.ndarray, label: int, causal: bool) -> dict[str, Any]:
    """One training example as the Trainer's collators take it: a classifier's ``labels`` is its class; a causal
    LM's is its ids with the untrained positions -100 (the prompt: ``label`` is ``n_prompt``; the model shifts)."""
    x = torch.from_numpy(np.array(ids, dtype=np.int64))
    if not causal:
        return {"input_ids": x, "labels": label}
    targets = x.clone()
    targets[:max(label, 1)] = -100  # the first token is never a target; nor is a prompt token
    return {"input_ids": x, "labels": targets}


def group_by_length(transformers) -> dict[str, Any]:
    """HF's length grouping under the installed version's name (transformers 5: train_sampling_strategy)."""
    names = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    return ({"train_sampling_strategy": "group_by_length"} if "train_sampling_strategy" in names
            else {"group_by_length": True})


def padding_mask(items: list[dict], longest: int) -> torch.Tensor:
    mask = torch.zeros(len(items), longest, dtype=torch.long)
    for r, x in enumerate(items):
        mask[r, :len(x["input_ids"])] = 1
    return mask


def figures(t0: float, ends: list[float], counts: list[tuple[int, int]]) -> dict[str, Any]:
    """samples/s and tokens/s over steps 2..N (wall clock between step ends), time to first step, samples seen."""
    steady_s = ends[-1] - ends[0] if len(ends) > 1 else 0.0
    steady = counts[1:]
    return {"samples_per_s": sum(n for n, _ in steady) / steady_s if steady_s else None,
            "tokens_per_s": sum(t for _, t in steady) / steady_s if steady_s else None,
            "time_to_first_step_s": ends[0] - t0 if ends else None,
            "samples_seen": sum(n for n, _ in counts), "steady_samples": sum(n for n, _ in steady),
            "steady_tokens": sum(t for _, t in steady), "steady_s": steady_s,
            "tokens_seen": sum(t for _, t in counts)}


def our_run(cfg: RunConfig, bundle, device, policy) -> tuple[dict[str, Any], torch.nn.Module]:
    """One run of this project's trainer (the config as given: the optimized settings), built by the one set-up."""
    from train.perf.probe_budget import ProbeBudget
    from train.setup import projected_steps

    t0 = time.perf_counter()  # a user's run: its auto probes within train.probe_budget, as make train's
    budget = ProbeBudget(cfg.train.probe_budget, projected_steps(cfg, bundle, device), lambda *a, **k: None)
    run = build_run(cfg, bundle, device, policy, budget=budget)
    ends = StepEnds()
    run.trainer.add_callback(ends)
    stats = run.trainer.fit()
    steady_s = ends.ends[-1] - ends.ends[0] if len(ends.ends) > 1 else 0.0
    out = {"samples_per_s": stats.steady_samples / steady_s if steady_s else None,
           "tokens_per_s": stats.steady_real_tokens / steady_s if steady_s else None,
           "time_to_first_step_s": ends.ends[0] - t0 if ends.ends else None, "samples_seen": stats.samples,
           "steady_samples": stats.steady_samples, "steady_tokens": stats.steady_real_tokens, "steady_s": steady_s,
           "tokens_seen": stats.real_tokens,
           "steps": stats.steps, "batch_size": cfg.batching.batch_size, "max_tokens": cfg.batching.max_tokens,
           "batching_method": cfg.batching.method,
           # what ran, where the config said auto (a packed row's attention path, the chunked loss)
           "packed_attention": (getattr(run.model, "packed_attention", None) if cfg.batching.method == "packed"
                                else None),
           "chunked_loss": getattr(run.model, "chunked_loss", None), "trainable_parameters": trainable(run.model)}
    return out, run.model


def trainable(model: torch.nn.Module) -> int:
    """Parameters the side trained (an adapter run's sides: the adapter alone, the same on every side)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


COLD_MARK = "bench-vs-hf cold side: "


def side_run(name: str, cfg: RunConfig, bundle, device, policy, tmp: Path) -> tuple[dict[str, Any], Any]:
    """One whole training run of side ``name`` (its figures, its trained model)."""
    if name == "hf-trainer":
        return hf_trainer_run(cfg, bundle, device, policy, tmp)
    if name == HF_PADDING_FREE:
        return hf_trainer_run(cfg, bundle, device, policy, tmp, True)
    if name == ALL_LEVERS:
        cfg_all = cfg.with_values(all_levers(cfg))
        return our_run(cfg_all, replan(cfg_all, bundle), device, policy)
    return our_run(cfg, bundle, device, policy)


def cold_child(cfg: RunConfig) -> dict[str, Any]:
    """A child process of the cold comparison: side ``bench.cold_side``'s one run; its figures on the last line."""
    start = start_run(cfg, run_dir=False)
    bundle = prepare_data(cfg, None, notice=lambda *a, **k: None)
    with tempfile.TemporaryDirectory() as tmp:
        fig, _ = side_run(cfg.bench.cold_side, cfg, bundle, start.device, start.policy, Path(tmp))
    print(COLD_MARK + json.dumps(fig), flush=True)
    return fig


def cold_comparison(config: Path, sides: tuple[str, ...], repeats: int,
                    notice: Callable[[str], None]) -> dict[str, Any]:
    """The cold comparison (``bench.cold_runs``): per repetition every side once, in a fresh process each (the order
    rotating by one side per repetition); per side the median of real tokens of the epoch ÷ the process's wall time,
    and per side its per-repetition ratio to each other side's run of the same repetition."""
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    for rep in range(repeats):
        for name in sides[rep % len(sides):] + sides[:rep % len(sides)]:
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "train", "bench-vs-hf", "--config", str(config),
                                   f"bench.cold_side={name}", "bench.cold_runs=0"], capture_output=True, text=True)
            wall = time.perf_counter() - t0
            line = next((x for x in reversed(proc.stdout.splitlines()) if x.startswith(COLD_MARK)), None)
            if proc.returncode or line is None:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
                raise UserError(f"bench-vs-hf: the cold run of side {name} failed (exit {proc.returncode}): {tail[0]}")
            fig = json.loads(line[len(COLD_MARK):])
            fig["process_s"] = wall
            fig["cold_tokens_per_s"] = fig["tokens_seen"] / wall
            runs[name].append(fig)
            notice(f"bench-vs-hf: cold {rep + 1}/{repeats} {name}: {fig['cold_tokens_per_s']:.0f} real tokens/s over "
                   f"the whole process ({wall:.1f} s, {fig['tokens_seen']} tokens)")
    median = {s: statistics.median(f["cold_tokens_per_s"] for f in runs[s]) for s in sides}
    per_rep = {f"{a}/{b}": [x["cold_tokens_per_s"] / y["cold_tokens_per_s"] for x, y in zip(runs[a], runs[b])]
               for a in sides for b in sides if a != b}
    return {"repeats": repeats, "median_tokens_per_s": median, "ratio_per_repeat": per_rep,
            "ratio_median": {k: statistics.median(v) for k, v in per_rep.items()}, "runs": runs}
