"""One training run, top to bottom: run directory → data → resolve → build → warm-up → fit → evaluate → report.

Writes ``runs/<run-id>/``: ``config.yaml`` (the resolved config, written once), ``metrics.jsonl``, ``buckets.json``
(when fitted on the fly), ``checkpoint.pt`` (state_dicts only) and ``report.json``."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from train.bench.rows import skip_reasons
from train.callbacks import AfterFirstStep
from train.checkpoint import optimizer_state_for
from train.compiling.warmup import warm_up_for_run
from train.config import RunConfig
from train.errors import Interrupted, UserError, atomic_write_text
from train.evaluation import EvaluationAbandoned, evaluate
from train.models.adapter import load_model_state
from train.numerics import NumericsAbort
from train.parallel.fsdp import check_fsdp, is_sharded
from train.parallel.process_group import DistContext, agreed, any_rank, broadcast_from_main, init_distributed, teardown
from train.parallel.sharded_checkpoint import load_sharded, load_whole
from train.perf.energy import EnergyMeter
from train.perf.memory import peak_memory, reset_peak
from train.report import (
    ReportInputs,
    build_report,
    clip_report,
    efficiency_fields,
    sampler_counts,
    write_aborted_report,
)
from train.report.levers import levers_section, model_section
from train.resolve import Checkpoint, Resolved, decision_lines, resolve_run
from train.resume import (
    Checkpointer,
    check_resume_state,
    complete_run,
    full_state,
    load_resume,
    restore_rng,
    truncate_metrics,
    write_state,
)
from train.run.files import export_at_end, say_data, write_run_files
from train.run.ranks import prepare_data_on_ranks, reduce_stats
from train.run.resume_settings import follow_schedule, resume_changes
from train.setup import BuiltRun, apply_threads_and_seed, build_run
from train.shutdown import ShutdownRequest
from train.tools.env import collect_env, device_name, resolve_device
from train.tools.run_dir import make_run_dir, unlock_run_dir
from train.tracking.gradstats import GradStatsCallback
from train.tracking.loggers import NullLogger
from train.tracking.run_tracking import Tracking


def run_training(cfg: RunConfig, t_start: float, buckets_force: bool = False, resume: Optional[str] = None,
                 hooks: tuple = (), continue_flag: Optional[str] = None) -> dict[str, Any]:
    """Train, evaluate and write the run directory. Returns the report dict.

    ``t_start`` is ``time.perf_counter()`` at command start, for ``perf.time_to_first_step_s``.
    Under ``torchrun`` every rank calls this; DDP is set up and torn down here and only rank 0
    writes files or prints. ``resume``: a run directory (or one of its checkpoint files) to
    continue from (see train/resume.py; a complete run's report.json is returned as it is, nothing retrained). After
    SIGTERM/SIGINT (during a step or an evaluation, which is then abandoned) the report has ``"status": "interrupted"``.
    ``hooks``: objects with ``attach(trainer, run_dir)`` (called before the loop) and
    ``finish(report)`` (called before report.json is written; may add keys), e.g. a profile session.
    ``continue_flag``: how the calling command continues a run (``--resume`` for ``python -m train train``), for the
    refusal of a ``train.run_id`` that exists (:func:`~train.tools.run_dir.make_run_dir`); None: a command that cannot.

    Raises:
        UserError: any bad input (config, data, buckets, run directory, checkpoint; ``dist.strategy=fsdp`` where it
            cannot run), on every rank.
    """
    check_fsdp(cfg)  # before any rank joins the group: every rank refuses alike
    ctx, device = init_distributed(resolve_device(cfg.train.device), host_collectives=cfg.dist.offload)
    try:
        return _train(cfg, t_start, buckets_force, resume, ctx, device, hooks, continue_flag)
    finally:
        teardown(ctx)


@dataclass(frozen=True)
class Run:
    """One run once built: what the fit, the evaluation and the report read. Nothing in it is reassigned."""

    ctx: DistContext
    device: torch.device
    run_dir: Path
    t_start: float
    data_s: float
    say: Callable[..., None]
    checkpoint: Optional[Checkpoint]
    resolved: Resolved
    built: BuiltRun
    tracking: Optional[Tracking]

    @property
    def cfg(self) -> RunConfig:
        return self.resolved.cfg


def _silent(*_args: Any, **_kwargs: Any) -> None:
    """``say`` on ranks other than 0."""


def _train(cfg: RunConfig, t_start: float, buckets_force: bool, resume: Optional[str], ctx: DistContext,
           device: torch.device, hooks: tuple, continue_flag: Optional[str] = None) -> dict[str, Any]:
    """The phases, in order; a signal or bad input before the first step removes a run directory it created."""
    say = print if ctx.is_main else _silent
    fresh = resume is None and not (cfg.train.run_id and (Path(cfg.train.output_dir) / cfg.train.run_id).exists())
    run_dir: Optional[Path] = None
    with ShutdownRequest(cfg.train.shutdown_timeout_s, immediate=True) as shutdown:
        try:
            shutdown.phase = "data preparation"  # named by a signal that arrives now (nothing to checkpoint yet)
            run_dir = _open_run_dir(cfg, resume, ctx, continue_flag)
            apply_threads_and_seed(cfg, notice=say)
            checkpoint = _load_checkpoint(resume, ctx, say)
            say(f"run {run_dir}: device {device}"
                + (f", {ctx.world_size} processes ({ctx.backend})" if ctx.enabled else ""), flush=True)
            t_data = time.perf_counter()
            bundle = prepare_data_on_ranks(cfg, run_dir, buckets_force, ctx, say)
            data_s = time.perf_counter() - t_data
            say_data(bundle, data_s, say)
            shutdown.phase = "model set-up"
            resolved = resolve_run(cfg, run_dir.name, bundle, device, ctx, checkpoint, say)
            checkpoint = _check_resume(resolved, checkpoint, run_dir, ctx, say)
            if checkpoint is not None and (done := complete_run(checkpoint.state, resolved.cfg, run_dir)) is not None:
                say(f"--resume {checkpoint.path}: {done['_why']}", flush=True)  # its files are left as they are
                return {**{k: v for k, v in done.items() if k != "_why"}, "nothing_trained": True}
            run = _build(resolved, checkpoint, run_dir, ctx, device, t_start, data_s, say)
            if checkpoint is None:
                write_run_files(resolved, run_dir, ctx)
            else:  # a resume that crashes before it trains leaves the run's files as they were
                run.built.trainer.add_callback(AfterFirstStep(lambda: write_run_files(resolved, run_dir, ctx)))
            shutdown.phase = "compile warm-up"
            warm_up_for_run(run.built.compiled, run.built.trainer, run.built.model, run_dir)
        except BaseException as exc:  # bad input, a signal or a crash before the first step
            if ctx.is_main and run_dir is not None:  # an in-process caller may go on: release the run
                unlock_run_dir(run_dir)
                if fresh:  # nothing trained: no run to keep
                    shutil.rmtree(run_dir, ignore_errors=True)
                    exc.args = (f"{exc.args[0]}; removed {run_dir}",) if isinstance(exc, Interrupted) else exc.args
            raise
        for hook in hooks:
            hook.attach(run.built.trainer, run_dir)
        shutdown.defer()  # from here a signal checkpoints the last completed step (an evaluation is abandoned)
        checkpointer = Checkpointer(run_dir, run.cfg, run.built.trainer, run.built.model, run.resolved.bundle, ctx,
                                    shutdown)
        stats, energy = _fit(run, checkpointer)
        evals = None if any_rank(shutdown.requested, ctx) else _evaluate(run, stats)
        interrupted = _interruption(run, shutdown, checkpointer) if evals is None else None
        final_eval, test_eval = evals or ((stats.evals[-1] if stats.evals else {}), {})
        return _report(run, stats, energy, final_eval, test_eval, interrupted, hooks)


def _open_run_dir(cfg: RunConfig, resume: Optional[str], ctx: DistContext, continue_flag: Optional[str]) -> Path:
    """``runs/<run-id>``: rank 0 creates it (drawing a unique id when none is set); every rank gets its path."""
    run_dir = agreed(lambda: make_run_dir(cfg, resume=resume is not None, continue_flag=continue_flag)
                     if ctx.is_main else None, ctx)
    run_id = broadcast_from_main(run_dir.name if run_dir is not None else None, ctx)
    return Path(cfg.train.output_dir) / run_id


def _load_checkpoint(resume: Optional[str], ctx: DistContext, say: Callable[..., None]) -> Optional[Checkpoint]:
    """The newest readable checkpoint of ``--resume`` (a truncated one skipped, named), or None for a fresh run."""
    if resume is None:
        return None
    path, state = agreed(lambda: load_resume(resume, say), ctx)
    return Checkpoint(path, state)


def _check_resume(resolved: Resolved, checkpoint: Optional[Checkpoint], run_dir: Path, ctx: DistContext,
                  say: Callable[..., None]) -> Optional[Checkpoint]:
    """The checkpoint checked against the resolved run (data, tokenizer, model; baked-in settings refused), before
    ``config.yaml`` is written: a refused resume leaves the run's files as they were. Says the changes that apply."""
    if checkpoint is None:
        return None
    # the settings first: a baked-in one that differs is named as the key the user set (model.source 'hf:bert' →
    # 'builtin'), not as what it changed in the model's spec
    applied, state = agreed(lambda: (
        resume_changes(checkpoint.state.get("config"), resolved.cfg, f"--resume {checkpoint.path}"),
        check_resume_state(checkpoint.state, checkpoint.path, ctx, resolved.bundle, resolved.model.spec,
                           resolved.cfg.data.tokenizer_path)), ctx)
    say(f"resuming from {checkpoint.path} (step {state['step']})"
        + (f"; changed settings applied: {'; '.join(applied)}" if applied else ""), flush=True)
    if "sharded" in state and not (resolved.cfg.dist.strategy == "fsdp" and ctx.enabled):
        state = agreed(lambda: load_whole(checkpoint.path), ctx)  # this run holds whole tensors: read every shard
    return Checkpoint(checkpoint.path, state)


def _build(resolved: Resolved, checkpoint: Optional[Checkpoint], run_dir: Path, ctx: DistContext,
           device: torch.device, t_start: float, data_s: float, say: Callable[..., None]) -> Run:
    """The one set-up (:func:`~train.setup.build_run`: loaders, compile session, trainer) from the resolved run,
    tracking on rank 0, the checkpoint's weights (before DDP broadcasts rank 0's) and its trainer state, the decisions
    block."""
    cfg = resolved.cfg
    if resolved.compile_enabled and ctx.enabled and cfg.dist.strategy == "ddp":
        raise UserError("compile.enabled=true under torchrun with dist.strategy=ddp is not supported yet: use dist."
                        "strategy=fsdp (compiles each block), compile.enabled=auto/false, or a single process")
    if ctx.rank:  # distinct dropout streams per rank; rank 0 keeps the single-process stream
        torch.manual_seed(cfg.train.seed + ctx.rank)
    if ctx.is_main and checkpoint is not None:  # records logged after the checkpoint, before the interruption
        truncate_metrics(run_dir / "metrics.jsonl", checkpoint.state["step"])
    # rank 0: metrics.jsonl (+ W&B on its own thread, bounded, never blocking); other ranks log nothing
    tracking = Tracking(cfg, run_dir) if ctx.is_main else None

    def load_weights(model: torch.nn.Module, _compiled: Any) -> None:
        if checkpoint is not None and "sharded" not in checkpoint.state:  # shards load after sharding
            load_model_state(model, checkpoint.state["model"], f"checkpoint {checkpoint.path}")

    built = build_run(cfg, resolved.bundle, device, resolved.policy, splits=("train", "validation", "test"),
                      model=resolved.model, ctx=ctx, compile=True, before_wrap=load_weights,
                      logger=lambda m: tracking.attach(m, device) if tracking is not None else NullLogger())
    for line in decision_lines(resolved, device_name(device)):
        say(line, flush=True)
    if tracking is not None and tracking.grad_stats is not None:
        if is_sharded(built.model):  # rank 0 alone cannot read whole gradients: each rank holds shards
            say("notice: tracking.grad_stats_every: no per-layer gradient records under dist.strategy=fsdp", flush=True)
        else:
            built.trainer.add_callback(GradStatsCallback(tracking.grad_stats, built.trainer))
    model_name = cfg.model.preset if cfg.model.source == "builtin" else cfg.model.source
    say(f"model: {model_name}, {sum(p.numel() for p in built.model.parameters()) / 1e6:.2f}M parameters; "
        f"{built.trainer.total_steps} steps ({len(built.loaders['train'])} "
        f"batch{'es' if len(built.loaders['train']) != 1 else ''} per epoch per rank"
        f"{f', {cfg.train.grad_accum} per step (train.grad_accum)' if cfg.train.grad_accum > 1 else ''})", flush=True)
    if checkpoint is not None:
        _restore_trainer(built, checkpoint, ctx, say)
    return Run(ctx, device, run_dir, t_start, data_s, say, checkpoint, resolved, built, tracking)


def _restore_trainer(built: BuiltRun, checkpoint: Checkpoint, ctx: DistContext, say: Callable[..., None]) -> None:
    """Optimizer, scheduler, sampler position and counters from the checkpoint, then its RNG states (last)."""
    state, trainer = checkpoint.state, built.trainer
    if "sharded" in state:  # the model's and AdamW's shards, resharded when another number of ranks wrote them
        load_sharded(checkpoint.path, built.model, trainer.optimizer, ctx)
        optimizer_state, note = None, None
    else:
        optimizer_state, note = optimizer_state_for(trainer.optimizer, state["optimizer"])  # this run's kernels apply
    trainer.load_state_dict({**state, "optimizer": optimizer_state}, state["ranks"][ctx.rank])
    written_by = state.get("torch")
    if written_by and written_by != str(torch.__version__):
        note = f"written by torch {written_by}, resumed on torch {torch.__version__}" + (f"; {note}" if note else
                                                                                     ": the kernels may differ")
    if note:
        say(f"notice: --resume {checkpoint.path}: {note}", flush=True)
    follow_schedule(trainer, state.get("total_steps"), built.cfg.optim.lr if built.cfg.train.resume_apply else None)
    step, total = trainer.start_step, trainer.total_steps
    if step > total:
        raise UserError(f"--resume {checkpoint.path}: the checkpoint is at step {step} of {total}; nothing left to "
                        "train (raise train.max_steps to train longer)")
    if step == total:  # trained to the end, but its final evaluation was interrupted: run that
        say(f"resume: training finished at step {step} of {total}; running the final evaluation", flush=True)
    restore_rng(state, ctx)  # last: nothing may draw from the RNGs between here and the next step


def _interruption(run: Run, shutdown: ShutdownRequest, checkpointer: Checkpointer) -> dict:
    """report.json's ``interrupted``: the signal, the last completed step, its checkpoint (``checkpoint.pt`` when the
    signal came in the last step or the final evaluation), the abandoned evaluation."""
    trainer = run.built.trainer
    stopped, last = trainer.stopped_at, checkpointer.last_path
    world, local = run.ctx.world_size, int(os.environ.get("LOCAL_WORLD_SIZE") or run.ctx.world_size)  # per node
    nproc = "" if world == 1 else f"NPROC={local} " + (f"NNODES={world // local} " if world > local else "")
    out = {"signal": shutdown.signal_name, "step": stopped or trainer.stats.steps,
           "total_steps": trainer.total_steps, "checkpoint": str(last if stopped else run.run_dir / "checkpoint.pt"),
           "resume_command": f"make train {nproc}ARGS=\"--resume {run.run_dir}\""}
    abandoned = trainer.stats.abandoned_eval or (None if stopped else "final evaluation")
    return {**out, **({"evaluation_abandoned": abandoned} if abandoned else {})}


def _fit(run: Run, checkpointer: Checkpointer) -> tuple[Any, dict]:
    """The loop (checkpoints and clean stop through ``checkpointer``), then the final checkpoint; returns the job's
    stats (summed over ranks) and the energy of the loop. A numerics abort writes its report and re-raises."""
    trainer, model = run.built.trainer, run.built.model
    reset_peak(run.device)
    energy_meter = EnergyMeter(run.device)
    trainer.add_callback(checkpointer)
    energy_meter.start()
    try:
        stats = trainer.fit()
    except NumericsAbort as abort:
        energy_meter.stop()
        if run.ctx.is_main:
            write_aborted_report(run.cfg, run.run_dir, run.resolved.bundle, trainer, abort, run.device,
                                 run.resolved.policy, run.t_start)
        raise
    finally:
        if run.tracking is not None:
            run.tracking.close()
    energy = energy_meter.stop()  # the training loop, periodic evaluations included
    if trainer.stopped_at is None:  # the final state, resumable and loadable (weights_only)
        write_state(run.run_dir / "checkpoint.pt", full_state(trainer, model, run.resolved.bundle, run.cfg, run.ctx),
                    run.ctx)
    reduce_stats(stats, run.ctx)
    return stats, energy


def _evaluate(run: Run, stats) -> Optional[tuple[dict, dict]]:
    """(validation, test) results: the validation at the last step (or a new one) and the test split; None when a
    signal abandoned them (said in one line; the final state is already in checkpoint.pt)."""
    built = run.built

    def on(split: str) -> dict:
        return evaluate(built.model, built.loaders[split], built.policy, built.bundle.num_classes, run.device, run.ctx,
                        phase="final evaluation", task=built.trainer.task)

    try:
        last = stats.evals[-1] if stats.evals and stats.evals[-1]["step"] == built.trainer.total_steps else None
        return last or on("validation"), on("test")
    except EvaluationAbandoned as exc:
        run.say(f"{exc}; the trained state is in {run.run_dir / 'checkpoint.pt'}", flush=True)
        return None


def _report(run: Run, stats, energy: dict, final_eval: dict, test_eval: dict, interrupted: Optional[dict],
            hooks: tuple) -> dict[str, Any]:
    """Build report.json from one ReportInputs, let the hooks add their sections, write it (rank 0)."""
    cfg, device, built, resolved = run.cfg, run.device, run.built, run.resolved
    trainer, compiled = built.trainer, built.compiled
    env = {**collect_env(device), **resolved.policy.report(), "num_threads": torch.get_num_threads(),
           "world_size": run.ctx.world_size, "distributed_backend": run.ctx.backend,
           "distributed_strategy": cfg.dist.strategy if run.ctx.enabled else None}
    sections = {"numerics": trainer.guard.report(), "clip": clip_report(cfg), "probes": resolved.probes}
    if run.tracking is not None:
        sections["tracking"] = run.tracking.report()
    sections["compile"] = compiled.report()
    sections["resumed_from"] = (None if run.checkpoint is None
                                else {"checkpoint": str(run.checkpoint.path), "step": run.checkpoint.state["step"]})
    sections["dist"] = {"strategy": cfg.dist.strategy if run.ctx.enabled else None,
                        "offload": cfg.dist.offload and run.ctx.enabled, "auto": resolved.strategy}
    sections["model"] = model_section(cfg, built.model, trainer.optimizer, peak_memory(device),
                                      trainer.activation_bytes)
    sections["levers"] = levers_section(cfg, built.model, resolved.policy, compiled, run.ctx, profiled=bool(hooks),
                                        bench_rows=skip_reasons(cfg))
    sections["levers"]["fast_dropout"] = resolved.fast_dropout
    sections["levers"]["chunked_loss"] = resolved.chunked_loss
    efficiency = efficiency_fields(built.model, stats, sum(trainer.timer.steady_ms) / 1e3, energy, device,
                                   resolved.policy.mode)
    report = build_report(ReportInputs(
        cfg, run.run_dir, resolved.bundle, stats, trainer.timer, final_eval, test_eval, env, peak_memory(device),
        sampler_counts(built.loaders["train"], trainer.epoch + 1), run.t_start, time.perf_counter() - run.t_start,
        data_prep_s=run.data_s, efficiency={**efficiency, "throughput_valid": True}, sections=sections,
        interrupted=interrupted, batching_auto=resolved.batching_auto, packed_attention=resolved.packed_attention))
    for hook in hooks:
        hook.finish(report)
    if run.ctx.is_main:
        for line in compiled.loud_warnings():
            print(line, file=sys.stderr, flush=True)
        report["export"] = export_at_end(built.model, run.run_dir, resolved.bundle, run.say, report)
        atomic_write_text(run.run_dir / "report.json", json.dumps(report, indent=2) + "\n")
    return report
