"""The resolve phase: a loaded config, its prepared data and (on resume) the checkpoint → a frozen, fully decided
config and the decisions block.

Every ``auto`` of a run is decided here, once, in this order: the run id (the run directory's name), the precision
(the checkpoint's on resume, else ``train.precision``), the model (built, checked for packing, its blocks
checkpointed where ``memory.checkpoint_blocks`` asks: a switch, not a measurement), the strategy under torchrun
(``dist.strategy=auto``: a rule of the model's size and the device's memory), the batching
method (``batching.method=auto``: the run's own step on its batches), fast dropout (``model.fast_dropout=auto``), the
compile switch (``compile.enabled``: a rule), the packed rows' attention path (``model.packed_attention``) and the
chunked LM loss (``model.chunked_loss``: causal LMs; its step A/B runs on the attention path just chosen). The
probes run on the run's model through a throwaway trainer and restore it bit-exactly. What comes out is a value, each
``auto`` replaced by what it decided (so ``config.yaml`` replays the run without measuring): nothing after this phase
edits the config; :func:`train.setup.build_run` builds the run from it.

Under torchrun rank 0 decides and every rank follows (a measurement cannot split the job).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from train.compiling.session import resolve_compile
from train.config import RunConfig
from train.data import DataBundle
from train.data.attention import AttentionChoice, apply_attention
from train.data.batching_auto import apply_batching, choose_batching
from train.models.dropout import decide_fast_dropout
from train.parallel.process_group import DistContext, agreed, broadcast_from_main
from train.parallel.strategy import decide_strategy
from train.perf.probe_budget import ProbeBudget
from train.precision import PrecisionDecision, PrecisionPolicy
from train.setup import (
    attention_choice,
    build_model,
    check_packing,
    checkpoint_blocks_for,
    chunked_loss_decision,
    first_train_batch,
    probe_steps,
    projected_steps,
)


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint to resume from: its path and its loaded state (train/resume.py's ``load_resume``)."""

    path: Path
    state: dict


@dataclass(frozen=True)
class Resolved:
    """A run with every decision made: the frozen ``cfg`` (what ``config.yaml`` holds), the precision ``policy``,
    the ``bundle`` planned for ``cfg.batching``, the ``model`` built from ``cfg`` (attention path set, dropout not
    yet swapped: :func:`~train.setup.build_run` swaps it from ``model.fast_dropout``), the compile switch and its
    reason, and report.json's decision sections (``batching_auto``, ``levers.fast_dropout``, ``packed_attention``,
    ``levers.chunked_loss``, ``dist.auto``: ``strategy``; None where the decision did not arise)."""

    cfg: RunConfig
    policy: PrecisionPolicy
    bundle: DataBundle
    model: torch.nn.Module
    compile_enabled: bool
    compile_reason: str
    batching_auto: Optional[dict]
    fast_dropout: dict
    attention: Optional[AttentionChoice]
    chunked_loss: dict
    strategy: Optional[dict] = None
    probes_line: Optional[str] = None
    """The decisions block's ``probes`` line: the time the auto probes took, their allowance, what they measured."""
    probes: Optional[dict] = None
    """report.json ``perf.probes`` (train/perf/probe_budget.py)."""

    @property
    def packed_attention(self) -> Optional[dict]:
        return None if self.attention is None else self.attention.as_report()


def precision_policy(cfg: RunConfig, device: torch.device, ctx: DistContext,
                     checkpoint: Optional[Checkpoint]) -> PrecisionPolicy:
    """The run's precision: the checkpoint's when resuming, else ``train.precision`` (``auto`` measured or cached).
    Under DDP rank 0 decides and every rank follows.

    Raises:
        UserError: the device cannot run the requested (or the checkpoint's) precision.
    """
    def decide() -> Optional[PrecisionPolicy]:
        if not ctx.is_main:
            return None
        if checkpoint is not None:
            return PrecisionPolicy.for_resume(checkpoint.state.get("precision"), cfg, device,
                                              f"checkpoint {checkpoint.path}")
        return PrecisionPolicy.for_config(cfg, device)

    policy = agreed(decide, ctx)
    if not ctx.enabled:
        return policy
    mine = broadcast_from_main((policy.mode, policy.reason, policy.source, policy.measurement) if ctx.is_main else None,
                               ctx)
    return policy if ctx.is_main else PrecisionPolicy.from_decision(PrecisionDecision(*mine), device)


def resolve_run(cfg: RunConfig, run_id: str, bundle: DataBundle, device: torch.device, ctx: DistContext,
                checkpoint: Optional[Checkpoint] = None, say: Callable[..., None] = print) -> Resolved:
    """Decide every ``auto`` of the run (module docstring) and freeze its config. ``run_id``: the run directory's
    name; ``bundle``: the prepared data with the optimal bucket plan; ``checkpoint``: the state to resume (its
    precision and its model architecture are kept). ``say``: where the one-line batching verdict goes.

    Raises:
        UserError: a precision the device cannot run, a model that cannot be built for this data or cannot run
            packed rows, ``model.packed_attention=flex`` where FlexAttention cannot train.
    """
    if run_id != cfg.train.run_id:  # rank 0 drew it: a new config, not an edit of the loaded one
        cfg = cfg.with_values({"train.run_id": run_id})
    policy = precision_policy(cfg, device, ctx, checkpoint)
    hf_config = (checkpoint.state if checkpoint else {}).get("spec", {}).get("hf_config")  # the checkpoint's model
    model = agreed(lambda: build_model(cfg, bundle, hf_config), ctx).to(device)
    check_packing(cfg, model)
    checkpoint_blocks_for(cfg, model)  # first: the probes below time the step the run will take

    def decided(choose: Callable[[], Any]) -> Any:
        return broadcast_from_main(choose() if ctx.is_main else None, ctx)

    strategy = None  # a rule of the model and the device: config.yaml keeps what it chose, as a resume should
    if cfg.dist.strategy == "auto":
        strategy = decided(lambda: decide_strategy(model, device, ctx.world_size, cfg.clip.method))

    batching = None
    if cfg.batching.method == "auto":  # config.yaml keeps the choice, so --resume replays it
        decision = decided(lambda: choose_batching(model, policy, cfg, bundle, device,
                                                   lambda: probe_steps(cfg, model, policy, device)))
        cfg, bundle = apply_batching(cfg, bundle, decision.method)
        batching = decision.as_report()
        say(f"batching: {decision.reason}", flush=True)
    fast_dropout = decided(lambda: _decide_fast_dropout(cfg, model, policy, bundle, device))
    # every auto becomes what it decided, so a rerun with --config runs/<id>/config.yaml makes the same choices
    # without measuring (a measurement on a busy machine is not cached, and may choose otherwise next time)
    decided_values = {"model.fast_dropout": "true" if fast_dropout["applied"] else "false"}
    if cfg.train.precision == "auto":
        decided_values["train.precision"] = policy.mode
    if strategy is not None and strategy["chosen"] is not None:
        decided_values["dist.strategy"] = strategy["chosen"]
    # compile.enabled=auto stays auto: a rule of the device kind and the batching, no measurement, so the same machine
    # decides the same; written as its outcome, the report's reason would say "compile.enabled=false" instead of why
    compile_enabled, compile_reason = resolve_compile(cfg.compile, device, bundle.pad_to, cfg.batching.method)
    budget = ProbeBudget(cfg.train.probe_budget, projected_steps(cfg, bundle, device), say)
    attention = None
    if cfg.batching.method == "packed":  # packed rows' attention path (train/data/attention.py), once compile is known
        attention = decided(lambda: attention_choice(cfg, model, policy, bundle, device, compile_enabled, budget))
        apply_attention(model, attention, device)
        if hasattr(model, "set_packed_attention"):  # a resume replays the path (the paths differ in rounding)
            decided_values["model.packed_attention"] = attention.path
    # after the attention path: its A/B times the step the run will take
    chunked = decided(lambda: chunked_loss_decision(cfg, model, policy, bundle, device, budget))
    if chunked["applied"]:
        model.set_chunked_loss(True)
    if cfg.model.task == "causal-lm":  # a classifier's config keeps its value (nothing to chunk)
        decided_values["model.chunked_loss"] = "true" if chunked["applied"] else "false"
    cfg = cfg.with_values(decided_values).freeze()
    return Resolved(cfg, policy, bundle, model, compile_enabled, compile_reason, batching, fast_dropout, attention,
                    chunked, strategy, budget.line() if ctx.is_main else None, budget.report())


def _decide_fast_dropout(cfg: RunConfig, model: torch.nn.Module, policy: PrecisionPolicy, bundle: DataBundle,
                         device: torch.device) -> dict:
    """``model.fast_dropout`` (train/models/dropout.py) on one real training batch (a loader of its own: the run's
    loaders are built from the resolved config); ``auto`` becomes ``true``/``false`` in the run's config, so a
    resume replays the choice instead of measuring again."""
    return decide_fast_dropout(model, cfg.model.fast_dropout, policy.mode, cfg.data.cache_dir,
                               lambda: first_train_batch(cfg, bundle, device), device,
                               lambda: probe_steps(cfg, model, policy, device))


PRETRAINED_LR = {"full": 1e-4, "adapter": 1e-3}
"""The highest peak learning rate the fine-tuning recipes of pretrained models commonly use (full fine-tuning;
a LoRA adapter): above it the optimizer line warns."""


def optimizer_line(cfg: RunConfig) -> str:
    """The decisions block's optimizer line: the recipe the config gives (AdamW, peak lr, warm-up, linear decay), and
    a warning where a pretrained base gets a learning rate of a from-scratch recipe."""
    from train.models.external import has_pretrained_weights

    o = cfg.optim
    line = (f"AdamW lr {o.lr:g} (optim.lr), {o.warmup_fraction:g} of the steps warming up, then linear decay to 0, "
            f"weight decay {o.weight_decay:g}")
    kind = "adapter" if cfg.model.adapter else "full"
    if has_pretrained_weights(cfg.model.source) and o.lr > PRETRAINED_LR[kind]:
        line += (f"; warning: a pretrained base {'with an adapter ' if kind == 'adapter' else ''}usually fine-tunes "
                 f"at lr <= {PRETRAINED_LR[kind]:g}: lr {o.lr:g} (a from-scratch rate) may undo what it learned")
    return line


def decision_lines(resolved: Resolved, device_name: str) -> list[str]:
    """The block every run prints before training: what was decided automatically, and why (or from which cache)."""
    cfg, bundle, policy = resolved.cfg, resolved.bundle, resolved.policy
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
    dropout = resolved.fast_dropout
    lines = ["decisions:",
             f"  device     {device_name}",
             f"  precision  {policy.mode} [{policy.source}] {policy.reason}",
             f"  compile    {'on' if resolved.compile_enabled else 'off'}: {resolved.compile_reason}",
             f"  buckets    {buckets}",
             f"  data       {data}; tokenizer {bundle.tokenizer_info['source']}",
             f"  dropout    {'16-bit mask' if dropout['applied'] else 'nn.Dropout'}: {dropout['reason']}"]
    if resolved.attention is not None:
        lines.append(f"  attention  {resolved.attention.path}: {resolved.attention.reason}")
    if resolved.strategy is not None:
        lines.append(f"  strategy   {resolved.strategy['chosen'] or 'none'}: {resolved.strategy['reason']}")
    blocks = getattr(resolved.model, "checkpoint_blocks_info", None) or {"applied": False, "reason": ""}
    lines.append(f"  memory     {'blocks checkpointed' if blocks['applied'] else 'activations kept'}: "
                 f"{blocks['reason']}")
    if cfg.model.task != "classification":
        chunked = resolved.chunked_loss
        lines.append(f"  loss       {'chunked' if chunked['applied'] else 'logits whole'}: {chunked['reason']}")
    lines.append(f"  optimizer  {optimizer_line(cfg)}")
    if resolved.probes_line:
        lines.append(f"  probes     {resolved.probes_line}")
    return lines
