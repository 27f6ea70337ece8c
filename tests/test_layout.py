"""The code's shape: data flows one way and no module imports itself in a circle.

Imports are read from the source, type-checking-only imports included: a circle of type
hints is still a circle for a reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _modules() -> dict[str, Path]:
    out = {}
    for path in (ROOT / "streamworld").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Project modules that `name` imports."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        for imp in ast.walk(node):
            if isinstance(imp, ast.ImportFrom):
                if imp.level:
                    parts = package.split(".")
                    parts = parts[: len(parts) - (imp.level - 1)]
                    target = ".".join(parts + ([imp.module] if imp.module else []))
                else:
                    target = imp.module or ""
                for candidate in [target, *(f"{target}.{a.name}" for a in imp.names)]:
                    if candidate in MODULES and candidate != name:
                        found.add(candidate)
            elif isinstance(imp, ast.Import):
                found.update(a.name for a in imp.names if a.name in MODULES)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _cycle() -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(u: str) -> list[str] | None:
        state[u] = 1
        stack.append(u)
        for v in sorted(GRAPH[u]):
            if u.startswith(v + "."):
                continue  # a module importing its own package's surface
            if state.get(v) == 1:
                return [*stack[stack.index(v) :], v]
            if not state.get(v) and (found := visit(v)):
                return found
        state[u] = 2
        stack.pop()
        return None

    for name in sorted(GRAPH):
        if not state.get(name) and (found := visit(name)):
            return found
    return None


def test_no_import_circle():
    assert _cycle() is None


@pytest.mark.parametrize(
    ("layer", "must_not_import"),
    [
        ("streamworld.models", ("streamworld.engine", "streamworld.server", "streamworld.media")),
        ("streamworld.engine", ("streamworld.server", "streamworld.media", "streamworld.cli")),
        ("streamworld.media", ("streamworld.server", "streamworld.engine")),
        ("streamworld.client", ("streamworld.server", "streamworld.engine")),
        ("streamworld.server", ("streamworld.cli",)),
    ],
)
def test_data_flows_one_way(layer, must_not_import):
    bad = {
        (name, dep)
        for name, deps in GRAPH.items()
        if name == layer or name.startswith(layer + ".")
        for dep in deps
        if any(dep == m or dep.startswith(m + ".") for m in must_not_import)
    }
    assert not bad


def test_outside_the_engine_only_its_package_surface_is_imported():
    """Server, command line, benchmarks and PushT use `streamworld.engine`, not its modules."""
    users = [n for n in GRAPH if n.split(".")[1:2] in (["server"], ["cli"], ["bench"], ["pusht"])]
    reached = {(n, d) for n in users for d in GRAPH[n] if d.startswith("streamworld.engine.")}
    assert not reached


def test_the_check_sees_imports():
    assert "streamworld.engine.scheduler" in GRAPH["streamworld.engine.engine"]
    assert "streamworld.models.config" in GRAPH["streamworld.engine.request"]
