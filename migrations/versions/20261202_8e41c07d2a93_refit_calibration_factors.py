"""Mark every stored factor's partition out of date, so the next load refits it: a factor now
moves toward 1 by its median's standard error, and one stored before would not.

Revision ID: 8e41c07d2a93
Revises: 3c1d9e7a5b20
Create Date: 2026-12-02 00:50:00.000000
"""

from collections.abc import Sequence

from alembic import op

revision: str = "8e41c07d2a93"
down_revision: str | None = "3c1d9e7a5b20"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_MARK_STORED_PARTITIONS = (
    "INSERT INTO calibration_change (estimator_version, method, level) "
    "SELECT DISTINCT estimator_version, method, level FROM calibration_factor"
)


def upgrade() -> None:
    op.execute(_MARK_STORED_PARTITIONS)


def downgrade() -> None:
    # The earlier fit leaves factors at their medians: the stored ones are refitted again.
    op.execute(_MARK_STORED_PARTITIONS)
