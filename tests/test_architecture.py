"""The tree's rooms and the arrows between them (docs/architecture.md).

Every `import` of a `service` module, at the top of a file or inside a function, counts. A
package may import only packages on a lower floor, and no modules import each other in a circle.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import service

ROOT = Path(service.__file__).parent

# The floors, lowest first. `web` is static files. (The HTTP client is its own distribution,
# clients/python, and imports nothing of the service: tests/client/test_client.py.)
FLOORS: dict[str, int] = {
    "core": 0,
    "web": 0,
    "catalog": 1,
    "store": 1,
    "calibration": 2,
    "trace": 2,
    "api": 3,
    "cli": 4,
    "openapi": 4,
}
MAX_LINES = 800


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(("service", *path.relative_to(ROOT).with_suffix("").parts))
        found[name.removesuffix(".__init__")] = path
    return found


def _imports(path: Path, modules: dict[str, Path]) -> Iterator[str]:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] == "service":
                yield node.module
                for alias in node.names:
                    if f"{node.module}.{alias.name}" in modules:
                        yield f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.split(".")[0] == "service")


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: set(_imports(path, modules)) & modules.keys() for name, path in modules.items()}


def _room(module: str) -> str:
    return module.split(".")[1] if "." in module else "service"


def test_every_package_has_a_floor() -> None:
    rooms = {_room(m) for m in _modules()} - {"service"}
    assert rooms == set(FLOORS), rooms ^ set(FLOORS)


def test_no_import_runs_up_a_floor() -> None:
    wrong = [
        f"{source} imports {target}"
        for source, targets in _graph().items()
        for target in targets
        if _room(source) != "service"
        and _room(target) != _room(source)
        and FLOORS[_room(target)] >= FLOORS[_room(source)]
    ]
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_circles() -> None:
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    assert not circles, circles


def test_no_file_is_over_800_lines() -> None:
    long = {
        str(path.relative_to(ROOT)): n
        for path in ROOT.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, long


def _package(module: str, modules: dict[str, Path]) -> str:
    """The package that holds `module`: itself for a package, else its parent."""
    return module if modules[module].name == "__init__.py" else module.rpartition(".")[0]


def _private_imports() -> Iterator[tuple[str, str, str]]:
    """(importer, source module, name) for each `_name` a service module imports."""
    modules = _modules()
    for importer, path in modules.items():
        here = _package(importer, modules).split(".")
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = here[: len(here) - node.level + 1] if node.level else []
            source = ".".join([*base, *([node.module] if node.module else [])])
            if source not in modules:
                continue
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    yield importer, source, alias.name


def test_no_private_name_crosses_a_package() -> None:
    """A package's `_names` are its own: other packages import only its public names."""
    modules = _modules()
    crossing = [
        f"{importer} imports {source}.{name}"
        for importer, source, name in _private_imports()
        if _package(importer, modules) != _package(source, modules)
    ]
    assert not crossing, "\n".join(sorted(crossing))


def test_the_private_import_check_sees_imports() -> None:
    """The check above reads the tree: within a package, `_names` are imported today."""
    assert any(source.startswith("service.core.estimator") for _, source, _ in _private_imports())
