"""Changes name the model whose ratios were added, every ratio carries its upload's groups
(method, model, node, GPU, environment key, outcome) under one index, and each node's vote per
model is kept (`calibration_vote`), so that a refit fits only the changed models' factors (and
their partition's global one) from index ranges in SQL.

The copies are filled from each stored ratio's upload; the environment key as the service
derives it (torch and CUDA, major.minor). Changes stored before name no model: a refit takes
them as changes of every model of their partition. Every partition with ratios is marked
changed, so the first load builds its votes.

Revision ID: b7d2e4f19a06
Revises: 8e41c07d2a93
Create Date: 2026-12-02 06:50:00.000000
"""

import json
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "b7d2e4f19a06"
down_revision: str | None = "8e41c07d2a93"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Copied from the upload as they are named there.
_COPIED = ("method", "model", "node_id", "gpu_name", "outcome")
_GROUP_INDEX = (
    "estimator_version",
    "method",
    "level",
    "model",
    "outcome",
    "node_id",
    "ratio",
)


def _environment_key(environment: Any) -> str:
    """`service.calibration.factors.environment_key` as of this revision."""

    def major_minor(name: str) -> str:
        value = environment.get(name) if isinstance(environment, dict) else None
        if not isinstance(value, str) or not value:
            return "?"
        return ".".join(value.split("+")[0].split(".")[:2])

    return f"torch {major_minor('torch')}, cuda {major_minor('cuda')}"


def _outcome() -> sa.Enum:
    return sa.Enum(
        "completed", "oom", name="outcome", native_enum=False, create_constraint=True, length=16
    )


def _columns(nullable: bool) -> list[sa.Column[Any]]:
    return [
        sa.Column("method", sa.String(length=16), nullable=nullable),
        sa.Column("model", sa.String(length=200), nullable=nullable),
        sa.Column("node_id", sa.String(length=200), nullable=nullable),
        sa.Column("gpu_name", sa.String(length=200), nullable=nullable),
        sa.Column("environment_key", sa.String(length=200), nullable=nullable),
        sa.Column("outcome", _outcome(), nullable=nullable),
    ]


def _fill(connection: sa.Connection) -> None:
    ratio = sa.table(
        "calibration_ratio",
        sa.column("upload_id"),
        sa.column("environment_key"),
        *map(sa.column, _COPIED),
    )
    upload = sa.table(
        "calibration_upload", sa.column("id"), sa.column("environment"), *map(sa.column, _COPIED)
    )
    # The key of each distinct environment as stored (a fleet reports few).
    stored = sa.cast(upload.c.environment, sa.Text())
    texts = connection.execute(sa.select(stored).distinct()).scalars().all()
    keys = {text: _environment_key(json.loads(text)) for text in texts}
    if not keys:
        return
    # One UPDATE ... FROM (PostgreSQL; SQLite 3.33+): each ratio rewritten once, its upload
    # found by a join, not a lookup per ratio and column.
    connection.execute(
        ratio.update()
        .where(ratio.c.upload_id == upload.c.id)
        .values(
            {
                **{name: upload.c[name] for name in _COPIED},
                "environment_key": sa.case(keys, value=stored, else_=_environment_key({})),
            }
        )
    )


def upgrade() -> None:
    op.add_column("calibration_change", sa.Column("model", sa.String(length=200), nullable=True))
    op.create_table(
        "calibration_vote",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("estimator_version", sa.String(length=64), nullable=False),
        sa.Column("method", sa.String(length=16), nullable=False),
        sa.Column("level", sa.String(length=16), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("node_id", sa.String(length=200), nullable=False),
        sa.Column("log_vote", sa.Float(), nullable=False),
        sa.Column("completed_runs", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_calibration_vote")),
    )
    op.create_index(
        "ix_calibration_vote_pair",
        "calibration_vote",
        ["estimator_version", "method", "level", "model", "node_id"],
        unique=True,
    )
    with op.batch_alter_table("calibration_ratio") as batch:
        for column in _columns(nullable=True):
            batch.add_column(column)
    _fill(op.get_bind())
    with op.batch_alter_table("calibration_ratio") as batch:
        for column in _columns(nullable=False):
            batch.alter_column(column.name, existing_type=column.type, nullable=False)
        batch.create_index("ix_calibration_ratio_group", list(_GROUP_INDEX))
    op.execute(
        "INSERT INTO calibration_change (estimator_version, method, level) "
        "SELECT DISTINCT estimator_version, method, level FROM calibration_ratio"
    )


def downgrade() -> None:
    with op.batch_alter_table("calibration_ratio") as batch:
        batch.drop_index("ix_calibration_ratio_group")
        batch.drop_constraint(op.f("ck_calibration_ratio_outcome"), type_="check")
        for column in reversed(_columns(nullable=False)):
            batch.drop_column(column.name)
    op.drop_index("ix_calibration_vote_pair", "calibration_vote")
    op.drop_table("calibration_vote")
    op.drop_column("calibration_change", "model")
