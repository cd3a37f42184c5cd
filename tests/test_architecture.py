"""The layout keeps its promises: every module names its thread, MLX stays in engine/ and testing/,
no module imports itself back through others, and the code passes the linter and mypy --strict."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "vlmserve"
THREADS = ("[main]", "[loop]", "[pool]", "[worker]", "[any]")
MLX_HOMES = ("engine", "testing")


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__main__.py")


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_every_module_names_its_thread(path: Path) -> None:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    if path.name == "__init__.py" and not doc:
        return
    assert doc.startswith(THREADS), f"{path}: the docstring's first word names its thread, e.g. [worker]"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_mlx_is_imported_only_in_engine_and_testing(path: Path) -> None:
    if path.relative_to(PACKAGE).parts[0] in MLX_HOMES:
        return
    tree = ast.parse(path.read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n == "mlx" or n.startswith(("mlx.", "mlx_vlm", "mlx_lm"))], path


# Names of a family's processor and model classes (and mlx-vlm's model modules): a family's facts are its
# adapter's (engine/models/), so no other module tells families apart by them.
FAMILY_NAMES = ("Gemma3", "Gemma4", "Lfm2", "LlavaNext", "Idefics3", "SmolVLM", "Qwen", "Pixtral", "Mistral3",
                "mlx_vlm.models.")
FAMILY_HOMES = (("engine", "models"), ("testing",))


def _family_branches(source: str) -> list[tuple[int, str]]:
    """Where ``source`` tells families apart by a class or module name (line, name): ``<x>.startswith("Gemma4")``
    (or ``endswith``), or a comparison of a ``__name__`` or ``__module__`` with such a name."""
    def named(node: ast.AST) -> list[str]:
        return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                and n.value.startswith(FAMILY_NAMES)]

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
                "startswith", "endswith"):
            found += [(node.lineno, name) for arg in node.args for name in named(arg)]
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(isinstance(n, ast.Attribute) and n.attr in ("__name__", "__module__")
                   for side in sides for n in ast.walk(side)):
                found += [(node.lineno, name) for side in sides for name in named(side)]
    return sorted(found)


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_only_adapters_tell_families_apart_by_class_name(path: Path) -> None:
    parts = path.relative_to(PACKAGE).parts
    if parts[:2] in FAMILY_HOMES or parts[:1] in FAMILY_HOMES:
        return
    assert _family_branches(path.read_text()) == [], f"{path}: a family's fact belongs in its adapter (engine/models/)"


def test_the_family_branch_check_finds_branches() -> None:
    old = """
kind = type(ip).__name__
if kind.startswith("Gemma4"): pass
shrinks = not kind.startswith(("Pixtral", "Idefics3"))
own = type(lm).__module__.startswith("mlx_vlm.models.lfm2")
gemma = type(ip).__name__ == "Gemma3ImageProcessor"
plain = name.startswith("data:") or type(x).__name__ == "KVCache"
"""
    assert _family_branches(old) == [(3, "Gemma4"), (4, "Idefics3"), (4, "Pixtral"), (5, "mlx_vlm.models.lfm2"),
                                     (6, "Gemma3ImageProcessor")]


def test_ruff_is_clean() -> None:
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed (pip install -e '.[test]' installs it)")
    root = PACKAGE.parent
    result = subprocess.run([ruff, "check", "vlmserve", "tests", "benchmarks"], cwd=root, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


TYPED = ("vlmserve",)  # mypy --strict (pyproject.toml), all of it but testing/ (whose errors it ignores)


def test_mypy_is_clean() -> None:
    mypy = shutil.which("mypy") or str(Path(sys.executable).parent / "mypy")
    if not Path(mypy).exists():
        pytest.skip("mypy is not installed (pip install -e '.[test]' installs it)")
    result = subprocess.run([mypy, *TYPED], cwd=PACKAGE.parent, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules ``path`` imports, at any depth of the file (function-level imports
    count: they close the same circle, only later). ``from pkg import sub`` imports ``pkg.sub``."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], *filter(None, [base])])
            subs = {f"{base}.{a.name}" for a in node.names} & modules
            found.update(subs if len(subs) == len(node.names) else {base, *subs})
    return (found & modules) - {name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _package_graph() -> dict[str, set[str]]:
    paths = [*_modules(), *PACKAGE.rglob("__main__.py")]
    modules = {_module_name(p) for p in paths}
    return {_module_name(p): _imports(p, modules) for p in paths}


def test_no_import_circles() -> None:
    assert _cycles(_package_graph()) == []


def test_the_circle_check_finds_a_circle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _private_overrides(sources: list[str], base: str = "ModelRunner") -> list[str]:
    """``Class.method`` for each method of a subclass of ``base`` (at any depth, classes known by name) that
    overrides one of ``base``'s private (underscore, not dunder) methods."""
    classes = {n.name: n for source in sources for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)}

    def methods(cls: ast.ClassDef) -> set[str]:
        return {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}

    def bases(cls: ast.ClassDef) -> set[str]:
        return {b.id if isinstance(b, ast.Name) else b.attr for b in cls.bases if isinstance(b, (ast.Name, ast.Attribute))}

    private = {m for m in methods(classes[base]) if m.startswith("_") and not m.endswith("__")}
    family, grown = {base}, True
    while grown:
        more = {name for name, cls in classes.items() if name not in family and bases(cls) & family}
        family, grown = family | more, bool(more)
    return sorted(f"{name}.{m}" for name in family - {base} for m in methods(classes[name]) & private)


def test_no_runner_overrides_a_private_method_of_model_runner() -> None:
    """A pipeline rank is a ``ModelRunner`` with a ``Rank`` (engine/runner.py), not a subclass that
    rewrites the runner's insides."""
    assert _private_overrides([p.read_text() for p in (PACKAGE / "engine").rglob("*.py")]) == []


def test_the_override_check_finds_an_override() -> None:
    old = """
class ModelRunner:
    def __init__(self): pass
    def execute(self): pass
    def _share(self): pass
    def _guarded(self): pass
class LeaderRunner(ModelRunner):
    def __init__(self): pass
    def _share(self): pass
    def heartbeat(self): pass
class Deeper(runner.LeaderRunner):
    def _guarded(self): pass
    def _own(self): pass
"""
    assert _private_overrides([old]) == ["Deeper._guarded", "LeaderRunner._share"]


# Phase 1 hands the engine plain contracts (vlmserve/inputs.py) and never imports it: the arrow runs one way.
CONTRACTS = "vlmserve.inputs"


def test_preprocess_never_imports_the_engine() -> None:
    graph = _package_graph()
    upward = {m: sorted(i for i in graph[m] if i.startswith("vlmserve.engine")) for m in graph
              if m.startswith("vlmserve.preprocess")}
    assert {m: i for m, i in upward.items() if i} == {}


def test_the_contracts_import_nothing_of_the_package() -> None:
    """Below both phases: the contract module imports no module of the package, and (through it) no MLX."""
    assert _package_graph()[CONTRACTS] == set()
