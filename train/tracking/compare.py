"""``python -m train compare RUN_A RUN_B …``: runs side by side, without the network.

Reads each run's ``report.json`` (and ``metrics.jsonl`` for curves) and writes
``compare.md`` (a markdown table: quality, throughput, step time, memory, padding, W&B) and
``compare.png`` (matplotlib, Agg backend: loss, throughput, token efficiency per logged step, and
peak memory). Ratios are against the first run.

Given ``bench.json`` files (``make bench`` results, e.g. from two machines), it compares benchmarks instead
(:func:`compare_bench`): the machines (CPU model and flags or GPU, torch, threads, load) and, per training
configuration, samples/s of each file and its ratio to the first.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from train.errors import UserError, atomic_path, atomic_write_text


def resolve_run_dir(arg: str, runs_root: str = "runs") -> Path:
    """``arg`` as a run directory (or a report.json inside one); a bare name is also looked up under ``runs_root``.

    Raises:
        UserError: no such directory, or no report.json in it.
    """
    p = Path(arg)
    if p.name == "report.json" and p.is_file():
        p = p.parent
    if not p.is_dir() and (Path(runs_root) / arg).is_dir():
        p = Path(runs_root) / arg
    if not p.is_dir():
        raise UserError(f"run directory {arg} does not exist; pass a path like runs/<run-id>")
    if not (p / "report.json").is_file():
        raise UserError(f"{p} has no report.json (did the run finish?); "
                        f"train it with `python -m train train --run-id {p.name}`")
    return p


def load_run(run_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``(report, metric records)`` of a run directory.

    Raises:
        UserError: report.json or a metrics.jsonl line is not valid JSON (names the file and line).
    """
    path = run_dir / "report.json"
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg}); "
                        "rerun the training or remove the run") from None
    if not isinstance(report, dict):
        raise UserError(f"{path}: expected a JSON object")
    records: list[dict[str, Any]] = []
    mpath = run_dir / "metrics.jsonl"
    if mpath.is_file():
        for i, line in enumerate(mpath.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise UserError(f"{mpath}:{i}: malformed JSON ({exc.msg}); each line must be one JSON object") from None
    return report, records


def _get(report: dict, dotted: str) -> Any:
    cur: Any = report
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


def _fmt(value: Any, fmt: str) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return format(value, fmt)
    return str(value)


def _mib(v: Any) -> Optional[float]:
    return v / 2**20 if isinstance(v, (int, float)) else None


# (row label, getter, format, show ratio vs the first run)
ROWS: list[tuple[str, Callable[[dict], Any], str, bool]] = [
    ("device", lambda r: _get(r, "env.device_type"), "", False),
    ("precision", lambda r: _get(r, "env.precision"), "", False),
    ("batching method", lambda r: _get(r, "batching.method"), "", False),
    ("steps", lambda r: _get(r, "perf.steps"), "d", False),
    ("final train loss", lambda r: _get(r, "quality.final_train_loss"), ".4f", False),
    ("eval accuracy", lambda r: _get(r, "quality.eval_accuracy"), ".4f", False),
    ("test accuracy", lambda r: _get(r, "quality.test_accuracy"), ".4f", False),
    ("test macro-F1", lambda r: _get(r, "quality.test_macro_f1"), ".4f", False),
    ("throughput (samples/s)", lambda r: _get(r, "perf.throughput_samples_per_s"), ".1f", True),
    ("throughput (tokens/s)", lambda r: _get(r, "perf.throughput_tokens_per_s"), ".0f", True),
    ("step time p50 (ms)", lambda r: _get(r, "perf.step_time_ms.p50"), ".1f", True),
    ("step time p99 (ms)", lambda r: _get(r, "perf.step_time_ms.p99"), ".1f", True),
    ("time to first step (s)", lambda r: _get(r, "perf.time_to_first_step_s"), ".1f", False),
    ("peak memory (MiB)", lambda r: _mib(_get(r, "perf.peak_memory_bytes")), ".0f", True),
    ("token efficiency", lambda r: _get(r, "batching.token_efficiency"), ".3f", False),
    ("padding ratio", lambda r: _get(r, "batching.padding_ratio"), ".3f", False),
    ("distinct shapes", lambda r: _get(r, "batching.distinct_shapes"), "d", False),
    ("wall time (s)", lambda r: _get(r, "perf.wall_time_s"), ".0f", False),
    ("W&B", lambda r: (None if _get(r, "tracking") is None else
                       (_get(r, "tracking.wandb_mode") if _get(r, "tracking.wandb_active") else "off")), "", False),
]


def markdown_table(names: list[str], reports: list[dict]) -> str:
    """One column per run; numeric perf rows also show ×ratio against the first run."""
    lines = ["| metric | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
    for label, get, fmt, ratio in ROWS:
        values = [get(r) for r in reports]
        cells = []
        for i, v in enumerate(values):
            cell = _fmt(v, fmt)
            base = values[0]
            if ratio and i > 0 and isinstance(v, (int, float)) and isinstance(base, (int, float)) and base:
                cell += f" (×{v / base:.2f})"
            cells.append(cell)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(names: list[str], reports: list[dict], records: list[list[dict]], out: Path) -> None:
    """2×2 PNG: training loss, samples/s and token efficiency per logged step; peak memory per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    panels = [(axes[0][0], "loss", "training loss"), (axes[0][1], "samples_per_s", "throughput (samples/s)"),
              (axes[1][0], "token_efficiency", "token efficiency (1 = no padding)")]
    for ax, key, title in panels:
        for name, recs in zip(names, records):
            pts = [(r["step"], r[key]) for r in recs
                   if r.get("event") is None and r.get(key) is not None and "step" in r]
            if pts:
                ax.plot(*zip(*pts), label=name, marker="." if len(pts) < 30 else None)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    ax = axes[1][1]
    mem = [_mib(_get(r, "perf.peak_memory_bytes")) or 0.0 for r in reports]
    ax.bar(range(len(names)), mem, color=[f"C{i}" for i in range(len(names))])
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=20, fontsize=8)
    ax.set_title("peak memory (MiB)")
    fig.tight_layout()
    with atomic_path(out) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)


def compare(run_args: list[str], out_dir: Optional[str] = None, runs_root: str = "runs") -> tuple[str, Path, Path]:
    """Compare runs; writes ``compare.md`` and ``compare.png`` into ``out_dir`` (default ``<runs_root>/compare``).

    Returns ``(markdown, md_path, png_path)``. Raises UserError for a missing run/report or bad JSON.
    """
    if not run_args:
        raise UserError("compare needs at least one run directory, e.g. python -m train compare runs/a runs/b")
    dirs = [resolve_run_dir(a, runs_root) for a in run_args]
    loaded = [load_run(d) for d in dirs]
    names = [d.name for d in dirs]
    if len(set(names)) < len(names):
        names = [str(d) for d in dirs]
    reports = [r for r, _ in loaded]
    records = [m for _, m in loaded]
    md = markdown_table(names, reports)
    out = Path(out_dir) if out_dir else Path(runs_root) / "compare"
    md_path, png_path = out / "compare.md", out / "compare.png"
    plot(names, reports, records, png_path)
    atomic_write_text(md_path, f"# Run comparison\n\n{md}\n![curves](compare.png)\n")
    return md, md_path, png_path


def is_bench_file(arg: str) -> bool:
    """True for a ``bench.json`` file (or a directory holding ``bench.json`` or ``bench/bench.json``)."""
    p = Path(arg)
    return (p.is_file() and p.suffix == ".json" and p.name != "report.json") or (p / "bench.json").is_file() or \
        (p / "bench" / "bench.json").is_file()


def load_bench(arg: str) -> dict[str, Any]:
    """A ``make bench`` result. Raises UserError: not JSON, or not a bench.json (no ``training.configs``)."""
    p = Path(arg)
    p = p if p.is_file() else (p / "bench.json" if (p / "bench.json").is_file() else p / "bench" / "bench.json")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{p}: not a readable bench.json ({exc.__class__.__name__})") from None
    if not isinstance(data, dict) or not isinstance(data.get("training", {}).get("configs"), list):
        raise UserError(f"{p}: not a `make bench` result (no training.configs); pass runs/<id>/bench/bench.json")
    return data


def compare_bench(args: list[str], out_dir: Optional[str] = None, runs_root: str = "runs") -> tuple[str, Path]:
    """Benchmarks side by side: ``compare_bench.md`` with the machines and, per configuration present in every file,
    samples/s and the ratio to the first file. Returns ``(markdown, md_path)``."""
    benches = [load_bench(a) for a in args]
    lines = ["| | " + " | ".join(args) + " |", "|---|" + "---|" * len(args)]
    for label, key in (("device", "device"), ("CPU flags", "cpu_flags"), ("torch", "torch"),
                       ("torch threads", "num_threads"), ("load at start / end", None)):
        cells = []
        for b in benches:
            env = b.get("env", {})
            value = (f"{_fmt(env.get('load_1min'), '.2f')} / {_fmt(env.get('load_1min_at_end'), '.2f')}" if key is None
                     else ", ".join(env[key]) if isinstance(env.get(key), list) else _fmt(env.get(key), ""))
            cells.append(value)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    rows = [{r["name"]: r for r in b["training"]["configs"]} for b in benches]
    common = [n for n in rows[0] if all(n in r for r in rows[1:])]
    lines += ["", "| config | " + " | ".join(f"samples/s ({i + 1})" for i in range(len(args))) + " | "
              + " | ".join(f"× ({i + 1} vs 1)" for i in range(1, len(args))) + " |",
              "|---|" + "---|" * (2 * len(args) - 1)]
    for name in common:
        values = [r[name]["samples_per_s"] for r in rows]
        ratios = [_fmt(v / values[0] if values[0] else None, ".2f") for v in values[1:]]
        lines.append(f"| {name} | " + " | ".join(_fmt(v, ".1f") for v in values) + " | " + " | ".join(ratios) + " |")
    md = "\n".join(lines) + "\n"
    out = Path(out_dir) if out_dir else Path(runs_root) / "compare"
    md_path = out / "compare_bench.md"
    atomic_write_text(md_path, f"# Benchmark comparison\n\n{md}")
    return md, md_path
