"""scripts/docker_image.sh: bad input around the image is one line + the fix, exit 2; a stale image is refused.

A fake `docker` (a shell script) stands in for the engine, so these run anywhere.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "docker_image.sh"
pytestmark = pytest.mark.skipif(not SCRIPT.exists() or shutil.which("git") is None, reason="needs scripts/ and git")


def fake_docker(tmp_path: Path, info: str = "exit 0", runtimes: str = '{"runc":{}}', inspect: str = "exit 1",
                pull: str = "exit 1") -> Path:
    path = tmp_path / "docker"
    path.write_text(f"""#!/bin/sh
case "$1" in
  info) ( {info} ) || exit 1; case "$*" in *Runtimes*) echo '{runtimes}' ;; esac ;;
  image) {inspect} ;;
  pull) echo "Error response from daemon: Get https://registry-1.docker.io/v2/: dial tcp: lookup failed"; {pull} ;;
esac
""")
    path.chmod(0o755)
    return path


def run(tree: Path, docker: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    base = {"PATH": os.environ["PATH"], "DOCKER": str(docker), "IMG": "dmp:test", "STACK": "cpu", "GPUS": "",
            "BASE_IMAGE": "debian:bookworm-slim"}
    return subprocess.run(["bash", str(tree / "scripts" / "docker_image.sh"), *args], capture_output=True, text=True,
                          env={**base, **env}, timeout=60)


@pytest.fixture()
def tree(tmp_path: Path) -> Path:
    """A small git work tree with the script and the files the source hash covers."""
    t = tmp_path / "tree"
    (t / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, t / "scripts" / "docker_image.sh")
    for rel in ("train/__init__.py", "configs/a.yaml", "tests/test_a.py", "pyproject.toml", "README.md",
                "docker/Dockerfile", "docker/entrypoint.sh", "docker/requirements-cpu.lock"):
        (t / rel).parent.mkdir(parents=True, exist_ok=True)
        (t / rel).write_text(rel + "\n")
    (t / ".gitignore").write_text("__pycache__/\n")
    subprocess.run(["git", "init", "-q", str(t)], check=True)
    return t


def one_error_line(out: subprocess.CompletedProcess, *needles: str) -> str:
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_source_hash_follows_the_baked_in_files_only(tree: Path, tmp_path: Path) -> None:
    docker = fake_docker(tmp_path)
    first = run(tree, docker, "source-hash").stdout.strip()
    assert len(first) == 64 and run(tree, docker, "source-hash").stdout.strip() == first
    (tree / "README.md").write_text("docs only\n")
    (tree / "train" / "__pycache__").mkdir()
    (tree / "train" / "__pycache__" / "x.pyc").write_bytes(b"\0")
    assert run(tree, docker, "source-hash").stdout.strip() == first, "README.md and ignored files do not count"
    (tree / "train" / "__init__.py").write_text("changed\n")
    assert run(tree, docker, "source-hash").stdout.strip() != first
    (tree / "train" / "new.py").write_text("")  # untracked files count too
    assert len({run(tree, docker, "source-hash").stdout.strip(), first}) == 2


def test_current_image_runs_missing_image_builds_stale_image_refused(tree: Path, tmp_path: Path) -> None:
    want = run(tree, fake_docker(tmp_path), "source-hash").stdout.strip()
    current = fake_docker(tmp_path, inspect=f"echo '{want} abc123'")
    assert run(tree, current, "pre-run").returncode == 0
    missing = run(tree, fake_docker(tmp_path), "pre-run")
    assert missing.returncode == 3 and "not found: building it" in missing.stdout
    stale = fake_docker(tmp_path, inspect="echo '0000 abc123'")
    one_error_line(run(tree, stale, "pre-run"), "image is stale: make build STACK=cpu", "AUTO_BUILD=1")
    rebuild = run(tree, stale, "pre-run", AUTO_BUILD="1")
    assert rebuild.returncode == 3 and "rebuilding" in rebuild.stdout
    unlabelled = fake_docker(tmp_path, inspect="echo '<no value> <no value>'")  # built before the label existed
    one_error_line(run(tree, unlabelled, "pre-run"), "image is stale")


def test_bad_input_is_one_line_and_exit_2(tree: Path, tmp_path: Path) -> None:
    one_error_line(run(tree, tmp_path / "no-such-docker", "pre-run"), "no '", "docker-sandbox.sh", "RUNTIME=local")
    one_error_line(run(tree, fake_docker(tmp_path, info="exit 1"), "pre-run"), "does not answer", "RUNTIME=local")
    one_error_line(run(tree, fake_docker(tmp_path), "pre-run", GPUS="all", STACK="torch21"),
                   "GPUS=all", "no NVIDIA runtime", "STACK=cpu")
    one_error_line(run(tree, fake_docker(tmp_path), "pre-build", STACK="podman"), "STACK=podman is not one of")
    out = run(tree, fake_docker(tmp_path), "pre-build",
              BASE_IMAGE="nvidia/cuda:12.1.1-runtime-ubuntu22.04@sha256:" + "0" * 64)
    one_error_line(out, "cannot pull the base image nvidia/cuda:12.1.1", "STACK=cpu")
    assert "registry-1.docker.io" not in out.stderr + out.stdout.split("\n", 1)[-1], "Docker's own output stays hidden"


def test_gpus_with_the_nvidia_runtime_passes(tree: Path, tmp_path: Path) -> None:
    (tree / "docker" / "requirements.lock").write_text("x\n")
    want = run(tree, fake_docker(tmp_path), "source-hash", "torch21").stdout.strip()
    docker = fake_docker(tmp_path, runtimes='{"nvidia":{},"runc":{}}', inspect=f"echo '{want} abc'")
    out = run(tree, docker, "pre-run", GPUS="all", STACK="torch21")
    assert out.returncode == 0, out.stderr
