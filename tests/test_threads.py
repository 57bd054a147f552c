"""Threads fit the machine: more torch threads than usable cores (logical cores, or a cgroup's CPU quota) are
clamped with one notice line (train/tools/cores.py, train/setup.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from train import setup
from train.tools.cores import cgroup_quota, usable_cores


def test_cgroup_quota_reads_v2_and_v1(tmp_path: Path) -> None:
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("150000 100000\n")
    assert cgroup_quota(v2) == 1.5
    (v2 / "cpu.max").write_text("max 100000\n")
    assert cgroup_quota(v2) is None
    v1 = tmp_path / "v1" / "cpu"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("200000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_quota(tmp_path / "v1") == 2.0
    assert cgroup_quota(tmp_path / "none") is None


def test_a_quota_below_the_logical_cores_bounds_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: set(range(16)))
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    cores, why = usable_cores(tmp_path)
    assert cores == 2 and "quota of 1.5 cores" in why
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cores(tmp_path)[0] == 16


@pytest.mark.parametrize("requested, default, expected, says", [
    (64, 2, 2, True),      # the request beyond the cores: clamped, said
    (None, 16, 2, False),  # torch's default beyond a container's quota: clamped quietly
    (1, 2, 1, False),      # fewer threads than cores: as asked
    (2, 2, 2, False),
])
def test_thread_count_is_clamped_to_the_usable_cores(monkeypatch: pytest.MonkeyPatch, requested, default, expected,
                                                     says) -> None:
    monkeypatch.setattr(setup, "usable_cores", lambda: (2, "2 logical cores"))
    said: list[str] = []
    assert setup.thread_count(requested, default, said.append) == expected
    assert len(said) == (1 if says else 0)
    if says:
        assert said[0].startswith("notice: train.num_threads=64") and "using 2 threads" in said[0]


def test_a_run_with_too_many_threads_uses_the_cores(tiny_cfg, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setattr(setup, "usable_cores", lambda: (1, "1 logical core"))
    before = torch.get_num_threads()
    try:
        setup.apply_threads_and_seed(tiny_cfg("train.num_threads=64"))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert capsys.readouterr().out.count("notice: train.num_threads=64") == 1
