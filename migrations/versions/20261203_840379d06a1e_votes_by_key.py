"""Calibration votes belong to keys: every ratio carries its voter (the prefix of its upload's
key) in place of the node id its upload names, under the group index; the votes kept per model
are the voters'; and each key names the node ids it may upload for (`api_key.nodes`).

Upload keys stored before (without the admin scope) are given `*`: they keep uploading for any
node id, and each casts one vote. The votes are rebuilt: every partition with ratios is marked
changed, so the first load refits its factors with one vote per key.

Revision ID: 840379d06a1e
Revises: b7d2e4f19a06
Create Date: 2026-12-03 09:00:00.000000
"""

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "840379d06a1e"
down_revision: str | None = "b7d2e4f19a06"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_GROUP_INDEX = ("estimator_version", "method", "level", "model", "outcome")
_PREFIX_LENGTH = 16
_NAME_LENGTH = 200
_UPLOAD = sa.table(
    "calibration_upload", sa.column("id"), sa.column("api_key_id"), sa.column("node_id")
)
_KEY = sa.table("api_key", sa.column("id"), sa.column("prefix"))
_MARK_PARTITIONS = (
    "INSERT INTO calibration_change (estimator_version, method, level) "
    "SELECT DISTINCT estimator_version, method, level FROM calibration_ratio"
)


def _bind_keys(connection: sa.Connection) -> None:
    """Each key's node patterns: `*` for an upload key without the admin scope, else none."""
    key = sa.table("api_key", sa.column("id"), sa.column("scopes", sa.JSON()))
    nodes = sa.table("api_key", sa.column("id"), sa.column("nodes", sa.JSON()))
    for row in connection.execute(sa.select(key.c.id, key.c.scopes)).all():
        scopes = row.scopes or []
        patterns = ["*"] if "upload" in scopes and "admin" not in scopes else []
        connection.execute(nodes.update().where(nodes.c.id == row.id).values(nodes=patterns))


def _copy(connection: sa.Connection, column: str, source: Any, *where: Any) -> None:
    """Set each ratio's `column` to `source`, found by joining its upload (one UPDATE ...
    FROM; PostgreSQL, SQLite 3.33+)."""
    ratio = sa.table("calibration_ratio", sa.column("upload_id"), sa.column(column))
    connection.execute(
        ratio.update().where(ratio.c.upload_id == _UPLOAD.c.id, *where).values({column: source})
    )


def _vote_table(voter: str, length: int) -> None:
    op.create_table(
        "calibration_vote",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("estimator_version", sa.String(length=64), nullable=False),
        sa.Column("method", sa.String(length=16), nullable=False),
        sa.Column("level", sa.String(length=16), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column(voter, sa.String(length=length), nullable=False),
        sa.Column("log_vote", sa.Float(), nullable=False),
        sa.Column("completed_runs", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_calibration_vote")),
    )
    op.create_index(
        "ix_calibration_vote_pair",
        "calibration_vote",
        ["estimator_version", "method", "level", "model", voter],
        unique=True,
    )


def _regroup(old: str, new: str, length: int, fill: Any) -> None:
    """Ratios grouped by `new` instead of `old`: the column added and filled (`fill`), the
    group index rebuilt on it, `old` dropped."""
    with op.batch_alter_table("calibration_ratio") as batch:
        batch.add_column(sa.Column(new, sa.String(length=length), nullable=True))
    fill(op.get_bind())
    with op.batch_alter_table("calibration_ratio") as batch:
        batch.alter_column(new, existing_type=sa.String(length=length), nullable=False)
        batch.drop_index("ix_calibration_ratio_group")
        batch.drop_column(old)
        batch.create_index("ix_calibration_ratio_group", [*_GROUP_INDEX, new, "ratio"])
    # The votes kept per (model, old) are rebuilt per (model, new) by the first load.
    op.drop_index("ix_calibration_vote_pair", "calibration_vote")
    op.drop_table("calibration_vote")
    _vote_table(new, length)
    op.execute(_MARK_PARTITIONS)


def _fill_voters(connection: sa.Connection) -> None:
    _copy(connection, "voter", _KEY.c.prefix, _UPLOAD.c.api_key_id == _KEY.c.id)


def _fill_nodes(connection: sa.Connection) -> None:
    _copy(connection, "node_id", _UPLOAD.c.node_id)


def upgrade() -> None:
    # Added in place, not by a batch's copy: SQLite cannot drop the keys' table while uploads
    # refer to it.
    op.add_column(
        "api_key",
        sa.Column("nodes", sa.JSON(), nullable=False, server_default=sa.text("'[]'")),
    )
    _bind_keys(op.get_bind())
    _regroup("node_id", "voter", _PREFIX_LENGTH, _fill_voters)


def downgrade() -> None:
    _regroup("voter", "node_id", _NAME_LENGTH, _fill_nodes)
    # In place (SQLite 3.35+), for the reason above.
    op.execute("ALTER TABLE api_key DROP COLUMN nodes")
