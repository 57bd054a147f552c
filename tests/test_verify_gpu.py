"""make verify-gpu and the container preflight, run for real on whatever this machine has."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata

import pytest

from train.tools import preflight, verify_gpu
from train.tools.verify_gpu import Check


def test_verify_gpu_runs_natively_and_reports_the_device_it_has(tmp_path):
    out = subprocess.run([sys.executable, "-m", "train.tools.verify_gpu", "--json", str(tmp_path / "v.json")],
                         capture_output=True, text=True, timeout=120)
    report = json.loads((tmp_path / "v.json").read_text())
    names = [c["name"] for c in report["checks"]]
    assert {"driver / nvidia-smi", "torch.cuda.is_available()", "/dev/shm", "cache dir writable", "py-spy ptrace",
            "nsys"} <= set(names)
    assert out.returncode == report["exit_code"]
    import torch

    if not torch.cuda.is_available():
        assert out.returncode == 77 and "NO GPU" in out.stdout, out.stdout + out.stderr
        assert "Traceback" not in out.stderr
    else:
        assert out.returncode in (0, 1) and "matmul vs CPU" in names


def test_exit_code_rules():
    ok = Check("a", "PASS", "")
    assert verify_gpu.exit_code([ok, Check("b", "WARN", "")]) == 0
    assert verify_gpu.exit_code([ok, Check("b", "NO-GPU", "")]) == 77
    assert verify_gpu.exit_code([Check("b", "NO-GPU", ""), Check("c", "FAIL", "")]) == 1


def test_unwritable_cache_is_a_hard_failure_with_advice(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(blocker / "sub"))
    row = verify_gpu.check_cache()
    assert row.status == "FAIL" and "TORCHINDUCTOR_CACHE_DIR" in row.advice
    table = verify_gpu.format_table([row])
    assert "→" in table


def test_small_shm_warns_only_with_workers(tmp_path):
    assert verify_gpu.check_shm("/definitely/not/here").status == "WARN"
    assert preflight.shm_problem(0) is None
    assert "bus error" in preflight.shm_problem(10_000)  # no machine has 2.5 TB of /dev/shm


def test_preflight_reads_num_workers_from_the_command():
    assert preflight.num_workers_from(["python", "-m", "train", "train", "--config", "configs/smoke.yaml"]) == 0
    assert preflight.num_workers_from(["python", "-m", "train", "train", "--config", "configs/smoke.yaml",
                                       "data.num_workers=3"]) == 3
    assert preflight.num_workers_from(["bash"]) == 0


def test_preflight_triton_and_pynvml(monkeypatch):
    real_requires, real_version = metadata.requires, metadata.version

    def fake_requires(name):
        return ["triton==2.1.0; platform_system == \"Linux\""] if name == "torch" else real_requires(name)

    def fake_version(name):
        return {"triton": "2.0.0", "torch": "2.1.0"}.get(name) or real_version(name)

    monkeypatch.setattr(preflight.metadata, "requires", fake_requires)
    monkeypatch.setattr(preflight.metadata, "version", fake_version)
    assert "pins triton==2.1.0" in preflight.triton_pin_problem()
    monkeypatch.setattr(preflight.metadata, "packages_distributions", lambda: {"pynvml": ["nvidia-ml-py3"]})
    assert "nvidia-ml-py3" in preflight.pynvml_problem()
    monkeypatch.setattr(preflight.metadata, "packages_distributions", lambda: {"pynvml": ["nvidia-ml-py"]})
    assert preflight.pynvml_problem() is None


@pytest.mark.skipif(sys.platform != "linux", reason="bash entrypoint")
def _entrypoint(tmp_path, cache: str) -> subprocess.CompletedProcess:
    env = {"PATH": f"{__import__('os').path.dirname(sys.executable)}:/usr/bin:/bin", "DMP_PREFLIGHT": "1",
           "TORCHINDUCTOR_CACHE_DIR": f"{cache}/inductor", "TRITON_CACHE_DIR": f"{cache}/triton",
           "DMP_DATA_CACHE": f"{cache}/deep-model-perf"}
    return subprocess.run(["bash", "docker/entrypoint.sh", "sh", "-c", "umask; echo $TORCHINDUCTOR_CACHE_DIR"],
                          capture_output=True, text=True, env=env, timeout=60,
                          cwd=__import__("pathlib").Path(__file__).resolve().parent.parent)


NO_ENTRYPOINT = pytest.mark.skipif(
    not (__import__("pathlib").Path(__file__).resolve().parent.parent / "docker").is_dir(),
    reason="docker/ is not in this tree (inside the image)")


@NO_ENTRYPOINT
def test_entrypoint_refuses_an_unwritable_cache_volume_in_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    out = _entrypoint(tmp_path, str(blocker))
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert (len(lines) == 1 and lines[0].startswith("error: the cache volume is not writable")
            and "make clean-cache" in lines[0])


@NO_ENTRYPOINT
def test_entrypoint_shares_a_writable_cache_with_the_group(tmp_path):
    out = _entrypoint(tmp_path, str(tmp_path / "cache"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0002", f"{tmp_path}/cache/inductor"], "umask 0002: the volume's group can write"
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()], "the write probe leaves nothing behind"
