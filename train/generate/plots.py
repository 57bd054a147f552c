"""``generate.png``: the latency CDF of each path's batched run (TTFT and E2E) and, under open-loop load, achieved
output tokens/s against p99 TTFT for the chosen path and the static-batching baseline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from train.errors import atomic_path


def plot_generate(result: dict[str, Any], path: Path) -> None:
    """Write the figure to ``path`` (atomically; matplotlib's Agg backend, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cdf, load) = plt.subplots(1, 2, figsize=(11, 4))
    for name, fig_ in result["batched"].items():
        for key, style in (("ttft", "--"), ("e2e", "-")):
            values = sorted(v for v in fig_["values_ms"][key] if v is not None)
            if values:
                cdf.step(values, [(i + 1) / len(values) for i in range(len(values))], style, where="post",
                         label=f"{name} {key}")
    floor = (result.get("floor") or {}).get("tpot_floor_ms", {}).get("batched")
    title = "batched: latency CDF" + (f" (TPOT floor {floor:.2f} ms: bytes read / bandwidth)" if floor else "")
    cdf.set(xlabel="latency (ms, log scale)", ylabel="share of requests", title=title, xscale="log")
    cdf.legend(fontsize=7)
    ol = result["open_loop"]
    for name, levels in ((f"{ol['path']}", ol["levels"]), ("static batching (dynamic)", ol["baseline"])):
        xs = [lv["output_tokens_per_s"] for lv in levels]
        ys = [lv["ttft_ms"]["p99"] for lv in levels]
        load.plot(xs, ys, "o-", label=name)
    load.set(xlabel="output tokens/s (achieved)", ylabel="p99 TTFT (ms)", title="open loop: throughput vs p99 TTFT")
    load.legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
