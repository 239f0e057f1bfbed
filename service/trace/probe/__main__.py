"""`python -m service.trace.probe`: measure the matrix (`service.trace.probe.matrix`)."""

import sys

from service.trace.probe.matrix import main

if __name__ == "__main__":
    sys.exit(main())
