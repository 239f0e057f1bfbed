"""Migrations: upgrade to head, downgrade to base, one step at a time, and no drift."""

from __future__ import annotations

import re
from pathlib import Path

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect

from service.store.db import create_engine_from_url
from service.store.migrate import MIGRATIONS_DIR, alembic_config, downgrade, upgrade
from service.store.models import Base

TABLES = {
    "api_key",
    "calibration_upload",
    "calibration_ratio",
    "calibration_factor",
    "calibration_change",
    "calibration_rederivation",
    "calibration_vote",
}


def tables(url: str) -> set[str]:
    engine = create_engine_from_url(url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def revisions(url: str) -> list[str]:
    """Revision ids, base first."""
    script = ScriptDirectory.from_config(alembic_config(url))
    return [rev.revision for rev in reversed(list(script.walk_revisions()))]


def test_upgrade_to_head_and_downgrade_to_base(blank_database_url: str) -> None:
    upgrade(blank_database_url)
    assert tables(blank_database_url) == TABLES
    downgrade(blank_database_url, "base")
    assert tables(blank_database_url) == set()
    upgrade(blank_database_url)
    assert tables(blank_database_url) == TABLES


def test_every_revision_downgrades_and_upgrades_again(blank_database_url: str) -> None:
    config = alembic_config(blank_database_url)
    for revision in revisions(blank_database_url):
        command.upgrade(config, revision)
        command.downgrade(config, "-1")
        command.upgrade(config, revision)


def test_models_and_migrations_agree(blank_database_url: str) -> None:
    upgrade(blank_database_url)
    engine = create_engine_from_url(blank_database_url)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={"compare_type": True})
            assert compare_metadata(context, Base.metadata) == []
    finally:
        engine.dispose()


def test_one_head_and_dated_file_names() -> None:
    script = ScriptDirectory(str(MIGRATIONS_DIR))
    assert len(script.get_heads()) == 1
    names = [path.name for path in Path(MIGRATIONS_DIR, "versions").glob("*.py")]
    assert names
    assert all(re.fullmatch(r"20\d{6}_[0-9a-f]+_\w+\.py", name) for name in names), names
