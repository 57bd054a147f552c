"""Compile options, the cache directory, the warm-up stopping rule — no compilation in this file."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from train.compiling.session import CPU_AUTO_REASON, CacheDirWarning, resolve_compile, setup_cache_dir
from train.compiling.warmup import ShapeBatches, StabilityDetector, time_shape
from train.config import CompileConfig, load_config
from train.errors import UserError


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No inherited cache variables (restored afterwards), and a private temp dir for the fallback."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    tmp = tmp_path / "systmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return tmp


def test_config_section_parses_and_validates() -> None:
    cfg = load_config(None, ["compile.enabled=true", "compile.mode=max-autotune"])
    assert cfg.compile.enabled == "true" and cfg.compile.mode == "max-autotune" and cfg.compile.dynamic is False
    assert load_config(None, ["compile.enabled=false"]).compile.enabled == "false"
    assert load_config(None, []).compile.enabled == "auto"
    with pytest.raises(UserError, match="compile.mode='fast'"):
        load_config(None, ["compile.mode=fast"])
    with pytest.raises(UserError, match="compile.enabled='maybe'"):
        load_config(None, ["compile.enabled=maybe"])
    with pytest.raises(UserError, match="Did you mean 'compile.warmup_cv'"):
        load_config(None, ["compile.warmup_vc=0.1"])
    with pytest.raises(UserError, match="warmup_max_steps"):
        load_config(None, ["compile.warmup_window=10", "compile.warmup_max_steps=5"])


def test_auto_is_off_on_cpu_with_the_measured_reason() -> None:
    cpu = torch.device("cpu")
    assert resolve_compile(CompileConfig(enabled="auto"), cpu, "bound") == (False, CPU_AUTO_REASON)
    assert "by rule" in CPU_AUTO_REASON and "measured" not in CPU_AUTO_REASON  # a rule, not a claimed measurement
    assert resolve_compile(CompileConfig(enabled="true"), cpu, "bound") == (True, "requested")
    packed = resolve_compile(CompileConfig(enabled="true"), cpu, "batch-max", "packed")[1]
    assert "batching.method=packed pads" in packed and "random" not in packed  # the run's own method is named
    on, why = resolve_compile(CompileConfig(enabled="true"), cpu, "batch-max")
    assert on and "recompiles" in why
    assert resolve_compile(CompileConfig(enabled=False), cpu, "bound") == (False, "compile.enabled=false")


def test_cache_dir_is_exported_and_its_state_reported(clean_env: Path, tmp_path: Path) -> None:
    info = setup_cache_dir(str(tmp_path / "cache"))
    assert info.source == "config" and info.state == "cold" and info.fallback_reason is None
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str((tmp_path / "cache").resolve())
    assert os.environ["TRITON_CACHE_DIR"] == str((tmp_path / "cache" / "triton").resolve())
    (tmp_path / "cache" / "fxgraph").mkdir()
    (tmp_path / "cache" / "fxgraph" / "entry").write_text("x")
    assert setup_cache_dir(None).source == "env"  # now $TORCHINDUCTOR_CACHE_DIR is set
    assert setup_cache_dir(str(tmp_path / "cache")).state == "warm"


def test_unwritable_cache_dir_falls_back_with_one_warning(clean_env: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "afile"
    blocker.write_text("")  # a file where a directory should be: unwritable even for root
    with pytest.warns(CacheDirWarning, match="not writable") as caught:
        info = setup_cache_dir(str(blocker / "inductor"))
    assert len(caught) == 1
    assert info.source == "fallback" and Path(info.dir).parent == clean_env.resolve()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == info.dir and Path(info.dir).is_dir()
    assert "afile/inductor" in info.fallback_reason


def test_no_writable_cache_dir_is_a_user_error(clean_env: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "afile"
    blocker.write_text("")
    monkeypatch.setattr(tempfile, "tempdir", str(blocker))  # the fallback is unwritable too
    with pytest.warns(CacheDirWarning), pytest.raises(UserError, match="compile.cache_dir"):
        setup_cache_dir(str(blocker / "inductor"))


class FakeClock:
    """Seconds that advance only when a (synthetic) step runs."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_warmup_stops_at_the_cv_threshold_on_a_synthetic_sequence() -> None:
    # compile step, then settling times; the last 4 of [..., 52, 50, 51, 50] have CV 1.9% ≤ 5%
    durations_ms = [9000.0, 300.0, 120.0, 80.0, 60.0, 52.0, 50.0, 51.0, 50.0, 50.0, 50.0, 50.0]
    clock, calls = FakeClock(), []

    def step(batch: dict) -> None:
        clock.now += durations_ms[len(calls)] / 1e3
        calls.append(batch)

    shape = ShapeBatches("train", 2, 8, batches=[{"i": 0}, {"i": 1}])
    det = StabilityDetector(window=4, cv_threshold=0.05, max_steps=20)
    r = time_shape(step, shape, det, torch.device("cpu"), clock)
    # timed steps: 300 120 80 60 52 50 51 50 → CV of (60,52,50,51) is 8.6%, of (52,50,51,50) 1.9%: stop after 8
    assert r["stable"] and r["steps_to_stability"] == 8 and len(calls) == 9
    assert r["first_step_ms"] == pytest.approx(9000.0)
    assert r["steady_step_ms"] == pytest.approx(50.5) and r["cv"] <= 0.05
    assert r["compile_s"] == pytest.approx((9000.0 - 50.5) / 1e3)
    assert [c["i"] for c in calls[:3]] == [0, 1, 0]  # real batches, cycled


def test_warmup_gives_up_at_the_cap_and_says_not_stable() -> None:
    det = StabilityDetector(window=3, cv_threshold=0.05, max_steps=7)
    noisy = [10.0, 20.0] * 10
    n = next(i + 1 for i, ms in enumerate(noisy) if det.add(ms))
    assert n == 7 and not det.stable and det.cv > 0.05


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=1.0, max_value=1000.0), min_size=30, max_size=30),
       st.integers(min_value=2, max_value=6), st.sampled_from([0.01, 0.05, 0.2]))
def test_stability_detector_stops_exactly_at_first_stable_window(times: list[float], window: int, thr: float) -> None:
    import statistics

    det = StabilityDetector(window=window, cv_threshold=thr, max_steps=20)
    n = next((i + 1 for i, ms in enumerate(times) if det.add(ms)), None)
    assert n is not None and n <= 20

    def cv_ok(k: int) -> bool:
        last = times[k - window:k]
        return statistics.stdev(last) / statistics.fmean(last) <= thr

    first = next((k for k in range(window, 21) if cv_ok(k)), None)
    if first is None:
        assert n == 20 and not det.stable
    else:
        assert n == first and det.stable


def test_bench_compile_children_get_the_repository_root_on_their_path() -> None:
    # the children's PYTHONPATH once pointed at train/commands, whose profile.py shadowed the standard library's
    # profile module: torch._dynamo's `import cProfile` then failed in every bench-compile child
    from train.bench import compilation

    assert (compilation.ROOT / "train" / "__init__.py").is_file()
    assert not (compilation.ROOT / "profile.py").exists()
