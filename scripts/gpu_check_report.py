"""The summaries of scripts/gpu_check.sh (stdlib only: runs with any python, before or without torch).

    gpu_check_report.py line  WORK STEP MODE        one line for a finished step
    gpu_check_report.py ok    WORK STEP MODE        exit 0 if the step passed
    gpu_check_report.py write WORK OUT MODE STEPS   OUT/gpu_check.json + gpu_check.md, a few PNGs/traces copied

WORK holds the steps' run directories, ``steps/<step>.status`` ("rc seconds timeout_s") and ``steps/<step>.log``.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

NO_GPU = 77  # verify_gpu's exit code on a host without a GPU: expected in a dry run
TIMEOUT_RCS = (124, 137)
TARGETS = "MFU >= 40% of the measured matmul peak; optimized >= 2x hf-style samples/s; compile: 0 recompiles after " \
          "warm-up, steady step >= 1.3x faster than eager; bf16/fp16 eval accuracy within 1.0 point of fp32; " \
          "0 host syncs; fsdp + offload: parameters + gradients + optimizer state on the device per rank <= 0.1x ddp's"


def _load(path: Optional[Path]) -> Optional[dict]:
    try:
        return json.loads(path.read_text()) if path is not None and path.is_file() else None
    except (OSError, ValueError):
        return None


def _find(work: Path, pattern: str) -> Optional[Path]:
    hits = sorted(work.glob(pattern))
    return hits[0] if hits else None


def _f(x: Any, spec: str = ".1f", scale: float = 1.0) -> str:
    return "n/a" if not isinstance(x, (int, float)) or isinstance(x, bool) else format(x * scale, spec)


# -- per step: where its result is, and its headline --------------------------------------------------------------
def _verify(work: Path) -> tuple[Optional[dict], str]:
    r = _load(work / "verify_gpu.json")
    if r is None:
        return None, "no verify_gpu.json"
    counts: dict[str, int] = {}
    for c in r.get("checks", []):
        counts[c.get("status", "?")] = counts.get(c.get("status", "?"), 0) + 1
    fails = [c["name"] for c in r.get("checks", []) if c.get("status") == "FAIL"]
    return r, f"verdict {r.get('verdict')}; " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) + \
        (f"; FAIL: {', '.join(fails)}" if fails else "")


def _precision(work: Path) -> tuple[Optional[dict], str]:
    r = _load(_find(work, "gc-precision*/bench-precision.json"))
    if r is None:
        return None, "no bench-precision.json"
    parts = [f"{row.get('requested')}→{row.get('precision')}: {_f(row.get('step_time_ms_p50'))} ms/step, "
             f"peak {_f(row.get('peak_memory_bytes'), '.2f', 1 / 2**30)} GiB, acc {_f(row.get('eval_accuracy'), '.3f')}"
             + (f" (gap {_f(row.get('accuracy_gap_points'), '+.2f')} pt)" if "accuracy_gap_points" in row else "")
             for row in r.get("rows", [])]
    return r, "; ".join(parts)


def _bench(work: Path) -> tuple[Optional[dict], str]:
    r = _load(_find(work, "gc-bench*/bench/bench.json"))
    if r is None:
        return None, "no bench.json"
    rows = r.get("training", {}).get("configs", [])
    parts = [f"{row.get('name')}: {_f(row.get('samples_per_s'), '.0f')} samples/s, "
             f"MFU {_f(row.get('mfu_vs_table_peak'), '.1%')} "
             f"table / {_f(row.get('mfu_vs_measured_peak'), '.1%')} measured, "
             f"{_f(row.get('energy_j_per_sample'), '.3f')} J/sample"
             for row in rows]
    inf = r.get("inference") or {}
    lat = [f"{k} p50 {_f((v.get('latency_ms') or {}).get('p50'), '.2f')} ms" for k, v in inf.items()
           if isinstance(v, dict) and "latency_ms" in v]
    return r, "; ".join(parts + lat)


def _compile(pattern: str) -> Callable[[Path], tuple[Optional[dict], str]]:
    def get(work: Path) -> tuple[Optional[dict], str]:
        r = _load(_find(work, pattern))
        if r is None:
            return None, "no bench-compile.json"
        return r, (f"step p50 eager {_f(r.get('eager_step_ms_p50'), '.2f')} ms, "
                   f"compiled {_f(r.get('compiled_step_ms_p50'), '.2f')} ms "
                   f"(eager/compiled {_f(r.get('speedup_eager_over_compiled_p50'), '.2f')}x); recompiles after warm-up "
                   f"{r.get('recompiles_after_warmup')}; first step cold {_f(r.get('cold_first_step_s'))} s, warm "
                   f"{_f(r.get('warm_first_step_s'))} s, eager {_f(r.get('eager_first_step_s'))} s")
    return get


def _run(work: Path) -> tuple[Optional[dict], str]:
    run = _find(work, "gc-compile-run*")
    r = _load(run / "report.json" if run else None)
    if r is None:
        return None, "no report.json"
    w = _load(run / "warmup.json") or {}
    c, p = r.get("compile", {}), r.get("perf", {})
    t = w.get("totals", {})
    out = {"report": {k: r.get(k) for k in ("status", "compile", "perf", "quality", "batching", "precision")},
           "warmup": w}
    return out, (f"compile {c.get('status')} ({c.get('mode')}), {t.get('shapes')} shapes warmed "
                 f"({t.get('train_shapes')} train, "
                 f"{t.get('eval_shapes')} eval) in {_f(t.get('warmup_s'))} s; "
                 f"recompiles after warm-up {c.get('recompiles_after_warmup')}; "
                 f"step p50 {_f((p.get('step_time_ms') or {}).get('p50'), '.2f')} ms; "
                 f"first step {_f(p.get('first_step_ms'), '.0f')} ms")


def _profile(work: Path) -> tuple[Optional[dict], str]:
    run = _find(work, "gc-profile*")
    r = _load(run / "profile" / "summary.json" if run else None)
    if r is None:
        return None, "no profile summary.json"
    top = r.get("verdicts") or r.get("top_ops") or r.get("ops") or []
    names = [str(o.get("name", o))[:40] for o in top[:3]] if isinstance(top, list) else []
    return r, (f"profiled step median {_f(r.get('profiled_step_time_ms_median'), '.2f')} ms; skipped: "
               f"{', '.join(sorted(r.get('skipped', {}))) or 'none'}" + (f"; top: {'; '.join(names)}" if names else ""))


def _sync(work: Path) -> tuple[Optional[dict], str]:
    r = _load(work / "sync_audit.json")
    if r is None:
        return None, "no sync_audit.json"
    return r, f"{r.get('host_syncs')} host sync(s) in {r.get('watched_steps')} steady steps ({r.get('method')})"


def _optimize(work: Path) -> tuple[Optional[dict], str]:
    run = _find(work, "gc-optimize*")
    r = _load(run / "optimize" / "optimize.json" if run else None)
    if r is None:
        return None, "no optimize.json"
    kept = [f"{d['lever']}={d['value']}" for d in r.get("decisions", []) if d.get("accepted")]
    conf = (r.get("confirmation") or {}).get("ratio") or {}
    end = (f"optimized vs baseline {_f(conf.get('median'), '.2f')}x [{_f(conf.get('low'), '.2f')}, "
           f"{_f(conf.get('high'), '.2f')}]" if conf else "no end-to-end confirmation (nothing kept)")
    return r, (f"{r.get('status')} after {_f(r.get('seconds'), '.0f')} s; {len(r.get('decisions', []))} A/Bs; kept "
               f"{', '.join(kept) or 'nothing'}; {end}")


def _causal(work: Path) -> tuple[Optional[dict], str]:
    run = _find(work, "gc-causal*")
    r = _load(run / "report.json" if run else None)
    if r is None:
        return None, "no report.json"
    p, q, lv = r.get("perf", {}), r.get("quality") or {}, r.get("levers", {})
    out = {k: r.get(k) for k in ("status", "task", "perf", "quality", "compile", "levers", "batching")}
    return out, (f"test perplexity {_f(q.get('test_perplexity'), '.1f')}; "
                 f"{_f(p.get('throughput_target_tokens_per_s'), '.0f')} target tokens/s; "
                 f"MFU {_f(p.get('mfu'), '.3f')}; "
                 f"chunked loss "
                 f"{(lv.get('chunked_loss') or {}).get('applied')}; compile {(r.get('compile') or {}).get('enabled')}; "
                 f"peak memory {_f(p.get('peak_memory_bytes'), '.0f', 1 / (1 << 20))} MiB")


def _generate(pattern: str) -> Callable[[Path], tuple[Optional[dict], str]]:
    def get(work: Path) -> tuple[Optional[dict], str]:
        r = _load(_find(work, pattern))
        if r is None:
            return None, "no generate.json"
        keep = ("source", "precision", "device", "chosen_path", "choice", "paths", "correctness", "first_response",
                "decode_profile", "kv_cache", "peak_memory_bytes", "energy_j_per_output_token",
                "energy_unavailable_reason", "max_new_tokens")
        out = {k: r.get(k) for k in keep}
        out["single"] = {p: {k: f.get(k) for k in ("ttft_ms", "tpot_ms", "e2e_ms", "output_tokens_per_s")}
                         for p, f in (r.get("single") or {}).items()}
        out["batched"] = {p: {k: f.get(k) for k in ("ttft_ms", "tpot_ms", "output_tokens_per_s", "batch_size")}
                          for p, f in (r.get("batched") or {}).items()}
        out["open_loop"] = {"path": (r.get("open_loop") or {}).get("path"),
                            "levels": [{k: lv.get(k) for k in ("load", "ttft_ms", "tpot_ms", "output_tokens_per_s")}
                                       for lv in (r.get("open_loop") or {}).get("levels", [])]}
        parts = [f"{p}: batch-1 TTFT {_f(f['ttft_ms'].get('p50'))} ms, TPOT {_f(f['tpot_ms'].get('p50'), '.2f')} ms; "
                 f"batched {_f(out['batched'].get(p, {}).get('output_tokens_per_s'), '.0f')} tok/s"
                 for p, f in out["single"].items()]
        fresh = (r.get("first_response") or {}).get("fresh_process") or {}
        ratio = _f(fresh.get("warm_over_cold_first_response"), ".2f")
        return out, (f"{r.get('precision')}, chosen {r.get('chosen_path')}; " + "; ".join(parts)
                     + (f"; fresh process warm/cold first response {ratio}" if fresh.get("cold") else ""))
    return get


def _mib(x: Any) -> str:
    return _f(x, ".1f", 1 / (1 << 20)) + " MiB"


def _fsdp_memory(work: Path) -> tuple[Optional[dict], str]:
    r = _load(work / "fsdp_memory.json")
    if r is None:
        return None, "no fsdp_memory.json"
    gpu = r.get("device") == "cuda"
    worst = {s: max((rank.get("on_device") if gpu else rank.get("total")) or 0 for rank in r.get(s) or [{}])
             for s in ("ddp", "fsdp", "fsdp-offload")}
    ratio = _f((r.get("on_device_over_ddp_per_rank") or {}).get("fsdp-offload"), ".3f")
    return r, (f"{r.get('ranks')} rank(s) on {r.get('device')}, {r.get('precision')}, {r.get('parameters')} "
               f"parameters; state per rank {'on the device' if gpu else 'in all (the CPU: device = host)'}: "
               f"ddp {_mib(worst['ddp'])}, fsdp {_mib(worst['fsdp'])}, fsdp+offload {_mib(worst['fsdp-offload'])}"
               + (f" ({ratio}x ddp's; target <= 0.1)" if gpu else "")
               + f"; offload vs fsdp max loss difference {_f(r.get('offload_max_loss_difference'), '.2e')}")


def _fsdp_run(work: Path) -> tuple[Optional[dict], str]:
    run = _find(work, "gc-fsdp*")
    r = _load(run / "report.json" if run else None)
    if r is None:
        return None, "no report.json"
    env, q, d = r.get("env") or {}, r.get("quality") or {}, r.get("dist") or {}
    out = {k: r.get(k) for k in ("status", "dist", "perf", "quality", "model", "export")}
    return out, (f"{r.get('status')}: {env.get('world_size')} ranks ({env.get('distributed_backend')}), strategy "
                 f"{d.get('strategy')}, offload {d.get('offload')}; final train loss "
                 f"{_f(q.get('final_train_loss'), '.3f')}; peak memory rank 0 "
                 f"{_mib((r.get('perf') or {}).get('peak_memory_bytes'))}")


STEPS: dict[str, Callable[[Path], tuple[Optional[dict], str]]] = {
    "verify-gpu": _verify, "bench-precision": _precision, "bench": _bench,
    "compile-default": _compile("gc-compile-default*/bench-compile.json"),
    "compile-reduce-overhead": _compile("gc-compile-ro*/bench-compile.json"),
    "compile-run": _run, "profile": _profile, "sync-audit": _sync, "optimize": _optimize, "causal-lm": _causal,
    "generate": _generate("gc-generate/generate.json"), "generate-0.5b": _generate("gc-generate-05b/generate.json"),
    "fsdp": _fsdp_memory, "fsdp-run": _fsdp_run,
}


def step_record(work: Path, name: str, mode: str) -> dict[str, Any]:
    """The step's status, timing, headline, result JSON and (when it failed) the tail of its log."""
    status_file = work / "steps" / f"{name}.status"
    if not status_file.is_file():
        return {"status": "not run", "passed": None}
    rc, seconds, limit = (int(x) for x in status_file.read_text().split())
    result, headline = STEPS[name](work)
    expected_no_gpu = name == "verify-gpu" and rc == NO_GPU and mode == "dry-run"
    passed = (rc == 0 or expected_no_gpu) and (result is not None)
    status = "timeout" if rc in TIMEOUT_RCS else ("ok" if passed else "failed")
    rec: dict[str, Any] = {"status": status, "passed": passed, "rc": rc, "seconds": seconds, "timeout_s": limit,
                           "headline": headline, "result": result}
    if expected_no_gpu:
        rec["note"] = "no GPU on this host (exit 77): expected in a dry run"
    if not passed:
        log = work / "steps" / f"{name}.log"
        lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
        rec["error"] = "\n".join(lines[-25:]) or f"exit {rc}, no output"
    return rec


def targets(steps: dict[str, dict]) -> dict[str, Any]:
    """The issue's GPU targets, evaluated where the numbers exist (None: not measured)."""
    def res(name: str) -> dict:
        return (steps.get(name) or {}).get("result") or {}

    rows = {r.get("name"): r for r in res("bench").get("training", {}).get("configs", [])}
    opt, hf = rows.get("optimized", {}), rows.get("hf-style", {})
    prec = [r for r in res("bench-precision").get("rows", []) if "accuracy_gap_points" in r]
    ro = res("compile-reduce-overhead")
    run = (res("compile-run").get("report") or {}).get("compile", {})
    sync = res("sync-audit")
    offload = (res("fsdp").get("on_device_over_ddp_per_rank") or {}).get("fsdp-offload")

    def ok(v: Any, cond: Callable[[Any], bool]) -> Optional[bool]:
        return None if v is None else bool(cond(v))

    speed = ((opt.get("samples_per_s") / hf["samples_per_s"])
             if opt.get("samples_per_s") and hf.get("samples_per_s") else None)
    gaps = [r.get("accuracy_gap_points") for r in prec] if prec else None
    return {
        "mfu_vs_measured_peak_ge_40pct": {"value": opt.get("mfu_vs_measured_peak"),
                                          "reached": ok(opt.get("mfu_vs_measured_peak"), lambda v: v >= 0.40)},
        "optimized_over_hf_style_samples_ge_2x": {"value": speed, "reached": ok(speed, lambda v: v >= 2.0)},
        "compile_recompiles_after_warmup_eq_0": {"value": run.get("recompiles_after_warmup"),
                                                 "reached": ok(run.get("recompiles_after_warmup"), lambda v: v == 0)},
        "cuda_graphs_steady_speedup_ge_1_3x": {"value": ro.get("speedup_eager_over_compiled_p50"),
                                               "reached": ok(ro.get("speedup_eager_over_compiled_p50"),
                                                             lambda v: v >= 1.3)},
        "bf16_fp16_accuracy_within_1pt_of_fp32": {"value": gaps,
                                                  "reached": ok(gaps, lambda v: all(g is not None and abs(g) <= 1.0
                                                                                    for g in v))},
        "host_syncs_in_steady_steps_eq_0": {"value": sync.get("host_syncs"),
                                            "reached": ok(sync.get("host_syncs"), lambda v: v == 0)},
        "fsdp_offload_device_state_le_0_1x_ddp": {"value": offload, "reached": ok(offload, lambda v: v <= 0.1)},
    }


def write(work: Path, out: Path, mode: str, names: list[str]) -> int:
    steps = {n: step_record(work, n, mode) for n in names}
    copied = _copy_artifacts(work, out)
    doc = {"mode": mode, "passed": all(s["passed"] is not False for s in steps.values()), "steps": steps,
           "targets": targets(steps) if mode == "gpu" else "not evaluated in a dry run (CPU, tiny sizes)",
           "target_definitions": TARGETS, "artifacts": copied, "work_dir": str(work)}
    (out / "gpu_check.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    md = [f"# gpu_check ({mode})", "", "| step | status | seconds | summary |", "| --- | --- | --- | --- |"]
    for n, s in steps.items():
        md.append(f"| {n} | {s['status']} | {s.get('seconds', '')} / {s.get('timeout_s', '')} | "
                  f"{str(s.get('headline', s.get('note', ''))).replace('|', '/')} |")
    if isinstance(doc["targets"], dict):
        md += ["", "## Targets", "", "| target | value | reached |", "| --- | --- | --- |"]
        md += [f"| {k} | {v['value']} | {v['reached']} |" for k, v in doc["targets"].items()]
    failed = [n for n, s in steps.items() if s["passed"] is False]
    for n in failed:
        md += ["", f"## {n}: {steps[n]['status']}", "", "```", steps[n].get("error", ""), "```"]
    md += ["", f"Artifacts: {', '.join(copied) or 'none'}; full run directories in {work}."]
    (out / "gpu_check.md").write_text("\n".join(md) + "\n")
    return 1 if failed else 0


def _copy_artifacts(work: Path, out: Path, limit_bytes: int = 50 << 20) -> list[str]:
    """At most 6 files beside gpu_check.json/.md: the bench and GPU-sampling plots and the profiler trace."""
    wanted = [("gc-bench*/bench/throughput.png", "bench_throughput.png"),
              ("gc-bench*/bench/memory.png", "bench_memory.png"),
              ("gc-bench*/bench/latency_cdf.png", "bench_latency_cdf.png"),
              ("gc-profile*/profile/gpu_samples.png", "profile_gpu_samples.png"),
              ("gc-profile*/profile/trace.json.gz", "profile_trace.json.gz")]
    copied = []
    for pattern, name in wanted:
        src = _find(work, pattern)
        if src is not None and src.stat().st_size <= limit_bytes:
            shutil.copyfile(src, out / name)
            copied.append(name)
    return copied


def main(argv: list[str]) -> int:
    cmd, work = argv[0], Path(argv[1])
    if cmd == "write":
        return write(work, Path(argv[2]), argv[3], argv[4].split(","))
    name, mode = argv[2], argv[3]
    rec = step_record(work, name, mode)
    if cmd == "ok":
        return 0 if rec["passed"] else 1
    extra = f": {rec.get('note')}" if rec.get("note") else ""
    print(f"{name}: {rec['status'].upper()} (exit {rec.get('rc')}, {rec.get('seconds')} s){extra} — "
          f"{rec.get('headline', '')}",
          flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
