"""One training run end to end: run directory → data → model → loop → evaluation → report.json.

Writes ``runs/<run-id>/``: ``config.yaml`` (fully resolved), ``metrics.jsonl``, ``buckets.json``
(when fitted on the fly), ``checkpoint.pt`` (state_dicts only) and ``report.json``.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from train.commands.ranks import precision_policy, prepare_data_on_ranks, reduce_stats
from train.compiling.warmup import warm_up_for_run
from train.config import RunConfig, dump_config
from train.data import DataBundle, make_loader
from train.data.attention import apply_attention, choose_packed_attention
from train.data.batching_auto import apply_batching, choose_batching
from train.distributed import DistContext, agreed, any_rank, broadcast_from_main, init_distributed, teardown
from train.errors import Interrupted, UserError, atomic_write_text
from train.evaluation import EvaluationAbandoned, evaluate
from train.models.dropout import decide_fast_dropout
from train.numerics import NumericsAbort
from train.perf.energy import EnergyMeter
from train.perf.memory import peak_memory, reset_peak
from train.precision import PrecisionPolicy
from train.report import (
    ReportInputs,
    build_report,
    clip_report,
    efficiency_fields,
    sampler_counts,
    write_aborted_report,
)
from train.report.levers import levers_section, model_section
from train.resume import (
    Checkpointer,
    apply_lr,
    check_resume_state,
    complete_run,
    full_state,
    load_resume,
    restore_rng,
    resume_changes,
    truncate_metrics,
    write_state,
)
from train.setup import (
    apply_threads_and_seed,
    build_model,
    build_run,
    check_packing,
    make_run_dir,
    probe_steps,
    unlock_run_dir,
)
from train.shutdown import ShutdownRequest
from train.tools.env import collect_env, device_name, resolve_device
from train.tracking.gradstats import GradStatsCallback
from train.tracking.loggers import NullLogger
from train.tracking.run_tracking import Tracking
from train.trainer import Trainer


def run_training(cfg: RunConfig, t_start: float, buckets_force: bool = False,
                 resume: Optional[str] = None, hooks: tuple = ()) -> dict[str, Any]:
    """Train, evaluate and write the run directory. Returns the report dict.

    ``t_start`` is ``time.perf_counter()`` at command start, for ``perf.time_to_first_step_s``.
    Under ``torchrun`` every rank calls this; DDP is set up and torn down here and only rank 0
    writes files or prints. ``resume``: a run directory (or one of its checkpoint files) to
    continue from (see train/resume.py; a complete run's report.json is returned as it is, nothing retrained). After
    SIGTERM/SIGINT (during a step or an evaluation, which is then abandoned) the report has ``"status": "interrupted"``.
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
    data = {"hit": f"cache hit ({b.get('cache_dir')})",
            "miss": f"cache miss, prepared and stored in {b.get('cache_dir')}",
            "off": f"not cached ({b.get('cache_unavailable_reason')})"}.get(b.get("cache", "off"), "not cached")
    if b.get("cache") == "miss" and b.get("cache_unavailable_reason"):
        data = f"cache miss ({b['cache_unavailable_reason']})"
    if bundle.plan is not None:
        buckets = (f"{cfg.batching.method}, {len(bundle.bounds)} buckets {bundle.bounds} ({bundle.plan_source}; "
                   f"predicted token efficiency {bundle.plan.predicted_token_efficiency:.3f})")
    else:
        buckets = f"{cfg.batching.method}: {bundle.plan_source}"
    return ["decisions:",
            f"  device     {device_name(device)}",
            f"  precision  {policy.mode} [{policy.source}] {policy.reason}",
            f"  compile    {'on' if compiled.enabled else 'off'}: {compiled.reason}",
            f"  buckets    {buckets}",
            f"  data       {data}; tokenizer {bundle.tokenizer_info['source']}"]


@dataclass
class _Run:
    """What the phases of one run hand each other (filled in as the run goes)."""

    cfg: RunConfig
    ctx: DistContext
    device: torch.device
    t_start: float
    say: Callable[..., None]
    run_dir: Path = None  # type: ignore[assignment]
    state: Optional[dict] = None
    ckpt_path: Optional[Path] = None
    policy: PrecisionPolicy = None  # type: ignore[assignment]
    bundle: DataBundle = None  # type: ignore[assignment]
    data_s: float = 0.0
    model: Any = None
    loaders: dict[str, Any] = field(default_factory=dict)
    compiled: Any = None
    tracking: Optional[Tracking] = None
    trainer: Trainer = None  # type: ignore[assignment]
    batching_auto: Optional[dict] = None
    packed_attention: Optional[dict] = None
    fast_dropout: Optional[dict] = None


class _Complete(Exception):  # --resume of a complete run: nothing to train; args[0] is its report.json
    pass


def _run_training(cfg: RunConfig, t_start: float, buckets_force: bool, resume: Optional[str], ctx: DistContext,
                  device: torch.device, hooks: tuple = ()) -> dict[str, Any]:
    """The phases: prepare → build → resume → fit → evaluate → report."""
    r = _Run(cfg, ctx, device, t_start, print if ctx.is_main else (lambda *a, **k: None))
    fresh = resume is None and not (cfg.train.run_id and (Path(cfg.train.output_dir) / cfg.train.run_id).exists())
    with ShutdownRequest(cfg.train.shutdown_timeout_s, immediate=True) as shutdown:
        try:
            phases = (("data preparation", lambda: _prepare(r, resume, buckets_force)),
                      ("model set-up", lambda: (_build(r), _resume(r, resume))),
                      ("compile warm-up", lambda: warm_up_for_run(r.compiled, r.trainer, r.model, r.run_dir)))
            for name, phase in phases:
                shutdown.phase = name  # named by a signal that arrives now (nothing to checkpoint yet)
                phase()
        except (Interrupted, UserError) as exc:
            if ctx.is_main and r.run_dir is not None:  # an in-process caller may go on: release the run
                unlock_run_dir(r.run_dir)
                if fresh:  # nothing trained: no run to keep
                    shutil.rmtree(r.run_dir, ignore_errors=True)
                    exc.args = (f"{exc.args[0]}; removed {r.run_dir}",) if isinstance(exc, Interrupted) else exc.args
            raise
        except _Complete as done:
            return {**done.args[0], "nothing_trained": True}  # its one line is said; cmd_train prints no summary
        for hook in hooks:
            hook.attach(r.trainer, r.run_dir)
        shutdown.defer()  # from here a signal checkpoints the last completed step (an evaluation is abandoned)
        checkpointer = Checkpointer(r.run_dir, r.cfg, r.trainer, r.model, r.bundle, ctx, shutdown)
        stats, energy = _fit(r, checkpointer)
        evals = None if any_rank(shutdown.requested, ctx) else _evaluate(r, stats)
        interrupted = _interruption(r, shutdown, checkpointer) if evals is None else None
        final_eval, test_eval = evals or ((stats.evals[-1] if stats.evals else {}), {})
        return _report(r, stats, energy, final_eval, test_eval, interrupted, hooks)


def _interruption(r: _Run, shutdown: ShutdownRequest, checkpointer: Checkpointer) -> dict:
    """report.json's ``interrupted``: the signal, the last completed step, its checkpoint (``checkpoint.pt`` when the
    signal came in the last step or the final evaluation), the abandoned evaluation."""
    stopped, last = r.trainer.stopped_at, checkpointer.last_path
    out = {"signal": shutdown.signal_name, "step": stopped or r.trainer.stats.steps,
           "total_steps": r.trainer.total_steps, "checkpoint": str(last if stopped else r.run_dir / "checkpoint.pt"),
           "resume_command": f"make train ARGS=\"--resume {r.run_dir}\""}
    abandoned = r.trainer.stats.abandoned_eval or (None if stopped else "final evaluation")
    return {**out, **({"evaluation_abandoned": abandoned} if abandoned else {})}


def _prepare(r: _Run, resume: Optional[str], buckets_force: bool) -> None:
    """Run directory (rank 0 draws the id), threads and seeds, the resume checkpoint, the precision policy, and the
    data (split, tokenized, bucket plan)."""
    cfg, ctx = r.cfg, r.ctx
    # rank 0 draws a unique run id; the drawn id is a decision: a new config, not an edit of the loaded one
    run_dir = agreed(lambda: make_run_dir(cfg, resume=resume is not None) if ctx.is_main else None, ctx)
    run_id = broadcast_from_main(run_dir.name if run_dir is not None else None, ctx)
    if run_id != cfg.train.run_id:
        r.cfg = cfg = cfg.with_values({"train.run_id": run_id})
    r.run_dir = Path(cfg.train.output_dir) / run_id
    apply_threads_and_seed(cfg)
    if resume is not None:  # the newest readable checkpoint (a truncated one skipped, named)
        r.ckpt_path, r.state = agreed(lambda: load_resume(resume, r.say), ctx)
    r.policy = precision_policy(cfg, r.device, ctx, r.state, r.ckpt_path)
    r.say(f"run {r.run_dir}: device {r.device}"
          + (f", {ctx.world_size} processes ({ctx.backend})" if ctx.enabled else ""),
          flush=True)
    t_data = time.perf_counter()
    r.bundle = prepare_data_on_ranks(cfg, r.run_dir, buckets_force, ctx, r.say)
    r.data_s = time.perf_counter() - t_data
    b = r.bundle
    r.say(f"data: {b.corpus.name}, {len(b.splits['train'])} train / {len(b.splits['validation'])} val / "
          f"{len(b.splits['test'])} test, {b.num_classes} classes, vocab {b.vocab_size} "
          f"(tokenizer {b.tokenizer_info['source']}, prepared data {b.cache.get('cache', 'off')}), {r.data_s:.1f}s",
          flush=True)


def _build(r: _Run) -> None:
    """Model (checked against the resume checkpoint), the ``auto`` decisions that need it, then the one set-up
    (:func:`~train.setup.build_run`: loaders, compile session, trainer) and tracking."""
    cfg, ctx, device, bundle = r.cfg, r.ctx, r.device, r.bundle
    hf_config = (r.state or {}).get("spec", {}).get("hf_config")  # resume: the checkpoint's architecture
    r.model = agreed(lambda: build_model(cfg, bundle, hf_config), ctx).to(device)
    check_packing(cfg, r.model)

    def probe():
        return probe_steps(cfg, r.model, r.policy, device)

    if cfg.batching.method == "auto":  # resolved once the model exists; config.yaml keeps the choice for --resume
        decision = broadcast_from_main(choose_batching(r.model, r.policy, cfg, bundle, device, probe)
                                       if ctx.is_main else None, ctx)
        r.cfg, r.bundle = cfg, bundle = apply_batching(cfg, bundle, decision.method)  # a new config and plan
        r.batching_auto = decision.as_report()
        r.say(f"batching: {decision.reason}", flush=True)
    r.cfg = cfg
    r.fast_dropout = _fast_dropout(r, probe)
    r.cfg = cfg = r.cfg.with_values({}).freeze()  # every decision made: the run's config is a value from here on
    if r.state is not None:  # refused here, before config.yaml is written: a refused resume leaves it as it was
        r.state, applied = agreed(lambda: (check_resume_state(r.state, r.ckpt_path, ctx, bundle, r.model.spec),
                                           resume_changes(r.state.get("config"), cfg, f"--resume {r.ckpt_path}")), ctx)
        r.say(f"resuming from {r.ckpt_path} (step {r.state['step']})"  # one notice line: the changes that apply
              + (f"; changed settings applied: {'; '.join(applied)}" if applied else ""), flush=True)
        if (done := complete_run(r.state, cfg, r.run_dir)) is not None:  # said, its files left as they are
            r.say(f"--resume {r.ckpt_path}: {done['_why']}", flush=True)
            raise _Complete({k: v for k, v in done.items() if k != "_why"})
    if ctx.is_main:  # written once, resolved, after the resume checks (--resume replays it)
        atomic_write_text(r.run_dir / "config.yaml", dump_config(cfg))
    if ctx.is_main:  # after the resume checks: a refused resume leaves the run's own tokenizer copy alone
        keep_tokenizer(bundle, r.run_dir)
    if ctx.rank:  # distinct dropout streams per rank; rank 0 keeps the single-process stream
        torch.manual_seed(cfg.train.seed + ctx.rank)

    def before_wrap(model: torch.nn.Module, compiled: Any) -> None:
        r.compiled = compiled
        if compiled.enabled and ctx.enabled:
            raise UserError("compile.enabled=true under torchrun is not supported yet: use compile.enabled=auto/false "
                            "with NPROC > 1, or compile a single-process run")
        if r.state is not None:
            model.load_state_dict(r.state["model"])  # before DDP: its construction broadcasts rank 0's weights
            if ctx.is_main:
                truncate_metrics(r.run_dir / "metrics.jsonl", r.state["step"])
        # rank 0: metrics.jsonl (+ W&B on its own thread, bounded, never blocking); other ranks log nothing
        r.tracking = Tracking(cfg, r.run_dir) if ctx.is_main else None

    def logger(model: torch.nn.Module):
        return r.tracking.attach(model, device) if r.tracking is not None else NullLogger()

    built = build_run(cfg, bundle, device, r.policy, splits=("train", "validation", "test"), model=r.model, ctx=ctx,
                      compile=True, logger=logger, before_wrap=before_wrap)
    r.loaders, r.trainer = built.loaders, built.trainer
    lines = decision_lines(device, r.policy, r.compiled, bundle, cfg)
    lines.append(f"  dropout    {'16-bit mask' if r.fast_dropout['applied'] else 'nn.Dropout'}: "
                 f"{r.fast_dropout['reason']}")
    if cfg.batching.method == "packed":  # packed rows' attention path (train/data/attention.py), once compile is known
        choice = broadcast_from_main(choose_packed_attention(r.model, r.policy, cfg, bundle, device, r.compiled.enabled,
                                                             probe) if ctx.is_main else None, ctx)
        apply_attention(r.model, choice, device)
        r.packed_attention = choice.as_report()
        lines.append(f"  attention  {choice.path}: {choice.reason}")
    for line in lines:
        r.say(line, flush=True)
    if r.tracking is not None and r.tracking.grad_stats is not None:
        r.trainer.add_callback(GradStatsCallback(r.tracking.grad_stats, r.trainer))
    model_name = cfg.model.preset if cfg.model.source == "builtin" else cfg.model.source
    r.say(f"model: {model_name}, {sum(p.numel() for p in r.model.parameters()) / 1e6:.2f}M parameters; "
          f"{r.trainer.total_steps} steps ({len(r.loaders['train'])} batches per epoch per rank)", flush=True)


def _fast_dropout(r: _Run, probe) -> dict:
    """``model.fast_dropout`` (train/models/dropout.py), decided by rank 0 on one real training batch (a loader of
    its own: the run's loader is not built yet) and followed by every rank; ``auto`` becomes ``true``/``false`` in
    the run's config (config.yaml), so a resume replays the choice instead of measuring again."""
    def batch() -> dict:
        return next(iter(make_loader(r.bundle, "train", r.cfg, train=True, device=r.device)))

    def decide() -> dict:
        return decide_fast_dropout(r.model, r.cfg.model.fast_dropout, r.policy.mode, r.cfg.data.cache_dir, batch,
                                   r.device, probe)

    report = broadcast_from_main(decide() if r.ctx.is_main else None, r.ctx)
    r.cfg = r.cfg.with_values({"model.fast_dropout": "true" if report["applied"] else "false"})
    return report


def _resume(r: _Run, resume: Optional[str]) -> None:
    """Optimizer, scheduler, sampler position and counters from the checkpoint, then its RNG states (last)."""
    if r.state is None:
        return
    r.trainer.load_state_dict(r.state, r.state["ranks"][r.ctx.rank])
    if r.cfg.train.resume_apply == "optim.lr":
        apply_lr(r.trainer, r.cfg.optim.lr)
    step, total = r.trainer.start_step, r.trainer.total_steps
    if step > total:
        raise UserError(f"--resume {resume}: the checkpoint is at step {step} of {total}; nothing left to train "
                        "(raise train.max_steps to train longer)")
    if step == total:  # trained to the end, but its final evaluation was interrupted: run that
        r.say(f"resume: training finished at step {step} of {total}; running the final evaluation", flush=True)
    restore_rng(r.state, r.ctx)  # last: nothing may draw from the RNGs between here and the next step


def _fit(r: _Run, checkpointer: Checkpointer) -> tuple[Any, dict]:
    """The loop (checkpoints and clean stop through ``checkpointer``), then the final checkpoint; returns the job's
    stats (summed over ranks) and the energy of the loop. A numerics abort writes its report and re-raises."""
    reset_peak(r.device)
    energy_meter = EnergyMeter(r.device)
    r.trainer.add_callback(checkpointer)
    energy_meter.start()
    try:
        stats = r.trainer.fit()
    except NumericsAbort as abort:
        energy_meter.stop()
        if r.ctx.is_main:
            write_aborted_report(r.cfg, r.run_dir, r.bundle, r.trainer, abort, r.device, r.policy, r.t_start)
        raise
    finally:
        if r.tracking is not None:
            r.tracking.close()
    energy = energy_meter.stop()  # the training loop, periodic evaluations included
    if r.trainer.stopped_at is None:  # the final state, resumable and loadable (weights_only)
        write_state(r.run_dir / "checkpoint.pt", full_state(r.trainer, r.model, r.bundle, r.cfg, r.ctx), r.ctx)
    reduce_stats(stats, r.ctx)
    return stats, energy


def _evaluate(r: _Run, stats) -> Optional[tuple[dict, dict]]:
    """(validation, test) results: the validation at the last step (or a new one) and the test split; None when a
    signal abandoned them (said in one line; the final state is already in checkpoint.pt)."""
    n = r.bundle.num_classes

    def run(split: str) -> dict:
        return evaluate(r.model, r.loaders[split], r.policy, n, r.device, r.ctx, phase="final evaluation")

    try:
        last = stats.evals[-1] if stats.evals and stats.evals[-1]["step"] == r.trainer.total_steps else None
        return last or run("validation"), run("test")
    except EvaluationAbandoned as exc:
        r.say(f"{exc}; the trained state is in {r.run_dir / 'checkpoint.pt'}", flush=True)
        return None


def _report(r: _Run, stats, energy: dict, final_eval: dict, test_eval: dict, interrupted: Optional[dict],
            hooks: tuple) -> dict[str, Any]:
    """Build report.json from one ReportInputs, let the hooks add their sections, write it (rank 0)."""
    cfg, device, trainer = r.cfg, r.device, r.trainer
    env = {**collect_env(device), **r.policy.report(), "num_threads": torch.get_num_threads(),
           "world_size": r.ctx.world_size, "distributed_backend": r.ctx.backend}
    sections = {"numerics": trainer.guard.report(), "clip": clip_report(cfg)}
    if r.tracking is not None:
        sections["tracking"] = r.tracking.report()
    sections["compile"] = r.compiled.report()
    sections["resumed_from"] = None if r.state is None else {"checkpoint": str(r.ckpt_path), "step": r.state["step"]}
    sections["model"] = model_section(cfg, r.model)
    from train.commands.bench.training import skip_reasons  # here: the bench package's imports cost start-up

    sections["levers"] = levers_section(cfg, r.model, r.policy, r.compiled, r.ctx, profiled=bool(hooks),
                                        bench_rows=skip_reasons(cfg))
    sections["levers"]["fast_dropout"] = r.fast_dropout
    efficiency = efficiency_fields(r.model, stats, sum(trainer.timer.steady_ms) / 1e3, energy, device, r.policy.mode)
    report = build_report(ReportInputs(
        cfg, r.run_dir, r.bundle, stats, trainer.timer, final_eval, test_eval, env, peak_memory(device),
        sampler_counts(r.loaders["train"], trainer.epoch + 1), r.t_start, time.perf_counter() - r.t_start,
        data_prep_s=r.data_s,
        efficiency={**efficiency, "throughput_valid": True}, sections=sections, interrupted=interrupted,
        batching_auto=r.batching_auto, packed_attention=r.packed_attention))
    for hook in hooks:
        hook.finish(report)
    if r.ctx.is_main:
        for line in r.compiled.loud_warnings():
            print(line, file=sys.stderr, flush=True)
        atomic_write_text(r.run_dir / "report.json", json.dumps(report, indent=2) + "\n")
    return report


