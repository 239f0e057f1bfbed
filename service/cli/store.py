"""`vramcast keys` (create API keys, list them with their uploads, revoke them and purge their
uploads) and `vramcast db` (run the migrations, re-derive calibration ratios for this
estimator version).

Both take `--database-url`, by default VRAMCAST_DATABASE_URL or the embedded SQLite file.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

from alembic import command
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from service.calibration import EstimateFn, rederive_ratios
from service.calibration.uploads import RederiveProgress, rederivation_status, revoke
from service.core.estimator import ESTIMATOR_VERSION
from service.store.db import create_engine_from_url, create_session_factory, database_url_from_env
from service.store.keys import KeyScope, create_key, key_usage
from service.store.migrate import alembic_config

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

Handler = Callable[[argparse.Namespace], int]
# Builds the estimator of jobs as uploads store them (the API's job JSON), on first use.
JobEstimatorFactory = Callable[[], EstimateFn]


def _add_database_url(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--database-url",
        default=None,
        help="SQLAlchemy URL (default: $VRAMCAST_DATABASE_URL or sqlite:///./var/vramcast.db)",
    )


def _url(args: argparse.Namespace) -> str:
    return args.database_url or database_url_from_env()


def _fail(args: argparse.Namespace, message: str, code: int = EXIT_FAILED) -> int:
    print(f"vramcast {args.command}: error: {message}", file=sys.stderr)
    return code


def _with_store(run: Handler) -> Handler:
    """Report database errors in one line (with the likely fix) instead of a traceback."""

    def handler(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except SQLAlchemyError as error:
            reason = str(error.orig if hasattr(error, "orig") else error).strip().splitlines()[0]
            return _fail(args, f"{reason} (is the database up and `vramcast db upgrade` run?)")
        except FileNotFoundError as error:
            # The Alembic scripts live in the source tree (migrations/), not in a wheel.
            return _fail(
                args,
                f"{error}; run `vramcast db` from a source checkout or the Docker image",
            )

    return handler


@contextmanager
def _sessions(args: argparse.Namespace) -> Iterator[sessionmaker[Session]]:
    engine = create_engine_from_url(_url(args))
    try:
        yield create_session_factory(engine)
    finally:
        engine.dispose()


@_with_store
def _keys_create(args: argparse.Namespace) -> int:
    nodes = args.nodes or []
    try:
        with _sessions(args) as sessions, sessions.begin() as session:
            issued = create_key(
                session, scopes=args.scopes, name=args.name, now=datetime.now(UTC), nodes=nodes
            )
            prefix, scopes = issued.key.prefix, ",".join(issued.key.scopes)
    except ValueError as error:
        return _fail(args, f"{error} (--node)", EXIT_USAGE)
    bound = f" for nodes {', '.join(nodes)}" if nodes else ""
    print(f"created key {prefix} ({scopes}){bound} named {args.name!r}; it is shown only once:")
    print(issued.token)
    return EXIT_OK


@_with_store
def _keys_list(args: argparse.Namespace) -> int:
    with _sessions(args) as sessions, sessions() as session:
        usage = key_usage(session, include_revoked=args.all)
        rows = [
            (
                f"{item.key.prefix}  {','.join(item.key.scopes):<18} "
                f"{item.key.created_at.isoformat()}  {item.uploads:>8} uploads  "
                f"nodes {','.join(item.key.nodes) or '-'}  {item.key.name}"
                + (f"  revoked {item.key.revoked_at.isoformat()}" if item.key.revoked_at else "")
            )
            for item in usage
        ]
    for row in rows:
        print(row)
    return EXIT_OK


@_with_store
def _keys_revoke(args: argparse.Namespace) -> int:
    with _sessions(args) as sessions, sessions.begin() as session:
        revocation = revoke(
            session,
            args.prefix,
            purge=args.purge,
            estimator_version=ESTIMATOR_VERSION,
            now=datetime.now(UTC),
        )
    if revocation is None:
        return _fail(args, f"no key with prefix {args.prefix!r}", EXIT_USAGE)
    purge = revocation.purge
    if purge is None:
        print(f"revoked key {args.prefix}")
    else:
        print(
            f"revoked key {args.prefix}; purged {purge.uploads} uploads ({purge.ratios} "
            f"ratios), refitted {purge.refitted} partitions of estimator {ESTIMATOR_VERSION}"
        )
    return EXIT_OK


@_with_store
def _db_upgrade(args: argparse.Namespace) -> int:
    command.upgrade(alembic_config(_url(args)), args.revision)
    return EXIT_OK


@_with_store
def _db_downgrade(args: argparse.Namespace) -> int:
    command.downgrade(alembic_config(_url(args)), args.revision)
    return EXIT_OK


@_with_store
def _db_current(args: argparse.Namespace) -> int:
    command.current(alembic_config(_url(args)))
    return EXIT_OK


def _progress_line(progress: RederiveProgress) -> str:
    finished = f", finished {progress.finished_at.isoformat()}" if progress.finished_at else ""
    return (
        f"rederive {progress.estimator_version}: {progress.phase}, {progress.done}/"
        f"{progress.total} uploads looked at ({progress.percent:.1f} %), {progress.derived} "
        f"given ratios; started {progress.started_at.isoformat()}{finished}"
    )


def _print_progress(progress: RederiveProgress) -> None:
    # Progress goes to stderr: stdout keeps the one-line result for scripts.
    print(_progress_line(progress), file=sys.stderr, flush=True)


def _db_rederive(job_estimator: JobEstimatorFactory) -> Handler:
    @_with_store
    def handler(args: argparse.Namespace) -> int:
        if args.status:
            with _sessions(args) as sessions, sessions() as session:
                status = rederivation_status(session, ESTIMATOR_VERSION)
            if status is None:
                print(f"rederive {ESTIMATOR_VERSION}: never run")
            else:
                print(_progress_line(status))
            return EXIT_OK
        estimate = job_estimator()
        # The job commits after each batch: stopped, it resumes where it was on the next run.
        with _sessions(args) as sessions, sessions() as session:
            derived = rederive_ratios(
                session,
                estimate=estimate,
                estimator_version=ESTIMATOR_VERSION,
                progress=_print_progress,
            )
        print(f"derived ratios of {derived} uploads for estimator {ESTIMATOR_VERSION}")
        return EXIT_OK

    return handler


def add_keys_parser(subparsers: Any) -> None:
    keys = subparsers.add_parser("keys", help="create, list and revoke API keys")
    actions = keys.add_subparsers(dest="keys_command", required=True)

    create = actions.add_parser("create", help="create a key; prints it once, on the last line")
    create.add_argument(
        "--scope",
        dest="scopes",
        action="append",
        required=True,
        type=KeyScope,
        choices=list(KeyScope),
        help="read, upload or admin; repeat for several",
    )
    create.add_argument(
        "--node",
        dest="nodes",
        action="append",
        metavar="ID",
        help="a node id an upload key may upload for, or a shell-style pattern ('gpu-node-*'; "
        "'*' for any); repeat for several. Needed for an upload key; the key casts one "
        "calibration vote whatever node ids its uploads name, so give each node its own key",
    )
    create.add_argument("--name", default="", help="what the key is for, shown in listings")
    _add_database_url(create)
    create.set_defaults(handler=_keys_create)

    listing = actions.add_parser(
        "list", help="list keys (never their secrets), with their uploads and node ids"
    )
    listing.add_argument("--all", action="store_true", help="include revoked keys")
    _add_database_url(listing)
    listing.set_defaults(handler=_keys_list)

    revoking = actions.add_parser("revoke", help="revoke a key by its prefix")
    revoking.add_argument("prefix", help="the key's prefix, as `keys list` shows it")
    revoking.add_argument(
        "--purge",
        action="store_true",
        help="also delete every calibration upload made with the key, and refit the factors "
        "without them",
    )
    _add_database_url(revoking)
    revoking.set_defaults(handler=_keys_revoke)


def add_db_parser(subparsers: Any, job_estimator: JobEstimatorFactory | None = None) -> None:
    """`vramcast db`; `rederive` only with the estimator of stored jobs (the API's)."""
    db = subparsers.add_parser("db", help="database migrations and calibration ratios")
    actions = db.add_subparsers(dest="db_command", required=True)

    upgrade = actions.add_parser("upgrade", help="migrate to a revision (default: head)")
    upgrade.add_argument("revision", nargs="?", default="head")
    _add_database_url(upgrade)
    upgrade.set_defaults(handler=_db_upgrade)

    downgrade = actions.add_parser("downgrade", help="migrate down to a revision, e.g. base")
    downgrade.add_argument("revision")
    _add_database_url(downgrade)
    downgrade.set_defaults(handler=_db_downgrade)

    current = actions.add_parser("current", help="print the database's revision")
    _add_database_url(current)
    current.set_defaults(handler=_db_current)

    if job_estimator is not None:
        rederive = actions.add_parser(
            "rederive",
            help=f"derive ratios of estimator {ESTIMATOR_VERSION} for uploads that lack them "
            "(run once per deployment of a new estimator); progress on stderr, and a stopped "
            "run resumes where it was",
        )
        rederive.add_argument(
            "--status", action="store_true", help="print the job's progress and exit"
        )
        _add_database_url(rederive)
        rederive.set_defaults(handler=_db_rederive(job_estimator))


def register(subparsers: Any, *, job_estimator: JobEstimatorFactory | None = None) -> None:
    """Add `keys` and `db` to the `vramcast` command line."""
    add_keys_parser(subparsers)
    add_db_parser(subparsers, job_estimator)
