"""torch.compile for the run: options, the persistent cache directory, and recompile accounting.

* :func:`resolve_compile` turns ``compile.enabled`` (``true|false|auto``) into on/off and the reason.
* :func:`setup_cache_dir` points ``TORCHINDUCTOR_CACHE_DIR`` / ``TRITON_CACHE_DIR`` at a project-owned
  directory (``.cache/inductor``; the image mounts a shared volume there), checks it is writable and
  otherwise falls back to a per-user temporary directory with one warning. Inductor writes cache
  entries to a temporary file and renames it into place, so two processes can share the directory;
  a missing entry is a miss (recompile), and one that does not load is bypassed the same way.
* :class:`CompiledForward` wraps ``torch.compile(model, dynamic=False)``: it is what the trainer and
  evaluation call, and it counts every graph dynamo compiles (``counters["stats"]["unique_graphs"]``)
  against the input shape that caused it, with dynamo's guard-failure reason. After warm-up
  (:mod:`train.compiling.warmup`) every new graph is a *recompile*; the target is 0. Hitting dynamo's recompile
  limit (after which dynamo silently runs that code eagerly) is caught from dynamo's warning and
  reported loudly, so eager speed is never reported as compiled speed.

Version differences (torch 2.1 vs current) live in :mod:`train.compat`.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from train import compat
from train.config import CompileConfig
from train.errors import UserError

DEFAULT_CACHE_DIR = ".cache/inductor"

# What `auto` says on CPU: a rule, stated as one (no measurement is taken in the run). It rests on
# `python -m train bench-compile` results recorded in docs (compiled slower than eager at p50 for the tiny
# model on the 2-core development CPUs); a user can measure their own machine with the same command.
CPU_AUTO_REASON = ("auto: off on CPU by rule (auto compiles only on CUDA, where static bucket shapes also allow CUDA "
                   "graphs; a cold compile costs tens of seconds per batch shape); set compile.enabled=true to compile "
                   "here, and `python -m train bench-compile` measures whether it pays on this machine")


class CacheDirWarning(UserWarning):
    """The configured compile cache directory is unusable; a per-user temporary directory is used instead."""


def resolve_compile(cfg: CompileConfig, device: torch.device, pad_to: str,
                    method: str = "random") -> tuple[bool, str]:
    """(enabled, reason) for ``compile.enabled`` on ``device``; ``pad_to`` is the batches' padding
    ("bound"|"batch-max"), ``method`` the ``batching.method`` that pads so (named in the reason).

    Raises:
        UserError: ``compile.enabled=true`` where torch.compile cannot run.
    """
    if cfg.enabled == "false":
        return False, "compile.enabled=false"
    if cfg.enabled == "auto" and device.type != "cuda":
        return False, CPU_AUTO_REASON  # decided without importing torch._dynamo (it costs eager runs start-up time)
    ok, why = compat.dynamo_supported()
    if cfg.enabled == "true":
        if not ok:
            raise UserError(f"compile.enabled=true but {why}; set compile.enabled=false or auto")
        if pad_to == "batch-max" and not cfg.dynamic:
            return True, (f"requested; note: batching.method={method} pads to the batch maximum, so almost every "
                          "batch is a new shape and compile.dynamic=false recompiles for each (counted in report.json)")
        return True, "requested"
    if not ok:
        return False, f"auto: {why}"
    if pad_to == "batch-max" and not cfg.dynamic:
        return False, (f"auto: batching.method={method} has no static shapes (a new sequence length almost every "
                       "batch); use a bucketed method or compile.dynamic=true")
    return True, "auto: CUDA device; bucket shapes are static, so each is compiled once and warmed up"


@dataclass
class CacheInfo:
    """Where the persistent compile cache lives and what state it was in at the start."""

    dir: str
    source: str  # "config" | "env" | "default" | "fallback"
    state: str  # "cold" (empty at start) | "warm" (had entries)
    fallback_reason: Optional[str] = None


def _writable(path: Path) -> Optional[str]:
    """None if ``path`` can be created and written (unique probe file: safe with concurrent processes), else why not."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return f"{exc.strerror or exc.__class__.__name__}"
    return None


def _has_entries(path: Path) -> bool:
    for _root, _dirs, files in os.walk(path):
        if any(not f.startswith(".write-test-") for f in files):
            return True
    return False


def fallback_cache_dir() -> Path:
    """The per-user temporary fallback: ``<tmp>/deep-model-perf-inductor-<uid>``."""
    uid = os.getuid() if hasattr(os, "getuid") else os.getpid()
    return Path(tempfile.gettempdir()) / f"deep-model-perf-inductor-{uid}"


def setup_cache_dir(configured: Optional[str]) -> CacheInfo:
    """Choose, check and export the compile cache directory; call before the first compile.

    Sets ``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR`` (``<dir>/triton``) in ``os.environ`` and
    enables inductor's on-disk FX-graph cache. Order: ``configured``, else ``$TORCHINDUCTOR_CACHE_DIR``,
    else ``.cache/inductor``. An unwritable choice falls back to :func:`fallback_cache_dir` with one
    :class:`CacheDirWarning`.

    Raises:
        UserError: neither the chosen directory nor the fallback can be written.
    """
    if configured:
        path, source = Path(configured), "config"
    elif os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        path, source = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]), "env"
    else:
        path, source = Path(DEFAULT_CACHE_DIR), "default"
    reason = None
    problem = _writable(path)
    if problem is not None:
        fallback = fallback_cache_dir()
        reason = f"{path} is not writable ({problem}); using {fallback}"
        warnings.warn(f"compile cache: {reason}. Set compile.cache_dir to a writable directory to keep compiled "
                      "graphs across runs.", CacheDirWarning, stacklevel=2)
        second = _writable(fallback)
        if second is not None:
            raise UserError(f"compile cache: neither {path} ({problem}) nor {fallback} ({second}) is writable; "
                            "set compile.cache_dir to a writable directory or compile.enabled=false")
        path, source = fallback, "fallback"
    path = path.resolve()
    state = "warm" if _has_entries(path) else "cold"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    os.environ["TRITON_CACHE_DIR"] = str(path / "triton")
    compat.refresh_inductor_cache_dir()
    compat.enable_persistent_graph_cache()
    return CacheInfo(dir=str(path), source=source, state=state, fallback_reason=reason)


class _LimitHandler(logging.Handler):
    """Catches dynamo's "torch._dynamo hit config.<limit>" warning."""

    def __init__(self, monitor: "RecompileMonitor") -> None:
        super().__init__(level=logging.WARNING)
        self.monitor = monitor

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = record.getMessage()
        except Exception:  # pragma: no cover
            return
        if msg.startswith(compat.RECOMPILE_LIMIT_MESSAGE):
            self.monitor.limit_hits.append(msg.splitlines()[0] + " | "
                                           + " ".join(line.strip() for line in msg.splitlines()[1:3]))


@dataclass
class RecompileMonitor:
    """Counts compiled graphs per call, split into warm-up and after warm-up, with shapes and reasons."""

    dynamic: bool = False
    phase: str = "warmup"  # "warmup" until :meth:`end_warmup`, then "run"
    warmed: set = field(default_factory=set)  # (phase, batch, length) keys compiled in warm-up
    seen: set = field(default_factory=set)
    graphs_warmup: int = 0
    graphs_after_warmup: int = 0
    events: list = field(default_factory=list)  # recompiles after warm-up
    limit_hits: list = field(default_factory=list)
    eager_fallback_shapes: list = field(default_factory=list)
    _gf: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._handler = _LimitHandler(self)
        logging.getLogger(compat.RECOMPILE_LIMIT_LOGGER).addHandler(self._handler)
        self._gf = compat.guard_failure_snapshot()

    def close(self) -> None:
        logging.getLogger(compat.RECOMPILE_LIMIT_LOGGER).removeHandler(self._handler)

    def end_warmup(self) -> None:
        """From now on every new graph counts as a recompile."""
        self.phase = "run"
        self._gf = compat.guard_failure_snapshot()

    def record(self, key: tuple, new_graphs: int) -> None:
        first_time = key not in self.seen
        self.seen.add(key)
        if new_graphs and self.phase == "warmup":
            self.graphs_warmup += new_graphs
            self.warmed.add(key)
            self._gf = compat.guard_failure_snapshot()
            return
        if new_graphs:
            self.graphs_after_warmup += new_graphs
            reasons = compat.guard_failures_since(self._gf)
            self._gf = compat.guard_failure_snapshot()
            phase, b, s = key
            if key in self.warmed:
                why = "guard failure on a warmed shape"
            else:
                why = f"new {phase} shape [{b}, {s}] not among the {len(self.warmed)} warmed shapes"
            self.events.append({"phase": phase, "shape": [b, s], "graphs": new_graphs, "reason": why,
                                "guard_failures": reasons[:3], "guard_failures_total": len(reasons)})
        elif first_time and not self.dynamic and self.phase == "run" and key not in self.warmed:
            # a static-shape compile of a never-seen shape produced no graph: dynamo ran it eagerly
            self.eager_fallback_shapes.append({"phase": key[0], "shape": [key[1], key[2]]})

    @property
    def limit_hit(self) -> bool:
        return bool(self.limit_hits)


class CompiledForward(nn.Module):
    """``model`` compiled with ``torch.compile``, called exactly like the model, with recompile accounting.

    forward(input_ids LongTensor[B, S], attention_mask BoolTensor[B, S], blocks_context) → fp32 logits [B, C].
    ``parameters()``, ``train()`` and ``eval()`` reach the wrapped model; save ``model.state_dict()``
    (the wrapper adds no state). Each call costs two counter reads.
    """

    def __init__(self, model: nn.Module, cfg: CompileConfig, monitor: RecompileMonitor,
                 per_block: bool = False) -> None:
        super().__init__()
        self.model = model
        kwargs: dict[str, Any] = {"dynamic": cfg.dynamic, "fullgraph": cfg.fullgraph, "backend": cfg.backend}
        if cfg.mode != "default":
            kwargs["mode"] = cfg.mode
        compiled: Any = model
        if per_block:  # dist.strategy=fsdp: each transformer block in place, before FSDP2 wraps it (as torchtitan)
            from train.parallel.fsdp import transformer_blocks

            for block in transformer_blocks(model):
                block.compile(**kwargs)
        else:
            compiled = torch.compile(model, **kwargs)
        object.__setattr__(self, "compiled", compiled)  # not a submodule: no duplicate state
        object.__setattr__(self, "monitor", monitor)
        object.__setattr__(self, "_traceable", {})  # compat.traceable_callable's cache

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        b, s = input_ids.shape
        key = ("train" if self.model.training and torch.is_grad_enabled() else "eval", b, s)
        # callables (the blocks context) in a form dynamo traces without a graph break (torch < 2.4)
        args = tuple(compat.traceable_callable(a, self._traceable) for a in args)
        kwargs = {k: compat.traceable_callable(v, self._traceable) for k, v in kwargs.items()}
        before = compat.compiled_graph_count()
        out = self.compiled(input_ids, attention_mask, *args, **kwargs)
        self.monitor.record(key, compat.compiled_graph_count() - before)
        return out


@dataclass
class CompileSession:
    """The run's compile state: what the trainer calls (``forward``), the cache, the monitor, the warm-up result."""

    enabled: bool
    reason: str
    cfg: CompileConfig
    forward: nn.Module
    cache: Optional[CacheInfo] = None
    monitor: Optional[RecompileMonitor] = None
    recompile_limit: Optional[int] = None
    warmup: Optional[dict] = None  # warmup.json content when warm-up ran
    warmup_skipped_reason: Optional[str] = None
    shapes: Optional[dict] = None  # planned (phase, batch, length) → real batches (train.compiling.warmup)
    cache_counts_start: Optional[dict] = None
    t_created: float = field(default_factory=time.perf_counter)

    @classmethod
    def create(cls, cfg: CompileConfig, device: torch.device, model: nn.Module, pad_to: str = "bound",
               planned_graphs: int = 0, per_block: bool = False, method: str = "random") -> "CompileSession":
        """Resolve ``compile.enabled``; when on: set up the cache dir, the recompile limit and wrap ``model``.

        ``planned_graphs`` (train + eval shapes the bucket plan will produce) sizes the default limit. ``per_block``:
        compile each transformer block in place instead of the whole model (a sharded run: FSDP2's all-gathers and
        reduce-scatters stay outside the compiled code; ``forward`` then calls the model, sharded after this).
        """
        enabled, reason = resolve_compile(cfg, device, pad_to, method)
        if not enabled:
            return cls(enabled=False, reason=reason, cfg=cfg, forward=model)
        cache = setup_cache_dir(cfg.cache_dir)
        limit = cfg.recompile_limit or max(compat.recompile_limit(), planned_graphs + 8)
        compat.set_recompile_limit(limit)
        compat.enable_guard_failure_reporting()
        monitor = RecompileMonitor(dynamic=cfg.dynamic)
        fwd = CompiledForward(model, cfg, monitor, per_block)
        return cls(enabled=True, reason=reason + ("; each transformer block compiled (dist.strategy=fsdp)"
                                                  if per_block else ""), cfg=cfg, forward=fwd, cache=cache,
                   monitor=monitor, recompile_limit=limit, cache_counts_start=compat.compile_cache_counts())

    def loud_warnings(self) -> list[str]:
        """Lines to print (and report) when the compiled run was not what it claims."""
        if not self.enabled or self.monitor is None:
            return []
        m, out = self.monitor, []
        if m.limit_hit or m.eager_fallback_shapes:
            out.append(f"WARNING: torch.compile hit its recompile limit ({self.recompile_limit}): "
                       "some shapes ran EAGER; step times in this report are NOT compiled speed. "
                       + (m.limit_hits[0] if m.limit_hits else ""))
        if m.graphs_after_warmup:
            ev = m.events[0]
            out.append(f"WARNING: {m.graphs_after_warmup} recompile(s) after warm-up; first: {ev['reason']}"
                       + (f" ({ev['guard_failures'][0]})" if ev["guard_failures"] else ""))
        return out

    def report(self) -> dict[str, Any]:
        """report.json's ``compile`` section (keys are a contract: add, never rename)."""
        c = self.cfg
        out: dict[str, Any] = {"enabled": self.enabled, "reason": self.reason, "mode": c.mode, "backend": c.backend,
                               "dynamic": c.dynamic, "fullgraph": c.fullgraph}
        if not self.enabled:
            why = "compile disabled: " + self.reason
            out.update({"warmup_s": None, "recompiles_after_warmup": None, "cache_dir": None, "cache_state": None,
                        "unavailable_reason": why})
            return out
        m = self.monitor
        assert m is not None and self.cache is not None
        w = self.warmup
        out.update({
            "status": ("recompile-limit-hit: eager fallback" if (m.limit_hit or m.eager_fallback_shapes)
                       else "recompiled after warm-up" if m.graphs_after_warmup else "compiled"),
            "warmup_s": w["totals"]["warmup_s"] if w else None,
            "recompiles_after_warmup": m.graphs_after_warmup,
            "recompile_events": m.events[:20],
            "recompile_limit": self.recompile_limit,
            "recompile_limit_hit": m.limit_hit or bool(m.eager_fallback_shapes),
            "recompile_limit_messages": m.limit_hits[:5],
            "eager_fallback_shapes": m.eager_fallback_shapes[:20],
            "graphs_compiled_in_warmup": m.graphs_warmup,
            "cache_dir": self.cache.dir,
            "cache_dir_source": self.cache.source,
            "cache_dir_fallback_reason": self.cache.fallback_reason,
            "cache_state": self.cache.state,
            "cache_counts": count_delta(compat.compile_cache_counts(), self.cache_counts_start),
        })
        if w is None:
            out["warmup_unavailable_reason"] = self.warmup_skipped_reason or "warm-up did not run"
        else:
            out["warmup_all_stable"] = w["totals"]["all_stable"]
            out["warmup_max_cv"] = w["totals"]["max_cv"]
        return out


def count_delta(now: Optional[dict], start: Optional[dict]) -> Optional[dict]:
    """``now - start`` per counter (a counter missing from ``start`` counts from 0); None when either is None."""
    if now is None or start is None:
        return None
    return {k: now[k] - start.get(k, 0) for k in now}
