"""Command-line interface: argument parsing only; each command calls a function in its module.

    python -m train train   [--config FILE] [--run-id ID] [--buckets-force] [--resume RUN_DIR] [section.key=value ...]
    python -m train precision [--config FILE] [--remeasure] [section.key=value ...]
    python -m train buckets [--config FILE] [--out FILE] [section.key=value ...]
    python -m train bench-batching [--config FILE] [--run-id ID] [--num-buckets K] [...] [section.key=value ...]
    python -m train profile [--config FILE] [--run-id ID] [--tools torch,pyspy,gpu,nsys] [section.key=value ...]
    python -m train bench-precision [--config FILE] [--steps N] [--bf16-cpu-steps M] [section.key=value ...]
    python -m train compare RUN_A RUN_B ... [--out DIR]
    python -m train wandb-sync [--runs-dir DIR] [--all] [--dry-run]
    python -m train bench-tracking [--config FILE] [--rounds N] [--block-steps N] [--online-check] [section.key=value ...]
    python -m train warmup  [--config FILE] [--run-id ID] [section.key=value ...]
    python -m train bench-compile [--config FILE] [--run-id ID] [--steps N] [--rounds R] [section.key=value ...]

Bad input (a :class:`~train.errors.UserError`) prints one ``error:`` line and exits 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import Optional

from train.errors import RunAborted, UserError


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="YAML run config (default: built-in defaults)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="config overrides, e.g. train.max_steps=200 batching.method=pad-to-max")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m train", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train the classifier and write runs/<id>/report.json")
    _common(p)
    p.add_argument("--run-id", default=None, help="run directory name (default: a timestamp)")
    p.add_argument("--buckets-force", action="store_true", help="use batching.boundaries_file even if its fingerprints differ")
    p.add_argument("--resume", default=None, metavar="RUN_DIR",
                   help="continue runs/<id> from its newest checkpoint (or a given checkpoint file) with the run's own "
                        "config.yaml (--config is ignored; overrides still apply)")
    p = sub.add_parser("precision", help="what train.precision=auto picks on this machine for a config, and why")
    _common(p)
    p.add_argument("--remeasure", action="store_true", help="drop this machine's cached decision and measure again")
    p = sub.add_parser("buckets", help="fit bucket boundaries on the training split and save them as JSON")
    _common(p)
    p.add_argument("--out", default=None, help="output JSON (default: runs/buckets/<method>-<K>.json)")
    p = sub.add_parser("bench", help="training + inference benchmark, naive vs optimized, in one run")
    _common(p)
    p.add_argument("--run-id", default=None, help="run directory name (default: a timestamp)")
    p.add_argument("--configs", default=None, help="comma-separated training configurations (default: all)")
    p.add_argument("--warmup-steps", type=int, default=3, help="untimed steps per configuration first")
    p.add_argument("--rounds", type=int, default=4, help="rounds of interleaved timed windows")
    p.add_argument("--window", type=int, default=5, help="timed steps per configuration per round")
    p.add_argument("--checkpoint", default=None, help="checkpoint.pt to serve in the inference benchmark")
    p.add_argument("--requests", type=int, default=200, help="inference requests (single and batched)")
    p.add_argument("--inference-batch-size", type=int, default=32)
    p.add_argument("--skip-inference", action="store_true")
    p = sub.add_parser("bench-batching", help="batching methods side by side; writes runs/<id>/bench-batching.{json,md,png}")
    _common(p)
    p.add_argument("--run-id", default=None, help="run directory name (default: bench-batching-<timestamp>)")
    for flag, what in (("num-buckets", "K of the optimal-<K> rows (default 16)"),
                       ("batch-size", "samples per batch, all rows but -max-tokens (default 64)"),
                       ("max-tokens", "token budget per batch of the optimal-<K>-max-tokens row (default 2048)"),
                       ("window-samples", "samples per timed window (default 256)"),
                       ("windows", "timed windows per method; throughput is their median (default 3)"),
                       ("warmup-windows", "untimed rounds first (default 1)")):
        p.add_argument(f"--{flag}", type=int, default=None, help=what)
    p = sub.add_parser("profile", help="profile real training steps: torch.profiler attribution table, py-spy, nsys, GPU sampling")
    _common(p)
    p.add_argument("--run-id", default=None, help="run directory name (default: profile)")
    p.add_argument("--tools", default="torch,pyspy,gpu,nsys",
                   help="comma-separated: torch, pyspy, gpu, nsys (each skipped with a message where unavailable)")
    p = sub.add_parser("bench-precision", help="fp32 vs the auto precision (and bf16/fp16 on CUDA) on the same batches")
    _common(p)
    p.add_argument("--steps", type=int, default=150, help="training steps per row (default 150)")
    p.add_argument("--bf16-cpu-steps", type=int, default=4, help="steps of the timing-only bf16 row on CPU (0: none)")
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the step-time median")
    p.add_argument("--run-id", default=None, help="run directory name (default: bench-precision-<timestamp>)")
    p = sub.add_parser("compare", help="compare runs side by side: markdown table + PNG (no network)")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories (or run ids under --runs-dir)")
    p.add_argument("--out", default=None, help="output directory (default: <runs-dir>/compare)")
    p.add_argument("--runs-dir", default="runs", help="where bare run ids are looked up (default: runs)")
    p = sub.add_parser("wandb-sync", help="upload offline W&B runs under --runs-dir with `wandb sync`")
    p.add_argument("--runs-dir", default="runs")
    p.add_argument("--all", action="store_true", help="also runs already marked as synced")
    p.add_argument("--dry-run", action="store_true", help="list what would be synced")
    p = sub.add_parser("bench-tracking", help="step-time overhead of tracking (none / jsonl / W&B offline), one process")
    _common(p)
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--block-steps", type=int, default=100, help="optimizer steps per block (default 100)")
    p.add_argument("--online-check", action="store_true", help="also time W&B forced online with no reachable server")
    p.add_argument("--out", default=None, help="result JSON (default: <output_dir>/bench-tracking/bench.json)")
    p = sub.add_parser("warmup", help="compile and warm every batch shape of the run's bucket plan; write runs/<id>/warmup.json")
    _common(p)
    p.add_argument("--run-id", default=None, help="run directory name (default: a timestamp)")
    p.add_argument("--buckets-force", action="store_true", help="use batching.boundaries_file even if its fingerprints differ")
    p = sub.add_parser("bench-compile", help="time to first step with a cold vs warm compile cache (separate processes), "
                       "compiled vs eager step time; write runs/<id>/bench-compile.json")
    _common(p)
    p.add_argument("--run-id", default=None, help="run directory name (default: bench-compile-<timestamp>)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per configuration per round")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (eager, compiled, eager, ...)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: one first-step process → JSON file
    return parser


def cmd_compare(args: argparse.Namespace) -> int:
    from train.compare import compare

    md, md_path, png_path = compare(args.runs, args.out, args.runs_dir)
    print(md)
    print(f"wrote {md_path} and {png_path}")
    return 0


def cmd_bench_tracking(args: argparse.Namespace) -> int:
    from train.bench_tracking import bench_tracking
    from train.config import load_config

    if args.rounds < 1 or args.block_steps < 2:
        raise UserError("--rounds must be ≥ 1 and --block-steps ≥ 2")
    cfg = load_config(args.config or "configs/smoke.yaml", list(args.overrides))
    res = bench_tracking(cfg, args.rounds, args.block_steps, args.online_check, args.out)
    med = res["ms_per_step_median"]
    print(f"ms/step (median of {args.rounds} blocks): none {med['none']:.2f}, jsonl {med['jsonl']:.2f}, full {med['full']:.2f}")
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


def cmd_train(args: argparse.Namespace, t_start: float) -> int:
    from train.config import load_config
    from train.run import run_training, summary_lines

    overrides = list(args.overrides)
    if args.run_id:
        overrides.append(f"train.run_id={args.run_id}")
    if args.resume:
        from train.resume import find_resume_checkpoint

        run_dir, _ = find_resume_checkpoint(args.resume)
        cfg = load_config(str(run_dir / "config.yaml"), [o for o in overrides if not o.startswith("train.run_id=")])
        cfg.train.output_dir, cfg.train.run_id = str(run_dir.parent), run_dir.name
    else:
        cfg = load_config(args.config, overrides)
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


def cmd_precision(args: argparse.Namespace) -> int:
    from train.config import load_config
    from train.env import resolve_device
    from train.precision import PrecisionPolicy, decision_cache_path, probe_for

    cfg = load_config(args.config, list(args.overrides))
    device = resolve_device(cfg.train.device)
    if args.remeasure:
        decision_cache_path(probe_for(cfg), cfg.data.cache_dir).unlink(missing_ok=True)
    policy = PrecisionPolicy.for_config(cfg, device)
    print(f"precision {policy.mode} [{policy.source}] {policy.reason}")
    return 0


def cmd_buckets(args: argparse.Namespace) -> int:
    from pathlib import Path

    from train.config import load_config
    from train.data import BUCKETED, prepare_splits
    from train.data.buckets import BucketPlan

    cfg = load_config(args.config, args.overrides)
    b = cfg.batching
    if b.method not in BUCKETED:
        raise UserError(f"batching.method={b.method!r} uses no buckets; choose one of {', '.join(BUCKETED)}")
    prepared = prepare_splits(cfg)
    plan = BucketPlan.fit(prepared.splits["train"].lengths, b.num_buckets, b.method, b.round_to, cfg.data.max_len,
                          prepared.data_fingerprint, prepared.tokenizer_info["fingerprint"])
    out = Path(args.out or f"{cfg.train.output_dir}/buckets/{b.method}-{b.num_buckets}.json")
    plan.save(out)
    print(f"{b.method} K={b.num_buckets}: bounds {plan.bounds}, counts {plan.counts}, "
          f"predicted token efficiency {plan.predicted_token_efficiency:.4f}")
    print(f"wrote {out}; train with batching.boundaries_file={out}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from train.bench import CONFIGS, markdown, run_bench
    from train.config import load_config

    overrides = list(args.overrides) + ([f"train.run_id={args.run_id}"] if args.run_id else [])
    cfg = load_config(args.config, overrides)
    if min(args.warmup_steps, args.rounds, args.window, args.requests, args.inference_batch_size) < 1:
        raise UserError("--warmup-steps, --rounds, --window, --requests and --inference-batch-size must be ≥ 1")
    names = [n.strip() for n in args.configs.split(",")] if args.configs else list(CONFIGS)
    result = run_bench(cfg, names, args.warmup_steps, args.rounds, args.window, args.checkpoint, args.requests,
                       args.inference_batch_size, args.skip_inference)
    print(markdown(result))
    print(f"wrote {cfg.train.output_dir}/{cfg.train.run_id or '<timestamp>'}/bench/ (bench.json, bench.md, PNGs)")
    return 0


def cmd_warmup(args: argparse.Namespace) -> int:
    from train.config import load_config
    from train.warmup import run_warmup

    overrides = list(args.overrides) + ([f"train.run_id={args.run_id}"] if args.run_id else [])
    result = run_warmup(load_config(args.config, overrides), buckets_force=args.buckets_force)
    t = result["totals"]
    print(f"{t['shapes']} shapes ({t['train_shapes']} train, {t['eval_shapes']} eval) in {t['warmup_s']:.1f}s, "
          f"{t['stable_shapes']} stable (CV ≤ {100 * result['criteria']['cv_threshold']:.0f}%); wrote {result['path']}")
    return 0


def cmd_bench_compile(args: argparse.Namespace, t_start: float) -> int:
    from train.bench_compile import first_step_child, run_bench_compile
    from train.config import load_config

    overrides = list(args.overrides) + ([f"train.run_id={args.run_id}"] if args.run_id else [])
    cfg = load_config(args.config, overrides)
    if args.child:
        first_step_child(cfg, t_start, args.child)
        return 0
    if args.steps < 2 or args.rounds < 1:
        raise UserError("bench-compile: --steps must be ≥ 2 and --rounds ≥ 1")
    run_bench_compile(cfg, args.config, list(args.overrides), args.steps, args.rounds)
    return 0


def cmd_bench_precision(args: argparse.Namespace) -> int:
    from train.bench_precision import main_bench
    from train.config import load_config

    if args.steps < 2 or args.warmup < 0 or args.warmup >= args.steps or args.bf16_cpu_steps < 0:
        raise UserError("bench-precision: need --steps ≥ 2, 0 ≤ --warmup < --steps and --bf16-cpu-steps ≥ 0")
    overrides = list(args.overrides) + ([f"train.run_id={args.run_id}"] if args.run_id else [])
    return main_bench(load_config(args.config, overrides), args.steps, args.bf16_cpu_steps, args.warmup)


def cmd_bench_batching(args: argparse.Namespace) -> int:
    from train.bench_batching import BenchBatchingConfig, run_bench
    from train.config import load_config
    from train.run import make_run_dir

    names = ("num_buckets", "batch_size", "max_tokens", "window_samples", "windows", "warmup_windows")
    bc = BenchBatchingConfig(**{n: getattr(args, n) for n in names if getattr(args, n) is not None})
    overrides = list(args.overrides) + ([f"train.run_id={args.run_id}"] if args.run_id else [])
    cfg = load_config(args.config, overrides)
    cfg.train.run_id = cfg.train.run_id or time.strftime("bench-batching-%Y%m%d-%H%M%S", time.gmtime())
    run_dir = make_run_dir(cfg)
    run_bench(cfg, bc, run_dir)
    print((run_dir / "bench-batching.md").read_text(encoding="utf-8"))
    print(f"wrote {run_dir}/bench-batching.json, .md, .png")
    return 0


def cmd_profile(args: argparse.Namespace, t_start: float) -> int:
    from train.config import load_config
    from train.profiling.session import parse_tools, run_profile

    tools = parse_tools(args.tools)
    overrides = list(args.overrides)
    if args.run_id:
        overrides.append(f"train.run_id={args.run_id}")
    cfg = load_config(args.config, overrides)
    child_args = (["--config", args.config] if args.config else []) + list(args.overrides)
    run_profile(cfg, tools, t_start, child_args)
    return 0


def main(argv: Optional[Sequence[str]] = None, t_start: Optional[float] = None) -> int:
    t_start = time.perf_counter() if t_start is None else t_start
    args = build_parser().parse_args(argv)
    try:
        if args.command == "train":
            return cmd_train(args, t_start)
        if args.command == "precision":
            return cmd_precision(args)
        if args.command == "buckets":
            return cmd_buckets(args)
        if args.command == "bench":
            return cmd_bench(args)
        if args.command == "bench-batching":
            return cmd_bench_batching(args)
        if args.command == "profile":
            return cmd_profile(args, t_start)
        if args.command == "bench-precision":
            return cmd_bench_precision(args)
        if args.command == "compare":
            return cmd_compare(args)
        if args.command == "wandb-sync":
            from train.wandb_sync import sync

            return sync(args.runs_dir, args.all, args.dry_run)
        if args.command == "bench-tracking":
            return cmd_bench_tracking(args)
        if args.command == "warmup":
            return cmd_warmup(args)
        if args.command == "bench-compile":
            return cmd_bench_compile(args, t_start)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except RunAborted as exc:  # e.g. the numerics guard; the diagnostic report is already in the run directory
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 2
