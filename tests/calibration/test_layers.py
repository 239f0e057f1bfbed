"""The calibration package sits between the store and the API: it never imports the API."""

from __future__ import annotations

import ast
from pathlib import Path

CALIBRATION = Path(__file__).resolve().parents[2] / "service" / "calibration"
ALLOWED = ("service.core", "service.catalog", "service.store", "service.calibration")


def test_calibration_imports_no_api_and_no_cli() -> None:
    offenders = []
    for path in sorted(CALIBRATION.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                inside = any(name == top or name.startswith(f"{top}.") for top in ALLOWED)
                if name.split(".")[0] == "service" and not inside:
                    offenders.append(f"{path.name}: {name}")
    assert not offenders, offenders
    assert len(list(CALIBRATION.glob("*.py"))) >= 4  # the walk saw the package
