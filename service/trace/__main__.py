"""`python -m service.trace ARGS` is `vramcast trace ARGS`."""

from __future__ import annotations

import sys

from service.cli import main

if __name__ == "__main__":
    sys.exit(main(["trace", *sys.argv[1:]]))
