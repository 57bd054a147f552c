"""``model.packed_attention``: which attention runs packed rows (``batching.method=packed``), decided and said.

Four paths, all exact (a packed sample's logits equal its unpacked logits; tests/test_packing.py,
tests/test_causal_models.py):

* ``sdpa-mask``: ``scaled_dot_product_attention`` with a block-diagonal mask [R, 1, C, C] (every model and torch;
  the only one for a Hugging Face classifier). A row pays C² scores whatever samples it holds;
* ``flex`` (the built-in encoder): FlexAttention (``torch.nn.attention.flex_attention``, torch ≥ 2.5) with a
  document ``BlockMask`` built per batch by ``create_block_mask`` (same predicate: same ``seq_index``). It has no
  attention-probability dropout. Where the run's compile is on, ``flex_attention`` is wrapped in ``torch.compile``
  (fused kernel; the whole-model compile inlines it); off, it runs eager (unfused: it materialises the scores);
* ``varlen`` (causal LMs): each sample attends over itself only, samples of similar length batched into causal SDPA
  calls (train/models/varlen.py): Σ Lᵢ² scores instead of C² per row, on every torch and device. Offered where the
  model's packing probe found it exact; never with a sliding window or under compile (shapes change per batch).
* ``eager-mask`` (causal LMs whose own attention is SDPA): the same block-causal mask, added to the scores in
  transformers' eager attention (score matmul, softmax in fp32, value matmul). It computes what ``sdpa-mask`` does,
  without the fused kernel: on rows of tens of tokens in bf16 on a CPU the flash kernel's per-block overhead costs
  more than the scores it saves (docs/models.md has the timings).

Availability: :func:`train.compat.flex_attention_functions` for ``flex`` (training needs its backward: torch 2.13
has none on CPU), the decoder's probe for ``varlen`` and ``eager-mask``. A path requested where it cannot run, or
on a model without it, is a one-line :class:`~train.errors.UserError`. ``auto`` is ``sdpa-mask`` by rule where no
other path can run, or for ``flex`` where ``model.dropout`` > 0 (flex would drop attention dropout and so change
the model's training); otherwise it times the run's training step (a probe trainer's) on one packed batch of the
run's own shape with ``sdpa-mask`` and each path that can run (one untimed call each, then ``repeats`` interleaved
rounds, median) and picks the fastest other path when it is ≥ :data:`ALT_MARGIN` × as fast as ``sdpa-mask``. The
model and every RNG are restored afterwards. Measured decisions are cached under
``data.cache_dir/decisions/`` like ``batching.method=auto`` (train/data/batching_auto.py); a busy machine measures
but does not cache.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from dataclasses import asdict, dataclass
from typing import Any, Optional

import numpy as np
import torch

from train.compat import flex_attention_functions
from train.config import RunConfig
from train.data.bundle import DataBundle
from train.data.causal_collate import pack_collate_for
from train.data.loaders import pack_layout
from train.data.packing import pack_rows
from train.errors import UserError
from train.perf.probe_budget import ProbeBudget
from train.perf.switch_ab import switch_ab
from train.precision import PrecisionPolicy
from train.tools import decisions
from train.tools.env import machine_load

PROBE_REPEATS = 3
"""Timed rounds per path in the attention probe (after one untimed step each)."""
ALT_MARGIN = 1.0
"""``auto`` picks another path when the ``sdpa-mask`` step takes ≥ this × its step (ties go to the other
path: flex and varlen compute fewer scores)."""
DECISION_FORMAT = 3
PATH_DETAIL = {"sdpa-mask": "scaled_dot_product_attention with a block-diagonal bool mask [R, 1, C, C]",
               "flex": "FlexAttention (torch.nn.attention.flex_attention) with a document BlockMask",
               "varlen": "scaled_dot_product_attention per sample, causal, samples of similar length batched "
                         "(train/models/varlen.py)",
               "eager-mask": "transformers' eager attention: score matmul + the block-causal mask as an additive float "
                             "mask, softmax in fp32, value matmul"}


@dataclass
class AttentionChoice:
    """The packed-rows attention ``path`` that runs (``sdpa-mask`` | ``flex``), the ``requested`` value, a one-line
    ``reason``, its ``source`` (requested | rule | measured | cached), ``compiled_flex`` (flex_attention under
    torch.compile) and, when measured or cached, the ``measurement`` (step ms per path) and its ``cache_path``."""

    path: str
    requested: str
    reason: str
    source: str
    compiled_flex: bool = False
    measurement: Optional[dict[str, Any]] = None
    cache_path: Optional[str] = None

    def as_report(self) -> dict[str, Any]:
        return {**asdict(self), "detail": PATH_DETAIL[self.path]}


def flex_functions(device: torch.device, compiled: bool) -> tuple[Optional[tuple[Callable, Callable]], str]:
    """``(flex_attention, create_block_mask)`` for training on ``device`` (``flex_attention`` compiled when
    ``compiled``), or ``(None, why)``."""
    fns, why = flex_attention_functions(device.type, backward=True)
    if fns is None or not compiled:
        return fns, why
    return (torch.compile(fns[0], dynamic=False), fns[1]), ""


def apply_attention(model: torch.nn.Module, choice: AttentionChoice, device: torch.device) -> None:
    """Set ``choice.path`` on ``model`` (the built-in encoder or a causal LM; a classifier of its own is left
    alone)."""
    if not hasattr(model, "set_packed_attention"):
        return
    fns = flex_functions(device, choice.compiled_flex)[0] if choice.path == "flex" else None
    model.set_packed_attention(choice.path, fns)


def probe_batch(cfg: RunConfig, bundle: DataBundle) -> dict:
    """One packed batch of the run's shape (``pack_layout``): rows packed from the first ``batching.pack_window``
    samples of a seeded permutation of the training split."""
    split = bundle.splits["train"]
    lengths = np.asarray(split.lengths)
    layout = pack_layout(cfg, lengths)
    ids = np.random.default_rng([cfg.train.seed, 7]).permutation(len(lengths))[: cfg.batching.pack_window]
    rows = pack_rows(lengths[ids], layout.capacity, cfg.train.seed)[: layout.rows]
    items = [(r, split.ids[int(ids[j])], 0) for r, row in enumerate(rows) for j in row]
    return pack_collate_for(bundle.task, bundle.pad_id, layout.capacity, layout.rows,
                            layout.max_seqs).collate_items(items)


def measure_paths(model: torch.nn.Module, step: Callable[[dict], Any], batch: dict, device: torch.device,
                  fns: Optional[tuple[Callable, Callable]], alts: tuple[str, ...] = ("flex",),
                  repeats: int = PROBE_REPEATS) -> dict[str, Any]:
    """Median ms of the run's training step (``step(batch)``: a probe trainer's :meth:`~train.trainer.Trainer.step`,
    restored by its caller) on the packed ``batch`` with ``sdpa-mask`` and with each path of ``alts`` (``flex``, with
    its ``fns``; ``varlen``; ``eager-mask``), through the one A/B primitive (one untimed step each, then ``repeats``
    rotated rounds): ``{"sdpa-mask": ms, <alt>: ms, …, "speedup": {alt: sdpa ÷ alt}, "speedup_interval": {alt:
    [low, high]}, "repeats", "shape"}``. The model's path is restored afterwards."""
    states = {path: (path, fns if path == "flex" else None) for path in ("sdpa-mask", *alts)}
    ab = switch_ab(step, batch, lambda state: model.set_packed_attention(*state), states,
                   restore=(model.packed_attention, getattr(model, "_flex", None)), rounds=repeats, device=device)
    med = {path: ab.arms[path].median_step_ms() for path in ("sdpa-mask", *alts)}
    ratios = {alt: ab.ratio(alt, "sdpa-mask", "steps") for alt in alts}
    return {**med, "speedup": {a: med["sdpa-mask"] / med[a] for a in alts},
            "speedup_interval": {a: [r.low, r.high] for a, r in ratios.items()},
            "repeats": repeats, "shape": "x".join(map(str, batch["input_ids"].shape))}


def _cache_key(model: torch.nn.Module, policy: PrecisionPolicy, batch: dict, device: torch.device,
               compiled: bool) -> dict[str, Any]:
    return {**decisions.machine_identity(device),
            "model": str(getattr(model, "spec", type(model).__name__)), "precision": policy.mode,
            "compiled": compiled, "shape": list(batch["input_ids"].shape), "label_slots": int(batch["labels"].shape[0])}


def ruled_out(path: str, compiled: bool, dropout: float) -> str:
    """Why ``auto`` does not run ``path`` with these settings, by rule ("" where it may): ``varlen`` under compile
    (its shapes change with every batch), ``flex`` with ``model.dropout`` > 0 (FlexAttention has no attention
    dropout). The run's choice and ``make optimize``'s attention lever both ask it."""
    if path == "varlen" and compiled:
        return "its group shapes change with every batch, so a compiled model would recompile"
    if path == "flex" and dropout > 0:
        return f"model.dropout={dropout} > 0 and FlexAttention has no attention dropout (flex would change training)"
    return ""


def alternatives(model: Optional[torch.nn.Module], device: torch.device,
                 compiled: bool) -> list[tuple[str, Optional[tuple[Callable, Callable]], str]]:
    """``[(path, fns, why_not)]``: the paths besides ``sdpa-mask`` this model has — ``flex`` for the built-in encoder
    (``fns``: FlexAttention's pair), ``varlen`` and ``eager-mask`` for a causal LM — each with why it cannot run here
    ("" when it can)."""
    paths = getattr(model, "packed_attention_paths", ("sdpa-mask", "flex"))  # None: the encoder (tests)
    if "flex" in paths:
        fns, why = flex_functions(device, compiled)
        return [("flex", fns, why)]
    out = []
    for path in paths[1:]:
        # dropout rules out flex for auto only (a requested flex runs, with a note): choose_packed_attention
        out.append((path, None, model.path_available(path) or ruled_out(path, compiled, 0.0)))
    return out


def choose_packed_attention(model: torch.nn.Module, policy: PrecisionPolicy, cfg: RunConfig, bundle: DataBundle,
                            device: torch.device, compiled: bool,
                            probe: Optional[Callable[[], ContextManager[Callable[[dict], Any]]]] = None,
                            measure: Optional[Callable[..., dict[str, Any]]] = None,
                            budget: Optional[ProbeBudget] = None) -> AttentionChoice:
    """Resolve ``model.packed_attention`` for this packed run (module docstring); ``compiled``: the run's compile
    is on. ``probe()``: a context manager giving the run's training step for a measurement and restoring the model
    after it (:func:`train.setup.probe_steps`; needed only where a measurement runs). ``measure``:
    :func:`measure_paths` when None (tests force its result). ``budget``: the run's probe allowance
    (train/perf/probe_budget.py); a measurement past it is not run, and the path is sdpa-mask by rule.

    Raises:
        UserError: a path this model has not (``flex`` on a decoder, ``varlen`` on the encoder, either on a
            classifier of its own), or one that cannot run here (one line: the key, why, the fix).
    """
    requested = cfg.model.packed_attention
    # a Hugging Face / python: classifier: its own attention with a 4-D block mask
    if model is not None and not hasattr(model, "set_packed_attention"):
        if requested not in ("auto", "sdpa-mask"):
            raise UserError(f"model.packed_attention={requested}: model.source={cfg.model.source} runs its own "
                            "attention (a block-diagonal mask); use model.packed_attention=auto or sdpa-mask")
        return AttentionChoice("sdpa-mask", requested, "the model's own attention with a block-diagonal mask "
                               "(train/models/packed.py)", "rule")
    if requested == "sdpa-mask":
        return AttentionChoice("sdpa-mask", requested, "requested (model.packed_attention=sdpa-mask)", "requested")
    alts = alternatives(model, device, compiled)
    names = [a for a, _, _ in alts]
    if requested not in ("auto", *names):
        raise UserError(f"model.packed_attention={requested}: model.source={cfg.model.source} runs sdpa-mask or "
                        f"{' or '.join(names)}; use model.packed_attention=auto, sdpa-mask or {', '.join(names)}")
    fns = next((f for a, f, _ in alts if a == "flex"), None)
    if requested != "auto":
        why = next(w for a, _, w in alts if a == requested)
        if why:
            fix = ("a torch ≥ 2.5 build whose FlexAttention has a backward on this device (CUDA)" if requested == "flex"
                   else "compile.enabled=false" if compiled and requested == "varlen" else
                   "a decoder without a sliding window" if requested == "varlen" else "model.packed_attention=auto")
            raise UserError(f"model.packed_attention={requested}: {why} (torch {torch.__version__}, device "
                            f"{device.type}); use model.packed_attention=sdpa-mask or auto, or {fix}")
        dropout = cfg.model.dropout if requested == "flex" else 0.0
        note = f"; attention dropout {dropout} not applied (FlexAttention has none)" if dropout else ""
        return AttentionChoice(requested, requested, f"requested (model.packed_attention={requested}, "
                               f"{_how(requested, compiled)}){note}", "requested",
                               compiled_flex=compiled and requested == "flex")
    runnable = tuple(a for a, _, w in alts if not w)
    if not runnable:
        whys = "; ".join(f"{a} cannot train here ({w})" for a, _, w in alts)
        return AttentionChoice("sdpa-mask", requested, f"auto: {whys}: sdpa-mask", "rule")
    why = ruled_out("flex", compiled, cfg.model.dropout) if "flex" in runnable else ""
    if why:  # varlen and eager-mask apply attention dropout as SDPA does
        return AttentionChoice("sdpa-mask", requested, f"auto: {why}: sdpa-mask by rule", "rule")
    batch = probe_batch(cfg, bundle)
    fp = _cache_key(model, policy, batch, device, compiled)
    path = decisions.cache_path(cfg.data.cache_dir, "attention", fp, DECISION_FORMAT)
    cached = decisions.read_cached(path, fp, "path", tuple(PATH_DETAIL))
    if cached is not None:
        return AttentionChoice(cached["path"], requested, cached["reason"], "cached",
                               compiled and cached["path"] == "flex", cached["measurement"], path)
    load = machine_load()
    skip = budget.check("model.packed_attention", (len(runnable) + 1) * (1 + PROBE_REPEATS)) \
        if budget is not None else None
    if skip:
        return AttentionChoice("sdpa-mask", requested, f"auto: {skip}: sdpa-mask", "rule")
    with probe() as step:
        m = (measure or measure_paths)(model, step, batch, device, fns, runnable)
    speedup = {a: m["sdpa-mask"] / m[a] for a in runnable}
    best = max(runnable, key=speedup.__getitem__)
    chosen = best if speedup[best] >= ALT_MARGIN else "sdpa-mask"
    others = "".join(f"; {a} {m[a]:.1f} ms ({_how(a, compiled)})" for a in runnable if a != best)
    reason = (f"auto: {best} ran {speedup[best]:.2f}x the speed of sdpa-mask on this run's packed shape {m['shape']} "
              f"(training step {m[best]:.1f} vs {m['sdpa-mask']:.1f} ms, median of {m['repeats']}, {policy.mode}, "
              f"{best} {_how(best, compiled)}{others}): {chosen}")
    choice = AttentionChoice(chosen, requested, reason + decisions.busy_note(load), "measured",
                             compiled and chosen == "flex", m)
    choice.cache_path = decisions.store(path, {"path": chosen, "reason": reason, "measurement": m, "fingerprint": fp},
                                        load)
    return choice


def _how(path: str, compiled: bool) -> str:
    return {"flex": "compiled" if compiled else "eager, unfused", "varlen": "per-sample SDPA",
            "eager-mask": "transformers' eager attention"}.get(path, path)
