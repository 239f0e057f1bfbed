"""Settings shared by every test package."""

from __future__ import annotations

from hypothesis import settings

# Speed is measured by `make bench`, not by timed tests: a property's first example may pay
# for a cache (an allocator replay, a catalog load) that later ones reuse.
settings.register_profile("vramcast", deadline=None)
settings.load_profile("vramcast")
