"""Changes name the model whose ratios were added, and uploads keep their environment's key, so
a refit fits only the changed models' factors (and the partition's global one) in SQL.

`calibration_upload.environment_key` is filled for every stored upload from its environment,
as the service derives it (torch and CUDA, major.minor). Changes stored before name no model:
the refit takes them as changes of every model of their partition.

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

# The key of an environment that names neither torch nor CUDA: the column's default (an
# upload the service stores always names its key).
_UNKNOWN_KEY = "torch ?, cuda ?"


def _environment_key(environment: Any) -> str:
    """`service.calibration.factors.environment_key` as of this revision."""

    def major_minor(name: str) -> str:
        value = environment.get(name) if isinstance(environment, dict) else None
        if not isinstance(value, str) or not value:
            return "?"
        return ".".join(value.split("+")[0].split(".")[:2])

    return f"torch {major_minor('torch')}, cuda {major_minor('cuda')}"


def upgrade() -> None:
    op.add_column("calibration_change", sa.Column("model", sa.String(length=200), nullable=True))
    op.add_column(
        "calibration_upload",
        sa.Column(
            "environment_key",
            sa.String(length=200),
            nullable=False,
            server_default=_UNKNOWN_KEY,
        ),
    )
    # One UPDATE per distinct environment as stored (a fleet reports few), not one per upload.
    connection = op.get_bind()
    stored = sa.cast(sa.column("environment"), sa.Text())
    upload = sa.table("calibration_upload", sa.column("environment"), sa.column("environment_key"))
    texts = connection.execute(sa.select(stored).select_from(upload).distinct()).scalars().all()
    for text in texts:
        key = _environment_key(json.loads(text))
        if key != _UNKNOWN_KEY:
            connection.execute(upload.update().where(stored == text).values(environment_key=key))


def downgrade() -> None:
    # Dropped in place (SQLite 3.35+): a batch rebuild of calibration_upload would cascade
    # its deletion to every ratio, foreign keys being enforced.
    op.drop_column("calibration_upload", "environment_key")
    op.drop_column("calibration_change", "model")
