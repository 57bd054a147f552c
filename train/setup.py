"""How every command starts, in one place: the run directory (train/tools/run_dir.py), the resolved ``config.yaml``,
the device, torch threads, seeds and the precision policy; and the model built from a config and its data.

    start = start_run(cfg, prefix="bench-precision-")   # run_dir, device, policy
    model = build_model(cfg, bundle).to(start.device)

``python -m train train`` starts through the same pieces in :mod:`train.run.training`, where under torchrun rank 0
creates the directory and every rank follows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from train.config import RunConfig, dump_config
from train.errors import UserError, atomic_write_text
from train.evaluation import EvaluateBefore, eval_before_wanted
from train.models.encoder import EncoderClassifier, resolve_spec
from train.precision import PrecisionPolicy
from train.tools.cores import usable_cores
from train.tools.env import resolve_device
from train.tools.run_dir import make_run_dir


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def thread_count(requested: Optional[int], current: int, notice: Callable[[str], None] = print) -> int:
    """The torch threads to use: ``requested`` (``train.num_threads``; None: torch's ``current`` default), clamped to
    the cores this process can use (:func:`train.tools.cores.usable_cores`), since more threads than cores
    oversubscribe them and slow every step. A clamped request is said in one ``notice:`` line."""
    cores, why = usable_cores()
    want = requested or current
    if want <= cores:
        return want
    if requested:
        notice(f"notice: train.num_threads={requested} but this process can use {cores} cores ({why}); using "
               f"{cores} threads (more threads than cores oversubscribe them and slow every step)")
    return cores


def apply_threads_and_seed(cfg: RunConfig, notice: Callable[[str], None] = print) -> None:
    """torch's intra-op threads (``train.num_threads``, or torch's default, clamped to the usable cores:
    :func:`thread_count`) and :func:`seed_everything` with ``train.seed``."""
    threads = thread_count(cfg.train.num_threads, torch.get_num_threads(), notice)
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    seed_everything(cfg.train.seed)


@dataclass
class RunStart:
    """What :func:`start_run` set up: ``run_dir`` (None when not asked for), ``device``, ``policy`` and ``cfg``, the
    resolved, frozen config (its ``train.run_id`` the directory's name; what ``config.yaml`` holds)."""

    run_dir: Optional[Path]
    device: torch.device
    policy: PrecisionPolicy
    cfg: Optional[RunConfig] = None


def start_run(cfg: RunConfig, prefix: str = "", run_dir: bool = True) -> RunStart:
    """A single-process command's start: the run directory with ``config.yaml`` (unless ``run_dir=False``),
    the device, ``train.num_threads``, every RNG seeded, and the precision policy (``train.precision``).

    Raises:
        UserError: unwritable run directory, unavailable device, or a precision the device cannot run.
    """
    directory = None
    resolved = cfg
    if run_dir:
        directory = make_run_dir(cfg, prefix)
        if directory.name != cfg.train.run_id:
            resolved = cfg.with_values({"train.run_id": directory.name})
    resolved = resolved.with_values({}).freeze() if not resolved.frozen else resolved
    if directory is not None:
        atomic_write_text(directory / "config.yaml", dump_config(resolved))
    device = resolve_device(cfg.train.device)
    apply_threads_and_seed(cfg)
    return RunStart(run_dir=directory, device=device, policy=PrecisionPolicy.for_config(cfg, device), cfg=resolved)


def build_model(cfg: RunConfig, bundle, hf_config: Optional[str] = None) -> torch.nn.Module:
    """The model for ``cfg.model`` sized to ``bundle`` (vocabulary, classes); weights from torch's RNG (or, for
    ``model.source=hf:<dir>``, the directory's). ``model.source`` other than ``builtin``: see train/models/
    (``hf_config``: a checkpoint's Hugging Face config JSON, to rebuild that architecture on resume).

    Raises:
        UserError: ``hidden_size`` not divisible by ``num_heads``, a bucket bound beyond ``data.max_len``, or an
            external model that cannot be built (train.models.build_external).
    """
    m = cfg.model
    if m.source != "builtin":
        from train.models import build_external

        return build_external(cfg, bundle, hf_config)
    if m.task != "classification":
        raise UserError(f"model.task={m.task} needs a decoder: the built-in model is an encoder classifier; set "
                        "model.source=hf:llama (or hf:qwen2, hf:gpt2: random init sized by model.preset) or "
                        "hf:<a local causal-LM directory>")
    spec = resolve_spec(m.preset, bundle.vocab_size, bundle.num_classes, cfg.data.max_len, m.dropout, m.pooling,
                        num_layers=m.num_layers, hidden_size=m.hidden_size, num_heads=m.num_heads, ffn_size=m.ffn_size)
    if spec.hidden_size % spec.num_heads:
        raise UserError(f"model: hidden_size {spec.hidden_size} is not divisible by num_heads {spec.num_heads}")
    if max(bundle.bounds) > spec.max_len:
        raise UserError(f"bucket bound {max(bundle.bounds)} exceeds data.max_len={spec.max_len} (the position table); "
                        "refit the buckets or raise data.max_len")
    return EncoderClassifier(spec)


def replan(cfg: RunConfig, bundle):
    """``bundle`` with the bucket plan of ``cfg.batching`` (a benchmark row or a decision that changed the batching
    method); the prepared splits are shared, only bounds, padding and plan are new. Fitted plans are not saved."""
    from train.data import bucket_plan

    bounds, pad_to, plan, source = bucket_plan(cfg, bundle.splits["train"].lengths, bundle.data_fingerprint,
                                               bundle.tokenizer_info["fingerprint"], None, False, lambda _m: None)
    return dataclasses.replace(bundle, bounds=bounds, pad_to=pad_to, plan=plan, plan_source=source)


@dataclass
class BuiltRun:
    """A run ready to take steps: its config, device, precision policy, data bundle, model (the plain module),
    loaders by split, compile session (None when not asked for) and trainer."""

    cfg: RunConfig
    device: torch.device
    policy: PrecisionPolicy
    bundle: Any
    model: torch.nn.Module
    loaders: dict[str, Any]
    trainer: Any
    compiled: Any = None
    attention: Any = None  # the packed rows' AttentionChoice where build_run decided it (packed_attention_for)


def build_run(cfg: RunConfig, bundle, device: torch.device, policy: PrecisionPolicy, *,
              splits: tuple[str, ...] = ("train",), model: Optional[torch.nn.Module] = None,
              hf_config: Optional[str] = None, ctx: Any = None, compile: bool = False,
              logger: Optional[Callable[[torch.nn.Module], Any]] = None,
              before_wrap: Optional[Callable[[torch.nn.Module, Any], None]] = None, budget: Any = None) -> BuiltRun:
    """The one set-up of a run from a resolved config and its prepared data — what ``make train``, warm-up and every
    benchmark row build, in this order: the model (seeded with ``train.seed``, unless ``model`` is given;
    ``model.fast_dropout=true``: its dropout modules swapped; ``memory.checkpoint_blocks``: its blocks checkpointed,
    before compiling and wrapping), the packed attention path and chunked loss the config
    names where the model is not yet on them (:func:`packed_attention_for`, :func:`chunked_loss_for`), a loader per
    split in ``splits`` (``train`` shuffled, rank-sharded under ``ctx``), the compile session (``compile``: the run's
    ``compile`` settings, shapes planned), ``before_wrap(model, compiled)`` (e.g. loading a checkpoint before DDP
    broadcasts rank 0's weights), and the :class:`~train.trainer.Trainer` (validation as its periodic evaluation when
    that split is built and not empty; ``logger(model)`` its metrics logger; the step through the compiled forward
    or the DDP wrapper; ``dist.strategy=fsdp``: the model sharded in place, before the trainer builds its optimizer).

    Raises:
        UserError: a model that cannot be built for this data, or ``batching.method=packed`` on a model without
            packed rows.
    """
    from train.compiling.warmup import start_compile
    from train.data import make_loader
    from train.parallel.process_group import DistContext, wrap_model
    from train.trainer import Trainer

    ctx = ctx or DistContext()
    if model is None:
        seed_everything(cfg.train.seed)  # every row / side of a comparison starts from the same weights
        model = build_model(cfg, bundle, hf_config).to(device)
    check_packing(cfg, model)
    if cfg.model.fast_dropout == "true":  # "auto" is resolved by the command (run_training) into true/false
        from train.models.dropout import set_fast_dropout

        set_fast_dropout(model, True)
    checkpoint_blocks_for(cfg, model)  # before the compile session and the DDP / FSDP2 wrap
    attention = packed_attention_for(cfg, model, policy, bundle, device, compile, budget)
    chunked_loss_for(cfg, model, policy, bundle, device, budget)
    loaders = {s: make_loader(bundle, s, cfg, train=s == "train", device=device, world_size=ctx.world_size,
                              rank=ctx.rank) for s in splits}
    compiled = None
    sharded = ctx.enabled and cfg.dist.strategy == "fsdp"
    if compile:
        evals = [loaders[s] for s in ("validation", "test") if s in loaders]
        compiled = start_compile(cfg, device, model, bundle.pad_to, loaders["train"], evals, sharded=sharded)
    if before_wrap is not None:
        before_wrap(model, compiled)
    val = loaders.get("validation")
    has_val = val is not None and len(bundle.splits["validation"]) > 0  # none: no periodic evaluation
    if compiled is not None and compiled.enabled:
        if sharded:  # FSDP2 shards in place the model whose blocks were compiled; the session still counts graphs
            wrap_model(model, ctx, device, cfg.dist.strategy, policy.mode, cfg.dist.offload)
        forward = compiled.forward
    else:
        forward = wrap_model(model, ctx, device, cfg.dist.strategy, policy.mode, cfg.dist.offload)
    trainer = Trainer(cfg=cfg, model=model, policy=policy, device=device, train_loader=loaders.get("train"),
                      eval_loader=val if has_val else None, num_classes=bundle.num_classes, dist_ctx=ctx,
                      logger=logger(model) if logger is not None else None, train_model=forward)
    if has_val and eval_before_wanted(cfg):
        trainer.add_callback(EvaluateBefore(trainer, bundle))
    return BuiltRun(cfg, device, policy, bundle, model, loaders, trainer, compiled, attention)


def attention_choice(cfg: RunConfig, model: torch.nn.Module, policy: PrecisionPolicy, bundle: Any,
                     device: torch.device, compiled: bool, budget: Any = None) -> Any:
    """``model.packed_attention`` decided for this run (:func:`train.data.attention.choose_packed_attention`, its
    probe the run's own step), without applying it: the resolve phase's decision, and :func:`packed_attention_for`'s.
    Raises UserError (one line: the key, why, the fix) for a path this model has not or that cannot run here."""
    from train.data.attention import choose_packed_attention

    return choose_packed_attention(model, policy, cfg, bundle, device, compiled,
                                   lambda: probe_steps(cfg, model, policy, device), budget=budget)


def chunked_loss_decision(cfg: RunConfig, model: torch.nn.Module, policy: PrecisionPolicy, bundle: Any,
                          device: torch.device, budget: Any = None) -> dict:
    """``model.chunked_loss`` decided for this run (:func:`train.tasks.chunked_loss.decide_chunked_loss`: ``auto``
    times the run's own step both ways on its first training batch, cached), without applying it: the resolve
    phase's decision, and :func:`chunked_loss_for`'s. Raises UserError as that does."""
    from train.tasks.chunked_loss import decide_chunked_loss

    return decide_chunked_loss(cfg.model.chunked_loss, cfg.model.task, model, policy.mode, device,
                               cache_dir=cfg.data.cache_dir, batch=lambda: first_train_batch(cfg, bundle, device),
                               probe=lambda: probe_steps(cfg, model, policy, device), budget=budget)


def projected_steps(cfg: RunConfig, bundle: Any, device: torch.device) -> int:
    """The optimizer steps a run will take: ``train.max_steps``, else ``train.epochs`` × the training loader's batches
    ÷ ``train.grad_accum`` (a loader of its own, as :func:`first_train_batch`): what ``train.probe_budget`` is a share
    of."""
    import math

    from train.data import make_loader

    if cfg.train.max_steps is not None:
        return int(cfg.train.max_steps)
    batches = len(make_loader(bundle, "train", cfg, train=True, device=device))
    return max(1, math.ceil(cfg.train.epochs * batches / cfg.train.grad_accum))


def first_train_batch(cfg: RunConfig, bundle: Any, device: torch.device) -> dict:
    """The first batch of a training loader of its own (the run's loaders are built later, from the resolved
    config): what the ``auto`` probes that time one real batch measure on."""
    from train.data import make_loader

    return next(iter(make_loader(bundle, "train", cfg, train=True, device=device)))


def packed_attention_for(cfg: RunConfig, model: torch.nn.Module, policy: PrecisionPolicy, bundle: Any,
                         device: torch.device, compiled: bool, budget: Any = None) -> Any:
    """Put packed rows on ``cfg.model.packed_attention``'s path where nothing has: a bench row or optimize arm that
    switches packing on keeps the user's ``auto``, decided here as the resolve phase decides it
    (:func:`attention_choice`, cached); an explicit path is checked and applied. The ``AttentionChoice``, or None
    (model untouched): unpacked, one path, or already on it (the resolve phase's)."""
    from train.data.attention import apply_attention

    if cfg.batching.method != "packed" or not hasattr(model, "set_packed_attention") \
            or cfg.model.packed_attention == getattr(model, "packed_attention", None):
        return None
    choice = attention_choice(cfg, model, policy, bundle, device, compiled, budget)
    apply_attention(model, choice, device)
    return choice


def chunked_loss_for(cfg: RunConfig, model: torch.nn.Module, policy: PrecisionPolicy, bundle: Any,
                     device: torch.device, budget: Any = None) -> Optional[dict]:
    """Set a causal LM's ``model.chunked_loss`` where nothing has (a bench row, an optimize arm or a bench-vs-hf side
    that asks for it) as the resolve phase decides it (:func:`chunked_loss_decision`). Its result, or None (model
    untouched): not a causal LM, or already as asked."""
    if cfg.model.task != "causal-lm" or not hasattr(model, "set_chunked_loss") \
            or cfg.model.chunked_loss == ("true" if model.chunked_loss else "false"):
        return None
    decision = chunked_loss_decision(cfg, model, policy, bundle, device, budget)
    model.set_chunked_loss(decision["applied"])
    return decision


def checkpoint_blocks_for(cfg: RunConfig, model: torch.nn.Module) -> dict:
    """``memory.checkpoint_blocks`` applied to ``model`` (train/models/block_checkpoint.py; idempotent, so the resolve
    phase's model is left as it set it): report.json's ``levers.checkpoint_blocks`` entry ``{"applied", "reason",
    "blocks"}``. Raises UserError: asked for on a model without repeated transformer blocks."""
    from train.models.block_checkpoint import set_checkpoint_blocks

    return set_checkpoint_blocks(model, cfg.memory.checkpoint_blocks, cfg.model.source)


def check_packing(cfg: RunConfig, model: torch.nn.Module) -> None:
    """Raises UserError when ``batching.method=packed`` and the model cannot run packed rows."""
    if cfg.batching.method == "packed" and not getattr(model, "supports_packing", False):
        why = getattr(model, "packing_reason", None) or ("it cannot take per-sample positions and a block-diagonal "
                                                         "mask (forward(..., position_ids=, seq_index=, num_seqs=))")
        raise UserError(f"batching.method=packed: model.source={cfg.model.source} cannot run packed rows: {why}; "
                        "use batching.method=optimal")


@contextlib.contextmanager
def probe_trainer(cfg: RunConfig, model: torch.nn.Module, policy: PrecisionPolicy,
                  device: torch.device) -> Iterator[Any]:
    """A throwaway :class:`~train.trainer.Trainer` on ``model`` (an AdamW of its own, no loader: the probe hands
    every batch to ``step(batch, count=False)``), so an ``auto`` probe times the step ``make train`` runs. The model's
    weights, the GradScaler and every RNG are restored bit-exactly afterwards (the run continues as if no probe ran).

    Raises:
        RuntimeError: the state could not be restored bit-exactly.
    """
    from train.compiling.warmup import restore, snapshot
    from train.trainer import Trainer

    trainer = Trainer(cfg=cfg, model=model, policy=policy, device=device, train_loader=None, num_classes=1)
    state = snapshot(model, trainer)
    was_training = model.training
    model.train()
    try:
        yield trainer
    finally:
        model.train(was_training)
        if not restore(model, trainer, state):
            raise RuntimeError("a probe could not restore the model state bit-exactly")


@contextlib.contextmanager
def probe_steps(cfg: RunConfig, model: torch.nn.Module, policy: PrecisionPolicy,
                device: torch.device) -> Iterator[Callable[[dict], None]]:
    """``step(batch)``: one uncounted :meth:`~train.trainer.Trainer.step` of a :func:`probe_trainer` — what the
    ``auto`` probes (batching, packed attention) time; everything is restored on exit."""
    with probe_trainer(cfg, model, policy, device) as trainer:
        def step(batch: dict) -> None:
            trainer.step(batch, count=False)

        yield step
