"""The calibration package sits above the core, catalog and store, below the API and CLI."""

from __future__ import annotations

import subprocess
import sys

LAYERS_BELOW = ("service.core", "service.catalog", "service.store", "service.calibration")


def test_calibration_imports_no_api_and_no_cli() -> None:
    # A fresh interpreter: this one has imported the API already.
    program = (
        "import sys, service.calibration.factors, service.calibration.provider, "
        "service.calibration.service, service.calibration.uploads; "
        "print('\\n'.join(name for name in sys.modules if name.startswith('service.')))"
    )
    run = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, check=True
    )
    loaded = run.stdout.split()
    outside = [
        name
        for name in loaded
        if not any(name == top or name.startswith(f"{top}.") for top in LAYERS_BELOW)
    ]
    assert not outside, outside
    assert "service.calibration.service" in loaded  # the walk saw the package
