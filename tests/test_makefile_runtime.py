"""The Makefile's container plumbing, checked with `make -n` (prints the commands, runs nothing)."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DETECT = ROOT / "scripts" / "detect_runtime.sh"
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")

# target → what the container runs after the image name
CONTAINER_COMMANDS = {
    "train": "python -m train train --config",
    "warmup": "python -m train warmup --config",
    "profile": "python -m train profile --config",
    "profile-pyspy": "python -m train profile --tools pyspy",
    "profile-nsys": "python -m train profile --tools nsys",
    "bench": "python -m train bench",
    "verify-gpu": "python -m train.tools.verify_gpu",
    "test": "python -m pytest",
    "smoke": "python -m train train --config configs/smoke.yaml",
    "shell": "bash",
}


def make_n(*args: str, env: dict | None = None) -> str:
    out = subprocess.run(["make", "-n", "--no-print-directory", *args], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, **(env or {})}, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def docker_run(output: str) -> list[str]:
    lines = [ln for ln in output.splitlines() if " run " in ln and "docker" in ln]
    assert len(lines) == 1, output
    words = shlex.split(lines[0].split("&&", 1)[1])
    assert words[:2] == ["docker", "run"]
    return words


def flag_values(words: list[str], flag: str) -> list[str]:
    vals = [words[i + 1] for i, w in enumerate(words[:-1]) if w == flag]
    return vals + [w.split("=", 1)[1] for w in words if w.startswith(flag + "=")]


@pytest.mark.parametrize("target", sorted(CONTAINER_COMMANDS))
def test_docker_run_has_every_required_flag_and_volume(target):
    words = docker_run(make_n("RUNTIME=docker", target, "ARGS=train.max_steps=5"))
    uid, gid = os.getuid(), os.getgid()
    assert flag_values(words, "--gpus") == ["all"]
    assert "--ipc=host" in words
    assert "memlock=-1" in flag_values(words, "--ulimit")
    assert f"{uid}:{gid}" in flag_values(words, "--user")
    volumes = flag_values(words, "-v")
    assert "deep-model-perf-cache:/cache" in volumes, "a named volume shared by all targets"
    assert f"{ROOT}/runs:/app/runs" in volumes and f"{ROOT}/wandb:/app/wandb" in volumes
    env = flag_values(words, "-e")
    assert "WANDB_API_KEY" in env and "WANDB_MODE" in env, "passed through by name, value never on the command line"
    assert "SYS_PTRACE" in flag_values(words, "--cap-add")
    assert "--rm" in words and "--init" in words, "--init: signals reach the trainer, zombies are reaped"
    assert flag_values(words, "--group-add") == ["47474"], "the cache volume's group: host users share /cache"
    assert "--network=host" not in words, "one node: the default bridge network"
    image_at = words.index("deep-model-perf:cu121-torch2.1.0")
    assert " ".join(words[image_at + 1:]).startswith(CONTAINER_COMMANDS[target])
    if target != "shell":
        assert "-it" not in words, "non-interactive targets must run without a TTY (CI)"


def test_runs_and_wandb_exist_before_docker_creates_them_as_root():
    out = make_n("RUNTIME=docker", "train")
    line = next(ln for ln in out.splitlines() if "docker run" in ln)
    assert line.startswith("mkdir -p runs wandb && docker run")


def test_nsys_gets_perf_event_access_and_others_do_not():
    nsys = docker_run(make_n("RUNTIME=docker", "profile-nsys"))
    assert "SYS_ADMIN" in flag_values(nsys, "--cap-add") and "seccomp=unconfined" in flag_values(nsys, "--security-opt")
    train = docker_run(make_n("RUNTIME=docker", "train"))
    assert "SYS_ADMIN" not in flag_values(train, "--cap-add") and "--security-opt" not in train


def test_variables_override_image_tag_gpus_and_args():
    words = docker_run(make_n("RUNTIME=docker", "IMAGE=reg.example/dmp", "TAG=v9", "GPUS=device=1", "train",
                              "ARGS=train.max_steps=7 --run-id x"))
    assert "reg.example/dmp:v9" in words and flag_values(words, "--gpus") == ["device=1"]
    assert words[-3:] == ["train.max_steps=7", "--run-id", "x"]
    words = docker_run(make_n("RUNTIME=docker", "STACK=torch2x", "bench", "BENCH=bench-compile"))
    assert "deep-model-perf:cu124-torch2.6.0" in words
    assert words[-4:] == ["train", "bench-compile", "--config", "configs/bench-cpu.yaml"]


def test_docker_targets_check_the_image_and_build_it_when_missing():
    out = make_n("RUNTIME=docker", "train")
    assert ("IMG='deep-model-perf:cu121-torch2.1.0' STACK='torch21' GPUS='all'" in out
            and "scripts/docker_image.sh pre-run" in out)
    assert "docker build -f docker/Dockerfile --build-arg STACK=torch21" in out


@pytest.mark.parametrize("target", ["train", "smoke", "profile", "warmup", "bench", "bench-compile", "verify-gpu",
                                    "test"])
def test_cpu_stack_runs_without_gpus_on_its_own_image(target):
    words = docker_run(make_n("RUNTIME=docker", "STACK=cpu", target))
    assert "--gpus" not in words and not [w for w in words if w.startswith("--gpus")], \
        "--gpus fails without the NVIDIA runtime"
    assert "deep-model-perf:cpu-torch2.1.0" in words and "--init" in words
    words = docker_run(make_n("RUNTIME=docker", "STACK=cpu", "GPUS=all", target))
    assert flag_values(words, "--gpus") == ["all"], \
        "asked for explicitly: passed (and refused by pre-run without the runtime)"


def test_cpu_stack_builds_on_debian_with_python311_and_its_lock():
    words = shlex.split(make_n("build", "STACK=cpu").strip().splitlines()[-1])
    args = flag_values(words, "--build-arg")
    assert {"STACK=cpu", "BASE_IMAGE=debian:bookworm-slim", "PYTHON=python3.11", "LOCK=requirements-cpu.lock",
            "NSYS_VERSION=", "TORCH_VERSION=2.1.0"} <= set(args)
    assert (any(a.startswith("SOURCE_HASH=") for a in args)
            and words[-3:] == ["-t", "deep-model-perf:cpu-torch2.1.0", "."])
    uid = os.getuid()
    assert f"UID={uid if uid else 1000}" in args, "the image's default user is never root"


def test_several_nodes_use_the_host_network():
    words = docker_run(make_n("RUNTIME=docker", "train", "NNODES=2", "NPROC=2", "MASTER_ADDR=10.0.0.1"))
    assert "--network=host" in words and "train.tools.launch" in words and "--nnodes=2" in words


def test_build_passes_stack_versions_and_caller_ids():
    out = make_n("build", "STACK=torch2x")
    words = shlex.split(out.strip().splitlines()[-1])
    args = flag_values(words, "--build-arg")
    assert {"STACK=torch2x", "TORCH_VERSION=2.6.0", "TRITON_VERSION=3.2.0", "CUDA_VERSION=12.4.1",
            f"UID={os.getuid() or 1000}", f"GID={os.getgid() if os.getuid() else 1000}"} <= set(args)
    assert words[-3:] == ["-t", "deep-model-perf:cu124-torch2.6.0", "."]


@pytest.mark.parametrize("target,expected", [
    ("train", ".venv/bin/python -m train train --config configs/cpu-tiny.yaml"),
    ("smoke", ".venv/bin/python -m train train --config configs/smoke.yaml"),
    ("warmup", ".venv/bin/python -m train warmup --config configs/cpu-tiny.yaml"),
    ("profile", ".venv/bin/python -m train profile --config"),
    ("profile-pyspy", ".venv/bin/python -m train profile --tools pyspy"),
    ("profile-nsys", ".venv/bin/python -m train profile --tools nsys"),
    ("bench", ".venv/bin/python -m train bench"),
    ("verify-gpu", "scripts/verify_gpu.sh"),
    ("test", '.venv/bin/python -m pytest -q -m "not slow"'),
])
def test_local_runtime_runs_the_venv(target, expected):
    out = make_n("RUNTIME=local", target)
    assert "runtime: local (RUNTIME=local)" in out
    assert expected in out and "docker run" not in out


def test_auto_runtime_says_which_and_matches_the_detector():
    detected = subprocess.run([str(DETECT)], capture_output=True, text=True,
                              env={**os.environ, "RUNTIME": "auto"}).stdout.split()
    out = make_n("train")
    assert f"runtime: {detected[0]} (" in out


def _fake_bin(tmp_path: Path, name: str, body: str) -> None:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)


@pytest.mark.parametrize("info,smi,want", [
    ("exit 1", "exit 0", "local"),                                   # engine not reachable
    ("echo '{\"runc\":{}}'", "exit 0", "local"),                     # engine without GPU support
    ("echo '{\"nvidia\":{},\"runc\":{}}'", "exit 9", "local"),       # nvidia runtime but no GPU visible
    ("echo '{\"nvidia\":{},\"runc\":{}}'", "exit 0", "docker"),      # engine + GPU
])
def test_detect_runtime_auto(tmp_path, info, smi, want):
    _fake_bin(tmp_path, "docker", info)
    _fake_bin(tmp_path, "nvidia-smi", smi)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "RUNTIME": "auto", "DOCKER": str(tmp_path / "docker")}
    out = subprocess.run([str(DETECT)], capture_output=True, text=True, env=env).stdout.split()
    assert out[0] == want


def test_bad_runtime_is_an_error():
    out = subprocess.run(["make", "-s", "train", "RUNTIME=podman"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0 and "RUNTIME=podman is not one of auto, docker, local" in out.stderr


@pytest.mark.parametrize("target", ["build", "verify-gpu", "warmup", "train", "profile", "profile-pyspy",
                                    "profile-nsys", "bench", "shell", "test", "lint", "clean", "lock", "test-torch21",
                                    "clean-cache"])
def test_every_target_exists(target):
    make_n(target)


def test_train_config_defaults_to_the_gpu_config_only_when_nvidia_smi_lists_a_gpu(tmp_path: Path) -> None:
    smi = tmp_path / "nvidia-smi"
    smi.write_text('#!/bin/sh\necho "GPU 0: NVIDIA H200 (UUID: GPU-0)"\n')
    smi.chmod(0o755)
    gpu = make_n("RUNTIME=local", "train", f"NVIDIA_SMI={smi}")
    assert "train --config configs/gpu-bert-base.yaml" in gpu and "nvidia-smi lists a GPU" in gpu
    for absent in ("false", str(tmp_path / "missing")):  # no GPU listed, or no nvidia-smi at all
        cpu = make_n("RUNTIME=local", "train", f"NVIDIA_SMI={absent}")
        assert "train --config configs/cpu-tiny.yaml" in cpu
    assert "train --config configs/smoke.yaml" in make_n("RUNTIME=local", "train", f"NVIDIA_SMI={smi}",
                                                         "CONFIG=configs/smoke.yaml")


@pytest.mark.parametrize("bad", ["NPROC=0", "NPROC=two", "NNODES=0", "NPROC=-1"])
def test_process_counts_that_are_not_whole_numbers_are_one_line_and_exit_2(bad):
    out = subprocess.run(["make", "-n", "--no-print-directory", "train", bad], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr  # not torchrun's AssertionError traceback
    assert "both must be whole numbers >= 1" in out.stderr and bad in out.stderr
