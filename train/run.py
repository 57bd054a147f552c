"""One training run end to end: run directory → data → model → loop → evaluation → report.json.

Writes ``runs/<run-id>/``: ``config.yaml`` (fully resolved), ``metrics.jsonl``, ``buckets.json``
(when fitted on the fly), ``checkpoint.pt`` (state_dicts only) and ``report.json``.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from train.config import RunConfig, dump_config
from train.data import DataBundle, make_loader, prepare_data
from train.distributed import DistContext, agreed, all_reduce_sum, broadcast_from_main, init_distributed, teardown, wrap_model
from train.env import collect_env, device_name, resolve_device
from train.errors import UserError, atomic_write_text
from train.model import EncoderClassifier, resolve_spec
from train.numerics import NumericsAbort
from train.perf.devices import mfu_fields
from train.perf.energy import EnergyMeter, per_unit
from train.perf.flops import StepFlops
from train.perf.memory import peak_memory, reset_peak
from train.precision import Decision, PrecisionPolicy
from train.resume import (
    Checkpointer,
    check_resume_state,
    find_resume_checkpoint,
    full_state,
    read_resume_state,
    restore_rng,
    truncate_metrics,
    write_state,
)
from train.shutdown import ShutdownRequest
from train.tracking import NullLogger
from train.tracking_setup import Tracking
from train.trainer import Trainer, TrainStats, evaluate
from train.warmup import start_compile, warm_up_for_run


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices)."""
    import random

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def make_run_dir(cfg: RunConfig) -> Path:
    """Create ``<output_dir>/<run_id>`` (run_id defaults to a UTC timestamp).

    Raises:
        UserError: the directory cannot be created or written.
    """
    run_id = cfg.train.run_id or time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    run_dir = Path(cfg.train.output_dir) / run_id
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise UserError(f"cannot write the run directory {run_dir} ({exc.strerror}); "
                        "set train.output_dir to a writable place") from None
    return run_dir


def start_run(cfg: RunConfig) -> tuple[Path, torch.device]:
    """Single-process command start: create the run directory, write ``config.yaml``, resolve the device,
    apply ``train.num_threads`` and seed every RNG. Returns (run_dir, device).

    Raises:
        UserError: unwritable run directory or unavailable device.
    """
    run_dir = make_run_dir(cfg)
    atomic_write_text(run_dir / "config.yaml", dump_config(cfg))
    device = resolve_device(cfg.train.device)
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    seed_everything(cfg.train.seed)
    return run_dir, device


def build_model(cfg: RunConfig, bundle: DataBundle) -> EncoderClassifier:
    m = cfg.model
    spec = resolve_spec(m.preset, bundle.vocab_size, bundle.num_classes, cfg.data.max_len, m.dropout, m.pooling,
                        num_layers=m.num_layers, hidden_size=m.hidden_size, num_heads=m.num_heads, ffn_size=m.ffn_size)
    if spec.hidden_size % spec.num_heads:
        raise UserError(f"model: hidden_size {spec.hidden_size} is not divisible by num_heads {spec.num_heads}")
    if max(bundle.bounds) > spec.max_len:
        raise UserError(f"bucket bound {max(bundle.bounds)} exceeds data.max_len={spec.max_len} (the position table); "
                        "refit the buckets or raise data.max_len")
    return EncoderClassifier(spec)


def _ratio(a: float, b: float) -> Optional[float]:
    return a / b if b else None


def build_report(cfg: RunConfig, run_dir: Path, bundle: DataBundle, stats: TrainStats, timer_summary: dict,
                 first_step_ms: Optional[float], steady_ms_total: float, final_eval: dict, test_eval: dict,
                 env: dict, memory: dict, sampler_counts: dict, t_start: float, wall_s: float) -> dict[str, Any]:
    """The run's report.json (keys are a contract: add, never rename)."""
    train_split = bundle.splits["train"]
    test_labels = bundle.splits["test"].labels
    majority = float(np.bincount(test_labels).max() / len(test_labels)) if len(test_labels) else None
    steady_s = steady_ms_total / 1e3
    perf = {
        "throughput_samples_per_s": _ratio(stats.steady_samples, steady_s),
        "throughput_tokens_per_s": _ratio(stats.steady_real_tokens, steady_s),
        "time_to_first_step_s": (stats.first_step_end - t_start) if stats.first_step_end else None,
        "first_step_ms": first_step_ms,
        "step_time_ms": timer_summary,
        "steps": stats.steps,
        "train_samples_seen": stats.samples,
        "wall_time_s": wall_s,
        **memory,
    }
    if stats.steps < 2:
        perf["throughput_unavailable_reason"] = "fewer than 2 steps: no steady-state steps after the first (cold) one"
    return {
        "status": "completed",
        "run_id": run_dir.name,
        "run_dir": str(run_dir),
        "quality": {
            "eval_accuracy": final_eval.get("accuracy"),
            "eval_macro_f1": final_eval.get("macro_f1"),
            "eval_loss": final_eval.get("loss"),
            "final_train_loss": stats.final_train_loss,
            "test_accuracy": test_eval.get("accuracy"),
            "test_macro_f1": test_eval.get("macro_f1"),
            "test_majority_class_accuracy": majority,
            "evals": stats.evals,
        },
        "data": {
            "name": bundle.corpus.name,
            "source": cfg.data.source,
            "train_samples": len(train_split),
            "validation_samples": len(bundle.splits["validation"]),
            "test_samples": len(bundle.splits["test"]),
            "num_classes": bundle.num_classes,
            "label_names": bundle.corpus.label_names,
            "truncated_samples": sum(s.truncated for s in bundle.splits.values()),
            "truncated_train_samples": train_split.truncated,
            "mean_train_length": float(train_split.lengths.mean()),
            "max_train_length": int(train_split.lengths.max()),
            "data_fingerprint": bundle.data_fingerprint,
            "tokenizer": bundle.tokenizer_info,
            **bundle.cache,
        },
        "batching": {
            "method": cfg.batching.method,
            "num_buckets": len(bundle.bounds) if bundle.plan is not None else None,
            "bucket_bounds": bundle.bounds,
            "boundaries_source": bundle.plan_source,
            "predicted_token_efficiency": bundle.plan.predicted_token_efficiency if bundle.plan else None,
            "token_efficiency": _ratio(stats.real_tokens, stats.padded_tokens),
            "padding_ratio": 1 - stats.real_tokens / stats.padded_tokens if stats.padded_tokens else None,
            "distinct_shapes": len(stats.seq_lens),
            "distinct_batch_shapes": len(stats.batch_shapes),
            "batch_size": cfg.batching.batch_size,
            "max_tokens": cfg.batching.max_tokens,
            "dropped_samples": sampler_counts["dropped"],
            "repeated_samples": sampler_counts["repeated"],
            "truncated_in_collate": stats.truncated_in_collate,
        },
        "perf": perf,
        "env": env,
    }


def run_training(cfg: RunConfig, t_start: float, buckets_force: bool = False,
                 resume: Optional[str] = None, hooks: tuple = ()) -> dict[str, Any]:
    """Train, evaluate and write the run directory. Returns the report dict.

    ``t_start`` is ``time.perf_counter()`` at command start, for ``perf.time_to_first_step_s``.
    Under ``torchrun`` every rank calls this; DDP is set up and torn down here and only rank 0
    writes files or prints. ``resume``: a run directory (or one of its checkpoint files) to
    continue from (see train/resume.py). After SIGTERM/SIGINT the report has ``"status": "interrupted"``.
    ``hooks``: objects with ``attach(trainer, run_dir)`` (called before the loop) and
    ``finish(report)`` (called before report.json is written; may add keys), e.g. a profile session.

    Raises:
        UserError: any bad input (config, data, buckets, run directory, checkpoint), on every rank.
    """
    ctx, device = init_distributed(resolve_device(cfg.train.device))
    try:
        return _run_training(cfg, t_start, buckets_force, resume, ctx, device, hooks)
    finally:
        teardown(ctx)


def _precision_policy(cfg: RunConfig, device: torch.device, ctx: DistContext, state: Optional[dict],
                      ckpt_path: Optional[Path]) -> PrecisionPolicy:
    """The run's precision: the checkpoint's when resuming, else ``train.precision`` (``auto`` measured or cached).
    Under DDP rank 0 decides and every rank follows, so a measurement cannot split the job.

    Raises:
        UserError: the device cannot run the requested (or the checkpoint's) precision.
    """
    def decide() -> Optional[PrecisionPolicy]:
        if not ctx.is_main:
            return None
        if state is not None:
            return PrecisionPolicy.for_resume(state.get("precision"), cfg, device, f"checkpoint {ckpt_path}")
        return PrecisionPolicy.for_config(cfg, device)

    policy = agreed(decide, ctx)
    if not ctx.enabled:
        return policy
    mine = broadcast_from_main((policy.mode, policy.reason, policy.source, policy.measurement) if ctx.is_main else None,
                               ctx)
    return policy if ctx.is_main else PrecisionPolicy.from_decision(Decision(*mine), device)


def keep_tokenizer(bundle: DataBundle, run_dir: Path) -> None:
    """Copy the run's tokenizer to ``<run_dir>/tokenizer.json`` (what ``--resume`` needs if caches are cleared);
    ``data.tokenizer.run_copy`` names it. A missing source file is skipped."""
    src = Path(bundle.tokenizer_info.get("path") or "")
    if src.is_file():
        atomic_write_text(run_dir / "tokenizer.json", src.read_text(encoding="utf-8"))
        bundle.tokenizer_info["run_copy"] = str(run_dir / "tokenizer.json")


def decision_lines(device: torch.device, policy: PrecisionPolicy, compiled, bundle: DataBundle,
                   cfg: RunConfig) -> list[str]:
    """The block every run prints before training: what was decided automatically, and why (or from which cache)."""
    b = bundle.cache
    data = {"hit": f"cache hit ({b.get('cache_dir')})", "miss": f"cache miss, prepared and stored in {b.get('cache_dir')}",
            "off": f"not cached ({b.get('cache_unavailable_reason')})"}.get(b.get("cache", "off"), "not cached")
    if b.get("cache") == "miss" and b.get("cache_unavailable_reason"):
        data = f"cache miss ({b['cache_unavailable_reason']})"
    if bundle.plan is not None:
        buckets = (f"{cfg.batching.method}, {len(bundle.bounds)} buckets {bundle.bounds} ({bundle.plan_source}; predicted "
                   f"token efficiency {bundle.plan.predicted_token_efficiency:.3f})")
    else:
        buckets = f"{cfg.batching.method}: {bundle.plan_source}"
    return ["decisions:",
            f"  device     {device_name(device)}",
            f"  precision  {policy.mode} [{policy.source}] {policy.reason}",
            f"  compile    {'on' if compiled.enabled else 'off'}: {compiled.reason}",
            f"  buckets    {buckets}",
            f"  data       {data}; tokenizer {bundle.tokenizer_info['source']}"]


def _reduce_stats(stats: TrainStats, ctx: DistContext) -> None:
    """Turn this rank's counters into job totals (sums over ranks; shapes: union). No-op single-process."""
    if not ctx.enabled:
        return
    names = ("samples", "real_tokens", "padded_tokens", "steady_samples", "steady_real_tokens", "truncated_in_collate")
    totals = all_reduce_sum(torch.tensor([getattr(stats, n) for n in names], dtype=torch.float64), ctx)
    for name, value in zip(names, totals.tolist()):
        setattr(stats, name, int(value))
    shapes = [None] * ctx.world_size
    torch.distributed.all_gather_object(shapes, (stats.seq_lens, stats.batch_shapes), group=ctx.control_group)
    stats.seq_lens = set().union(*(a for a, _ in shapes))
    stats.batch_shapes = set().union(*(b for _, b in shapes))


def _prepare_data(cfg: RunConfig, run_dir: Path, buckets_force: bool, ctx: DistContext, say) -> DataBundle:
    """``prepare_data`` on every rank, consistently.

    Rank 0 goes first (it may train and cache the tokenizer and the prepared data); the other ranks then
    load rank 0's tokenizer rather than train their own (training is deterministic, see
    train/data/tokenizer.py, but a per-node cache may hold an older entry). Finally every rank checks that
    it holds rank 0's data, tokenizer and bucket bounds.

    Raises:
        UserError: bad input on any rank, or ranks that disagree (e.g. a per-node data copy that differs).
    """
    if not ctx.enabled:
        return prepare_data(cfg, run_dir, buckets_force, notice=say)
    bundle = agreed(lambda: prepare_data(cfg, run_dir, buckets_force, notice=say) if ctx.is_main else None, ctx)
    tok_json = None
    if ctx.is_main:
        tok_file = Path(bundle.tokenizer_info["path"])
        tok_json = tok_file.read_text(encoding="utf-8") if tok_file.is_file() else None
    tok_json = broadcast_from_main(tok_json, ctx)

    def follow() -> DataBundle:
        if ctx.is_main:
            return bundle
        local = copy.deepcopy(cfg)
        with tempfile.TemporaryDirectory() as tmp:
            if tok_json is not None:
                local.data.tokenizer_path = os.path.join(tmp, "tokenizer.json")
                Path(local.data.tokenizer_path).write_text(tok_json, encoding="utf-8")
            return prepare_data(local, None, buckets_force, notice=lambda *a, **k: None)

    bundle = agreed(follow, ctx)
    facts = (bundle.data_fingerprint, bundle.tokenizer_info["fingerprint"], list(bundle.bounds))
    main_facts = broadcast_from_main(facts, ctx)

    def check() -> None:
        if facts != main_facts:
            raise UserError(f"rank {ctx.rank} prepared other data than rank 0 (data, tokenizer, buckets: {facts} vs "
                            f"{main_facts}); give every node the same data.source and a shared data.cache_dir "
                            "(or data.tokenizer_path and batching.boundaries_file)")

    agreed(check, ctx)
    return bundle


def _run_training(cfg: RunConfig, t_start: float, buckets_force: bool, resume: Optional[str], ctx: DistContext,
                  device: torch.device, hooks: tuple = ()) -> dict[str, Any]:
    say = print if ctx.is_main else (lambda *a, **k: None)
    if ctx.enabled and cfg.train.run_id is None:  # one timestamp for all ranks
        cfg.train.run_id = broadcast_from_main(time.strftime("%Y%m%d-%H%M%S", time.gmtime()), ctx)
    run_dir = agreed(lambda: make_run_dir(cfg) if ctx.is_main else Path(cfg.train.output_dir) / cfg.train.run_id, ctx)
    if ctx.is_main:
        atomic_write_text(run_dir / "config.yaml", dump_config(cfg))
        if resume is None:
            for stale in ("report.json", "metrics.jsonl"):
                (run_dir / stale).unlink(missing_ok=True)
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    seed_everything(cfg.train.seed)
    state, ckpt_path = None, None
    if resume is not None:
        _, ckpt_path = find_resume_checkpoint(resume)
        state = agreed(lambda: read_resume_state(ckpt_path), ctx)
    policy = _precision_policy(cfg, device, ctx, state, ckpt_path)
    say(f"run {run_dir}: device {device}" + (f", {ctx.world_size} processes ({ctx.backend})" if ctx.enabled else ""),
        flush=True)

    t_data = time.perf_counter()
    bundle = _prepare_data(cfg, run_dir, buckets_force, ctx, say)
    data_s = time.perf_counter() - t_data
    say(f"data: {bundle.corpus.name}, {len(bundle.splits['train'])} train / {len(bundle.splits['validation'])} val / "
        f"{len(bundle.splits['test'])} test, {bundle.num_classes} classes, vocab {bundle.vocab_size} "
        f"(tokenizer {bundle.tokenizer_info['source']}, prepared data {bundle.cache.get('cache', 'off')}), {data_s:.1f}s",
        flush=True)

    model = agreed(lambda: build_model(cfg, bundle), ctx).to(device)
    if state is not None:
        state = agreed(lambda: check_resume_state(state, ckpt_path, ctx, bundle, model.spec), ctx)
        say(f"resuming from {ckpt_path} (step {state['step']})", flush=True)
    if ctx.is_main:  # after the resume checks: a refused resume leaves the run's own tokenizer copy alone
        keep_tokenizer(bundle, run_dir)
    if ctx.rank:  # distinct dropout streams per rank; rank 0 keeps the single-process stream
        torch.manual_seed(cfg.train.seed + ctx.rank)
    ws, rk = ctx.world_size, ctx.rank
    train_loader = make_loader(bundle, "train", cfg, train=True, device=device, world_size=ws, rank=rk)
    val_loader = make_loader(bundle, "validation", cfg, train=False, device=device, world_size=ws, rank=rk)
    test_loader = make_loader(bundle, "test", cfg, train=False, device=device, world_size=ws, rank=rk)
    compiled = start_compile(cfg, device, model, bundle.pad_to, train_loader, [val_loader, test_loader])
    if compiled.enabled and ctx.enabled:
        raise UserError("compile.enabled=true under torchrun is not supported yet: use compile.enabled=auto/false "
                        "with NPROC > 1, or compile a single-process run")
    for line in decision_lines(device, policy, compiled, bundle, cfg):
        say(line, flush=True)
    if state is not None:
        model.load_state_dict(state["model"])  # before DDP: its construction broadcasts rank 0's weights
        if ctx.is_main:
            truncate_metrics(run_dir / "metrics.jsonl", state["step"])
    # rank 0: metrics.jsonl (+ W&B on its own thread, bounded, never blocking); other ranks log nothing
    tracking = Tracking(cfg, run_dir) if ctx.is_main else None
    logger = tracking.attach(model, device) if tracking is not None else NullLogger()
    trainer = Trainer(cfg, model, policy, device, train_loader, val_loader, logger, bundle.num_classes,
                      grad_stats=tracking.grad_stats if tracking is not None else None,
                      dist_ctx=ctx, train_model=compiled.forward if compiled.enabled else wrap_model(model, ctx, device))
    say(f"model: {cfg.model.preset}, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters; "
        f"{trainer.total_steps} steps ({len(train_loader)} batches per epoch per rank)", flush=True)
    if state is not None:
        trainer.load_state_dict(state, state["ranks"][ctx.rank])
        if trainer.start_step >= trainer.total_steps:
            raise UserError(f"--resume {resume}: the checkpoint is at step {trainer.start_step} of {trainer.total_steps}; "
                            "nothing left to train (raise train.max_steps to train longer)")
        restore_rng(state, ctx)  # last: nothing may draw from the RNGs between here and the next step
    warm_up_for_run(compiled, trainer, model, run_dir)
    for hook in hooks:
        hook.attach(trainer, run_dir)
    reset_peak(device)
    energy_meter = EnergyMeter(device)
    with ShutdownRequest(cfg.train.shutdown_timeout_s) as shutdown:
        checkpointer = Checkpointer(run_dir, cfg, trainer, model, bundle, ctx, shutdown)
        trainer.on_step_end = checkpointer
        energy_meter.start()
        try:
            stats = trainer.fit()
        except NumericsAbort as abort:
            energy_meter.stop()
            if ctx.is_main:
                write_aborted_report(cfg, run_dir, bundle, trainer, abort, device, policy, t_start)
            raise
        finally:
            if tracking is not None:
                tracking.close()
        energy = energy_meter.stop()  # the training loop, periodic evaluations included
        interrupted = trainer.stopped_at is not None
        if not interrupted:  # the final state, resumable and loadable (weights_only)
            write_state(run_dir / "checkpoint.pt", full_state(trainer, model, bundle, cfg, ctx), ctx)
        _reduce_stats(stats, ctx)
        sampler = train_loader.batch_sampler
        sampler_counts = {"dropped": sampler.dropped_samples, "repeated": sampler.repeated_samples}
        if interrupted:  # bounded shutdown: no extra evaluation
            final_eval, test_eval = (stats.evals[-1] if stats.evals else {}), {}
        else:
            final_eval = stats.evals[-1] if stats.evals else evaluate(model, val_loader, policy, bundle.num_classes,
                                                                      device, ctx)
            test_eval = evaluate(model, test_loader, policy, bundle.num_classes, device, ctx)
        memory = peak_memory(device)
        env = {**collect_env(device), **policy.report(), "num_threads": torch.get_num_threads(),
               "world_size": ctx.world_size, "distributed_backend": ctx.backend}
        report = build_report(cfg, run_dir, bundle, stats, trainer.timer.summary(), trainer.timer.first_ms,
                              sum(trainer.timer.steady_ms), final_eval, test_eval, env, memory, sampler_counts, t_start,
                              time.perf_counter() - t_start)
        report["perf"]["data_prep_s"] = data_s
        report["perf"].update(efficiency_fields(model, stats, sum(trainer.timer.steady_ms) / 1e3, energy, device,
                                                policy.mode))
        for hook in hooks:
            hook.finish(report)
        report["numerics"] = trainer.guard.report()
        report["perf"]["throughput_valid"] = True
        report["clip"] = clip_report(cfg)
        if tracking is not None:
            report["tracking"] = tracking.report()
        report["compile"] = compiled.report()
        if ctx.is_main:
            for line in compiled.loud_warnings():
                print(line, file=sys.stderr, flush=True)
        report["resumed_from"] = None if state is None else {"checkpoint": str(ckpt_path), "step": state["step"]}
        if interrupted:
            report["status"] = "interrupted"
            report["interrupted"] = {
                "signal": shutdown.signal_name, "step": trainer.stopped_at, "total_steps": trainer.total_steps,
                "checkpoint": str(checkpointer.last_path), "resume_command": f"make train ARGS=\"--resume {run_dir}\""}
            report["quality"]["test_unavailable_reason"] = "interrupted before the final evaluation"
        if ctx.is_main:
            atomic_write_text(run_dir / "report.json", json.dumps(report, indent=2) + "\n")
    return report


def efficiency_fields(model: EncoderClassifier, stats: TrainStats, steady_s: float, energy: dict,
                      device: torch.device, precision: str) -> dict[str, Any]:
    """perf.mfu (+ both peaks) from FLOPs counted per steady-state step shape, and energy per step/sample/token."""
    step_flops = StepFlops(model.spec)
    steady_flops = sum(step_flops(b, s) * n for (b, s), n in stats.steady_shape_counts.items())
    achieved = steady_flops / steady_s if steady_s > 0 and steady_flops else None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    out = {"flops_per_step_mean": steady_flops / max(1, sum(stats.steady_shape_counts.values())),
           **mfu_fields(achieved, device, name, precision)}
    out.update(per_unit(energy, stats.steps, stats.samples, stats.real_tokens))
    return out


def clip_report(cfg: RunConfig) -> dict[str, Any]:
    """report.json ``clip``: the method and its parameters."""
    c = cfg.clip
    params = {"global-norm": {"max_norm": c.max_norm}, "per-layer-std": {"std_k": c.std_k},
              "agc": {"agc_lambda": c.agc_lambda, "agc_eps": c.agc_eps}, "none": {}}[c.method]
    return {"method": c.method, **params}


def write_aborted_report(cfg: RunConfig, run_dir: Path, bundle: DataBundle, trainer: Trainer, abort: NumericsAbort,
                         device: torch.device, policy: PrecisionPolicy, t_start: float) -> None:
    """report.json for a run the numerics guard stopped: status ``aborted-numerics``, the diagnosis under
    ``numerics``, no evaluation, and throughput figures null (``perf.throughput_valid`` false)."""
    sampler = trainer.train_loader.batch_sampler
    env = {**collect_env(device), **policy.report(), "num_threads": torch.get_num_threads()}
    report = build_report(cfg, run_dir, bundle, trainer.stats, trainer.timer.summary(), trainer.timer.first_ms,
                          sum(trainer.timer.steady_ms), {}, {}, env, peak_memory(device),
                          {"dropped": sampler.dropped_samples, "repeated": sampler.repeated_samples}, t_start,
                          time.perf_counter() - t_start)
    report["status"] = "aborted-numerics"
    report["error"] = str(abort)
    report["numerics"] = {**abort.diagnosis, "aborted": True}
    report["clip"] = clip_report(cfg)
    perf = report["perf"]
    perf["throughput_valid"] = False
    for key in ("throughput_samples_per_s", "throughput_tokens_per_s"):
        perf[key] = None
    perf["throughput_unavailable_reason"] = "run aborted by the numerics guard: steps were skipped, not trained"
    atomic_write_text(run_dir / "report.json", json.dumps(report, indent=2) + "\n")


def summary_lines(report: dict[str, Any]) -> list[str]:
    q, p, b = report["quality"], report["perf"], report["batching"]

    def f(x: Optional[float], fmt: str) -> str:
        return "n/a" if x is None else format(x, fmt)

    return [
        f"test accuracy {f(q['test_accuracy'], '.4f')} (majority class {f(q['test_majority_class_accuracy'], '.4f')}), "
        f"test macro-F1 {f(q['test_macro_f1'], '.4f')}, eval accuracy {f(q['eval_accuracy'], '.4f')}",
        f"throughput {f(p['throughput_samples_per_s'], '.1f')} samples/s, {f(p['throughput_tokens_per_s'], '.0f')} tokens/s; "
        f"step p50 {f(p['step_time_ms']['p50'], '.1f')} ms, p99 {f(p['step_time_ms']['p99'], '.1f')} ms; "
        f"first step after {f(p['time_to_first_step_s'], '.1f')} s; peak memory {p['peak_memory_bytes'] / 2**20:.0f} MiB",
        f"token efficiency {f(b['token_efficiency'], '.3f')} with {b['distinct_shapes']} sequence lengths; "
        f"wall time {p['wall_time_s']:.0f} s",
        *_compile_line(report.get("compile")),
        f"report: {os.path.join(report['run_dir'], 'report.json')}",
    ]


def _compile_line(c: Optional[dict]) -> list[str]:
    if not c or not c.get("enabled"):
        return []
    warm = "n/a" if c["warmup_s"] is None else f"{c['warmup_s']:.0f} s"
    return [f"compile: {c['status']}; warm-up {warm}, recompiles after warm-up {c['recompiles_after_warmup']}, "
            f"cache {c['cache_state']} ({c['cache_dir']})"]
