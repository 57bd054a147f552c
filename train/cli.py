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
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

from train.errors import Interrupted, RunAborted, UserError


def load_cfg(args: argparse.Namespace, default_config: Optional[str] = None):
    """The command's RunConfig: ``--config`` (or ``default_config``) + overrides (+ ``--run-id`` as ``train.run_id``,
    + each given config-key flag such as ``--rounds 8`` as its key, e.g. ``bench.rounds=8``; a flag wins over an
    override of the same key).

    Raises:
        UserError: unreadable config, unknown key, bad value.
    """
    from train.config import load_config

    overrides = list(args.overrides) + ([f"train.run_id={args.run_id}"] if getattr(args, "run_id", None) else [])
    overrides += flag_overrides(args)
    return load_config(args.config or default_config, overrides)


def flag_overrides(args: argparse.Namespace) -> list[str]:
    """``section.key=value`` for every config-key flag given on the command line (see :func:`_key_flag`)."""
    keys: dict[str, str] = getattr(args, "_config_keys", None) or {}
    return [f"{key}={json.dumps(getattr(args, dest))}" for dest, key in keys.items() if getattr(args, dest) is not None]


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


# -- the commands ---------------------------------------------------------------------------------------------

def cmd_train(args: argparse.Namespace, t_start: float) -> int:
    from train.config import load_config
    from train.report import summary_lines
    from train.run import run_training

    if args.resume:
        from train.resume import find_resume_checkpoint

        run_dir, _ = find_resume_checkpoint(args.resume)
        cfg = load_config(str(run_dir / "config.yaml"), list(args.overrides))
        cfg.train.output_dir, cfg.train.run_id = str(run_dir.parent), run_dir.name
    else:
        cfg = load_cfg(args)
    report = run_training(cfg, t_start, buckets_force=args.buckets_force, resume=args.resume)
    main_rank = os.environ.get("RANK", "0") == "0"
    if report.get("status") == "interrupted":
        info = report["interrupted"]
        if main_rank:
            print(f"interrupted by {info['signal']} after step {info['step']}/{info['total_steps']}; "
                  f"checkpoint {info['checkpoint']}; resume with: {info['resume_command']}")
        return 0 if info["signal"] == "SIGTERM" else 130  # SIGTERM = preemption: a clean, resumable stop
    if main_rank:
        for line in summary_lines(report):
            print(line)
    return 0


def cmd_precision(args: argparse.Namespace, t_start: float) -> int:
    from train.precision import PrecisionPolicy, decision_cache_path, probe_for
    from train.tools.env import resolve_device

    cfg = load_cfg(args)
    if args.remeasure:
        decision_cache_path(probe_for(cfg), cfg.data.cache_dir).unlink(missing_ok=True)
    policy = PrecisionPolicy.for_config(cfg, resolve_device(cfg.train.device))
    print(f"precision {policy.mode} [{policy.source}] {policy.reason}")
    return 0


def cmd_buckets(args: argparse.Namespace, t_start: float) -> int:
    from pathlib import Path

    from train.data import fit_bucket_plan

    cfg = load_cfg(args)
    b = cfg.batching
    plan = fit_bucket_plan(cfg)
    out = Path(args.out or f"{cfg.train.output_dir}/buckets/{b.method}-{b.num_buckets}.json")
    plan.save(out)
    print(f"{b.method} K={b.num_buckets}: bounds {plan.bounds}, counts {plan.counts}, "
          f"predicted token efficiency {plan.predicted_token_efficiency:.4f}")
    print(f"wrote {out}; train with batching.boundaries_file={out}")
    return 0


def cmd_bench(args: argparse.Namespace, t_start: float) -> int:
    from train.bench import markdown, run_bench

    cfg = load_cfg(args)
    result = run_bench(cfg)
    print(markdown(result))
    print(f"wrote {cfg.train.output_dir}/{cfg.train.run_id}/bench/ (bench.json, bench.md, PNGs)")
    return 0


def cmd_bench_gate(args: argparse.Namespace, t_start: float) -> int:
    from train.bench.gate import run_gate

    passed, _ = run_gate(load_cfg(args, default_config="configs/bench-gate.yaml"))
    return 0 if passed else 1


def cmd_bench_baseline(args: argparse.Namespace, t_start: float) -> int:
    from train.bench.gate import write_baseline

    write_baseline(load_cfg(args, default_config="configs/bench-gate.yaml"))
    return 0


def cmd_bench_batching(args: argparse.Namespace, t_start: float) -> int:
    from train.bench.batching import run_bench
    from train.setup import make_run_dir

    cfg = load_cfg(args)
    run_dir = make_run_dir(cfg, prefix="bench-batching-")
    run_bench(cfg, run_dir)
    print((run_dir / "bench-batching.md").read_text(encoding="utf-8"))
    print(f"wrote {run_dir}/bench-batching.json, .md, .png")
    return 0


def cmd_profile(args: argparse.Namespace, t_start: float) -> int:
    from train.profiling.session import parse_tools, run_profile

    tools = parse_tools(args.tools)
    child_args = (["--config", args.config] if args.config else []) + list(args.overrides)
    run_profile(load_cfg(args), tools, t_start, child_args)
    return 0


def cmd_bench_precision(args: argparse.Namespace, t_start: float) -> int:
    from train.bench.precision import markdown, run_bench

    out = run_bench(load_cfg(args))
    print(markdown(out))
    print(f"wrote {out['run_dir']}/bench-precision.json and .md")
    return 0


def cmd_compare(args: argparse.Namespace, t_start: float) -> int:
    from train.tracking.compare import compare, compare_bench, is_bench_file

    if all(is_bench_file(a) for a in args.runs):
        md, md_path = compare_bench(args.runs, args.out, args.runs_dir)
        print(md)
        print(f"wrote {md_path}")
        return 0
    md, md_path, png_path = compare(args.runs, args.out, args.runs_dir)
    print(md)
    print(f"wrote {md_path} and {png_path}")
    return 0


def cmd_wandb_sync(args: argparse.Namespace, t_start: float) -> int:
    from train.tracking.sync import sync

    return sync(args.runs_dir, args.all, args.dry_run)


def cmd_bench_tracking(args: argparse.Namespace, t_start: float) -> int:
    from train.bench.tracking import run_bench

    cfg = load_cfg(args, default_config="configs/smoke.yaml")
    res = run_bench(cfg)
    med = res["ms_per_step_median"]
    print(f"ms/step (median of {cfg.bench_tracking.rounds} blocks): none {med['none']:.2f}, jsonl {med['jsonl']:.2f}, full {med['full']:.2f}")
    print(f"overhead of full tracking vs none: {100 * res['overhead_full_vs_none']:+.2f}% (target ≤ 2%: "
          f"{'met' if res['target_met'] else 'NOT met'}); vs jsonl only: {100 * res['overhead_full_vs_jsonl']:+.2f}%")
    print(f"CPU time per step (process + wandb-core), less sensitive to a shared machine: full vs none "
          f"{100 * res['cpu_overhead_full_vs_none']:+.2f}%, vs jsonl {100 * res['cpu_overhead_full_vs_jsonl']:+.2f}%")
    if "online_unreachable" in res:
        o = res["online_unreachable"]
        print(f"W&B forced online, server unreachable: extra wall time {o['extra_wall_s']:.1f} s "
              f"(init timeout {o['init_timeout_s']:g} s); W&B active: {o['wandb_active']}; reason: {o['wandb_fallback_reason']}")
    print(f"wrote {res['path']}")
    return 0


def cmd_warmup(args: argparse.Namespace, t_start: float) -> int:
    from train.compiling.warmup import run_warmup

    result = run_warmup(load_cfg(args), buckets_force=args.buckets_force)
    t = result["totals"]
    print(f"{t['shapes']} shapes ({t['train_shapes']} train, {t['eval_shapes']} eval) in {t['warmup_s']:.1f}s, "
          f"{t['stable_shapes']} stable (CV ≤ {100 * result['criteria']['cv_threshold']:.0f}%); wrote {result['path']}")
    return 0


def cmd_bench_compile(args: argparse.Namespace, t_start: float) -> int:
    from train.bench.compilation import first_step_child, run_bench

    cfg = load_cfg(args)
    if args.child:
        first_step_child(cfg, t_start, args.child)
        return 0
    run_bench(cfg, args.config, list(args.overrides))
    return 0


# -- the table ------------------------------------------------------------------------------------------------

def _args_train(p: argparse.ArgumentParser) -> None:
    p.add_argument("--buckets-force", action="store_true", help="use batching.boundaries_file even if its fingerprints differ")
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
    _key_flag(p, "--bf16-cpu-steps", "bench_precision.bf16_cpu_steps", "steps of the timing-only bf16 row on CPU (0: none)")
    _key_flag(p, "--warmup", "bench_precision.warmup", "first steps left out of the step-time median")


def _args_compare(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories (or run ids under --runs-dir); or bench.json "
                   "files (make bench results, e.g. from two machines) to compare benchmarks")
    p.add_argument("--out", default=None, help="output directory (default: <runs-dir>/compare)")
    p.add_argument("--runs-dir", default="runs", help="where bare run ids are looked up (default: runs)")


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


def _args_warmup(p: argparse.ArgumentParser) -> None:
    p.add_argument("--buckets-force", action="store_true", help="use batching.boundaries_file even if its fingerprints differ")


def _args_bench_compile(p: argparse.ArgumentParser) -> None:
    _key_flag(p, "--steps", "bench_compile.steps", "timed steps per configuration per round")
    _key_flag(p, "--rounds", "bench_compile.rounds", "interleaved rounds (eager, compiled, compiled, eager, ...)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: one first-step process → JSON file



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
    "train": Command("train the classifier and write runs/<id>/report.json", cmd_train, _args_train,
                     run_id="<UTC time>-<random>"),
    "precision": Command("what train.precision=auto picks on this machine for a config, and why", cmd_precision,
                         _args_precision),
    "buckets": Command("fit bucket boundaries on the training split and save them as JSON", cmd_buckets, _args_buckets),
    "bench": Command("training + inference benchmark, naive vs optimized, in one run", cmd_bench, _args_bench,
                     run_id="bench-<UTC time>-<random>"),
    "bench-gate": Command("performance regression gate: a short bench vs the committed baseline; exit 1 on a regression",
                          cmd_bench_gate, _args_bench_gate, run_id="bench-gate-<UTC time>-<random>"),
    "bench-baseline": Command("measure the gate's figures bench_gate.repeats times and rewrite the baseline (says what "
                              "changed)", cmd_bench_baseline, _args_bench_gate, run_id="bench-baseline-<UTC time>-<random>"),
    "bench-vs-hf": Command("an HF model: the HF Trainer vs this project, interleaved → runs/<id>/bench-vs-hf.{json,md}",
                           lambda a, t: __import__("train.bench.vs_hf", fromlist=["command"]).command(a, t),
                           run_id="bench-vs-hf-<UTC time>-<random>"),
    "bench-batching": Command("batching methods side by side → runs/<id>/bench-batching.{json,md,png}", cmd_bench_batching,
                              _args_bench_batching, run_id="bench-batching-<UTC time>-<random>"),
    "bench-precision": Command("fp32 vs the auto precision (and bf16/fp16 on CUDA) on the same batches",
                               cmd_bench_precision, _args_bench_precision, run_id="bench-precision-<UTC time>-<random>"),
    "bench-compile": Command("cold vs warm compile cache (separate processes), compiled vs eager step time",
                             cmd_bench_compile, _args_bench_compile, run_id="bench-compile-<UTC time>-<random>"),
    "bench-tracking": Command("step-time overhead of tracking (none / jsonl / W&B offline), one process",
                              cmd_bench_tracking, _args_bench_tracking, run_id="bench-tracking-<UTC time>-<random>"),
    "profile": Command("profile real training steps: torch.profiler attribution, py-spy, nsys, GPU sampling",
                       cmd_profile, _args_profile, run_id="profile"),
    "warmup": Command("compile and warm every batch shape of the run's bucket plan → runs/<id>/warmup.json",
                      cmd_warmup, _args_warmup, run_id="<UTC time>-<random>"),
    "compare": Command("compare runs side by side: markdown table + PNG (no network)", cmd_compare, _args_compare,
                       config=False),
    "wandb-sync": Command("upload offline W&B runs under --runs-dir with `wandb sync`", cmd_wandb_sync, _args_wandb_sync,
                          config=False),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m train", description="deep-model-perf: train, profile and benchmark; every command below has its own --help.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, c in COMMANDS.items():
        p = sub.add_parser(name, help=c.help, description=c.help)
        if c.config:
            p.add_argument("--config", default=None, help="YAML run config (default: built-in defaults)")
            p.add_argument("overrides", nargs="*", metavar="section.key=value",
                           help="config overrides, e.g. train.max_steps=200 batching.method=pad-to-max")
        if c.run_id:
            p.add_argument("--run-id", default=None, help=f"run directory name (default: {c.run_id})")
            _key_flag(p, "--overwrite", "train.overwrite", "replace the earlier run in the directory --run-id names", None)
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
    try:
        return COMMANDS[args.command].run(args, t_start)
    except (UserError, RunAborted) as exc:  # RunAborted: e.g. the numerics guard (its report is already written)
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except Interrupted as exc:  # a signal before the first step (train/shutdown.py)
        print(f"interrupted: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
