"""Warm-up per batch shape: compile and run every shape the bucket plan produces until its step time is stable.

The shapes are known before training: a bucket's samples and batch size never change between epochs,
so an epoch yields, per bucket, full batches ``[b_k, L_k]`` and (unless ``batching.drop_last``) one
partial batch ``[n_k mod b_k, L_k]``; evaluation loaders add their own partial batches. Warm-up takes
real batches of each shape from a *copy* of each loader's sampler (the training sampler's position is
untouched), runs them — a full optimizer step for training shapes, a no-grad forward for evaluation
shapes — and stops a shape when the coefficient of variation of its last ``n`` step times is ≤ the
threshold (the original design's CI criterion: < 5%) or at a cap.

Partial batches are warmed as shapes of their own, rather than padded or marked dynamic: padding the
batch would change the loss and metric code; a dynamic batch dimension cannot cover a batch of one
sample (dynamo specialises sizes 0 and 1) and CUDA graphs (``reduce-overhead``) need static shapes
anyway. It costs at most one extra graph per bucket; ``batching.drop_last=true`` removes them from
training.

Warm-up must not change the training result: model weights, optimizer and scheduler state, the
GradScaler and every RNG are snapshotted before and restored after, and the restore is verified.
"""

from __future__ import annotations

import copy
import json
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from train import compat
from train.checkpoint import rng_state, set_rng_state
from train.compiling.session import CompileSession, count_delta, resolve_compile
from train.errors import atomic_write_text
from train.perf.timer import Timed
from train.shutdown import pause_point
from train.tools.progress import beside, progress_bar


class StabilityDetector:
    """Decides when a sequence of step times is stable.

    ``add(ms)`` returns True when done: the last ``window`` times have coefficient of variation
    (sample std / mean) ≤ ``cv_threshold`` (``stable``), or ``max_steps`` times were seen (not stable).
    """

    def __init__(self, window: int, cv_threshold: float, max_steps: int) -> None:
        if window < 2 or max_steps < window:
            raise ValueError("window must be ≥ 2 and max_steps ≥ window")
        self.window, self.cv_threshold, self.max_steps = window, cv_threshold, max_steps
        self.times: list[float] = []
        self.stable = False

    @property
    def cv(self) -> Optional[float]:
        """CV of the last ``window`` times; None before there are that many."""
        if len(self.times) < self.window:
            return None
        last = self.times[-self.window:]
        mean = statistics.fmean(last)
        return statistics.stdev(last) / mean if mean > 0 else None

    @property
    def steady_ms(self) -> Optional[float]:
        """Median of the last ``window`` times."""
        return statistics.median(self.times[-self.window:]) if self.times else None

    def add(self, ms: float) -> bool:
        self.times.append(ms)
        cv = self.cv
        if cv is not None and cv <= self.cv_threshold:
            self.stable = True
            return True
        return len(self.times) >= self.max_steps


@dataclass
class ShapeBatches:
    """Real batches of one (phase, batch, length) shape."""

    phase: str  # "train" | "eval"
    batch_size: int
    seq_len: int
    batches: list = field(default_factory=list)  # collated batch dicts


def planned_shapes(loader: DataLoader, phase: str, per_shape: int = 3) -> dict[tuple, ShapeBatches]:
    """Every (phase, batch, length) shape one epoch of ``loader`` yields, with up to ``per_shape`` real batches each.

    Uses a deep copy of the loader's :class:`BucketBatchSampler` from the start of its current epoch,
    so the loader's own position is untouched. Raises ValueError for a loader without one.
    """
    sampler = copy.deepcopy(loader.batch_sampler)
    if not hasattr(sampler, "lengths") or not hasattr(sampler, "load_state_dict"):
        raise ValueError("warm-up needs a BucketBatchSampler (train.data.make_loader)")
    sampler.load_state_dict({**sampler.state_dict(), "start": 0})
    collate, dataset = loader.collate_fn, loader.dataset
    out: dict[tuple, ShapeBatches] = {}
    for idx in sampler:
        key = (phase, *collate.target_shape(len(idx), int(sampler.lengths[idx].max())))
        entry = out.setdefault(key, ShapeBatches(phase, key[1], key[2]))
        if len(entry.batches) < per_shape:
            batch = collate([dataset[i] for i in idx])
            if tuple(batch["input_ids"].shape) != key[1:]:
                raise RuntimeError(f"planned shape {key[1:]} but collate produced {tuple(batch['input_ids'].shape)}")
            entry.batches.append(batch)
    return out


@dataclass
class TrainingState:
    """A bit-exact copy of what a training step changes, including what the loop accumulates for its next
    metrics record (the numerics guard's loss/norm/bad-step sums), so warm-up steps never show in the metrics."""

    model: dict
    optimizer: dict
    scheduler: dict
    scaler: Optional[dict]
    rng: dict
    guard: Optional[dict] = None


def snapshot(model: torch.nn.Module, trainer: Any) -> TrainingState:
    rng = rng_state()
    scaler, guard = trainer.policy.scaler, getattr(trainer, "guard", None)
    return TrainingState(model={k: v.detach().clone() for k, v in model.state_dict().items()},
                         optimizer=copy.deepcopy(trainer.optimizer.state_dict()),
                         scheduler=copy.deepcopy(trainer.scheduler.state_dict()),
                         scaler=copy.deepcopy(scaler.state_dict()) if scaler is not None else None, rng=rng,
                         guard=guard.state_dict() if guard is not None else None)


def restore(model: torch.nn.Module, trainer: Any, state: TrainingState) -> bool:
    """Put everything back in place (tensors copied in place, so compiled graphs stay valid). Returns True if
    bit-exact."""
    model.load_state_dict(state.model)
    trainer.optimizer.load_state_dict(copy.deepcopy(state.optimizer))
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.scheduler.load_state_dict(copy.deepcopy(state.scheduler))
    if state.scaler is not None:
        trainer.policy.scaler.load_state_dict(copy.deepcopy(state.scaler))
    set_rng_state(state.rng)
    guard_exact = True
    if state.guard is not None:
        trainer.guard.load_state_dict(state.guard)
        guard_exact = torch.equal(trainer.guard.state_dict()["accumulators"], state.guard["accumulators"])
    now = model.state_dict()
    return all(torch.equal(now[k], v) for k, v in state.model.items()) and not trainer.optimizer.state and guard_exact


def time_shape(step: Callable[[dict], Any], shape: ShapeBatches, detector: StabilityDetector,
               device: torch.device, clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """Run ``step`` on the shape's batches (cycling) until ``detector`` is done; the first call is the compile."""
    counts0 = compat.compile_cache_counts()
    graphs0 = compat.compiled_graph_count()

    def timed(batch: dict) -> float:
        with Timed(device, clock) as t:
            step(batch)
        return t.ms

    first_ms = timed(shape.batches[0])
    graphs_first = compat.compiled_graph_count() - graphs0
    counts1 = compat.compile_cache_counts()
    i = 1
    while not detector.add(timed(shape.batches[i % len(shape.batches)])):
        i += 1
    steady = detector.steady_ms
    cache = "unknown"
    if counts0 is not None and counts1 is not None:
        hits, misses = counts1["hits"] - counts0["hits"], counts1["misses"] - counts0["misses"]
        cache = "miss" if misses else "hit" if hits else ("none" if not graphs_first else "unknown")
    return {"phase": shape.phase, "batch_size": shape.batch_size, "seq_len": shape.seq_len,
            "first_step_ms": first_ms, "compile_s": max(0.0, first_ms - (steady or 0.0)) / 1e3,
            "graphs_compiled": graphs_first,
            "graphs_compiled_after_first_step": compat.compiled_graph_count() - graphs0 - graphs_first,
            "steps": len(detector.times), "steps_to_stability": len(detector.times) if detector.stable else None,
            "stable": detector.stable, "steady_step_ms": steady, "cv": detector.cv, "cache": cache}


def plan_all_shapes(train_loader: DataLoader, eval_loaders: Iterable[DataLoader]) -> dict[tuple, ShapeBatches]:
    """Training shapes of ``train_loader`` and evaluation shapes of every loader in ``eval_loaders``."""
    shapes = planned_shapes(train_loader, "train")
    for loader in eval_loaders:
        for key, entry in planned_shapes(loader, "eval").items():
            shapes.setdefault(key, entry)
    return shapes


def warm_up(trainer: Any, model: torch.nn.Module, forward: torch.nn.Module, shapes: dict[tuple, ShapeBatches],
            cv: float, window: int, max_steps: int, clock: Callable[[], float] = time.perf_counter,
            notice: Callable[[str], None] = print, progress: bool = False) -> dict[str, Any]:
    """Warm every shape in ``shapes``; restore the training state; return warmup.json's shapes, totals and criteria.

    ``trainer`` (a :class:`~train.trainer.Trainer`) supplies ``step``, ``optimizer``, ``scheduler``, ``policy`` and
    ``device``;
    ``forward`` is what the trainer calls (the compiled wrapper, or the model itself); ``model`` the
    plain module whose state is restored. ``clock`` returns seconds (injectable for tests). ``progress``: ask
    for a progress bar over the shapes (drawn on a terminal only).
    """
    t0 = time.perf_counter()
    device, policy = trainer.device, trainer.policy
    state = snapshot(model, trainer)
    was_training = forward.training

    def train_step(batch: dict) -> None:
        trainer.step(batch, count=False)  # the training step itself; nothing counted (the state is restored after)

    @torch.no_grad()
    def eval_step(batch: dict) -> None:
        ids, mask, labels = (batch[k].to(device) for k in ("input_ids", "attention_mask", "labels"))
        F.cross_entropy(forward(ids, mask, policy.blocks_autocast), labels)

    results = []
    bar = progress_bar(len(shapes), "warm-up", progress, unit="shape")
    say = beside(bar, notice)
    try:
        for key in sorted(shapes, key=lambda k: (k[0] != "train", k[2], k[1])):
            shape = shapes[key]
            forward.train(shape.phase == "train")
            det = StabilityDetector(window, cv, max_steps)
            r = time_shape(train_step if shape.phase == "train" else eval_step, shape, det, device, clock)
            results.append(r)
            bar.update(1)
            pause_point("compile warm-up")  # a test hook (no-op): a signal during warm-up
            say(f"warm-up {shape.phase} [{shape.batch_size}, {shape.seq_len}]: "
                f"first step {r['first_step_ms'] / 1e3:.1f}s "
                f"(cache {r['cache']}), {'stable' if r['stable'] else 'NOT stable'} after {r['steps']} steps, "
                f"steady {r['steady_step_ms']:.1f} ms, CV {100 * (r['cv'] or 0):.1f}%")
    finally:
        bar.close()
        forward.train(was_training)
        exact = restore(model, trainer, state)
    cvs = [r["cv"] for r in results if r["cv"] is not None]
    return {
        "shapes": results,
        "totals": {"shapes": len(results), "train_shapes": sum(r["phase"] == "train" for r in results),
                   "eval_shapes": sum(r["phase"] == "eval" for r in results),
                   "warmup_s": time.perf_counter() - t0, "compile_s": sum(r["compile_s"] for r in results),
                   "graphs_compiled": sum(r["graphs_compiled"] + r["graphs_compiled_after_first_step"]
                                          for r in results),
                   "stable_shapes": sum(r["stable"] for r in results), "all_stable": all(r["stable"] for r in results),
                   "max_cv": max(cvs) if cvs else None},
        "criteria": {"cv_threshold": cv, "window": window, "max_steps_per_shape": max_steps},
        "restored_bit_exact": exact,
    }


def start_compile(cfg: Any, device: torch.device, model: torch.nn.Module, pad_to: str, train_loader: DataLoader,
                  eval_loaders: Iterable[DataLoader], sharded: bool = False) -> CompileSession:
    """The run's :class:`CompileSession`; when compile is on, its bucket shapes are planned (and size the recompile
    limit). ``sharded`` (a ``dist.strategy=fsdp`` run under torchrun): each transformer block is compiled, and the
    shapes are not warmed (:func:`warm_up_for_run`)."""
    enabled, _ = resolve_compile(cfg.compile, device, pad_to, cfg.batching.method)
    shapes = None
    if enabled and pad_to == "bound":
        shapes = plan_all_shapes(train_loader, eval_loaders if cfg.compile.warmup_eval else ())
    session = CompileSession.create(cfg.compile, device, model, pad_to, planned_graphs=len(shapes or ()),
                                    per_block=sharded, method=cfg.batching.method)
    session.shapes = shapes
    if sharded:  # a warm-up step is a collective, and each rank would stop warming when its own times settle
        session.shapes = None
        session.warmup_skipped_reason = ("dist.strategy=fsdp: each rank compiles a shape on its first step with it "
                                         "(counted as a recompile); warm-up steps would have to agree over ranks")
    return session


def warm_up_for_run(session: CompileSession, trainer: Any, model: torch.nn.Module, out_dir: Optional[Path],
                    force: bool = False, notice: Callable[[str], None] = print) -> Optional[dict]:
    """Warm the session's shapes (when compile is on and ``compile.warmup``, or ``force``) and write ``warmup.json``.

    Afterwards every newly compiled graph counts as a recompile. Returns warmup.json's content, or None.
    """
    c = session.cfg
    if not (session.enabled or force):
        return None
    if not (c.warmup or force):
        session.warmup_skipped_reason = "compile.warmup=false"
    elif session.warmup_skipped_reason:
        pass
    elif session.shapes is None and session.enabled:
        session.warmup_skipped_reason = (f"batching.method={trainer.cfg.batching.method}: batches padded to their "
                                         "longest sample (evaluation at least): no fixed set of shapes to warm")
    else:
        shapes = session.shapes if session.shapes is not None else plan_all_shapes(
            trainer.train_loader, [trainer.eval_loader] if trainer.eval_loader is not None else [])
        notice(f"warm-up: {len(shapes)} shapes ({'compiled' if session.enabled else 'eager'}), "
               f"until CV of the last {c.warmup_window} steps ≤ {100 * c.warmup_cv:.0f}% or {c.warmup_max_steps} steps")
        progress = trainer.cfg.train.progress and trainer.dist.is_main
        result = warm_up(trainer, model, session.forward, shapes, c.warmup_cv, c.warmup_window, c.warmup_max_steps,
                         notice=notice, progress=progress)
        result["compile"] = {"enabled": session.enabled, "reason": session.reason, "mode": c.mode, "backend": c.backend,
                             "dynamic": c.dynamic, "fullgraph": c.fullgraph, "recompile_limit": session.recompile_limit}
        result["cache"] = ({"dir": session.cache.dir, "source": session.cache.source, "state": session.cache.state,
                            "fallback_reason": session.cache.fallback_reason,
                            "hit_or_miss": _overall_cache(result["shapes"]),
                            "counts": count_delta(compat.compile_cache_counts(), session.cache_counts_start)}
                           if session.cache else None)
        result["torch"] = torch.__version__
        session.warmup = result
        if out_dir is not None:
            atomic_write_text(out_dir / "warmup.json", json.dumps(result, indent=2) + "\n")
        t = result["totals"]
        notice(f"warm-up done in {t['warmup_s']:.1f}s: {t['stable_shapes']}/{t['shapes']} shapes stable "
               f"(max CV {100 * (t['max_cv'] or 0):.1f}%), {t['graphs_compiled']} graphs, "
               f"cache {result['cache']['hit_or_miss'] if result['cache'] else 'n/a'}, "
               f"state restored bit-exactly: {result['restored_bit_exact']}")
        if not result["restored_bit_exact"]:
            raise RuntimeError("warm-up could not restore the training state bit-exactly")
    if session.monitor is not None:
        session.monitor.end_warmup()
    return session.warmup


def _overall_cache(shapes: list[dict]) -> str:
    kinds = {r["cache"] for r in shapes if r["graphs_compiled"]}
    if not kinds:
        return "none compiled"
    return kinds.pop() if len(kinds) == 1 else "mixed (" + ", ".join(sorted(kinds)) + ")"
