"""Command-line interface: argument parsing only; each command calls a function in its module.

    python -m train train   [--config FILE] [--run-id ID] [--buckets-force] [section.key=value ...]
    python -m train buckets [--config FILE] [--out FILE] [section.key=value ...]
    python -m train warmup  [--config FILE] [--run-id ID] [section.key=value ...]
    python -m train bench-compile [--config FILE] [--run-id ID] [--steps N] [--rounds R] [section.key=value ...]

Bad input (a :class:`~train.errors.UserError`) prints one ``error:`` line and exits 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Optional

from train.errors import UserError


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
    p = sub.add_parser("buckets", help="fit bucket boundaries on the training split and save them as JSON")
    _common(p)
    p.add_argument("--out", default=None, help="output JSON (default: runs/buckets/<method>-<K>.json)")
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


def cmd_train(args: argparse.Namespace, t_start: float) -> int:
    from train.config import load_config
    from train.run import run_training, summary_lines

    overrides = list(args.overrides)
    if args.run_id:
        overrides.append(f"train.run_id={args.run_id}")
    cfg = load_config(args.config, overrides)
    report = run_training(cfg, t_start, buckets_force=args.buckets_force)
    for line in summary_lines(report):
        print(line)
    return 0


def cmd_buckets(args: argparse.Namespace) -> int:
    from pathlib import Path

    from train.config import load_config
    from train.data import BUCKETED
    from train.data.buckets import BucketPlan
    from train.data.sources import load_corpus
    from train.data.tokenizer import encode, load_or_train, texts_fingerprint

    cfg = load_config(args.config, args.overrides)
    b = cfg.batching
    if b.method not in BUCKETED:
        raise UserError(f"batching.method={b.method!r} uses no buckets; choose one of {', '.join(BUCKETED)}")
    corpus = load_corpus(cfg.data)
    tok, info = load_or_train(corpus.train.texts, cfg.data.vocab_size, cfg.data.cache_dir, cfg.data.tokenizer_path)
    lengths = encode(tok, corpus.train.texts, corpus.train.labels, cfg.data.max_len).lengths
    plan = BucketPlan.fit(lengths, b.num_buckets, b.method, b.round_to, cfg.data.max_len,
                          texts_fingerprint(corpus.train.texts), info["fingerprint"])
    out = Path(args.out or f"{cfg.train.output_dir}/buckets/{b.method}-{b.num_buckets}.json")
    plan.save(out)
    print(f"{b.method} K={b.num_buckets}: bounds {plan.bounds}, counts {plan.counts}, "
          f"predicted token efficiency {plan.predicted_token_efficiency:.4f}")
    print(f"wrote {out}; train with batching.boundaries_file={out}")
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


def main(argv: Optional[Sequence[str]] = None, t_start: Optional[float] = None) -> int:
    t_start = time.perf_counter() if t_start is None else t_start
    args = build_parser().parse_args(argv)
    try:
        if args.command == "train":
            return cmd_train(args, t_start)
        if args.command == "buckets":
            return cmd_buckets(args)
        if args.command == "warmup":
            return cmd_warmup(args)
        if args.command == "bench-compile":
            return cmd_bench_compile(args, t_start)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 2
