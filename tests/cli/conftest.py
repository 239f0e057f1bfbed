"""The store's database fixtures, for `vramcast keys` and `vramcast db`."""

from __future__ import annotations

from tests.store.conftest import blank_database_url

__all__ = ["blank_database_url"]
