"""The core imports nothing but the standard library and itself."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "service" / "core"


def test_core_imports_only_stdlib_and_core() -> None:
    offenders = []
    for path in sorted(CORE.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if name.startswith("service.core") or top in sys.stdlib_module_names:
                    continue
                offenders.append(f"{path.relative_to(CORE)}: {name}")
    assert not offenders, offenders
    assert len(list(CORE.rglob("*.py"))) >= 8  # the walk saw the core
    # and the estimator's and the schedule's packages
    assert {"estimator", "schedule"} <= {p.parent.name for p in CORE.rglob("*.py")}


def test_only_the_core_imports_the_estimator_packages_modules() -> None:
    """Outside the core, the estimator and the schedule are imported by their packages'
    public names (`service.core.estimator`, `service.core.schedule`), not their modules."""
    root = CORE.parents[1]
    offenders = []
    for top in ("service", "tests", "bench"):
        for path in sorted((root / top).rglob("*.py")):
            if CORE in path.parents:
                continue
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.ImportFrom) and node.module:
                    module = node.module
                elif isinstance(node, ast.Import):
                    module = " ".join(a.name for a in node.names)
                else:
                    continue
                for package in ("service.core.estimator.", "service.core.schedule."):
                    if package in f"{module} ":
                        offenders.append(f"{path.relative_to(root)}: {module}")
    assert not offenders, offenders
