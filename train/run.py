"""One training run end to end: run directory → data → model → loop → evaluation → report.json.

Writes ``runs/<run-id>/``: ``config.yaml`` (fully resolved), ``metrics.jsonl``, ``buckets.json``
(when fitted on the fly), ``checkpoint.pt`` (state_dicts only) and ``report.json``.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from train.compiling.warmup import start_compile, warm_up_for_run
from train.config import RunConfig, dump_config
from train.data import DataBundle, make_loader, prepare_data
from train.data.attention import apply_attention, choose_packed_attention
from train.data.batching_auto import apply_batching, choose_batching
from train.distributed import DistContext, agreed, all_reduce_sum, broadcast_from_main, init_distributed, teardown, wrap_model
from train.errors import Interrupted, UserError, atomic_write_text
from train.models.levers import levers_section, model_section
from train.numerics import NumericsAbort
from train.perf.energy import EnergyMeter
from train.perf.memory import peak_memory, reset_peak
from train.precision import Decision, PrecisionPolicy
from train.report import ReportInputs, build_report, clip_report, efficiency_fields, sampler_counts, write_aborted_report
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
from train.setup import apply_threads_and_seed, build_model, make_run_dir
from train.shutdown import ShutdownRequest
from train.tools.env import collect_env, device_name, resolve_device
from train.tracking.gradstats import GradStatsCallback
from train.tracking.loggers import NullLogger
from train.tracking.setup import Tracking
from train.trainer import Trainer, TrainStats, evaluate


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
            if fresh and ctx.is_main and r.run_dir is not None:  # nothing trained: no run to keep
                shutil.rmtree(r.run_dir, ignore_errors=True)
                if isinstance(exc, Interrupted):
                    exc.args = (f"{exc.args[0]}; removed {r.run_dir}",)
            raise
        for hook in hooks:
            hook.attach(r.trainer, r.run_dir)
        shutdown.defer()
        checkpointer = Checkpointer(r.run_dir, cfg, r.trainer, r.model, r.bundle, ctx, shutdown)
        stats, energy = _fit(r, checkpointer)
        interrupted = None
        if r.trainer.stopped_at is not None:
            interrupted = {"signal": shutdown.signal_name, "step": r.trainer.stopped_at,
                           "total_steps": r.trainer.total_steps, "checkpoint": str(checkpointer.last_path),
                           "resume_command": f"make train ARGS=\"--resume {r.run_dir}\""}
        final_eval, test_eval = _evaluate(r, stats, interrupted is not None)
        return _report(r, stats, energy, final_eval, test_eval, interrupted, hooks)


def _prepare(r: _Run, resume: Optional[str], buckets_force: bool) -> None:
    """Run directory (rank 0 draws the id), config.yaml, threads and seeds, the resume checkpoint, the precision
    policy, and the data (split, tokenized, bucket plan)."""
    cfg, ctx = r.cfg, r.ctx
    run_dir = agreed(lambda: make_run_dir(cfg, resume=resume is not None) if ctx.is_main else None, ctx)  # rank 0 draws a unique run id
    cfg.train.run_id = broadcast_from_main(cfg.train.run_id, ctx)
    r.run_dir = run_dir or Path(cfg.train.output_dir) / cfg.train.run_id
    if ctx.is_main:
        atomic_write_text(r.run_dir / "config.yaml", dump_config(cfg))
    apply_threads_and_seed(cfg)
    if resume is not None:
        _, r.ckpt_path = find_resume_checkpoint(resume)
        r.state = agreed(lambda: read_resume_state(r.ckpt_path), ctx)
    r.policy = _precision_policy(cfg, r.device, ctx, r.state, r.ckpt_path)
    r.say(f"run {r.run_dir}: device {r.device}" + (f", {ctx.world_size} processes ({ctx.backend})" if ctx.enabled else ""),
          flush=True)
    t_data = time.perf_counter()
    r.bundle = _prepare_data(cfg, r.run_dir, buckets_force, ctx, r.say)
    r.data_s = time.perf_counter() - t_data
    b = r.bundle
    r.say(f"data: {b.corpus.name}, {len(b.splits['train'])} train / {len(b.splits['validation'])} val / "
          f"{len(b.splits['test'])} test, {b.num_classes} classes, vocab {b.vocab_size} "
          f"(tokenizer {b.tokenizer_info['source']}, prepared data {b.cache.get('cache', 'off')}), {r.data_s:.1f}s",
          flush=True)


def _build(r: _Run) -> None:
    """Model (checked against the resume checkpoint), loaders, compile session, tracking and the trainer."""
    cfg, ctx, device, bundle = r.cfg, r.ctx, r.device, r.bundle
    hf_config = (r.state or {}).get("spec", {}).get("hf_config")  # resume: the checkpoint's architecture
    r.model = agreed(lambda: build_model(cfg, bundle, hf_config), ctx).to(device)
    if cfg.batching.method == "packed" and not getattr(r.model, "supports_packing", False):
        raise UserError(f"batching.method=packed: the model model.source={cfg.model.source} "
                        f"({type(getattr(r.model, 'inner', r.model)).__name__}) cannot take per-sample "
                        "positions and a block-diagonal mask (forward(..., position_ids=, seq_index=, num_seqs=)); use "
                        "batching.method=optimal")
    if cfg.batching.method == "auto":  # resolved once the model exists; config.yaml keeps the choice for --resume
        decision = broadcast_from_main(choose_batching(r.model, r.policy, cfg, bundle, device) if ctx.is_main else None, ctx)
        r.bundle = bundle = apply_batching(cfg, bundle, decision.method)
        r.batching_auto = decision.as_report()
        r.say(f"batching: {decision.reason}", flush=True)
        if ctx.is_main:
            atomic_write_text(r.run_dir / "config.yaml", dump_config(cfg))
    if r.state is not None:
        r.state = agreed(lambda: check_resume_state(r.state, r.ckpt_path, ctx, bundle, r.model.spec), ctx)
        r.say(f"resuming from {r.ckpt_path} (step {r.state['step']})", flush=True)
    if ctx.is_main:  # after the resume checks: a refused resume leaves the run's own tokenizer copy alone
        keep_tokenizer(bundle, r.run_dir)
    if ctx.rank:  # distinct dropout streams per rank; rank 0 keeps the single-process stream
        torch.manual_seed(cfg.train.seed + ctx.rank)
    r.loaders = {split: make_loader(bundle, split, cfg, train=split == "train", device=device, world_size=ctx.world_size,
                                    rank=ctx.rank) for split in ("train", "validation", "test")}
    r.compiled = start_compile(cfg, device, r.model, bundle.pad_to, r.loaders["train"],
                               [r.loaders["validation"], r.loaders["test"]])
    if r.compiled.enabled and ctx.enabled:
        raise UserError("compile.enabled=true under torchrun is not supported yet: use compile.enabled=auto/false "
                        "with NPROC > 1, or compile a single-process run")
    lines = decision_lines(device, r.policy, r.compiled, bundle, cfg)
    if cfg.batching.method == "packed":  # packed rows' attention path (train/data/attention.py), once compile is known
        choice = broadcast_from_main(choose_packed_attention(r.model, r.policy, cfg, bundle, device, r.compiled.enabled)
                                     if ctx.is_main else None, ctx)
        apply_attention(r.model, choice, device)
        r.packed_attention = choice.as_report()
        lines.append(f"  attention  {choice.path}: {choice.reason}")
    for line in lines:
        r.say(line, flush=True)
    if r.state is not None:
        r.model.load_state_dict(r.state["model"])  # before DDP: its construction broadcasts rank 0's weights
        if ctx.is_main:
            truncate_metrics(r.run_dir / "metrics.jsonl", r.state["step"])
    # rank 0: metrics.jsonl (+ W&B on its own thread, bounded, never blocking); other ranks log nothing
    r.tracking = Tracking(cfg, r.run_dir) if ctx.is_main else None
    logger = r.tracking.attach(r.model, device) if r.tracking is not None else NullLogger()
    has_val = len(bundle.splits["validation"]) > 0  # none: no periodic evaluation; the report says why
    r.trainer = Trainer(cfg=cfg, model=r.model, policy=r.policy, device=device, train_loader=r.loaders["train"],
                        eval_loader=r.loaders["validation"] if has_val else None, logger=logger, num_classes=bundle.num_classes, dist_ctx=ctx,
                        train_model=r.compiled.forward if r.compiled.enabled else wrap_model(r.model, ctx, device))
    if r.tracking is not None and r.tracking.grad_stats is not None:
        r.trainer.add_callback(GradStatsCallback(r.tracking.grad_stats, r.trainer))
    r.say(f"model: {cfg.model.preset if cfg.model.source == 'builtin' else cfg.model.source}, {sum(p.numel() for p in r.model.parameters()) / 1e6:.2f}M parameters; "
          f"{r.trainer.total_steps} steps ({len(r.loaders['train'])} batches per epoch per rank)", flush=True)


def _resume(r: _Run, resume: Optional[str]) -> None:
    """Optimizer, scheduler, sampler position and counters from the checkpoint, then its RNG states (last)."""
    if r.state is None:
        return
    r.trainer.load_state_dict(r.state, r.state["ranks"][r.ctx.rank])
    if r.trainer.start_step >= r.trainer.total_steps:
        raise UserError(f"--resume {resume}: the checkpoint is at step {r.trainer.start_step} of {r.trainer.total_steps}; "
                        "nothing left to train (raise train.max_steps to train longer)")
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
    _reduce_stats(stats, r.ctx)
    return stats, energy


def _evaluate(r: _Run, stats, interrupted: bool) -> tuple[dict, dict]:
    """(validation, test) results: the last periodic validation (or a new one) and the test split; after an
    interruption only what was already measured (a bounded shutdown evaluates nothing more)."""
    if interrupted:
        return (stats.evals[-1] if stats.evals else {}), {}
    n = r.bundle.num_classes
    final = stats.evals[-1] if stats.evals else evaluate(r.model, r.loaders["validation"], r.policy, n, r.device, r.ctx)
    return final, evaluate(r.model, r.loaders["test"], r.policy, n, r.device, r.ctx)


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
    sections["levers"] = levers_section(cfg, r.model, r.policy, r.compiled, r.ctx, profiled=bool(hooks))
    efficiency = efficiency_fields(r.model, stats, sum(trainer.timer.steady_ms) / 1e3, energy, device, r.policy.mode)
    report = build_report(ReportInputs(
        cfg, r.run_dir, r.bundle, stats, trainer.timer, final_eval, test_eval, env, peak_memory(device),
        sampler_counts(r.loaders["train"]), r.t_start, time.perf_counter() - r.t_start, data_prep_s=r.data_s,
        efficiency={**efficiency, "throughput_valid": True}, sections=sections, interrupted=interrupted,
        batching_auto=r.batching_auto, packed_attention=r.packed_attention))
    for hook in hooks:
        hook.finish(report)
    if r.ctx.is_main:
        for line in r.compiled.loud_warnings():
            print(line, file=sys.stderr, flush=True)
        atomic_write_text(r.run_dir / "report.json", json.dumps(report, indent=2) + "\n")
    return report


