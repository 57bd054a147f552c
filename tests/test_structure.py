"""The package's shape, kept: no import cycle, no module over 400 lines, one timer, no repeated blocks.

All read from the source (AST and text); nothing is imported or run.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "train"
pytestmark = pytest.mark.skipif(not PKG.is_dir(),
                                reason="no source tree beside tests/ (inside the image train/ is installed)")
MAX_LINES = 400
DUPLICATE_LINES = 10


def modules() -> dict[str, Path]:
    """Dotted module name → file, for every module of ``train/``."""
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module → the ``train`` modules it imports anywhere in its body (function-level imports included:
    a lazy import still ties two modules together). ``from train.x import y`` points at ``train.x`` (its
    ``__init__`` runs first) and also at ``train.x.y`` when that is a module."""
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                # the package itself runs first (its __init__), then the named submodule, if it is one
                targets = [base] + [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != name and t != "train":
                    graph[name].add(t)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_the_import_graph_has_no_cycle() -> None:
    mods = modules()
    graph = import_graph(mods)
    assert graph["train.commands.train"] >= {"train.setup", "train.compiling.warmup"}  # the graph is really read
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}}) is None


def test_no_module_over_400_lines() -> None:
    long = {str(p.relative_to(PKG.parent)): n for p in PKG.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"split these modules (over {MAX_LINES} lines): {long}"


def hand_timed_functions(path: Path) -> list[str]:
    """Functions that both synchronise the device and read ``perf_counter`` themselves (nested functions
    counted on their own)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names = set()
            for sub in ast.walk(node):
                if sub is not node and isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                if isinstance(sub, ast.Attribute):
                    names.add(sub.attr)
                elif isinstance(sub, ast.Name):
                    names.add(sub.id)
            if "synchronize" in names and "perf_counter" in names:
                found.append(f"{path.name}:{node.lineno} {node.name}")
    return found


def test_device_timing_goes_through_perf_timer(tmp_path: Path) -> None:
    """``synchronize → perf_counter → synchronize`` is written only in train/perf/ (``Timed``; ``StepTimer`` uses
    CUDA events and never synchronises per step)."""
    outside = [f for p in PKG.rglob("*.py") if "perf" not in p.relative_to(PKG).parts[:1]
               for f in hand_timed_functions(p)]
    assert not outside, f"use train.perf.timer.Timed instead: {outside}"
    sample = tmp_path / "hand_timed.py"  # the check sees a hand-timed function
    sample.write_text("import time\nimport torch\n\n"
                      "def f():\n    torch.cuda.synchronize()\n    return time.perf_counter()\n")
    assert hand_timed_functions(sample) == ["hand_timed.py:4 f"]


def repeated_blocks(files: list[Path], size: int = DUPLICATE_LINES) -> list[str]:
    """Places where ``size`` consecutive non-blank, non-comment lines (whitespace-normalised) occur twice."""
    seen: dict[tuple[str, ...], str] = {}
    out = []
    for path in files:
        lines = [(i + 1, re.sub(r"\s+", " ", line.strip())) for i, line in enumerate(path.read_text().splitlines())]
        lines = [(n, text) for n, text in lines if text and not text.startswith("#")]
        last_hit = -size
        for k in range(len(lines) - size + 1):
            block = tuple(text for _, text in lines[k:k + size])
            where = f"{path.relative_to(PKG.parent)}:{lines[k][0]}"
            if block in seen and k - last_hit >= size:
                out.append(f"{where} repeats {seen[block]}")
                last_hit = k
            seen.setdefault(block, where)
    return out


def test_no_block_of_10_lines_is_repeated(tmp_path: Path) -> None:
    assert not repeated_blocks(sorted(PKG.rglob("*.py"))), repeated_blocks(sorted(PKG.rglob("*.py")))
    body = "".join(f"x{i} = {i}\n" for i in range(12))
    (tmp_path / "a.py").write_text(body)
    (tmp_path / "b.py").write_text("y = 0\n" + body)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(__import__(__name__), "PKG", tmp_path)
        assert len(repeated_blocks([tmp_path / "a.py", tmp_path / "b.py"])) == 1


def test_the_top_level_holds_only_the_core() -> None:
    """Components live in their folders; at most 16 modules beside ``__init__``/``__main__`` at the top."""
    top = sorted(p.stem for p in PKG.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert len(top) <= 16, f"{len(top)} top-level modules: {top}; move components into their packages"
    assert {"cli", "setup", "trainer", "evaluation", "callbacks"} <= set(top)
    assert (PKG / "commands" / "__init__.py").is_file() and (PKG / "report" / "levers.py").is_file()


COMMANDS = ("train.commands", "train.cli", "train.__main__")
RUN_SETUP = ("train.setup", "train.resolve", "train.report", "train.report.levers", "train.resume")
STEP = ("train.trainer",)


def _layer(module: str) -> int:
    """4 commands, 3 run set-up, 2 the step (the trainer), 1 components and core."""
    for rank, prefixes in ((4, COMMANDS), (3, RUN_SETUP), (2, STEP)):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    return 1


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports that go up a layer: a component importing the trainer, the run set-up or a command; the trainer
    importing the set-up or a command; the set-up importing a command (lazy imports included)."""
    return sorted(f"{a} imports {b}" for a, targets in graph.items() for b in targets if _layer(b) > _layer(a))


def test_components_never_import_the_trainer_the_run_setup_or_a_command() -> None:
    graph = import_graph(modules())
    assert graph["train.commands.bench.training"] >= {"train.setup"}  # the graph is really read
    bad = layer_violations(graph)
    assert not bad, f"commands → run set-up → trainer → components: {bad}"
    assert layer_violations({"train.data.x": {"train.trainer"}, "train.setup": {"train.commands.train"},
                             "train.commands.train": {"train.setup", "train.data.x"}}) == [
        "train.data.x imports train.trainer", "train.setup imports train.commands.train"]


def test_one_step_drives_training() -> None:
    """``optimizer.step`` and ``.backward(`` only in the step's own machinery: the trainer, the precision policy
    (backward, scaler step) and the numerics guard (the step it may skip); a FLOP count and a capability probe
    run a backward that trains nothing."""
    allowed = {"trainer.py", "precision.py", "numerics.py", "perf/flops.py", "compat.py"}
    found = sorted(str(p.relative_to(PKG)) for p in PKG.rglob("*.py")
                   if re.search(r"optimizer\.step\(|\.backward\(", "\n".join(
                       line for line in p.read_text(encoding="utf-8").splitlines()
                       if not line.strip().startswith("#"))))
    assert set(found) <= allowed, f"a training step outside Trainer.step: {set(found) - allowed}"


TESTS = Path(__file__).resolve().parent


def imported_test_modules(path: Path) -> set[str]:
    """The ``tests/test_*.py`` modules (by stem) that ``path`` imports anywhere in its body: ``from tests.test_x
    import …``, ``import tests.test_x``, ``from tests import test_x``, ``from test_x import …`` (tests/ on
    sys.path), relative forms, and ``importlib.import_module("tests.test_x")`` / ``__import__`` with a literal."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            names.append(base)
            names += [f"{base}.{a.name}" if base else a.name for a in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("import_module", "__import__"):
                names.append(node.args[0].value)
    found = set()
    for name in names:
        parts = name.split(".")
        if parts and parts[0] == "tests":
            parts = parts[1:]
        if parts and parts[0].startswith("test_"):
            found.add(parts[0])
    return found - {path.stem}


def test_no_test_module_imports_another() -> None:
    """Helpers shared by test modules live in ``tests/conftest.py`` (``from tests.conftest import …``); a test
    module importing another runs (and couples to) that module's tests and imports."""
    offenders = {p.name: sorted(found) for p in sorted(TESTS.glob("*.py")) if (found := imported_test_modules(p))}
    assert not offenders, f"move the shared helpers into tests/conftest.py: {offenders}"


def test_the_test_import_check_sees_every_form(tmp_path: Path) -> None:
    forms = ["from tests.test_numerics import small_trainer", "import tests.test_resume", "from tests import test_cli",
             "from test_ddp import x", "from .test_models import y",
             "def f():\n    import importlib\n    return importlib.import_module('tests.test_packing')"]
    for i, form in enumerate(forms):
        (tmp_path / f"test_sample{i}.py").write_text(form + "\n")
    assert [imported_test_modules(tmp_path / f"test_sample{i}.py") for i in range(len(forms))] == [
        {"test_numerics"}, {"test_resume"}, {"test_cli"}, {"test_ddp"}, {"test_models"}, {"test_packing"}]
    (tmp_path / "test_fine.py").write_text("from tests.conftest import small_trainer\n"
                                           "import test_fine\nimport train.tests\n")
    assert imported_test_modules(tmp_path / "test_fine.py") == set()
