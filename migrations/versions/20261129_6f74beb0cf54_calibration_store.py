"""Calibration store: API keys, raw calibration uploads, derived ratios.

Revision ID: 6f74beb0cf54
Revises:
Create Date: 2026-11-29 16:56:42.115377
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "6f74beb0cf54"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "api_key",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("prefix", sa.String(length=16), nullable=False),
        sa.Column("key_hash", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("scopes", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_key")),
        sa.UniqueConstraint("key_hash", name=op.f("uq_api_key_key_hash")),
        sa.UniqueConstraint("prefix", name=op.f("uq_api_key_prefix")),
    )
    op.create_table(
        "calibration_upload",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("received_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("api_key_id", sa.Integer(), nullable=False),
        sa.Column("idempotency_key", sa.String(length=255), nullable=True),
        sa.Column("request_hash", sa.String(length=64), nullable=False),
        sa.Column("response", sa.JSON(), nullable=True),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("method", sa.String(length=16), nullable=False),
        sa.Column("job", sa.JSON(), nullable=False),
        sa.Column("gpu_name", sa.String(length=200), nullable=False),
        sa.Column("gpu_memory_total_bytes", sa.BigInteger(), nullable=False),
        sa.Column("measured_allocated_bytes", sa.BigInteger(), nullable=True),
        sa.Column("measured_reserved_bytes", sa.BigInteger(), nullable=True),
        sa.Column("measured_device_bytes", sa.BigInteger(), nullable=True),
        sa.Column(
            "outcome",
            sa.Enum(
                "completed",
                "oom",
                name="outcome",
                native_enum=False,
                create_constraint=True,
                length=16,
            ),
            nullable=False,
        ),
        sa.Column("environment", sa.JSON(), nullable=False),
        sa.Column("node_id", sa.String(length=200), nullable=False),
        sa.Column("run_id", sa.String(length=200), nullable=False),
        sa.CheckConstraint(
            "gpu_memory_total_bytes > 0",
            name=op.f("ck_calibration_upload_gpu_memory_total_bytes_positive"),
        ),
        sa.CheckConstraint(
            "measured_allocated_bytes <= measured_reserved_bytes",
            name=op.f("ck_calibration_upload_measured_allocated_within_reserved"),
        ),
        sa.CheckConstraint(
            "measured_allocated_bytes > 0 AND measured_allocated_bytes <= gpu_memory_total_bytes",
            name=op.f("ck_calibration_upload_measured_allocated_bytes_possible"),
        ),
        sa.CheckConstraint(
            "measured_allocated_bytes IS NOT NULL OR measured_reserved_bytes IS NOT NULL"
            " OR measured_device_bytes IS NOT NULL",
            name=op.f("ck_calibration_upload_measured_some_level"),
        ),
        sa.CheckConstraint(
            "measured_device_bytes > 0 AND measured_device_bytes <= gpu_memory_total_bytes",
            name=op.f("ck_calibration_upload_measured_device_bytes_possible"),
        ),
        sa.CheckConstraint(
            "measured_reserved_bytes > 0 AND measured_reserved_bytes <= gpu_memory_total_bytes",
            name=op.f("ck_calibration_upload_measured_reserved_bytes_possible"),
        ),
        sa.ForeignKeyConstraint(
            ["api_key_id"], ["api_key.id"], name=op.f("fk_calibration_upload_api_key_id_api_key")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_calibration_upload")),
        sa.UniqueConstraint(
            "api_key_id",
            "idempotency_key",
            name=op.f("uq_calibration_upload_api_key_id_idempotency_key"),
        ),
    )
    op.create_index(op.f("ix_calibration_upload_model"), "calibration_upload", ["model"])
    op.create_index(op.f("ix_calibration_upload_node_id"), "calibration_upload", ["node_id"])
    op.create_index(
        op.f("ix_calibration_upload_received_at"), "calibration_upload", ["received_at"]
    )

    op.create_table(
        "calibration_ratio",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column(
            "upload_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False
        ),
        sa.Column("estimator_version", sa.String(length=64), nullable=False),
        sa.Column(
            "level",
            sa.Enum(
                "allocated",
                "reserved",
                "device",
                name="level",
                native_enum=False,
                create_constraint=True,
                length=16,
            ),
            nullable=False,
        ),
        sa.Column("estimated_bytes", sa.BigInteger(), nullable=False),
        sa.Column("ratio", sa.Float(), nullable=False),
        sa.Column("outlier_reason", sa.String(length=500), nullable=True),
        sa.Column("computed_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint(
            "estimated_bytes > 0", name=op.f("ck_calibration_ratio_estimated_bytes_positive")
        ),
        sa.CheckConstraint("ratio > 0", name=op.f("ck_calibration_ratio_ratio_positive")),
        sa.ForeignKeyConstraint(
            ["upload_id"],
            ["calibration_upload.id"],
            name=op.f("fk_calibration_ratio_upload_id_calibration_upload"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_calibration_ratio")),
        sa.UniqueConstraint(
            "upload_id",
            "level",
            "estimator_version",
            name=op.f("uq_calibration_ratio_upload_id_level_estimator_version"),
        ),
    )
    op.create_index(
        "ix_calibration_ratio_estimator_version_level",
        "calibration_ratio",
        ["estimator_version", "level"],
    )


def downgrade() -> None:
    op.drop_index("ix_calibration_ratio_estimator_version_level", "calibration_ratio")
    op.drop_table("calibration_ratio")
    op.drop_index(op.f("ix_calibration_upload_received_at"), "calibration_upload")
    op.drop_index(op.f("ix_calibration_upload_node_id"), "calibration_upload")
    op.drop_index(op.f("ix_calibration_upload_model"), "calibration_upload")
    op.drop_table("calibration_upload")
    op.drop_table("api_key")
