"""`python -m service.cli ARGS` is `vramcast ARGS`."""

from __future__ import annotations

import sys

from service.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
