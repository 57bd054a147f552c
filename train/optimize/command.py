"""``python -m train optimize`` (``make optimize``): the command around the search — the run directory, the data, the
baseline made explicit (:func:`baseline_settings`), the real backend, the progress bar, SIGTERM, and the outputs
written after every decision (docs/optimize.md)."""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any, Optional

import torch

from train.config import RunConfig
from train.data import prepare_data
from train.errors import UserError
from train.optimize.backend import RunBackend
from train.optimize.deadline import Deadline, overshoot_allowed
from train.optimize.levers import CATALOGUE, select
from train.optimize.outputs import write_outputs
from train.optimize.preflight import model_capabilities, refuse_inapplicable
from train.optimize.results import SearchResult
from train.optimize.search import search
from train.optimize.settings import SearchSettings
from train.setup import build_model, start_run
from train.tools.env import device_name, machine_facts, resolve_device
from train.tools.progress import progress_bar


def baseline_settings(cfg: RunConfig, resolved_precision: str,
                      dropout: bool = True) -> tuple[dict[str, Any], list[str]]:
    """The overrides that make the user's config explicit where it says ``auto`` (so every arm runs one decided
    setting), and a note for each. ``train.precision=auto`` → what auto decided; ``batching.method=auto`` →
    ``optimal`` (packing is a lever the search measures); ``model.fast_dropout=auto`` → ``false`` (idem; ``dropout``:
    the model has an ``nn.Dropout`` with p > 0, else nothing to swap); a causal LM's ``model.chunked_loss=auto`` →
    ``false`` (idem); ``model.packed_attention=auto`` → ``sdpa-mask`` (the other paths are the attention lever).
    optimized.yaml keeps each ``auto`` that no candidate measured (:func:`optimized_settings`)."""
    out, notes = {}, []
    if cfg.train.precision == "auto":
        out["train.precision"] = resolved_precision
        notes.append(f"train.precision=auto runs {resolved_precision} here (what auto decided)")
    if cfg.batching.method == "auto":
        out["batching.method"] = "optimal"
        notes.append("batching.method=auto: the baseline runs optimal; packing is measured as the batching lever")
    if cfg.model.fast_dropout == "auto":
        out["model.fast_dropout"] = "false"
        notes.append("model.fast_dropout=auto: the baseline runs nn.Dropout; the cheaper mask is the fast_dropout "
                     "lever" if dropout else "model.fast_dropout=auto: the model has no nn.Dropout with p > 0 "
                     "(nothing to swap)")
    if cfg.model.task == "causal-lm" and cfg.model.chunked_loss == "auto":
        out["model.chunked_loss"] = "false"
        notes.append("model.chunked_loss=auto: the baseline keeps the logits whole; chunking is the chunked_loss lever")
    if cfg.model.packed_attention == "auto":
        out["model.packed_attention"] = "sdpa-mask"
        notes.append("model.packed_attention=auto: packed rows run sdpa-mask; the other paths are the attention lever")
    return out, notes


def optimized_settings(best: dict[str, Any], pinned: dict[str, Any], decisions: list) -> dict[str, Any]:
    """What optimized.yaml sets: the search's ``best`` less each ``auto`` the baseline pinned (``pinned``:
    :func:`baseline_settings`' overrides) that no measured candidate (``decisions``) set — nothing measured it, so
    the config keeps ``auto`` and decides it as any run does."""
    measured = {key for d in decisions for key in d.candidate.overrides}
    return {k: v for k, v in best.items() if k not in pinned or k in measured or v != pinned[k]}


def run_optimize(cfg: RunConfig, notice: Callable[[str], None] = print,
                 config_path: Optional[str] = None, t_start: Optional[float] = None) -> dict[str, Any]:
    """Run the search on ``cfg`` and write its outputs; returns optimize.json's dict (``status`` completed, budget or
    interrupted). SIGTERM and Ctrl-C end the search with what was measured so far written. ``t_start``: the
    command's start (``time.perf_counter()``, taken by ``python -m train`` before torch is imported; None: now) —
    ``optimize.budget_s`` counts from it, so the set-up, the data's preparation and every phase after them spend the
    one :class:`~train.optimize.deadline.Deadline`.

    Raises:
        UserError: an unknown lever in ``optimize.levers``, bad data or config.
    """
    deadline = Deadline(cfg.optimize.budget_s, start=t_start)
    try:
        levers = select(cfg.optimize.lever_names(), CATALOGUE)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    # the data and the model's capabilities before the run directory: a named lever that cannot apply is refused
    # before anything is measured or written
    device = resolve_device(cfg.train.device)
    bundle = prepare_data(cfg, None, notice=notice)
    caps = model_capabilities(build_model(cfg, bundle), device)
    if cfg.optimize.levers is not None:
        refuse_inapplicable(cfg.optimize.lever_names(), cfg, caps, device)
    start = start_run(cfg, prefix="optimize-")
    out_dir = start.run_dir / "optimize"
    base, notes = baseline_settings(start.cfg, start.policy.mode, dropout=caps.dropout_modules > 0)
    for n in notes:
        notice(f"optimize: {n}")
    backend = RunBackend(start.cfg, bundle, start.device, out_dir, notice, deadline=deadline, capabilities=caps)
    facts = machine_facts(start.device)
    meta = {"config": config_path or "the built-in defaults", "device": device_name(start.device),
            "budget_s": cfg.optimize.budget_s, "overshoot_allowed_s": overshoot_allowed(cfg.optimize.budget_s),
            "set_up_s": deadline.elapsed(),
            "load": facts.get("load_1min"), "notes": notes, "torch": torch.__version__,
            "optimized_yaml": str(out_dir / "optimized.yaml"), "levers": [lv.name for lv in levers],
            "min_gain": cfg.optimize.min_gain, "quality_tolerance": cfg.optimize.quality_tolerance,
            "planned_steps": backend.planned_steps(), "planned_samples": backend.planned_samples()}
    settings = SearchSettings.from_config(cfg.optimize, backend.planned_samples())
    bar = progress_bar(int(settings.budget_s), "optimize (s of budget)", cfg.train.progress)

    def update(res: SearchResult) -> None:
        bar.n = min(int(settings.budget_s), int(deadline.elapsed()))
        bar.refresh()
        kept = optimized_settings(res.best, base, res.decisions)
        best = start.cfg.with_values({**kept, "train.run_id": None, "train.overwrite": False})
        write_outputs(out_dir, res.as_dict(), meta, best, kept)

    def on_term(_sig, _frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        res = search(backend, levers, base, settings, planned_steps=backend.planned_steps(),
                     notice=lambda m: (bar.clear(), notice(m), bar.refresh()), on_update=update, deadline=deadline)
    finally:
        signal.signal(signal.SIGTERM, old)
        bar.close()
    out = res.as_dict()
    out["out_dir"] = str(out_dir)
    return out
