"""The image's locks and Dockerfile, checked statically (no Docker engine needed)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
LOCKS = {"torch21": DOCKER / "requirements.lock", "torch2x": DOCKER / "requirements-torch2x.lock",
         "cpu": DOCKER / "requirements-cpu.lock"}
# torch's own `triton==` pin for each torch in a lock (torch's wheel metadata, Requires-Dist).
TORCH_TRITON_PIN = {"2.1.0": "2.1.0", "2.6.0": "3.2.0"}
pytestmark = pytest.mark.skipif(not (DOCKER / "Dockerfile").exists(),
                                reason="docker/ is not in this tree (inside the image)")


def parse_lock(path: Path) -> dict[str, tuple[str, list[str]]]:
    """{name: (version, [sha256 hashes])} of a pip/uv hash-pinned requirements file; every entry must be `==`."""
    entries: dict[str, tuple[str, list[str]]] = {}
    current = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)", line)
        if m and not raw.startswith(" "):
            current = m.group(1).lower().replace("_", "-")
            assert current not in entries, f"{path.name}: {current} listed twice"
            entries[current] = (m.group(2), [])
            continue
        h = re.match(r"^--hash=sha256:([0-9a-f]{64})", line)
        if h:
            assert current is not None, f"{path.name}: hash before any requirement: {line}"
            entries[current][1].append(h.group(1))
            continue
        raise AssertionError(f"{path.name}: unexpected line {raw!r} (only name==version + --hash lines)")
    return entries


def in_names(path: Path) -> set[str]:
    names = set()
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.add(re.split(r"[<>=!~;\s\[]", line, maxsplit=1)[0].lower().replace("_", "-"))
    return names


@pytest.mark.parametrize("stack", sorted(LOCKS))
def test_lock_is_fully_hash_pinned(stack):
    entries = parse_lock(LOCKS[stack])
    assert len(entries) > 30
    missing = [n for n, (_, hashes) in entries.items() if not hashes]
    assert not missing, f"requirements without --hash: {missing}"


@pytest.mark.parametrize("stack", sorted(LOCKS))
def test_lock_pins_torch_with_its_own_triton_and_official_nvml(stack):
    entries = parse_lock(LOCKS[stack])
    torch_v, triton_v = entries["torch"][0], entries["triton"][0]
    assert TORCH_TRITON_PIN[torch_v] == triton_v, (f"torch {torch_v} pins triton {TORCH_TRITON_PIN[torch_v]}, "
                                                   f"lock has {triton_v}")
    assert "nvidia-ml-py" in entries
    assert "nvidia-ml-py3" not in entries


def test_default_lock_is_the_torch21_stack_with_numpy1():
    entries = parse_lock(LOCKS["torch21"])
    assert entries["torch"][0] == "2.1.0" and entries["triton"][0] == "2.1.0"
    assert int(entries["numpy"][0].split(".")[0]) < 2, "torch 2.1 wheels fail to import beside NumPy 2"
    for name in ("wandb", "py-spy", "torchmetrics", "tokenizers", "setuptools"):
        assert name in entries
    for stack in ("torch21", "cpu"):  # torch 2.1's inductor imports pkg_resources, gone from setuptools 81
        assert int(parse_lock(LOCKS[stack])["setuptools"][0].split(".")[0]) < 81, stack


@pytest.mark.parametrize("stack", sorted(LOCKS))
def test_lock_setuptools_builds_the_project_without_isolation(stack):
    # The image installs the project with --no-build-isolation: the lock's setuptools must meet pyproject's
    # build requirement (>= 77 reads `license = "MIT"`, PEP 639).
    need = re.search(r'setuptools>=(\d+)', (ROOT / "pyproject.toml").read_text()).group(1)
    assert int(parse_lock(LOCKS[stack])["setuptools"][0].split(".")[0]) >= int(need), stack


@pytest.mark.parametrize("stack,infile", [("torch21", "requirements-torch21.in"),
                                          ("torch2x", "requirements-torch2x.in"),
                                          ("cpu", "requirements-torch21.in")])
def test_lock_covers_its_input_and_the_project_dependencies(stack, infile):
    entries = parse_lock(LOCKS[stack])
    assert in_names(DOCKER / infile) <= set(entries)
    pyproject = (ROOT / "pyproject.toml").read_text()
    deps = re.search(r"^dependencies = \[(.*?)\]", pyproject, re.S | re.M).group(1)
    for dep in re.findall(r'"([A-Za-z0-9_.-]+)', deps):
        assert dep.lower().replace("_", "-") in entries, f"project dependency {dep} missing from {LOCKS[stack].name}"


def test_cpu_lock_is_the_torch21_lock_for_python311():
    """The cpu stack: torch 2.1.0 and the torch21 image's other versions, minus the Python 3.10-only backports."""
    cpu, cuda = parse_lock(LOCKS["cpu"]), parse_lock(LOCKS["torch21"])
    assert cpu["torch"][0] == "2.1.0" and cpu["triton"][0] == "2.1.0"
    assert {n: v for n, (v, _) in cpu.items()} == {n: v for n, (v, _) in cuda.items() if n in cpu}
    assert set(cuda) - set(cpu) <= {"exceptiongroup", "tomli", "async-timeout", "typing-extensions"}


def makefile_var(name: str) -> str:
    return re.search(rf"^{name} :?= (.*)$", (ROOT / "Makefile").read_text(), re.M).group(1)


def test_dockerfile_installs_each_lock_with_hashes_and_checks():
    text = (DOCKER / "Dockerfile").read_text()
    assert "--require-hashes" in text and "pip check" in text
    assert text.count("\nFROM ") == 1, "one recipe: the stacks differ by build arguments, not by stages"
    assert (re.search(r"^ARG BASE_IMAGE=.*\n(#.*\n)*FROM \$\{BASE_IMAGE\}\n", text, re.M)
            and 'COPY docker/${LOCK}' in text)
    for stack, lock in LOCKS.items():
        assert f"--build-arg LOCK={lock.name}" in makefile_var(f"STACK_BUILD_{stack}"), stack
        assert (ROOT / ".dockerignore").read_text().count(f"!docker/{lock.name}") == 1
    for stack, cuda in (("torch21", "12.1.1"), ("torch2x", "12.4.1")):
        assert re.fullmatch(rf"nvidia/cuda:{cuda}-runtime-ubuntu22\.04@sha256:[0-9a-f]{{64}}",
                            makefile_var(f"STACK_BASE_{stack}"))
        assert "PYTHON=python3.10" in makefile_var(f"STACK_BUILD_{stack}")
    assert makefile_var("STACK_BASE_cpu") == "debian:bookworm-slim"
    assert ("PYTHON=python3.11" in makefile_var("STACK_BUILD_cpu")
            and "NSYS_VERSION= " in makefile_var("STACK_BUILD_cpu") + " ")
    for var in ("TORCHINDUCTOR_CACHE_DIR=/cache/", "TRITON_CACHE_DIR=/cache/", "ln -s /cache /app/.cache"):
        assert var in text
    # Nsight Systems: the devtools repository's own key, the versioned package name.
    assert "devtools/repos/" in text and "/nvidia.pub" in text and "cuda-archive-keyring" not in text
    assert (re.search(r'nsight-systems-cli-\$\{NSYS_VERSION\}', text)
            and re.search(r"ARG NSYS_VERSION=\d{4}\.\d+\.\d+\n", text))
    assert "USER ${UID}:${GID}" in text and "ARG UID=" in text and "ARG GID=" in text
    assert "org.opencontainers.image.version" in text and "wordnet-base" in text
    assert "WANDB_API_KEY" not in text, "credentials are passed at run time, never baked into a layer"


def test_makefile_build_args_match_the_locks():
    makefile = (ROOT / "Makefile").read_text()
    for stack, lock in LOCKS.items():
        entries = parse_lock(lock)
        if stack == "torch21":  # torch's CUDA libraries follow the stack's CUDA minor (12.1), nvjitlink too
            assert entries["nvidia-nvjitlink-cu12"][0].startswith("12.1."), entries["nvidia-nvjitlink-cu12"]
        line = re.search(rf"^STACK_VERSIONS_{stack} := (.*)$", makefile, re.M).group(1)
        assert f"TORCH_VERSION={entries['torch'][0]}" in line
        assert f"TRITON_VERSION={entries['triton'][0]}" in line
