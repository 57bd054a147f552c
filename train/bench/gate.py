"""The performance regression gate: ``python -m train bench-gate`` (``make bench-gate``) and ``bench-baseline``.

A short ``make bench`` run of a few rows (``bench_gate.configs``, default naive / hf-style / optimized /
optimized-packed),
compared with a committed baseline (``bench/baseline-cpu.json``; ``bench/baseline-gpu.json`` on CUDA):

* **exact figures** — per row token efficiency, distinct shapes, samples per step and per epoch — depend only on the
  data, the tokenizer and the seeded samplers, so they must match (relative tolerance 1e-6);
* **timing** is compared only as **in-run ratios** (optimized/naive, optimized/hf-style, hf-style/naive,
  optimized-packed/optimized), never as absolute times on a shared CPU, and only against ratios **measured on the same
  kind of machine** (:func:`baseline_machine_key`: CPU model, performance flags, cores and threads, or the GPU's
  name): a band measured on one CPU bounds its noise, not another CPU's systematic offset. The baseline file holds
  one timing entry per machine; on a machine without one the ratios are shown, not
  gated, and ``bench-baseline`` adds it. A ratio may fall at most its band below the baseline's, each ratio's band
  the larger of ``bench_gate.band_floor`` and twice the largest relative deviation of that ratio ``bench-baseline``
  measured over ``bench_gate.repeats`` runs (at most 0.9); a GPU entry (``absolute_allowed``) also gates samples/s
  (band: the floor);
* every row's precision is pinned (``bench_gate.precision``, fp32 on a CPU), so the ratios mean the same on an
  AVX2-only and an AVX512-BF16 CPU.

The gate prints baseline vs now with ✓/✗ and exits 1 on a regression; ``bench-baseline`` rewrites the baseline
deliberately and prints what changed.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from train.bench.training import run_training_bench
from train.config import RunConfig
from train.data import prepare_data
from train.errors import UserError, atomic_write_text
from train.setup import start_run
from train.tools.env import collect_env, machine_facts, resolve_device

SCHEMA_VERSION = 2
EXACT_KEYS = ("token_efficiency", "distinct_shapes", "samples_per_step_mean", "samples_per_epoch")
RATIOS = (("optimized", "naive"), ("optimized", "hf-style"), ("hf-style", "naive"), ("optimized-packed", "optimized"))
EXACT_RTOL = 1e-6


def default_baseline(device: torch.device) -> Path:
    """``bench/baseline-gpu.json`` on CUDA, else ``bench/baseline-cpu.json`` (relative to the working directory)."""
    return Path("bench") / ("baseline-gpu.json" if device.type == "cuda" else "baseline-cpu.json")


def baseline_machine_key(device: torch.device) -> str:
    """Which timing entry of a baseline applies here: ``cuda:<GPU name>``, or ``cpu:<model>|<performance flags>|<logical
    cores>c|<torch threads>t`` (e.g. ``cpu:AMD EPYC|avx2,fma,avx512f|2c|2t``)."""
    facts = machine_facts(device)
    if device.type == "cuda":
        return f"cuda:{facts['gpu']}"
    return (f"cpu:{facts['cpu_model']}|{','.join(facts['cpu_flags'])}|{facts['logical_cores']}c|"
            f"{facts['torch_threads']}t")


def figures(rows: list[dict[str, Any]], data_fingerprint: str) -> dict[str, Any]:
    """What the gate compares, from ``run_training_bench`` rows: ``exact`` ({row.key: value}), ``ratios``
    ({"a/b": samples/s of a ÷ of b} for the :data:`RATIOS` whose rows ran), ``absolute`` ({row.samples_per_s}),
    and the context that must match for a comparison to mean anything (``precision`` per row, ``data_fingerprint``)."""
    by = {r["name"]: r for r in rows}
    exact = {f"{r['name']}.{k}": (round(r[k], 9) if isinstance(r[k], float) else r[k])
             for r in rows for k in EXACT_KEYS}
    ratios = {f"{a}/{b}": by[a]["samples_per_s"] / by[b]["samples_per_s"] for a, b in RATIOS if a in by and b in by}
    return {"exact": exact, "ratios": ratios,
            "absolute": {f"{r['name']}.samples_per_s": r["samples_per_s"] for r in rows},
            "precision": {r["name"]: r["precision"] for r in rows}, "data_fingerprint": data_fingerprint,
            "recompiles_after_warmup": None,
            "recompiles_unavailable_reason": "the gate trains eager steps (compile off); "
                                             "make bench-compile counts recompiles"}


def measure(cfg: RunConfig, device: torch.device, bundle, notice: Callable[[str], None] = print) -> dict[str, Any]:
    """One gate measurement: the configured rows, interleaved in this process, reduced to :func:`figures`."""
    g = cfg.bench_gate
    names = [n.strip() for n in g.configs.split(",") if n.strip()]
    rows = run_training_bench(cfg, bundle, device, names, notice,
                              precision=None if g.precision == "auto" else g.precision)
    return {**figures(rows, bundle.data_fingerprint), "rows": rows}


@dataclass
class Check:
    """One line of the gate's table."""

    name: str
    kind: str  # context | exact | ratio | absolute
    baseline: Any
    now: Any
    allowed: str
    ok: bool
    note: str = ""


def compare(baseline: dict[str, Any], now: dict[str, Any], machine: str = "", device_name: Optional[str] = None
            ) -> list[Check]:
    """Every check of ``now`` (:func:`figures`) against ``baseline`` (a baseline file's dict): context and exact figures
    always; ratios (and absolute figures where allowed) against the timing entry of ``machine``
    (:func:`baseline_machine_key`), shown but not gated when the baseline has none. Pure: no I/O."""
    checks = [Check("data fingerprint", "context", baseline["data_fingerprint"], now["data_fingerprint"], "equal",
                    baseline["data_fingerprint"] == now["data_fingerprint"], "other data: make bench-baseline"),
              Check("precision per row", "context", baseline["precision"], now["precision"], "equal",
                    baseline["precision"] == now["precision"],
                    "other precision: same bench_gate.precision as the baseline")]
    for key, base in baseline["exact"].items():
        value = now["exact"].get(key)
        same = value is not None and (value == base if isinstance(base, int) else
                                      math.isclose(value, base, rel_tol=EXACT_RTOL, abs_tol=1e-12))
        checks.append(Check(key, "exact", base, value, "equal" if isinstance(base, int) else f"±{EXACT_RTOL:g} rel",
                            same))
    entry = baseline["machines"].get(machine)
    if entry is None:
        note = f"not gated: no timing baseline for this machine ({machine}); make bench-baseline adds one"
        return checks + [Check(key, "ratio", None, value, "not gated", True, note)
                         for key, value in now["ratios"].items()]
    bands = entry["ratio_band"]
    for key, base in entry["ratios"].items():
        band_k = bands[key]
        value = now["ratios"].get(key)
        ok = value is not None and value >= base * (1 - band_k)
        note = ("faster than the baseline: make bench-baseline raises the bar"
                if ok and value > base * (1 + band_k) else "")
        checks.append(Check(key, "ratio", base, value, f"≥ {base * (1 - band_k):.3f} (−{band_k:.0%})", ok, note))
    if entry.get("absolute_allowed") and device_name == entry.get("device"):
        band = min(bands.values())
        for key, base in entry["absolute"].items():
            value = now["absolute"].get(key)
            ok = value is not None and value >= base * (1 - band)
            checks.append(Check(key, "absolute", base, value, f"≥ {base * (1 - band):.1f} (−{band:.0%})", ok))
    return checks


def _show(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    return "—" if x is None else str(x)


def table(checks: list[Check]) -> str:
    """The gate's markdown table: baseline vs now, the allowed range, ✓/✗."""
    lines = ["| check | kind | baseline | now | allowed | |", "|---|---|---|---|---|---|"]
    for c in checks:
        mark = "✓" if c.ok else "✗"
        lines.append(f"| {c.name} | {c.kind} | {_show(c.baseline)} | {_show(c.now)} | {c.allowed} | {mark} "
                     f"{c.note if (c.note and (not c.ok or c.kind == 'ratio')) else ''}|")
    return "\n".join(lines) + "\n"


def load_baseline(path: Path) -> dict[str, Any]:
    """Read a baseline file. Raises UserError (exit 2): missing, not JSON, or of another schema."""
    if not path.is_file():
        raise UserError(f"no gate baseline at {path}: create it deliberately with `make bench-baseline` "
                        "(and commit it)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: not a gate baseline JSON ({exc.__class__.__name__}); "
                        "rewrite it with make bench-baseline") from None
    if not isinstance(data, dict) or data.get("schema_version") != SCHEMA_VERSION:
        raise UserError(f"{path}: schema_version {data.get('schema_version') if isinstance(data, dict) else '?'}, this "
                        f"version reads {SCHEMA_VERSION}; rewrite it with make bench-baseline")
    return data


def baseline_path(cfg: RunConfig) -> Path:
    """``bench_gate.baseline``, or the default for the device ``train.device`` resolves to."""
    return (Path(cfg.bench_gate.baseline) if cfg.bench_gate.baseline
            else default_baseline(resolve_device(cfg.train.device)))


def _setup(cfg: RunConfig, prefix: str):
    start = start_run(cfg, prefix=prefix)
    return start, prepare_data(cfg, None, notice=lambda *a, **k: None)


def run_gate(cfg: RunConfig, notice: Callable[[str], None] = print) -> tuple[bool, dict[str, Any]]:
    """Measure once and compare with the baseline; writes ``runs/<id>/bench-gate.{json,md}``. Returns (passed, result).

    Raises:
        UserError: no (readable) baseline.
    """
    path = baseline_path(cfg)
    baseline = load_baseline(path)  # before anything is written: no baseline, no run directory
    start, bundle = _setup(cfg, "bench-gate-")
    t0 = time.perf_counter()
    now = measure(cfg, start.device, bundle, lambda *a, **k: None)
    machine = baseline_machine_key(start.device)
    checks = compare(baseline, now, machine, collect_env(start.device)["device"])
    passed = all(c.ok for c in checks)
    gated = machine in baseline["machines"]
    result = {"passed": passed, "baseline": str(path), "machine": machine, "timing_gated": gated,
              "seconds": time.perf_counter() - t0,
              "checks": [c.__dict__ for c in checks], "now": {k: v for k, v in now.items() if k != "rows"},
              "rows": now["rows"], "env": {**collect_env(start.device), **machine_facts(start.device)}}
    timing = (f"timing ratios gated against this machine's entry ({machine})" if gated else
              f"TIMING NOT GATED: no timing baseline for this machine ({machine}) among "
              f"{len(baseline['machines'])} in {path}; exact figures gated; `make bench-baseline` adds this machine")
    md = (f"# Regression gate vs {path}\n\n{timing}\n\n{table(checks)}\n" +
          ("PASSED\n" if passed else "REGRESSION\n"))
    atomic_write_text(start.run_dir / "bench-gate.md", md)
    atomic_write_text(start.run_dir / "bench-gate.json", json.dumps(result, indent=2) + "\n")
    notice(md + f"wrote {start.run_dir}/bench-gate.json and .md")
    return passed, result


def write_baseline(cfg: RunConfig, notice: Callable[[str], None] = print) -> dict[str, Any]:
    """Measure ``bench_gate.repeats`` times and write the baseline (medians of the ratios and absolute figures; the band
    from their spread). Prints what changed against the previous baseline.

    Raises:
        UserError: an exact figure differed between repeats (the gate could not hold it to equality).
    """
    path = baseline_path(cfg)
    start, bundle = _setup(cfg, "bench-baseline-")
    g = cfg.bench_gate
    runs = []
    for i in range(g.repeats):
        runs.append(measure(cfg, start.device, bundle, lambda *a, **k: None))
        notice(f"bench-baseline: measurement {i + 1}/{g.repeats}: " +
               ", ".join(f"{k} {v:.3f}" for k, v in runs[-1]["ratios"].items()))
    for other in runs[1:]:
        if other["exact"] != runs[0]["exact"]:
            diff = [k for k in runs[0]["exact"] if other["exact"].get(k) != runs[0]["exact"][k]]
            raise UserError(f"exact figures differ between repeats ({diff}): the data or sampler is not deterministic")
    ratios = {k: statistics.median(r["ratios"][k] for r in runs) for k in runs[0]["ratios"]}
    spread = {k: max(abs(r["ratios"][k] / ratios[k] - 1) for r in runs) for k in ratios}
    band = {k: min(0.9, max(g.band_floor, math.ceil(200 * v) / 100)) for k, v in spread.items()}
    env = {**collect_env(start.device), **machine_facts(start.device)}
    created = time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime())
    entry = {"created": created, "device": env["device"], "absolute_allowed": start.device.type == "cuda",
             "ratio_band": band, "ratios": ratios,
             "absolute": {k: statistics.median(r["absolute"][k] for r in runs) for k in runs[0]["absolute"]},
             "measured": {"repeats": g.repeats, "ratios_each_run": {k: [r["ratios"][k] for r in runs] for k in ratios},
                          "ratio_spread": spread,
                          "band_rule": f"per ratio: min(0.9, max({g.band_floor}, 2 x its spread))"},
             "env": env}
    common = {"data_fingerprint": runs[0]["data_fingerprint"], "precision": runs[0]["precision"],
              "exact": runs[0]["exact"]}
    old = load_baseline(path) if path.is_file() else None
    machines = {}
    if old is not None:
        if all(old.get(k) == v for k, v in common.items()):
            machines = dict(old["machines"])
        elif old["machines"]:
            notice(f"exact figures, data or precision changed: the timing entries of {sorted(old['machines'])} were "
                   "measured on other figures and are dropped; run make bench-baseline on those machines again")
    machine = baseline_machine_key(start.device)
    machines[machine] = entry
    new = {"schema_version": SCHEMA_VERSION, "created": created, **common, "machines": machines,
           "settings": {"bench": cfg.to_dict()["bench"], "bench_gate": cfg.to_dict()["bench_gate"],
                        "data_max_samples": cfg.data.max_samples, "model": cfg.model.preset}}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(new, indent=2) + "\n")
    notice(f"wrote {path} (machine {machine}); per ratio, spread over {g.repeats} runs → band: " +
           ", ".join(f"{k} {spread[k]:.1%} → {band[k]:.0%}" for k in band))
    for line in changes(old, new, machine):
        notice(line)
    return new


def changes(old: Optional[dict[str, Any]], new: dict[str, Any], machine: str) -> list[str]:
    """What a rewritten baseline changes: one line per figure that differs (all of them for a first baseline), the
    ratios and bands of ``machine``'s entry."""
    if old is None:
        return ["no previous baseline: every figure is new"]
    lines = []
    before, after = old["machines"].get(machine, {}), new["machines"][machine]
    if not before:
        lines.append(f"  a new machine entry: {machine}")
    for section, a_sec, b_sec in (("exact", old["exact"], new["exact"]),
                                  ("ratios", before.get("ratios", {}), after["ratios"])):
        for key in sorted(set(a_sec) | set(b_sec)):
            a, b = a_sec.get(key), b_sec.get(key)
            if a != b and not (isinstance(a, float) and isinstance(b, float) and math.isclose(a, b, rel_tol=1e-3)):
                lines.append(f"  {section} {key}: {_show(a)} → {_show(b)}")
    if before and before.get("ratio_band") != after["ratio_band"]:
        lines.append(f"  ratio_band: {_show(before.get('ratio_band'))} → {_show(after['ratio_band'])}")
    return lines or ["  no figure changed (ratios within 0.1%)"]
