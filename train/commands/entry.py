"""One function per ``python -m train`` command (the table in train/cli.py points here): read the config from the
parsed arguments, run the command's function, print its summary, return the exit code.

Each function imports its command's module inside its body: those modules import torch (and bench-vs-hf
transformers), so ``python -m train --help``, a bad flag and ``time_to_first_step_s`` pay only for the command
that runs."""

from __future__ import annotations

import argparse
import json
import os
import signal
from typing import Optional


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


# -- the commands ---------------------------------------------------------------------------------------------

def cmd_train(args: argparse.Namespace, t_start: float) -> int:
    from train.config import load_config
    from train.report import summary_lines
    from train.run.training import run_training

    if args.resume:
        from train.resume import find_resume_checkpoint

        run_dir, _ = find_resume_checkpoint(args.resume)
        cfg = load_config(str(run_dir / "config.yaml"), list(args.overrides) +
                          [f"train.output_dir={run_dir.parent}", f"train.run_id={run_dir.name}"])
    else:
        cfg = load_cfg(args)
    report = run_training(cfg, t_start, buckets_force=args.buckets_force, resume=args.resume, continue_flag="--resume")
    if report.get("nothing_trained"):  # --resume of a complete run: said in one line already
        return 0
    main_rank = os.environ.get("RANK", "0") == "0"
    if report.get("status") == "interrupted":
        info = report["interrupted"]
        if main_rank:
            print(f"interrupted by {info['signal']} after step {info['step']}/{info['total_steps']}; "
                  f"checkpoint {info['checkpoint']}; resume with: {info['resume_command']}")
        # 128 + the signal, as a shell reports a process the signal ended: a scheduler restarts a job that exits
        # non-zero (Kubernetes' restartPolicy: OnFailure), and this one has checkpointed for its --resume
        known = signal.Signals.__members__.get(info["signal"])  # a rank told by another: the stop is a SIGTERM's
        return 128 + (known or signal.SIGTERM).value
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
    from train.bench.suite import markdown, run_bench_suite

    cfg = load_cfg(args)
    result = run_bench_suite(cfg)
    print(markdown(result))
    print(f"wrote {result['run_dir']}/bench/ (bench.json, bench.md, PNGs)")
    return 0


def cmd_bench_gate(args: argparse.Namespace, t_start: float) -> int:
    from train.bench.gate import run_gate

    passed, _ = run_gate(load_cfg(args, default_config="configs/bench-gate.yaml"))
    return 0 if passed else 1


def cmd_bench_baseline(args: argparse.Namespace, t_start: float) -> int:
    from train.bench.gate import write_baseline

    write_baseline(load_cfg(args, default_config="configs/bench-gate.yaml"))
    return 0


def cmd_bench_vs_hf(args: argparse.Namespace, t_start: float) -> int:
    from train.bench.vs_hf import run_bench_vs_hf

    run_bench_vs_hf(load_cfg(args, default_config="configs/bench-vs-hf.yaml"))
    return 0


def cmd_bench_batching(args: argparse.Namespace, t_start: float) -> int:
    from train.bench.batching import run_batching_bench
    from train.tools.run_dir import make_run_dir
    from train.tools.run_lock import discard_if_unwritten

    cfg = load_cfg(args)
    run_dir = make_run_dir(cfg, prefix="bench-batching-")
    try:
        run_batching_bench(cfg, run_dir)
    except BaseException:  # refused or crashed before writing anything: no directory of it stays
        discard_if_unwritten(run_dir)
        raise
    print((run_dir / "bench-batching.md").read_text(encoding="utf-8"))
    print(f"wrote {run_dir}/bench-batching.json, .md, .png")
    return 0


def cmd_profile(args: argparse.Namespace, t_start: float) -> int:
    from train.profiling.session import parse_tools
    from train.run.profile import run_profile

    tools = parse_tools(args.tools)
    child_args = (["--config", args.config] if args.config else []) + list(args.overrides)
    run_profile(load_cfg(args), tools, t_start, child_args)
    return 0


def cmd_bench_precision(args: argparse.Namespace, t_start: float) -> int:
    from train.bench.precision_modes import markdown, run_precision_bench

    out = run_precision_bench(load_cfg(args))
    print(markdown(out))
    print(f"wrote {out['run_dir']}/bench-precision.json and .md")
    return 0


def cmd_bench_generate(args: argparse.Namespace, t_start: float) -> int:
    from pathlib import Path

    from train.bench.generate import real_model_default, run_bench_generate, summary_line, write_outputs
    from train.tools.run_dir import make_run_dir
    from train.tools.run_lock import discard_if_unwritten

    # RUN_DIR is the first word when it is no override (argparse puts it among the overrides)
    run_dir = args.overrides.pop(0) if args.overrides and "=" not in args.overrides[0] else None
    from train.errors import UserError

    if run_dir is not None and not Path(run_dir).is_dir():
        raise UserError(f"bench-generate: no such run directory {run_dir} (give runs/<id> of a model.task=causal-lm "
                        "run: make bench-generate RUN=runs/<id>)")
    run_config = str(Path(run_dir) / "config.yaml") if run_dir and not args.config else None
    cfg = load_cfg(args, default_config=run_config)
    real = real_model_default(cfg) if run_dir is None and not args.config else None
    if real is not None:  # make models installed SmolLM2: served by default; the user's overrides still win
        args.overrides = real[1] + list(args.overrides)
        cfg = load_cfg(args, default_config=real[0])
    if args.child:
        from train.bench.generate import first_response_child

        first_response_child(cfg, run_dir, t_start, args.child)
        return 0
    # a new directory of its own (the run's config.yaml names the trained run's id): --run-id, or a drawn one
    out = make_run_dir(cfg.with_values({"train.run_id": getattr(args, "run_id", None)}), prefix="generate-")
    try:
        result = run_bench_generate(cfg, run_dir, out, notice=lambda m: print(m, flush=True),
                                    command=(args.config, list(args.overrides)))
    except BaseException:  # refused or crashed before writing anything: no directory of it stays
        discard_if_unwritten(out)
        raise
    print(summary_line(result, write_outputs(result, out)), flush=True)
    return 0


def cmd_export(args: argparse.Namespace, t_start: float) -> int:
    from train.run.export import export_run

    block = export_run(args.run_dir, args.checkpoint, args.merged, args.out, args.dtype)
    print(f"exported {block['format']} to {block['path']}: {', '.join(block['files'])}"
          + (f" (base: {block['base']})" if block.get("base") else ""), flush=True)
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


def cmd_models(args: argparse.Namespace, t_start: float) -> int:
    from train.models.pretrained import MODELS, install_all

    dirs = install_all(args.cache_dir, args.names or None)
    for name, d in dirs.items():
        m = MODELS[name]
        print(f"{name} ({m.title}, {m.note}): model.source=hf:{d}"
              + (" model.task=causal-lm" if m.task == "causal-lm" else ""), flush=True)
    return 0


def cmd_wandb_sync(args: argparse.Namespace, t_start: float) -> int:
    from train.tracking.sync import sync

    return sync(args.runs_dir, args.all, args.dry_run)


def cmd_bench_tracking(args: argparse.Namespace, t_start: float) -> int:
    from train.bench.tracking import run_tracking_bench

    cfg = load_cfg(args, default_config="configs/smoke.yaml")
    res = run_tracking_bench(cfg)
    med = res["ms_per_step_median"]
    print(f"ms/step (median of {cfg.bench_tracking.rounds} blocks): none {med['none']:.2f}, "
          f"jsonl {med['jsonl']:.2f}, full {med['full']:.2f}")
    print(f"overhead of full tracking vs none: {100 * res['overhead_full_vs_none']:+.2f}% (target ≤ 2%: "
          f"{'met' if res['target_met'] else 'NOT met'}); vs jsonl only: {100 * res['overhead_full_vs_jsonl']:+.2f}%")
    print(f"CPU time per step (process + wandb-core), less sensitive to a shared machine: full vs none "
          f"{100 * res['cpu_overhead_full_vs_none']:+.2f}%, vs jsonl {100 * res['cpu_overhead_full_vs_jsonl']:+.2f}%")
    if "online_unreachable" in res:
        o = res["online_unreachable"]
        print(f"W&B forced online, server unreachable: extra wall time {o['extra_wall_s']:.1f} s "
              f"(init timeout {o['init_timeout_s']:g} s); W&B active: {o['wandb_active']}; "
              f"reason: {o['wandb_fallback_reason']}")
    print(f"wrote {res['path']}")
    return 0


def cmd_warmup(args: argparse.Namespace, t_start: float) -> int:
    from train.run.warmup import run_warmup

    result = run_warmup(load_cfg(args), buckets_force=args.buckets_force)
    t = result["totals"]
    print(f"{t['shapes']} shapes ({t['train_shapes']} train, {t['eval_shapes']} eval) in {t['warmup_s']:.1f}s, "
          f"{t['stable_shapes']} stable (CV ≤ {100 * result['criteria']['cv_threshold']:.0f}%); wrote {result['path']}")
    return 0


def cmd_sync_audit(args: argparse.Namespace, t_start: float) -> int:
    from train.run.sync_audit import run_sync_audit

    result = run_sync_audit(load_cfg(args), args.mode, args.out, t_start)
    print(f"sync audit: {result['host_syncs']} host sync(s) in {result['watched_steps']} steady steps "
          f"({result['method']}): {'PASS' if result['passed'] else 'FAIL'}; wrote {result['path']}", flush=True)
    return 0 if result["passed"] else 1


def cmd_bench_compile(args: argparse.Namespace, t_start: float) -> int:
    from train.bench.compilation import first_step_child, run_compile_bench

    cfg = load_cfg(args)
    if args.child:
        first_step_child(cfg, t_start, args.child)
        return 0
    run_compile_bench(cfg, args.config, list(args.overrides))
    return 0


def cmd_optimize(args: argparse.Namespace, t_start: float) -> int:
    from train.optimize import run_optimize

    cfg = load_cfg(args)
    res = run_optimize(cfg, config_path=args.config, t_start=t_start)
    conf = (res.get("confirmation") or {}).get("ratio")
    kept = [f"{d['lever']}={d['value']}" for d in res["decisions"] if d["accepted"]]
    status = {"budget": f"stopped by optimize.budget_s={cfg.optimize.budget_s:g}"}.get(res["status"], res["status"])
    print(f"optimize: {status} after {res['seconds']:.0f} s; kept {', '.join(kept) or 'nothing'}; "
          + (f"optimized vs baseline {conf['median']:.2f}x [{conf['low']:.2f}, {conf['high']:.2f}]" if conf and
             conf.get("low") is not None else "no end-to-end confirmation"))
    print(f"optimize: {res['out_dir']}/optimize.md; train it with: make train CONFIG={res['out_dir']}/optimized.yaml")
    return 130 if res["status"] == "interrupted" else 0


def cmd_optimize_grid(args: argparse.Namespace, t_start: float) -> int:
    from train.optimize.grid import check_optimized, run_grid

    check_optimized(args.optimized)
    g = run_grid(load_cfg(args), args.optimized, config_path=args.config)
    print(f"optimize-grid: {g['points']} combinations in {g['seconds']:.0f} s; best {g['best']} "
          f"{g['best_samples_per_s']:.1f} samples/s; {g['out_dir']}/grid.md")
    if g["optimized"]:
        o = g["optimized"]
        r, share = o["vs_best"], o["search_share_of_grid_time"]
        print(f"optimize-grid: optimized = {r['median']:.3f}x [{r['low']:.3f}, {r['high']:.3f}] of the grid's best "
              f"(>= {o['target_share']:.0%}: {o['share_verdict']}); the search took "
              + ("an unknown time" if share is None else f"{share:.0%} of the grid's time"))
    return 0
