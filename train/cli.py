"""Command-line interface: argument parsing only; each command calls a function in its module.

    python -m train train   [--config FILE] [--run-id ID] [--buckets-force] [--resume RUN_DIR] [section.key=value ...]
    python -m train buckets [--config FILE] [--out FILE] [section.key=value ...]

Bad input (a :class:`~train.errors.UserError`) prints one ``error:`` line and exits 2.
"""

from __future__ import annotations

import argparse
import os
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
    p.add_argument("--resume", default=None, metavar="RUN_DIR",
                   help="continue runs/<id> from its newest checkpoint (or a given checkpoint file) with the run's own "
                        "config.yaml (--config is ignored; overrides still apply)")
    p = sub.add_parser("buckets", help="fit bucket boundaries on the training split and save them as JSON")
    _common(p)
    p.add_argument("--out", default=None, help="output JSON (default: runs/buckets/<method>-<K>.json)")
    return parser


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


def main(argv: Optional[Sequence[str]] = None, t_start: Optional[float] = None) -> int:
    t_start = time.perf_counter() if t_start is None else t_start
    args = build_parser().parse_args(argv)
    try:
        if args.command == "train":
            return cmd_train(args, t_start)
        if args.command == "buckets":
            return cmd_buckets(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 2
