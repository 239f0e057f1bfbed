"""Fitted calibration factors, the partitions whose factors are out of date, and the progress
of re-deriving ratios for a new estimator version.

Every (estimator version, method, level) that already has ratios is marked out of date, so
the first factor load after the upgrade fits and stores its factors.

Revision ID: 3c1d9e7a5b20
Revises: 6f74beb0cf54
Create Date: 2026-12-01 04:40:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "3c1d9e7a5b20"
down_revision: str | None = "6f74beb0cf54"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "calibration_factor",
        sa.Column("id", _ID, nullable=False),
        sa.Column("estimator_version", sa.String(length=64), nullable=False),
        sa.Column("method", sa.String(length=16), nullable=False),
        sa.Column("level", sa.String(length=16), nullable=False),
        sa.Column("scope", sa.String(length=32), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("variant", sa.String(length=200), nullable=False),
        sa.Column("ratio", sa.Float(), nullable=False),
        sa.Column("upper_multiplier", sa.Float(), nullable=False),
        sa.Column("nodes", sa.Integer(), nullable=False),
        sa.Column("models", sa.Integer(), nullable=False),
        sa.Column("rejected_nodes", sa.JSON(), nullable=False),
        sa.Column("runs", sa.Integer(), nullable=False),
        sa.Column("oom_runs", sa.Integer(), nullable=False),
        sa.Column("log_spread", sa.Float(), nullable=False),
        sa.Column("clamped", sa.Boolean(), nullable=False),
        sa.Column("fitted_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_calibration_factor")),
    )
    op.create_index(
        "ix_calibration_factor_group",
        "calibration_factor",
        ["estimator_version", "method", "level", "scope", "model", "variant"],
        unique=True,
    )
    op.create_table(
        "calibration_change",
        sa.Column("id", _ID, nullable=False),
        sa.Column("estimator_version", sa.String(length=64), nullable=False),
        sa.Column("method", sa.String(length=16), nullable=False),
        sa.Column("level", sa.String(length=16), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_calibration_change")),
    )
    op.create_index(
        "ix_calibration_change_estimator_version", "calibration_change", ["estimator_version"]
    )
    op.create_table(
        "calibration_rederivation",
        sa.Column("estimator_version", sa.String(length=64), nullable=False),
        sa.Column("through_upload_id", sa.BigInteger(), nullable=False),
        sa.Column("cursor_id", sa.BigInteger(), nullable=False),
        sa.Column("total", sa.BigInteger(), nullable=False),
        sa.Column("done", sa.BigInteger(), nullable=False),
        sa.Column("derived", sa.BigInteger(), nullable=False),
        sa.Column("phase", sa.String(length=16), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("estimator_version", name=op.f("pk_calibration_rederivation")),
    )
    # The factors of the ratios stored so far are fitted by the next load.
    op.execute(
        "INSERT INTO calibration_change (estimator_version, method, level) "
        "SELECT DISTINCT r.estimator_version, u.method, r.level "
        "FROM calibration_ratio r JOIN calibration_upload u ON u.id = r.upload_id"
    )


def downgrade() -> None:
    op.drop_table("calibration_rederivation")
    op.drop_index("ix_calibration_change_estimator_version", "calibration_change")
    op.drop_table("calibration_change")
    op.drop_index("ix_calibration_factor_group", "calibration_factor")
    op.drop_table("calibration_factor")
