"""The core imports nothing but the standard library and itself."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "service" / "core"


def test_core_imports_only_stdlib_and_core() -> None:
    offenders = []
    for path in sorted(CORE.glob("*.py")):
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
                offenders.append(f"{path.name}: {name}")
    assert not offenders, offenders
    assert len(list(CORE.glob("*.py"))) >= 8  # the walk saw the core
