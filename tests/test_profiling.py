"""Profiling: attribution on a real trace, verdict boundaries, intensity arithmetic, py-spy preflight,
nsys absent / stale export, GPU sample files."""

from __future__ import annotations

import gzip
import json
import os
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from train.config.profiling import ProfileConfig
from train.profiling import attribution as A
from train.profiling.nsys import StaleExportError, check_fresh, export_stats, nsys_available, parse_stats_csv
from train.profiling.ops import OpRecord, bytes_moved, estimated_flops
from train.profiling.pyspy import PySpyPhase, ptrace_preflight
from train.profiling.ranges import null_ranges
from train.profiling.session import ProfileSession
from train.profiling.window import TorchProfileWindow
from train.run.profile import run_profile
from train.run.training import run_training

PROFILE = ["profile.wait=1", "profile.warmup=1", "profile.active=3", "profile.top_k=40"]


def fake_proc(root: Path, cap_eff: str = "0000000000000000", scope: str | None = "2", tracer: str = "0") -> Path:
    (root / "self").mkdir(parents=True)
    (root / "self" / "status").write_text(f"Name:\tpython\nTracerPid:\t{tracer}\nCapEff:\t{cap_eff}\n")
    if scope is not None:
        (root / "sys" / "kernel" / "yama").mkdir(parents=True)
        (root / "sys" / "kernel" / "yama" / "ptrace_scope").write_text(scope + "\n")
    return root


def test_attribution_on_real_trace_bucketed_vs_pad_to_max(tiny_cfg, tmp_path: Path) -> None:
    proc = fake_proc(tmp_path / "proc")  # ptrace denied: py-spy must be skipped and training must finish
    summaries = {}
    # the timing-based rules (launch-bound, memory, compute, optimizer, other, data wait) are switched off by
    # thresholds no share reaches, so which recommendations make the top three does not depend on this machine's
    # timings; the padding rule's input (the padding share) is exact
    timing_rules_off = [f"profile.{k}=0.999" for k in ("data_bound_share", "launch_share", "memory_share",
                                                        "compute_share", "optimizer_share", "other_share")]
    for method, extra in (("optimal", []), ("pad-to-max", ["profile.max_trace_mb=0.001"])):
        cfg = tiny_cfg(f"batching.method={method}", f"train.run_id={method}", "train.max_steps=6", "train.eval_every=6",
                       *PROFILE, *timing_rules_off, "profile.top_k=1000", *extra)  # every op group in the table
        session = ProfileSession(cfg, ["torch", "pyspy"], proc_root=proc)
        report = run_training(cfg, time.perf_counter(), hooks=(session,))
        assert session.trainer.ranges is null_ranges  # profiler detached: its ranges and its callbacks
        assert not [cb for cb in session.trainer.callbacks if isinstance(cb, (TorchProfileWindow, PySpyPhase))]
        out = Path(report["run_dir"]) / "profile"
        s = json.loads((out / "summary.json").read_text())
        on_disk = json.loads((Path(report["run_dir"]) / "report.json").read_text())
        assert on_disk["profile"]["summary_json"] == str(out / "summary.json")
        assert "--cap-add SYS_PTRACE" in s["skipped"]["pyspy"] and "kernel.yama.ptrace_scope" in s["skipped"]["pyspy"]
        assert s["active_steps"] == 3 and s["ranked_by"] == "self CPU time"
        times = [r["self_time_us"] for r in s["table"]]
        assert times == sorted(times, reverse=True) and 8 <= len(times) <= 1000
        # the matmuls are there with the profiler's FLOPs wherever they rank (on a busy CPU, elementwise ops and
        # fused AdamW can outrank this tiny model's matmuls, so a top-k cut would make this timing-dependent)
        assert any(r["op"] in ("aten::mm", "aten::addmm", "aten::bmm") and r["flops"] > 0 for r in s["table"])
        for r in s["table"]:
            assert r["verdict"] in (A.COMPUTE, A.MEMORY, A.LAUNCH, A.UNKNOWN)
            if r["self_time_us"] > 0:  # the tail of every op group can be 0 (or, on torch 2.1, slightly negative) µs
                assert 0 < r["share_of_step"] <= 1
        br = s["breakdown_ms"]
        assert sum(br.values()) == pytest.approx(s["step_time_ms"], rel=1e-6)
        assert br["forward"] > 0 and br["loss"] > 0 and br["backward"] > 0 and br["optimizer"] > 0
        assert s["roofline"]["source"] == "measured" and s["roofline"]["ridge_flop_per_byte"] > 0
        assert "## Recommendations" in (out / "summary.md").read_text()
        summaries[method] = (s, out)
    bucketed, padded = summaries["optimal"][0], summaries["pad-to-max"][0]
    assert padded["context"]["padding_share"] > 0.4 > bucketed["context"]["padding_share"]
    assert "padding" in [r["rule"] for r in padded["recommendations"]]
    assert "padding" not in [r["rule"] for r in bucketed["recommendations"]]
    pad_rec = next(r for r in padded["recommendations"] if r["rule"] == "padding")
    assert f"{100 * padded['context']['padding_share']:.1f}%" in pad_rec["text"]  # cites its number
    # trace: gzipped Chrome JSON within the default cap; over a tiny cap it is deleted and said so
    trace = bucketed["trace"]
    assert trace["within_cap"] and trace["bytes"] == os.path.getsize(trace["path"]) < 50 * 2**20
    with gzip.open(trace["path"], "rt") as f:
        assert any(e.get("name") == "train/forward" for e in json.load(f)["traceEvents"])
    assert padded["trace"]["within_cap"] is False and padded["trace"]["path"] is None
    assert not (summaries["pad-to-max"][1] / "trace.json.gz").exists()


def row(**kw) -> dict:
    base = {"calls": 1, "self_time_us": 100.0, "cpu_total_us": 100.0, "intensity_flop_per_byte": 5.0}
    return {**base, **kw}


def test_verdict_boundaries() -> None:
    th = ProfileConfig(launch_us=10.0)
    assert A.verdict(row(intensity_flop_per_byte=4.0), 4.0, "cpu", th)[0] == A.COMPUTE  # at the ridge
    assert A.verdict(row(intensity_flop_per_byte=3.999), 4.0, "cpu", th)[0] == A.MEMORY
    assert A.verdict(row(self_time_us=100.0, calls=10), 4.0, "cpu", th)[0] == A.COMPUTE  # exactly 10 µs per call
    assert A.verdict(row(self_time_us=99.9, calls=10), 4.0, "cpu", th)[0] == A.LAUNCH
    assert A.verdict(row(cpu_total_us=200.0), 4.0, "cuda", th)[0] == A.LAUNCH  # CPU = 2× device
    assert A.verdict(row(cpu_total_us=199.9), 4.0, "cuda", th)[0] == A.COMPUTE
    assert A.verdict(row(cpu_total_us=500.0), 4.0, "cpu", th)[0] == A.COMPUTE  # the CPU ratio is a CUDA rule
    assert A.verdict(row(intensity_flop_per_byte=None), 4.0, "cpu", th)[0] == A.UNKNOWN


def synthetic_summary(data_us: float, step_us: float = 1000.0, **ctx) -> dict:
    mm = OpRecord("aten::mm", [[64, 64], [64, 64]], ["float", "float"], calls=1, self_cpu_us=300.0, cpu_total_us=300.0,
                  profiler_flops=2 * 64**3)
    roof = {"ridge_flop_per_byte": 4.0, "peak_flops_per_s": 1e11, "peak_bytes_per_s": 2.5e10, "source": "measured"}
    return A.build_summary([mm], device_type="cpu", step_total_us=step_us, active_steps=1,
                           stage_us={"data_wait": data_us, "forward": 300.0}, roofline=roof, th=ProfileConfig(),
                           ctx=ctx)


def test_data_bound_and_padding_boundaries() -> None:
    at, below = synthetic_summary(100.0), synthetic_summary(99.9)
    assert at["data_bound"] and not below["data_bound"]
    assert "data_wait" in [r["rule"] for r in at["recommendations"]]
    assert "data_wait" not in [r["rule"] for r in below["recommendations"]]
    fires = synthetic_summary(0.0, padding_share=0.25, batching_method="pad-to-max")
    quiet = synthetic_summary(0.0, padding_share=0.2499, batching_method="pad-to-max")
    assert "bucket by length" in next(r["text"] for r in fires["recommendations"] if r["rule"] == "padding")
    assert "padding" not in [r["rule"] for r in quiet["recommendations"]]
    assert len(fires["recommendations"]) <= 3


def test_float_mask_recommendation() -> None:
    shapes = [[8, 2, 32, 16], [8, 2, 32, 16], [8, 2, 32, 16], [8, 1, 1, 32], [], []]
    sdpa = OpRecord("aten::scaled_dot_product_attention", shapes,
                    ["float", "float", "float", "float", "Scalar", "Scalar"],
                    calls=4, self_cpu_us=50.0, cpu_total_us=400.0)
    as_bool = OpRecord(sdpa.name, shapes, ["float", "float", "float", "bool", "Scalar", "Scalar"], calls=4,
                       self_cpu_us=50.0)
    assert A.float_mask_rows([sdpa]) == [sdpa] and A.float_mask_rows([as_bool]) == []


@given(st.integers(1, 512), st.integers(1, 512), st.integers(1, 512))
def test_matmul_intensity(m: int, k: int, n: int) -> None:
    shapes, dtypes = [[m, k], [k, n]], ["float", "float"]
    flops, source = estimated_flops("aten::mm", shapes, dtypes)
    assert flops == 2 * m * k * n and source.startswith("matmul")
    assert bytes_moved("aten::mm", shapes, dtypes) == 4 * (m * k + k * n + m * n)
    assert bytes_moved("aten::mm", shapes, ["c10::BFloat16"] * 2) == 2 * (m * k + k * n + m * n)
    # addmm reads its bias too; bmm multiplies by the batch
    assert bytes_moved("aten::addmm", [[n], [m, k], [k, n]], ["float"] * 3) == 4 * (n + m * k + k * n + m * n)
    assert estimated_flops("aten::bmm", [[3, m, k], [3, k, n]], ["float"] * 2)[0] == 6 * m * k * n


def test_elementwise_intensity() -> None:
    n = 8 * 32 * 64
    flops, _ = estimated_flops("aten::add", [[8, 32, 64], [8, 32, 64], []], ["float", "float", "Scalar"])
    nbytes = bytes_moved("aten::add", [[8, 32, 64], [8, 32, 64], []], ["float", "float", "Scalar"])
    assert flops == n and nbytes == 12 * n and flops / nbytes == pytest.approx(1 / 12)
    # broadcast: output has the larger input's shape
    assert bytes_moved("aten::add", [[8, 32, 64], [32, 64]], ["float", "float"]) == 4 * (n + 32 * 64 + n)
    assert estimated_flops("aten::copy_", [[n], [n]], ["float", "float"])[0] == 0  # pure data movement
    assert estimated_flops("aten::some_new_op", [[n]], ["float"]) == (None, "unknown")


def _attach_works(_exe: str) -> tuple[bool, str]:
    return True, ""


def _attach_denied(_exe: str) -> tuple[bool, str]:
    return False, "Error: Operation not permitted (os error 1)"


def test_pyspy_preflight_denied_and_allowed(tmp_path: Path) -> None:
    spy = "/usr/bin/py-spy"
    denied = ptrace_preflight(spy, fake_proc(tmp_path / "a", scope="2"), attach=_attach_works)
    assert (not denied.ok and "--cap-add SYS_PTRACE" in denied.message()
            and "kernel.yama.ptrace_scope=2" in denied.message())
    off = ptrace_preflight(spy, fake_proc(tmp_path / "b", cap_eff="00000000000800000", scope="3"), attach=_attach_works)
    assert not off.ok and "ptrace_scope=3" in off.message()
    traced = ptrace_preflight(spy, fake_proc(tmp_path / "c", cap_eff="0000000000080000", scope="1", tracer="77"),
                              attach=_attach_works)
    assert not traced.ok and "pid 77" in traced.message()
    ok = ptrace_preflight(spy, fake_proc(tmp_path / "d", cap_eff="0000000000080000", scope="1"), attach=_attach_works)
    assert ok.ok, ok.message()
    scoped = ptrace_preflight(spy, fake_proc(tmp_path / "e", scope="1"), attach=_attach_works)
    assert scoped.ok and "PR_SET_PTRACER" in scoped.message()
    missing = ptrace_preflight("", fake_proc(tmp_path / "f", cap_eff="0000000000080000", scope=None),
                               attach=_attach_works)
    assert not missing.ok and "requirements-dev.txt" in missing.message()


def test_pyspy_preflight_trusts_a_real_attach_over_capability_bits(tmp_path: Path) -> None:
    """A container's non-root user: CapEff=0 despite --cap-add SYS_PTRACE, Yama scope 1 or no Yama at all.
    It may still trace itself (PR_SET_PTRACER), so the preflight decides by attaching, not by the bits."""
    for name, scope in (("yama1", "1"), ("no-yama", None)):
        proc = fake_proc(tmp_path / name, scope=scope)
        (tmp_path / ".dockerenv").touch()  # root = proc/.. = tmp_path: "in a container"
        allowed = ptrace_preflight("/usr/bin/py-spy", proc, attach=_attach_works)
        assert allowed.ok and "test attach" in allowed.message(), allowed.message()
        denied = ptrace_preflight("/usr/bin/py-spy", proc, attach=_attach_denied)
        assert not denied.ok and "--cap-add SYS_PTRACE" in denied.message() and "os error 1" in denied.message()


def test_pyspy_preflight_attaches_for_real() -> None:
    """The default attach: a py-spy dump of this very process (what the capture will do)."""
    from train.profiling.pyspy import find_pyspy, try_attach

    exe = find_pyspy()
    if exe is None:
        pytest.skip("py-spy not installed")
    ok, detail = try_attach(exe)
    assert ok, detail
    assert not try_attach("/nonexistent/py-spy")[0]


def test_nsys_absent_is_a_clear_skip(tiny_cfg, capsys) -> None:
    path, why = nsys_available(cuda_available=True, which=lambda _: None)
    assert path is None and "not on PATH" in why
    path, why = nsys_available(cuda_available=False, which=lambda _: "/opt/nsys/bin/nsys")
    assert path is None and "CUDA is not available" in why
    cfg = tiny_cfg("train.run_id=nsys")
    report = run_profile(cfg, ["nsys"], time.perf_counter(), [])
    assert "nsys skipped" in capsys.readouterr().out and "nsys" in report["profile"]["skipped"]
    summary = json.loads((Path(cfg.train.output_dir) / "nsys" / "profile" / "summary.json").read_text())
    assert "nsys skipped" in summary["skipped"]["nsys"]


KERN_CSV = """Time (%),Total Time (ns),Instances,Avg (ns),Med (ns),Min (ns),Max (ns),StdDev (ns),Name
61.5,1200,10,120.0,118.0,100,150,12.1,ampere_sgemm_128x64_tn
38.5,750,30,25.0,24.0,20,31,3.0,"void at::native::elementwise_kernel<128, 4>(int, float)"
"""


def test_nsys_stale_export_refused_and_fresh_parsed(tmp_path: Path) -> None:
    rep = tmp_path / "trace.nsys-rep"
    rep.write_text("rep")
    sqlite = tmp_path / "trace.sqlite"
    sqlite.write_text("old")
    old = time.time() - 100
    os.utime(sqlite, (old, old))
    with pytest.raises(StaleExportError, match="older than"):
        check_fresh(rep, sqlite, started_at=0)
    with pytest.raises(StaleExportError, match="not exported"):
        check_fresh(rep, tmp_path / "missing.sqlite", started_at=0)

    class Done:
        returncode, stdout, stderr = 0, "", ""

    def stale_run(cmd, **kw):  # "exports" a .sqlite dated before the report: must be refused
        assert "--force-export=true" in cmd
        sqlite.write_text("stale")
        os.utime(sqlite, (old, old))
        return Done()

    with pytest.raises(StaleExportError):
        export_stats("nsys", rep, started_at=0, run=stale_run)

    def fresh_run(cmd, **kw):
        assert not sqlite.exists()  # the old export was removed before nsys ran
        sqlite.write_text("fresh")
        (tmp_path / "trace_cuda_gpu_kern_sum.csv").write_text(KERN_CSV)
        return Done()

    sqlite.write_text("old")
    out = export_stats("nsys", rep, started_at=0, run=fresh_run)
    assert out["kernels"][0]["name"] == "ampere_sgemm_128x64_tn" and out["kernels"][1]["instances"] == 30
    assert out["memcpy"] == []
    assert parse_stats_csv(tmp_path / "trace_cuda_gpu_kern_sum.csv", top=1)[0]["total_time_ns"] == 1200


def test_gpu_sampler_writes_csv_and_png(tmp_path: Path) -> None:
    from train.profiling.gpu_sampler import GpuSampler

    n = iter(range(10**6))
    sampler = GpuSampler(lambda: {"sm_util_pct": next(n) % 100, "mem_util_pct": 5, "mem_used_bytes": 2**30,
                                  "power_w": 300.0, "sm_clock_mhz": 1980, "mem_clock_mhz": 2619}, interval_ms=10)
    sampler.start()
    time.sleep(0.3)
    sampler.stop()
    res = sampler.write(tmp_path)
    lines = Path(res["csv"]).read_text().splitlines()
    assert lines[0].startswith("t_s,sm_util_pct") and len(lines) == res["samples"] + 1 >= 3
    assert Path(res["png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_pyspy_records_the_running_job(tiny_cfg) -> None:
    check = ptrace_preflight()
    if not check.ok:
        pytest.skip(check.message())
    cfg = tiny_cfg("train.run_id=spy", "profile.pyspy_steps=3", "profile.pyspy_rate=50")
    report = run_profile(cfg, ["pyspy"], time.perf_counter(), [])
    s = json.loads(Path(report["profile"]["summary_json"]).read_text())["pyspy"]
    assert not s.get("errors"), s
    assert Path(s["outputs"]["flamegraph"]["path"]).read_text().lstrip().startswith("<?xml")
    assert "speedscope" in Path(s["outputs"]["speedscope"]["path"]).read_text()[:200]
    assert s["steps_with"] == 4 and s["steps_without"] == 6 and s["overhead_ratio"] is not None


@pytest.mark.parametrize("native,nonblocking,want", [(False, True, ["--nonblocking"]), (True, True, ["--native"]),
                                                     (False, False, [])])
def test_pyspy_command_defaults_never_pause_and_native_implies_blocking(tmp_path: Path, native, nonblocking,
                                                                        want) -> None:
    from train.config import ProfileConfig
    from train.profiling.pyspy import PtraceCheck

    assert ProfileConfig().pyspy_nonblocking and not ProfileConfig().pyspy_native, "defaults: Python frames, no pauses"
    phase = PySpyPhase(ProfileConfig(pyspy_native=native, pyspy_nonblocking=nonblocking), tmp_path, 3,
                       PtraceCheck(ok=True, pyspy="/bin/true"), attach_wait_s=0.0)
    phase._start("flamegraph")
    phase._stop()
    assert [f for f in phase._cmd if f in ("--native", "--nonblocking")] == want
    assert phase.result()["nonblocking"] == ("--nonblocking" in want)


def test_pyspy_overhead_is_matched_by_batch_shape() -> None:
    from train.profiling.pyspy import shape_matched_overhead

    short, long_ = (64, 16), (8, 128)
    off = [(short, 100.0)] * 2 + [(long_, 300.0)] * 3  # the windows without py-spy drew mostly long batches
    on = [(short, 110.0)] * 3 + [(long_, 330.0), ((1, 512), 900.0)]  # +10% on each shape; (1, 512) never ran without
    res = shape_matched_overhead(on, off)
    assert res["overhead_ratio"] == pytest.approx(0.10) and res["steps_matched"] == 4
    assert res["step_time_ms_with"] == 110.0 and res["step_time_ms_without"] == 300.0
    assert res["overhead_ratio_unmatched"] == pytest.approx(110 / 300 - 1), "plain medians mix shape with cost"
    fallback = shape_matched_overhead([((1, 512), 900.0)], off)
    assert fallback["steps_matched"] == 0 and fallback["overhead_method"].startswith("ratio of medians")
    assert fallback["overhead_ratio"] == pytest.approx(900 / 300 - 1)
    with pytest.raises(ValueError):
        shape_matched_overhead([], off)


def test_torch_and_pyspy_together_report_both_overheads(tiny_cfg) -> None:
    """`make profile`'s default: the torch.profiler window and py-spy in one run (the step times py-spy keeps are
    (shape, ms) pairs; the torch.profiler's overhead is taken against py-spy's unsampled steps)."""
    check = ptrace_preflight()
    if not check.ok:
        pytest.skip(check.message())
    cfg = tiny_cfg("train.run_id=both", "profile.pyspy_steps=3", "profile.pyspy_rate=50")
    report = run_profile(cfg, ["torch", "pyspy"], time.perf_counter(), [])
    s = json.loads(Path(report["profile"]["summary_json"]).read_text())
    assert s["pyspy"]["overhead_ratio"] is not None and s["pyspy"]["steps_matched"] > 0
    assert isinstance(s["torch_profiler_overhead_ratio"], float)
