"""Weights & Biases logger that can never slow or stop training.

Everything W&B does happens on one background thread: ``import wandb``, ``wandb.init``, every
``run.log`` and ``run.finish``. The training thread only puts records on a bounded queue
(``put_nowait``; when full the record is dropped and counted), so a slow disk, a slow network or a
hung W&B service cannot block a step. ``wandb.init`` is bounded twice: ``wandb.Settings(init_timeout=…)``
(W&B gives up by itself) and our own deadline — if the run is not ready ``tracking.init_timeout_s``
after it started, it is abandoned. Any failure (import, init, log, finish) prints one warning;
metrics.jsonl, the source of truth, is unaffected.

Mode: offline unless the user asks for online (``tracking.mode=online`` or ``WANDB_MODE=online``)
*and* has an API key ($WANDB_API_KEY or a ``wandb login`` netrc entry). Offline runs are uploaded
later with ``make wandb-sync``. (W&B: https://docs.wandb.ai/guides/technical-faq/setup/#can-i-run-wandb-offline)
"""

from __future__ import annotations

import importlib
import logging
import netrc
import os
import queue
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlparse

from train.config import TrackingConfig

_STOP = object()


# Default W&B API hosts (wandb ≤ 0.2x: api.wandb.ai; 0.31: api.forge.coreweave.com); $WANDB_BASE_URL overrides.
_DEFAULT_HOSTS = ("api.wandb.ai", "api.forge.coreweave.com")


def has_api_key(env: dict[str, str]) -> bool:
    """$WANDB_API_KEY, or a netrc entry for the W&B host (what ``wandb login`` writes)."""
    if env.get("WANDB_API_KEY"):
        return True
    base = env.get("WANDB_BASE_URL")
    hosts = (urlparse(base).hostname,) if base else _DEFAULT_HOSTS
    try:
        auth = netrc.netrc(env.get("NETRC"))
    except (OSError, netrc.NetrcParseError):
        return False
    return any(h and auth.authenticators(h) is not None for h in hosts)


def resolve_mode(cfg: TrackingConfig, env: Optional[dict[str, str]] = None) -> tuple[Optional[str], Optional[str]]:
    """``(mode, note)``: mode ``offline``/``online``, or None when W&B is off; note says why (or None).

    Off when ``tracking.wandb=off`` or ``WANDB_MODE=disabled`` / ``WANDB_DISABLED=true``. Online only when
    asked for (``tracking.mode=online``, or ``tracking.mode=auto`` with ``WANDB_MODE=online``) and an API key
    exists; otherwise offline, with a note when online was asked for.
    """
    env = dict(os.environ) if env is None else env
    if cfg.wandb == "off":
        return None, "tracking.wandb=off"
    env_mode = env.get("WANDB_MODE", "").strip().lower()
    if env_mode == "disabled" or env.get("WANDB_DISABLED", "").lower() in ("true", "1"):
        return None, "disabled by the environment (WANDB_MODE=disabled or WANDB_DISABLED=true)"
    wanted = cfg.mode if cfg.mode != "auto" else ("online" if env_mode in ("online", "run") else "offline")
    if wanted == "online" and not has_api_key(env):
        return "offline", "online mode asked for but no API key ($WANDB_API_KEY or `wandb login`): logging offline"
    return wanted, None


def _settings(wandb: Any, **wanted: Any) -> Any:
    """``wandb.Settings`` with each of ``wanted`` the installed version accepts (older ones lack some)."""
    accepted: dict[str, Any] = {}
    for key, value in wanted.items():
        try:
            wandb.Settings(**accepted, **{key: value})
            accepted[key] = value
        except Exception:
            pass
    return wandb.Settings(**accepted)


def to_wandb(record: dict[str, Any]) -> dict[str, Any]:
    """Our JSONL record → a flat W&B dict: ``train/loss``, ``eval/accuracy``, ``system/cpu_percent``,
    ``grad_norm/<param>``, ``grad_std/<param>``; plus ``step``. Non-numeric fields are left out."""
    event = record.get("event")
    out: dict[str, Any] = {}
    if event == "grad_stats":
        for name, row in record.get("layers", {}).items():
            out[f"grad_norm/{name}"] = row.get("norm")
            out[f"grad_std/{name}"] = row.get("std")
    else:
        prefix = {None: "train", "eval": "eval", "system": "system"}.get(event, str(event))
        for key, value in record.items():
            if key in ("step", "event") or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if event == "eval" and key.startswith("eval_"):
                key = key[5:]
            out[f"{prefix}/{key}"] = value
    out = {k: v for k, v in out.items() if v is not None}
    if record.get("step") is not None:
        out["step"] = record["step"]
    return out


class WandbLogger:
    """A :class:`~train.tracking.MetricLogger` backed by W&B on a background thread.

    Args:
        cfg: the ``tracking`` config section.
        mode: ``offline`` or ``online`` (from :func:`resolve_mode`).
        run_dir: the run directory; W&B writes ``run_dir/wandb/<offline-run-…>/``.
        name: the W&B run name (our run id).
        config: the resolved run config, stored with the W&B run.
        import_module: how ``wandb`` is imported (tests substitute failing or hanging fakes).

    ``log`` never blocks and never raises. ``status()`` gives the report.json fields.
    """

    def __init__(self, cfg: TrackingConfig, mode: str, run_dir: Path, name: str, config: dict[str, Any],
                 import_module: Callable[[str], Any] = importlib.import_module) -> None:
        self.cfg, self.mode, self.run_dir, self.name, self.config = cfg, mode, Path(run_dir), name, config
        self._import = import_module
        self._q: queue.Queue = queue.Queue(maxsize=cfg.queue_size)
        self._ready = threading.Event()  # init finished, successfully or not
        self._lock = threading.Lock()
        self._abandoned = False
        self.run: Any = None
        self.failure: Optional[str] = None
        self.logged = 0
        self.dropped = 0
        self.unsent = 0
        self.init_s: Optional[float] = None
        self.files_dir: Optional[str] = None
        self.last_step: Optional[int] = None
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._work, name="wandb-logger", daemon=True)
        self._thread.start()

    # -- failure handling ---------------------------------------------------------------------
    def _fail(self, reason: str, warn: bool = True) -> None:
        with self._lock:
            if self.failure is not None:
                return
            self.failure = reason
        if warn:
            warnings.warn(f"W&B: {reason}; continuing with metrics.jsonl only", stacklevel=2)

    @property
    def active(self) -> bool:
        """True while the W&B run exists and nothing has failed."""
        return self.run is not None and self.failure is None

    # -- the background thread ----------------------------------------------------------------
    def _init(self) -> Any:
        try:
            wandb = self._import("wandb")
        except ImportError as exc:
            self._fail(f"wandb is not importable ({exc})", warn=self.cfg.wandb == "on")
            return None
        # W&B logs to files under the run directory through `logging`: on a full disk each failed record would print
        # a "--- Logging error ---" block to stderr. Production setting (Python's logging docs): drop such records.
        logging.raiseExceptions = False
        settings = _settings(wandb, init_timeout=self.cfg.init_timeout_s, console="off", silent=True)
        run = wandb.init(project=self.cfg.project, name=self.name, dir=str(self.run_dir), config=self.config,
                         mode=self.mode, settings=settings)
        try:  # our step on the x axis; system records carry the last training step
            run.define_metric("step")
            run.define_metric("*", step_metric="step")
        except Exception:
            pass
        return run

    def _work(self) -> None:
        try:
            run = self._init()
        except BaseException as exc:  # noqa: BLE001 - anything from wandb.init, including its own timeout
            self._fail(f"wandb.init failed ({exc.__class__.__name__}: {exc})")
            run = None
        with self._lock:
            abandoned = self._abandoned
            if run is not None and not abandoned:
                self.run = run
                self.init_s = time.monotonic() - self._t0
                self.files_dir = str(Path(run.dir).parent) if getattr(run, "dir", None) else None
        self._ready.set()
        if run is not None and abandoned:
            self._finish(run)  # ready too late: close it quietly
            return
        while True:
            item = self._q.get()
            if item is _STOP:
                break
            if not self.active:
                self.unsent += 1
                continue
            try:
                data = to_wandb(item)
                step = data.get("step")
                if step is None and self.last_step is not None:
                    data["step"] = self.last_step
                elif step is not None:
                    self.last_step = step
                run.log(data)
                self.logged += 1
            except Exception as exc:
                self._fail(f"run.log failed ({exc.__class__.__name__}: {exc})")
                self.unsent += 1
        if run is not None:
            self._finish(run)

    def _finish(self, run: Any) -> None:
        try:
            run.finish(exit_code=0 if self.failure is None else 1)
        except Exception as exc:
            self._fail(f"wandb.finish failed ({exc.__class__.__name__}: {exc})")

    # -- the training thread ------------------------------------------------------------------
    def wait_ready(self) -> bool:
        """Wait (at most until ``init_timeout_s`` after construction) for ``wandb.init``. True if the run is up.

        On timeout the run is abandoned (one warning) and the logger goes quiet.
        """
        remaining = self.cfg.init_timeout_s - (time.monotonic() - self._t0)
        if not self._ready.wait(max(0.0, remaining)):
            with self._lock:
                self._abandoned = True
            self._fail(f"wandb.init did not finish within tracking.init_timeout_s={self.cfg.init_timeout_s:g} s")
        return self.active

    def watch(self, model: Any) -> None:
        """``run.watch(model, log=cfg.watch, log_freq=cfg.watch_log_freq)`` when asked for and the run is up.
        Waits for init (bounded). The hooks it installs run in the training thread (W&B's design)."""
        if self.cfg.watch == "off" or not self.wait_ready():
            return
        try:
            self.run.watch(model, log=self.cfg.watch, log_freq=self.cfg.watch_log_freq)
        except Exception as exc:
            warnings.warn(f"W&B: wandb.watch failed ({exc}); no histograms, metrics continue", stacklevel=2)

    def log(self, record: dict[str, Any]) -> None:
        """Queue ``record`` for W&B. Never blocks: a full queue drops the record and counts it."""
        if self.failure is not None:
            return
        try:
            self._q.put_nowait(record)
        except queue.Full:
            self.dropped += 1

    def close(self) -> None:
        """Drain the queue and finish the run, waiting at most the init deadline plus ``finish_timeout_s``."""
        if not self._ready.is_set():
            self.wait_ready()
        if self._abandoned:
            return  # the thread is still inside wandb.init; it closes the run itself if that ever returns
        try:
            self._q.put(_STOP, timeout=self.cfg.finish_timeout_s)
        except queue.Full:
            self._fail("the W&B queue did not drain")
        self._thread.join(self.cfg.finish_timeout_s)
        if self._thread.is_alive():
            self._fail(f"wandb.finish did not complete within "
                       f"tracking.finish_timeout_s={self.cfg.finish_timeout_s:g} s; "
                       "the W&B files may be incomplete")

    def status(self) -> dict[str, Any]:
        """The report.json ``tracking.wandb_*`` fields."""
        sync = None
        if self.mode == "offline" and self.files_dir:
            sync = f"wandb sync {self.files_dir}"
        return {"wandb_active": self.run is not None and self.failure is None, "wandb_mode": self.mode,
                "wandb_dir": self.files_dir, "wandb_fallback_reason": self.failure, "wandb_init_s": self.init_s,
                "wandb_logged_records": self.logged, "dropped_records": self.dropped,
                "wandb_unsent_records": self.unsent,
                "wandb_watch": None if self.cfg.watch == "off" else self.cfg.watch, "wandb_sync_command": sync}
