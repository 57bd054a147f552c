"""The image's locks and Dockerfile, checked statically (no Docker engine needed)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
LOCKS = {"torch21": DOCKER / "requirements.lock", "torch2x": DOCKER / "requirements-torch2x.lock"}
# torch's own `triton==` pin for each torch in a lock (torch's wheel metadata, Requires-Dist).
TORCH_TRITON_PIN = {"2.1.0": "2.1.0", "2.6.0": "3.2.0"}
pytestmark = pytest.mark.skipif(not (DOCKER / "Dockerfile").exists(), reason="docker/ is not in this tree (inside the image)")


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
    assert TORCH_TRITON_PIN[torch_v] == triton_v, f"torch {torch_v} pins triton {TORCH_TRITON_PIN[torch_v]}, lock has {triton_v}"
    assert "nvidia-ml-py" in entries
    assert "nvidia-ml-py3" not in entries


def test_default_lock_is_the_torch21_stack_with_numpy1():
    entries = parse_lock(LOCKS["torch21"])
    assert entries["torch"][0] == "2.1.0" and entries["triton"][0] == "2.1.0"
    assert int(entries["numpy"][0].split(".")[0]) < 2, "torch 2.1 wheels fail to import beside NumPy 2"
    for name in ("wandb", "py-spy", "torchmetrics", "tokenizers", "setuptools"):
        assert name in entries


@pytest.mark.parametrize("stack,infile", [("torch21", "requirements-torch21.in"), ("torch2x", "requirements-torch2x.in")])
def test_lock_covers_its_input_and_the_project_dependencies(stack, infile):
    entries = parse_lock(LOCKS[stack])
    assert in_names(DOCKER / infile) <= set(entries)
    pyproject = (ROOT / "pyproject.toml").read_text()
    deps = re.search(r"^dependencies = \[(.*?)\]", pyproject, re.S | re.M).group(1)
    for dep in re.findall(r'"([A-Za-z0-9_.-]+)', deps):
        assert dep.lower().replace("_", "-") in entries, f"project dependency {dep} missing from {LOCKS[stack].name}"


def test_dockerfile_installs_each_lock_with_hashes_and_checks():
    text = (DOCKER / "Dockerfile").read_text()
    assert "--require-hashes" in text and "pip check" in text
    for stack, lock in LOCKS.items():
        assert re.search(rf"AS cuda-{stack}\nENV DMP_STACK={stack} DMP_LOCK={lock.name}\n", text), stack
        assert (ROOT / ".dockerignore").read_text().count(f"!docker/{lock.name}") == 1
    assert re.search(r"FROM nvidia/cuda:12\.1\.1-(runtime|devel)-ubuntu22\.04 AS cuda-torch21", text)
    for var in ("TORCHINDUCTOR_CACHE_DIR=/cache/", "TRITON_CACHE_DIR=/cache/"):
        assert var in text
    assert re.search(r'nsight-systems-cli=\$\{NSYS_VERSION\}', text) and re.search(r"ARG NSYS_VERSION=\d", text)
    assert "USER ${UID}:${GID}" in text and "ARG UID=" in text and "ARG GID=" in text
    assert "org.opencontainers.image.version" in text and "wordnet-base" in text
    assert "WANDB_API_KEY" not in text, "credentials are passed at run time, never baked into a layer"


def test_makefile_build_args_match_the_locks():
    makefile = (ROOT / "Makefile").read_text()
    for stack, lock in LOCKS.items():
        entries = parse_lock(lock)
        line = re.search(rf"^STACK_VERSIONS_{stack} := (.*)$", makefile, re.M).group(1)
        assert f"TORCH_VERSION={entries['torch'][0]}" in line
        assert f"TRITON_VERSION={entries['triton'][0]}" in line
