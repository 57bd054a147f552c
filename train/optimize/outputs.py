"""What ``make optimize`` writes to ``runs/<id>/optimize/``: ``optimize.json`` (everything measured),
``optimize.md`` (evidence → lever → measured ratio → decision, in order), ``waterfall.png`` and ``optimized.yaml``
(a complete config for ``make train CONFIG=…``). Each file is written to a temp path and renamed, after every
decision, so an interrupted search leaves a valid partial report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from train.config import RunConfig, dump_config
from train.errors import atomic_path, atomic_write_text


def format_ratio(d: Optional[dict]) -> str:
    """A ratio dict as ``1.234x [1.100, 1.400]`` (``—`` when not measured, ``(one round)`` without an interval)."""
    if not d or d.get("median") is None:
        return "—"
    if d.get("low") is None:
        return f"{d['median']:.3f}x (one round)"
    return f"{d['median']:.3f}x [{d['low']:.3f}, {d['high']:.3f}]"


def format_loss(x: Optional[float]) -> str:
    """A held-out loss as ``2.1234`` (``—`` when not read)."""
    return "—" if x is None else f"{x:.4f}"


def _pct(x: Optional[float]) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def _load(x: Any) -> str:
    return f"{x:.2f}" if isinstance(x, (int, float)) else "unknown (no /proc/loadavg)"


def render_markdown(res: dict[str, Any], meta: dict[str, Any]) -> str:
    """optimize.md from optimize.json's dict."""
    lines = [f"# make optimize — {meta.get('config')}", "",
             f"Status: **{res['status']}** after {res['seconds']:.0f} s since the command started (budget "
             f"{meta.get('budget_s'):g} s"
             + (f", at most {meta['overshoot_allowed_s']:g} s past it" if meta.get("overshoot_allowed_s") else "")
             + ") on "
             f"{meta.get('device')}; 1-minute load {_load(meta.get('load'))} at the start. Baseline: the config as "
             "given"
             + (f" ({', '.join(f'{k}={v}' for k, v in res['baseline'].items())})" if res["baseline"] else "") + "."
             + (f" Stopped: {res['stop_reason']}." if res.get("stop_reason") else ""),
             "", "## Profiles (the evidence)", "",
             "| # | settings | step ms | padding | compute | memory | launch | data wait | optimizer | dropout mask |"
             " attention | top op |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, p in enumerate(res["profiles"]):
        s = ", ".join(f"{k}={v}" for k, v in p["settings"].items()) or "baseline"
        lines.append(f"| {i} | {s} | {p['step_ms']:.1f} | {_pct(p['padding_share'])} | {_pct(p['compute_share'])} | "
                     f"{_pct(p['memory_share'])} | {_pct(p['launch_share'])} | {_pct(p['data_wait_share'])} | "
                     f"{_pct(p['optimizer_share'])} | {_pct(p['dropout_mask_share'])} | "
                     f"{_pct(p.get('attention_share'))} | {p['top_op']} |")
    metric = next((d["ratio"].get("metric") for d in res["decisions"] if d.get("ratio")), None)
    lines += ["", "## Decisions, in order", ""]
    if metric == "real_tokens":
        lines += ["Measured ratios are of real tokens per second (every configuration trains the same samples; "
                  "docs/optimize.md says why not samples per window); quality verdicts after the same samples.", ""]
    lines += ["| # | lever | evidence (profile) | predicted | measured (interval) | may change | decision | why |",
              "|---|---|---|---|---|---|---|---|"]
    for i, d in enumerate(res["decisions"], 1):
        lines.append(f"| {i} | {d['lever']}={d['value']} | {d['evidence']} (#{d['profile']}) | {d['predicted']:.2f}x | "
                     f"{format_ratio(d['ratio'])} | {d['may_change']} | "
                     f"{'**accepted**' if d['accepted'] else 'rejected'} | "
                     f"{d['reason']} |")
    if res["not_tried"]:
        lines += ["", "## Not tried", ""] + [f"- {n['lever']}={n['value']} (predicted {n['predicted']:.2f}x): "
                                              f"{n['reason']}" for n in res["not_tried"]]
    if res["not_applicable"]:
        lines += ["", "## Levers that do not apply here", ""] + [f"- {k}: {v}"
                                                                 for k, v in res["not_applicable"].items()]
    w = res["waterfall"]
    lines += ["", "## Waterfall", ""]
    if not w["steps"]:
        lines.append("No lever was accepted: the baseline is the best configuration found.")
    else:
        lines += ["| step | ratio | cumulative (product of intervals) |", "|---|---|---|", "| baseline | 1 | 1 |"]
        lines += [f"| + {s['lever']} | {format_ratio({'median': s['ratio'], 'low': s['low'], 'high': s['high']})} | "
                  f"{s['cumulative']:.3f}x [{s['cumulative_low']:.3f}, {s['cumulative_high']:.3f}] |"
                  for s in w["steps"]]
        conf = res.get("confirmation") or {}
        lines.append(f"| **confirmed: optimized vs baseline, interleaved** | {format_ratio(conf.get('ratio'))} | "
                     + ("adds up (within the product)" if w["adds_up"] else
                        "does not add up: the levers interact" if w["adds_up"] is False else
                        conf.get("unavailable_reason", "not measured"))
                     + (f"; {conf['cut_short']}" if conf.get("cut_short") else "") + " |")
    y = meta.get("optimized_yaml")
    lines += ["", f"Optimized config: `{y}` → `make train CONFIG={y}`", ""]
    return "\n".join(lines)


def plot_waterfall(res: dict[str, Any], path: Path) -> Optional[str]:
    """waterfall.png: baseline → each accepted lever (cumulative, with the product of intervals) → confirmed.
    Returns None, or why there is no plot."""
    w = res["waterfall"]
    if not w["steps"]:
        return "no lever was accepted"
    # imported here, not at the top: pyplot's import (~0.5 s) would otherwise be paid by every process that imports
    # this package — the optimize commands at start, each of optimize-grid's fresh children — for one plot at most
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["baseline"] + [f"+ {s['lever']}" for s in w["steps"]]
    med = [1.0] + [s["cumulative"] for s in w["steps"]]
    lo = [1.0] + [s["cumulative_low"] for s in w["steps"]]
    hi = [1.0] + [s["cumulative_high"] for s in w["steps"]]
    conf = (res.get("confirmation") or {}).get("ratio")
    if conf and conf.get("median") is not None:
        names.append("confirmed")
        med.append(conf["median"])
        lo.append(conf["low"] if conf["low"] is not None else conf["median"])
        hi.append(conf["high"] if conf["high"] is not None else conf["median"])
    fig, ax = plt.subplots(figsize=(max(5, 1.3 * len(names)), 4))
    colors = ["#888"] + ["#3a7"] * len(w["steps"]) + (["#247"] if len(names) > len(w["steps"]) + 1 else [])
    ax.bar(range(len(names)), med, color=colors,
           yerr=[[m - a for m, a in zip(med, lo)], [b - m for m, b in zip(med, hi)]], capsize=4)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("samples/s vs baseline (95% interval)")
    ax.set_title("make optimize: accepted levers")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    return None


def write_outputs(out_dir: Path, res: dict[str, Any], meta: dict[str, Any], optimized: RunConfig,
                  settings: Optional[dict[str, Any]] = None) -> None:
    """optimized.yaml, optimize.json, optimize.md and waterfall.png (each atomically). ``settings``: what ``optimized``
    sets over the config (its header names them; None: ``res["best"]``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    over = res["best"] if settings is None else settings
    atomic_write_text(out_dir / "optimized.yaml", "# written by make optimize: the best configuration it measured "
                      f"({meta.get('config')} + {json.dumps(over)})\n" + dump_config(optimized))
    why = plot_waterfall(res, out_dir / "waterfall.png")
    payload = {**res, "meta": meta, "waterfall_png": None if why else str(out_dir / "waterfall.png"),
               "waterfall_png_unavailable_reason": why}
    atomic_write_text(out_dir / "optimize.json", json.dumps(payload, indent=2, default=str) + "\n")
    atomic_write_text(out_dir / "optimize.md", render_markdown(res, meta))
