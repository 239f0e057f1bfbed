"""Run the Alembic migrations programmatically (the CLI, tests, the one-shot migration job)."""

from __future__ import annotations

import sys
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Connection

# The migrations live at the repository root, next to the `service` package.
MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"


def alembic_config(url: str, *, connection: Connection | None = None) -> Config:
    """An Alembic config for `url` (or an open connection), without reading alembic.ini."""
    if not MIGRATIONS_DIR.is_dir():
        raise FileNotFoundError(f"migrations not found at {MIGRATIONS_DIR}")
    config = Config(stdout=sys.stdout)
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    # ConfigParser interpolation: a literal % in a URL (an escaped password) must be doubled.
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    command.downgrade(alembic_config(url), revision)
