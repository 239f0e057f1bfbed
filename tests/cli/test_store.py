"""`vramcast keys` and `vramcast db` against a fresh database of each backend."""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

import pytest
from sqlalchemy.orm import Session

from service.calibration.factors import fit_factor_table, load_factor_table, stored_factor_table
from service.calibration.uploads import submit_upload
from service.cli.store import register
from service.core.calibration import EMPTY_TABLE
from service.core.estimator import ESTIMATOR_VERSION
from service.store.db import create_engine_from_url, create_session_factory
from service.store.keys import KeyScope, allows, authenticate
from tests.store.factories import fake_estimate, new_upload, node_key, render


def run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="vramcast")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    code: int = args.handler(args)
    return code


def test_keys_lifecycle(blank_database_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    url = ("--database-url", blank_database_url)
    assert run("db", "upgrade", *url) == 0
    create = ("keys", "create", "--scope", "upload", "--scope", "read", "--name", "fleet")
    assert run(*create, "--node", "gpu-node-*", "--node", "login-1", *url) == 0
    created = capsys.readouterr().out.strip().splitlines()
    assert "for nodes gpu-node-*, login-1" in created[0]
    token = created[-1]

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
        assert "0 uploads" in listing and "nodes gpu-node-*,login-1" in listing

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


def test_an_upload_key_names_its_nodes(
    blank_database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    url = ("--database-url", blank_database_url)
    assert run("db", "upgrade", *url) == 0
    assert run("keys", "create", "--scope", "upload", *url) == 2
    assert "needs the node ids it may upload for" in capsys.readouterr().err
    assert run("keys", "create", "--scope", "admin", "--node", "n1", *url) == 2
    assert "only an upload key names its nodes" in capsys.readouterr().err
    assert run("keys", "list", *url) == 0
    assert capsys.readouterr().out == ""


def test_keys_list_counts_uploads_and_revoke_purges_them(
    blank_database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    url = ("--database-url", blank_database_url)
    assert run("db", "upgrade", *url) == 0
    engine = create_engine_from_url(blank_database_url)
    try:
        prefixes = {}
        with create_session_factory(engine).begin() as session:
            for node in ("a", "b", "c", "d"):
                key = node_key(session, node)
                prefixes[node] = key.prefix
                for model in ("org/alpha-7b", "org/beta-8b", "org/gamma-13b"):
                    upload = new_upload(
                        model=model,
                        node_id=node,
                        estimate_gib=10.0,
                        device_gib=12.0 * (1.2 if node == "d" else 1.05),
                    )
                    submit_upload(
                        session,
                        upload,
                        api_key_id=key.id,
                        idempotency_key=None,
                        estimate=partial(fake_estimate, version=ESTIMATOR_VERSION),
                        factors=EMPTY_TABLE,
                        render=render,
                    )
            load_factor_table(session, ESTIMATOR_VERSION)
        assert run("keys", "list", *url) == 0
        listing = capsys.readouterr().out.splitlines()
        assert len(listing) == 4 and all("3 uploads" in line for line in listing)
        assert f"{prefixes['d']}  upload" in listing[3] and "nodes d " in listing[3]

        assert run("keys", "revoke", prefixes["d"], "--purge", *url) == 0
        assert capsys.readouterr().out == (
            f"revoked key {prefixes['d']}; purged 3 uploads (3 ratios), refitted 1 "
            f"partitions of estimator {ESTIMATOR_VERSION}\n"
        )
        with create_session_factory(engine)() as session:
            stored = stored_factor_table(session, ESTIMATOR_VERSION)
            assert stored != EMPTY_TABLE
            assert stored == fit_factor_table(session, ESTIMATOR_VERSION)
            assert all(factor.nodes == 3 for factor in stored.factors.values())
        assert run("keys", "list", "--all", *url) == 0
        purged = [line for line in capsys.readouterr().out.splitlines() if prefixes["d"] in line]
        assert len(purged) == 1 and "0 uploads" in purged[0] and "revoked" in purged[0]
    finally:
        engine.dispose()
