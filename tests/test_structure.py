"""The package's shape, kept: no import cycle, no module over 360 lines, no function over 80, one timer, no repeated
blocks, no private name imported across modules, package ``__init__`` files that only re-export, comments that explain
(no run ids or dated measurements in the code), and a training command that never rebinds its config.

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
MAX_LINES = 360
MAX_FUNCTION_LINES = 80
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
    assert graph["train.run.training"] >= {"train.setup", "train.compiling.warmup"}  # the graph is really read
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}}) is None


def test_no_module_over_the_line_cap() -> None:
    long = {str(p.relative_to(PKG.parent)): n for p in PKG.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"split these modules (over {MAX_LINES} lines): {long}"


def folder_loops(graph: dict[str, set[str]]) -> list[str]:
    """Pairs of top-level folders (``train.data``, ``train.models``, …; a top-level module is its own) that import
    each other, in either direction, through any of their modules."""
    def folder(m: str) -> str:
        return ".".join(m.split(".")[:2])

    edges = {(folder(a), folder(b)) for a, targets in graph.items() for b in targets if folder(a) != folder(b)}
    return sorted(f"{a} <-> {b}" for a, b in edges if (b, a) in edges and a < b)


def test_no_two_folders_import_each_other() -> None:
    graph = import_graph(modules())
    assert graph["train.data.bundle"] >= {"train.models.external"}  # the graph is really read
    assert not folder_loops(graph), f"folder loops (move the shared piece below both): {folder_loops(graph)}"
    assert folder_loops({"train.perf.flops": {"train.models.encoder"}, "train.models.dropout": {"train.perf.ab"},
                         "train.data.x": {"train.errors"}}) == ["train.models <-> train.perf"]


def test_commands_only_parse_and_config_runs_no_component() -> None:
    """``train/commands/`` holds the command handlers alone (≤ 1.5k lines); ``train/config/`` imports nothing of the
    package but its own modules and the core's errors: reading a config runs no component's code."""
    lines = sum(len(p.read_text(encoding="utf-8").splitlines()) for p in (PKG / "commands").rglob("*.py"))
    assert lines <= 1500, f"train/commands/ has {lines} lines: move engine code out (train/run/, bench/, optimize/)"
    graph = import_graph(modules())
    foreign = sorted(f"{a} imports {b}" for a, targets in graph.items() if a.startswith("train.config")
                     for b in targets if not b.startswith("train.config") and b != "train.errors")
    assert not foreign, f"parsing a config runs a component's code: {foreign}"


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
DRIVERS = ("train.run", "train.bench", "train.optimize")
RUN_SETUP = ("train.setup", "train.resolve", "train.report", "train.report.levers", "train.resume")
STEP = ("train.trainer",)


def _layer(module: str) -> int:
    """5 commands, 4 drivers (a run, the benchmarks, the autotuner), 3 run set-up, 2 the step (the trainer),
    1 components and core."""
    for rank, prefixes in ((5, COMMANDS), (4, DRIVERS), (3, RUN_SETUP), (2, STEP)):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    return 1


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports that go up a layer: a component importing the trainer, the run set-up, a driver or a command; the
    trainer importing the set-up, a driver or a command; the set-up importing a driver or a command; a driver
    importing a command (lazy imports included)."""
    return sorted(f"{a} imports {b}" for a, targets in graph.items() for b in targets if _layer(b) > _layer(a))


def test_components_never_import_the_trainer_the_run_setup_or_a_command() -> None:
    graph = import_graph(modules())
    assert graph["train.bench.training"] >= {"train.setup"}  # the graph is really read
    bad = layer_violations(graph)
    assert not bad, f"commands → drivers → run set-up → trainer → components: {bad}"
    assert layer_violations({"train.data.x": {"train.trainer"}, "train.setup": {"train.run.training"},
                             "train.run.training": {"train.setup", "train.data.x"},
                             "train.bench.suite": {"train.commands.entry", "train.run.training"}}) == [
        "train.bench.suite imports train.commands.entry", "train.data.x imports train.trainer",
        "train.setup imports train.run.training"]


def test_one_step_drives_training() -> None:
    """``optimizer.step`` and ``.backward(`` only in the step's own machinery: the trainer, the precision policy
    (backward, scaler step) and the numerics guard (the step it may skip); a FLOP count and a capability probe
    run a backward that trains nothing."""
    allowed = {"trainer.py", "precision.py", "numerics.py", "perf/flops.py", "models/flops.py", "compat.py"}
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


def long_functions(path: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """Functions (methods and nested functions each on their own) longer than ``limit`` lines; the lines of a dict
    literal of 10 lines or more (a table) are not counted."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            tables = sum(sub.end_lineno - sub.lineno + 1 for sub in ast.walk(node)
                         if isinstance(sub, ast.Dict) and sub.end_lineno - sub.lineno >= 9)
            length = node.end_lineno - node.lineno + 1 - tables
            if length > limit:
                out.append(f"{path.relative_to(path.parents[1])}:{node.lineno} {node.name} ({length} lines)")
    return out


def test_no_function_over_80_lines(tmp_path: Path) -> None:
    found = [f for p in sorted(PKG.rglob("*.py")) for f in long_functions(p)]
    assert not found, f"split these functions (over {MAX_FUNCTION_LINES} lines): {found}"
    sample = tmp_path / "pkg" / "long.py"
    sample.parent.mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(81))
    table = "    t = {\n" + "".join(f"        {i}: {i},\n" for i in range(90)) + "    }\n"
    sample.write_text(f"def f():\n{body}\n\ndef g():\n{table}    return t\n")
    assert long_functions(sample) == ["pkg/long.py:1 f (82 lines)"]


def private_imports(path: Path) -> list[str]:
    """``from train.x import _name``: a private name used outside its module."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == "train"):
            out += [f"{path.name}:{node.lineno} {a.name}" for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")]
    return out


def test_no_private_name_is_imported_across_modules(tmp_path: Path) -> None:
    found = [f for p in sorted(PKG.rglob("*.py")) for f in private_imports(p)]
    assert not found, f"make these public or move them where they are used: {found}"
    sample = tmp_path / "m.py"
    sample.write_text("from train.data.readers import _rows_for, rows\nfrom .x import _y\nfrom os import _exit\n")
    assert private_imports(sample) == ["m.py:1 _rows_for", "m.py:2 _y"]


def shown(path: Path) -> str:
    """``path`` as the failure message names it: relative to the repository when inside it."""
    return str(path.relative_to(PKG.parent)) if path.is_relative_to(PKG.parent) else path.name


def logic_in_init(path: Path) -> list[str]:
    """What a package ``__init__.py`` defines beyond its docstring, imports, ``__all__`` and plain constants."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [f"{shown(path)}:{n.lineno} {getattr(n, 'name', type(n).__name__)}" for n in tree.body
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.If, ast.For, ast.With,
                              ast.Try, ast.While))]


def test_package_inits_only_re_export(tmp_path: Path) -> None:
    found = [f for p in sorted(PKG.rglob("__init__.py")) for f in logic_in_init(p)]
    assert not found, f"move this logic into a named module and re-export it: {found}"
    (tmp_path / "__init__.py").write_text('"""doc."""\nfrom a import b\n__all__ = ["b"]\n\ndef f():\n    pass\n')
    assert logic_in_init(tmp_path / "__init__.py")[0].endswith(":5 f")


# A comment or docstring that tells which run measured what: a run id of the project's own measurements
# (opt-naive-12, grid-naive-11, bvh-opt-hf-8, opt-hf-7) or a dated measurement. Those belong in docs/.
NARRATION = re.compile(r"\b(?:opt-naive|grid-naive|bvh-opt|opt-hf|bvh-[a-z]+)-\d+\b|\b20[2-3]\d-[01]\d-[0-3]\d\b")


def narrations(path: Path) -> list[str]:
    return [f"{shown(path)}:{i} {line.strip()[:80]}"
            for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if NARRATION.search(line)]


def test_no_history_narrated_in_the_code(tmp_path: Path) -> None:
    found = [f for p in sorted(PKG.rglob("*.py")) for f in narrations(p)]
    assert not found, f"move which run measured what into docs/: {found}"
    sample = tmp_path / "n.py"
    sample.write_text("# 276 samples/s in opt-naive-12\nx = 1  # measured 2026-12-03\ny = '%Y-%m-%d'\n")
    assert len(narrations(sample)) == 2


def config_rebinds(source: str) -> list[str]:
    """Where a function rebinds ``cfg`` (assigns it while it is a parameter, or a second time) or assigns an
    attribute called ``cfg``; nested functions are read on their own."""
    out = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        bound = sum(a.arg == "cfg" for a in fn.args.args + fn.args.kwonlyargs)
        stack = list(fn.body)
        while stack:
            node = stack.pop(0)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                continue
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.NamedExpr)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for sub in (s for t in targets for s in ast.walk(t)):
                    if isinstance(sub, ast.Attribute) and sub.attr == "cfg":
                        out.append(f"{fn.name}:{node.lineno} .cfg")
                    elif isinstance(sub, ast.Name) and sub.id == "cfg":
                        bound += 1
                        if bound > 1:
                            out.append(f"{fn.name}:{node.lineno} cfg")
            stack.extend(ast.iter_child_nodes(node))
    return out


def test_the_training_command_never_rebinds_its_config() -> None:
    """``train/run/training.py`` reads top to bottom: the resolve phase returns the frozen config, nothing rebinds
    it afterwards, and no mutable dataclass carries the run."""
    source = (PKG / "run" / "training.py").read_text(encoding="utf-8")
    tree = ast.parse(source)
    mutable = [n.name for n in tree.body if isinstance(n, ast.ClassDef) for d in n.decorator_list
               if isinstance(d, ast.Name) and d.id == "dataclass"]
    assert not mutable, f"a mutable dataclass carries the run: {mutable} (use @dataclass(frozen=True))"
    assert not config_rebinds(source), f"train/run/training.py rebinds its config: {config_rebinds(source)}"
    assert config_rebinds("def f(cfg):\n    cfg = g(cfg)\n\ndef h(r):\n    r.cfg = 1\n    cfg = 2\n") == [
        "f:2 cfg", "h:5 .cfg"]
