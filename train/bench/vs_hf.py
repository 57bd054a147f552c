"""``make bench-vs-hf``: one Hugging Face model trained by the real Hugging Face ``Trainer`` and by this project,
interleaved in one process on the same data, for the same number of samples.

Both sides start from the same initial weights (``build_model`` under the same seed) and see ``train.epochs``
passes over the same training split (so equal samples seen, up to each side's last partial batch):

* ``hf-trainer``: ``transformers.Trainer`` with its best settings on this device: ``bf16=True`` where
  ``train.precision=auto`` picks bf16 (``fp16=True`` where it picks fp16), ``group_by_length=True``,
  ``per_device_train_batch_size=batching.batch_size``, the same learning rate, warm-up, weight decay and
  clipping; no checkpoints, no logging, no tracking;
* ``hf-padding-free`` (causal LMs only, ``model.task=causal-lm``): the same Trainer with Hugging Face's own
  padding-free collator, ``DataCollatorWithFlattening`` (each batch's samples concatenated into one row with
  restarting ``position_ids``, no padding; transformers 5.x with SDPA detects the packed samples from the positions),
  no length grouping. A causal side's labels are its input ids with the prompt (and padding) set to -100; the model
  shifts them itself;
* ``this-project``: this project's trainer with the config as given (``configs/bench-vs-hf.yaml``: the
  ``optimized`` settings: fitted buckets, a token budget, the ``auto`` precision);
* ``all-levers``: the same with every lever this project can apply to the model on top: packed rows where the
  model runs them exactly (train/models/packed.py), the 16-bit dropout mask (``model.fast_dropout=true``) and, for a
  causal LM, the chunked loss (``model.chunked_loss=true``).

Each side first trains ``bench.warmup_runs`` untimed runs (1: every batch shape meets oneDNN's primitive cache and
the allocator once, as the A/B primitive's warm-up does for steps); then they take turns for ``bench.rounds`` rounds
(the order rotates; the one A/B primitive, train/perf/ab.py), so machine noise hits them alike. Per timed run:
samples/s and real tokens/s over the steady steps (the first excluded; wall clock between the ends of steps,
batch loading included), time to first step (model build → end of step 1), peak memory (the run's window),
and the held-out figures on the validation split, measured for every side by the same evaluation (accuracy; a
causal LM's loss per target token and perplexity). Figures: medians over rounds. A causal LM's headline is this
project against the faster of the two Hugging Face configurations.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from train.bench.vs_hf_sides import (
    ALL_LEVERS,
    CAUSAL_LM,
    HF_PADDING_FREE,
    SIDES,
    all_levers,
    cold_child,
    cold_comparison,
    our_run,
    side_run,
)
from train.config import RunConfig
from train.data import make_loader, prepare_data
from train.errors import UserError, atomic_write_text
from train.evaluation import evaluate
from train.perf.ab import CONFIDENCE, ABResult, Arm, interleave
from train.perf.memory import WindowPeakMemory
from train.precision import PrecisionPolicy
from train.setup import replan, start_run
from train.tools.env import collect_env, machine_facts


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
        import transformers
    except ImportError as exc:
        raise UserError(f"bench-vs-hf needs transformers and accelerate ({exc}); "
                        "pip install -r requirements.txt") from None
    if cfg.bench.cold_side is not None:
        return cold_child(cfg)
    start = start_run(cfg, prefix="bench-vs-hf-")
    device, policy = start.device, start.policy
    bundle = prepare_data(cfg, None, notice=notice)
    val = make_loader(bundle, "validation", cfg, train=False, device=device)
    levers = all_levers(cfg)
    cfg_all = cfg.with_values(levers)
    bundle_all = replan(cfg_all, bundle)
    causal = cfg.model.task == CAUSAL_LM
    sides = (SIDES[0], HF_PADDING_FREE, SIDES[1], ALL_LEVERS) if causal else (*SIDES, ALL_LEVERS)
    if causal and int(transformers.__version__.split(".")[0]) < 5:
        notice(f"bench-vs-hf: notice: transformers {transformers.__version__} finds the samples of a flattened row "
               "only under flash_attention_2; here the hf-padding-free side attends across samples (not exact)")
    every_run: dict[str, list[dict]] = {s: [] for s in sides}  # the warm-up runs first, then the timed ones
    env = {**collect_env(device), **machine_facts(device)}
    warmup = cfg.bench.warmup_runs

    def side(name: str) -> Arm:
        """One whole training run per round, self-timed over its steady steps (the A/B primitive pairs the rounds)."""
        def one() -> dict[str, float]:
            with tempfile.TemporaryDirectory() as tmp:
                fig, model = (our_run(cfg_all, bundle_all, device, policy) if name == ALL_LEVERS
                              else side_run(name, cfg, bundle, device, policy, Path(tmp)))
            held_out = evaluate(model, val, policy, bundle.num_classes, device)  # the model's own task
            fig["eval_accuracy"], fig["eval_loss"] = held_out["accuracy"], held_out["loss"]
            every_run[name].append(fig)
            if len(every_run[name]) <= warmup:
                notice(f"bench-vs-hf: warm-up run {len(every_run[name])}/{warmup} {name} (untimed): "
                       f"{_fmt(fig['samples_per_s'])} samples/s")
            return {"samples": fig["steady_samples"], "real_tokens": fig["steady_tokens"], "seconds": fig["steady_s"]}

        @contextlib.contextmanager
        def measure() -> Iterator[dict]:
            memory, out = WindowPeakMemory(device), {}
            memory.start()
            yield out
            fig = every_run[name][-1]
            fig.update(memory.stop())
            notice(f"bench-vs-hf: round {len(every_run[name]) - warmup}/{cfg.bench.rounds} {name}: "
                   f"{_fmt(fig['samples_per_s'])} samples/s, {_fmt(fig['tokens_per_s'], '.0f')} tokens/s, eval "
                   f"accuracy {_fmt(fig['eval_accuracy'], '.4f')}, eval loss {_fmt(fig['eval_loss'], '.4f')}, "
                   f"{fig['samples_seen']} samples")

        return Arm(name, one, measure)

    ab = interleave([side(s) for s in sides], rounds=cfg.bench.rounds, window=1, warmup=warmup, device=device)
    result = _result(cfg, policy, len(bundle.splits["train"]), ab, every_run, levers,
                     {**env, "load_1min_at_end": machine_facts(device)["load_1min"]})
    if cfg.bench.cold_runs:
        result["cold"] = cold_comparison(start.run_dir / "config.yaml", sides, cfg.bench.cold_runs, notice)
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
    if HF_PADDING_FREE in result["sides"]:
        result["causal"] = _causal_headline(result, ab)
    every = result["sides"][ALL_LEVERS]["median"]
    result[ALL_LEVERS.replace("-", "_")] = {
        "levers": levers, "speedup_vs_hf_trainer": ab.ratio(ALL_LEVERS, "hf-trainer").as_dict(),
        # what its levers' auto chose (the first timed run; every run decides the same, from the cache)
        "ran": {k: (runs[ALL_LEVERS] or [{}])[0].get(k) for k in ("packed_attention", "chunked_loss")},
        "speedup_vs_this_project": ab.ratio(ALL_LEVERS, "this-project").as_dict(),
        "eval_accuracy_delta_vs_hf_trainer": (
            every["eval_accuracy"] - theirs["eval_accuracy"]
            if None not in (every["eval_accuracy"], theirs["eval_accuracy"]) else None)}
    return result


def _causal_headline(result: dict[str, Any], ab: ABResult) -> dict[str, Any]:
    """A causal LM's comparison in real tokens/s: the faster Hugging Face configuration (by median tokens/s), this
    project's config and its all-levers side against it (paired rounds), and the held-out loss per target token of
    each side relative to it."""
    hf = max(SIDES[0], HF_PADDING_FREE, key=lambda s: result["sides"][s]["median"]["tokens_per_s"] or 0.0)
    ref = result["sides"][hf]["median"]["eval_loss"]

    def vs(side: str) -> dict[str, Any]:
        loss = result["sides"][side]["median"]["eval_loss"]
        return {"tokens_per_s_ratio": ab.ratio(side, hf, "real_tokens").as_dict(),
                "eval_loss_relative": (loss - ref) / ref if None not in (loss, ref) and ref else None}

    return {"faster_hf_configuration": hf, "this-project": vs("this-project"), ALL_LEVERS: vs(ALL_LEVERS)}


def _interval(result: dict[str, Any]) -> str:
    low, high = result.get("speedup_interval") or (None, None)
    if low is None:
        return "no interval"
    return f"{100 * CONFIDENCE:.0f}% interval [{low:.2f}, {high:.2f}]: {result['speedup_verdict']}"


def _median(runs: list[dict]) -> dict[str, Any]:
    keys = ("samples_per_s", "tokens_per_s", "time_to_first_step_s", "peak_memory_bytes", "eval_accuracy",
            "eval_loss", "samples_seen")
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
             "| eval loss | samples seen |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for side in result["sides"]:
        m = result["sides"][side]["median"]
        mem = None if m["peak_memory_bytes"] is None else m["peak_memory_bytes"] / 2**20
        lines.append(f"| {side} | {_fmt(m['samples_per_s'])} | {_fmt(m['tokens_per_s'], '.0f')} | "
                     f"{_fmt(m['time_to_first_step_s'], '.2f')} | {_fmt(mem, '.0f')} | "
                     f"{_fmt(m['eval_accuracy'], '.4f')} | {_fmt(m['eval_loss'], '.4f')} | "
                     f"{_fmt(m['samples_seen'], '.0f')} |")
    rounds = ", ".join(_fmt(x, ".2f") for x in result["speedup_per_round"])
    lines += ["", f"this project / HF Trainer samples/s: {_fmt(result['speedup_samples_per_s'], '.2f')}x (medians); "
              f"per round {rounds} (median {_fmt(result['speedup_median_of_rounds'], '.2f')}x, "
              f"{_interval(result)}); eval accuracy "
              f"difference {_fmt(result['eval_accuracy_delta'], '+.4f')}"]
    every = result.get("all_levers")
    if every:
        r = every["speedup_vs_hf_trainer"]
        ran = ", ".join(f"{k} {v}" for k, v in every.get("ran", {}).items() if v is not None)
        lines.append(f"{ALL_LEVERS} ({', '.join(f'{k}={v}' for k, v in every['levers'].items())}; ran: {ran}) / "
                     "HF Trainer: "
                     f"{_fmt(r['median'], '.2f')}x [{_fmt(r['low'], '.2f')}, {_fmt(r['high'], '.2f')}] "
                     f"({r['verdict']}, median of paired rounds); "
                     f"vs this-project {_fmt(every['speedup_vs_this_project']['median'], '.2f')}x; eval accuracy "
                     f"difference {_fmt(every['eval_accuracy_delta_vs_hf_trainer'], '+.4f')}")
    cold = result.get("cold")
    if cold:
        med = cold["median_tokens_per_s"]
        lines.append(f"cold ({cold['repeats']} fresh process(es) per side, interleaved): real tokens/s over the whole "
                     "process " + ", ".join(f"{s} {_fmt(v, '.0f')}" for s, v in med.items()))
        hf = [s for s in ("hf-trainer", HF_PADDING_FREE) if s in med]
        faster = max(hf, key=lambda s: med[s])
        for side in ("this-project", ALL_LEVERS):
            lines.append(f"cold {side} / {faster}: {_fmt(cold['ratio_median'][f'{side}/{faster}'], '.2f')}x (median "
                         "of the repetitions' ratios: " + ", ".join(
                             _fmt(x, ".2f") for x in cold["ratio_per_repeat"][f"{side}/{faster}"]) + ")")
    causal = result.get("causal")
    if causal:
        hf = causal["faster_hf_configuration"]
        for side in ("this-project", ALL_LEVERS):
            r, rel = causal[side]["tokens_per_s_ratio"], causal[side]["eval_loss_relative"]
            lines.append(f"{side} / {hf} (the faster HF configuration) real tokens/s: {_fmt(r['median'], '.2f')}x "
                         f"[{_fmt(r['low'], '.2f')}, {_fmt(r['high'], '.2f')}] ({r['verdict']}); held-out loss per "
                         f"target token {_fmt(None if rel is None else 100 * rel, '+.2f')}% relative")
    return "\n".join(lines) + "\n"

