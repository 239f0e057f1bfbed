"""`vramcast keys` and `vramcast db` against a fresh database of each backend."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from sqlalchemy.orm import Session

from service.cli.store import register
from service.store.db import create_engine_from_url
from service.store.keys import KeyScope, allows, authenticate


def run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="vramcast")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    code: int = args.handler(args)
    return code


def test_keys_lifecycle(blank_database_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    url = ("--database-url", blank_database_url)
    assert run("db", "upgrade", *url) == 0
    assert (
        run("keys", "create", "--scope", "upload", "--scope", "read", "--name", "fleet", *url) == 0
    )
    token = capsys.readouterr().out.strip().splitlines()[-1]

    engine = create_engine_from_url(blank_database_url)
    try:
        with Session(engine) as session:
            key = authenticate(session, token)
            assert key is not None and key.name == "fleet"
            assert allows(key, KeyScope.UPLOAD) and allows(key, KeyScope.READ)
            prefix = key.prefix

        assert run("keys", "list", *url) == 0
        listing = capsys.readouterr().out
        assert prefix in listing and "read,upload" in listing and token not in listing

        assert run("keys", "revoke", prefix, *url) == 0
        assert capsys.readouterr().out == f"revoked key {prefix}\n"
        with Session(engine) as session:
            assert authenticate(session, token) is None
        assert run("keys", "list", *url) == 0
        assert prefix not in capsys.readouterr().out
        assert run("keys", "list", "--all", *url) == 0
        assert "revoked" in capsys.readouterr().out
    finally:
        engine.dispose()

    assert run("keys", "revoke", "ffffffff", *url) == 2
    assert "no key with prefix" in capsys.readouterr().err


def test_db_upgrade_current_and_downgrade(
    blank_database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    url = ("--database-url", blank_database_url)
    assert run("db", "upgrade", *url) == 0
    assert run("db", "current", *url) == 0
    assert "(head)" in capsys.readouterr().out
    assert run("db", "downgrade", "base", *url) == 0


def test_keys_on_a_database_without_tables_say_what_to_do(
    blank_database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run("keys", "list", "--database-url", blank_database_url) == 1
    assert "vramcast db upgrade" in capsys.readouterr().err


def test_a_scope_must_be_known() -> None:
    with pytest.raises(SystemExit):
        run("keys", "create", "--scope", "everything")


def test_db_without_the_migration_scripts_says_where_to_run_it(
    blank_database_url: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    # As in a wheel install, where migrations/ (the Alembic scripts) is not shipped.
    monkeypatch.setattr("service.store.migrate.MIGRATIONS_DIR", tmp_path / "missing")
    assert run("db", "upgrade", "--database-url", blank_database_url) == 1
    err = capsys.readouterr().err
    assert "migrations not found" in err
    assert "source checkout" in err
