"""`python -m service.openapi`: see the package's docstring."""

import sys

from service.openapi import main

sys.exit(main())
