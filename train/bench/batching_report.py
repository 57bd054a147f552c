"""Outputs of ``bench-batching``: JSON, a markdown table and a PNG bar chart (matplotlib, Agg backend)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from train.errors import atomic_path, atomic_write_text


def markdown_table(result: dict[str, Any]) -> str:
    """The ``results`` rows as a GitHub markdown table, then the targets and the DP optimum per K."""
    lines = ["| method | token efficiency | distinct shapes | batches/epoch | samples/s | tokens/s | "
             "samples/s ÷ pad-to-max | tokens/s ÷ pad-to-max |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["results"]:
        lines.append(f"| `{r['name']}` | {r['token_efficiency']:.3f} | {r['distinct_shapes']} | "
                     f"{r['batches_per_epoch']} | "
                     f"{r['samples_per_s']:.1f} | {r['tokens_per_s']:.0f} | {r['samples_per_s_vs_pad_to_max']:.2f}× | "
                     f"{r['tokens_per_s_vs_pad_to_max']:.2f}× |")
    d, c, e = result["data"], result["config"], result["env"]
    lines += ["", f"{d['train_samples']} training samples of {d['name']} (mean length {d['mean_length']:.1f}, "
              f"max {d['max_length']}), model `{result['model']['preset']}`, batch {c['batch_size']}, "
              f"max_tokens {c['max_tokens']}; medians of {c['windows']} windows of ~{c['window_samples']} samples "
              f"after {c['warmup_windows']} warm-up round(s), methods interleaved. Device {e.get('device')}, "
              f"{e['num_threads']} threads, load average {e['load_avg_1m_start']:.1f} → {e['load_avg_1m_end']:.1f}.",
              "", "| target | value | reached |", "| --- | ---: | --- |"]
    for name, t in result["targets"].items():
        row = f" ({t['row']})" if "row" in t else ""
        lines.append(f"| {name} {t['target']}{row} | {t['value']:.3f} | {'yes' if t['reached'] else 'no'} |")
        if "not_reached_reason" in t:
            lines.append(f"| ↳ {t['not_reached_reason']} | | |")
    lines += ["", "Exact DP optimum (pad to bucket bound) per K: "
              + ", ".join(f"K={t['k']}: {t['token_efficiency']:.4f}" for t in result["dp_optimum_by_k"]), ""]
    return "\n".join(lines)


def bar_chart(result: dict[str, Any], path: Path) -> None:
    """Two panels: token efficiency and samples/s per method (ratio to pad-to-max on each bar)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["results"]
    names = [r["name"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    for ax, key, title in ((axes[0], "token_efficiency", "token efficiency (real ÷ processed tokens)"),
                           (axes[1], "samples_per_s", "training samples/s (median)")):
        values = [r[key] for r in rows]
        bars = ax.bar(range(len(rows)), values, color=["#999999"] * 3 + ["#6a9fd4"] + ["#1f5fa8"] * (len(rows) - 4))
        for bar, r in zip(bars, rows):
            label = f"{r[key]:.2f}" if key == "token_efficiency" else f"{r['samples_per_s_vs_pad_to_max']:.1f}×"
            ax.annotate(f"{label}\n{r['distinct_shapes']} shapes",
                        (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(rows)), names, rotation=30, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_ylim(0, max(values) * 1.2)
    fig.suptitle(f"bench-batching: {result['data']['train_samples']} {result['data']['name']} samples, "
                 f"model {result['model']['preset']}, {result['env'].get('device')}", fontsize=10)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)


def write_outputs(result: dict[str, Any], run_dir: Path) -> None:
    """``bench-batching.json``, ``bench-batching.md`` and ``bench-batching.png`` in ``run_dir`` (atomic)."""
    atomic_write_text(run_dir / "bench-batching.json", json.dumps(result, indent=2) + "\n")
    atomic_write_text(run_dir / "bench-batching.md", markdown_table(result))
    bar_chart(result, run_dir / "bench-batching.png")
