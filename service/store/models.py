"""Tables of the store: API keys, raw calibration uploads, and the ratios derived from them.

An upload row keeps exactly what the node sent (nothing is thrown away); a ratio row is
derived from it and an estimator version, so a new estimator re-derives every ratio.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    DateTime,
    Dialect,
    Enum,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    TypeDecorator,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from service.core.calibration import Level, Outcome

# Constraint names every database agrees on, so migrations can drop them by name.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# BIGINT on PostgreSQL; SQLite only auto-increments a column declared INTEGER PRIMARY KEY.
BigIntegerPK = BigInteger().with_variant(Integer(), "sqlite")
# The largest id such a key holds: BIGINT's (PostgreSQL) and SQLite's INTEGER's, both signed
# 64-bit.
MAX_ROW_ID = 2**63 - 1
# The stored width of a key's prefix (`service.store.keys` makes 8 hex digits), the voter.
PREFIX_LENGTH = 16


class UtcDateTime(TypeDecorator[datetime]):
    """A timezone-aware timestamp, stored in UTC; SQLite, which keeps no zone, gets UTC back."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("timestamps must be timezone-aware")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


def _values(enum: type[Level] | type[Outcome]) -> list[str]:
    return [member.value for member in enum]


def _outcome() -> Enum:
    return Enum(
        Outcome,
        name="outcome",
        native_enum=False,
        create_constraint=True,
        length=16,
        values_callable=_values,
    )


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map: ClassVar[dict[Any, Any]] = {
        datetime: UtcDateTime(),
        dict[str, Any]: JSON(),
    }


class ApiKey(Base):
    """An API key: only its SHA-256 is stored; the prefix names it in listings and revocation,
    and is the voter of the calibration runs uploaded with it."""

    __tablename__ = "api_key"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    prefix: Mapped[str] = mapped_column(String(PREFIX_LENGTH), unique=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    name: Mapped[str] = mapped_column(String(200))
    scopes: Mapped[list[str]] = mapped_column(JSON)
    # The node ids an upload key may upload for: shell-style patterns, fixed when the key is
    # made (`service.store.keys.speaks_for`); [] for keys without the upload scope, and for a
    # key stored without any (it then uploads for none).
    nodes: Mapped[list[str]] = mapped_column(JSON, server_default=text("'[]'"))
    created_at: Mapped[datetime]
    revoked_at: Mapped[datetime | None]


class CalibrationUpload(Base):
    """One upload from a training node, as sent, plus what idempotent replays need."""

    __tablename__ = "calibration_upload"
    __table_args__ = (
        UniqueConstraint("api_key_id", "idempotency_key"),
        CheckConstraint(
            "measured_allocated_bytes IS NOT NULL OR measured_reserved_bytes IS NOT NULL"
            " OR measured_device_bytes IS NOT NULL",
            name="measured_some_level",
        ),
        CheckConstraint(
            "measured_allocated_bytes > 0 AND measured_allocated_bytes <= gpu_memory_total_bytes",
            name="measured_allocated_bytes_possible",
        ),
        CheckConstraint(
            "measured_reserved_bytes > 0 AND measured_reserved_bytes <= gpu_memory_total_bytes",
            name="measured_reserved_bytes_possible",
        ),
        CheckConstraint(
            "measured_device_bytes > 0 AND measured_device_bytes <= gpu_memory_total_bytes",
            name="measured_device_bytes_possible",
        ),
        CheckConstraint(
            "measured_allocated_bytes <= measured_reserved_bytes",
            name="measured_allocated_within_reserved",
        ),
        CheckConstraint("gpu_memory_total_bytes > 0", name="gpu_memory_total_bytes_positive"),
    )

    id: Mapped[int] = mapped_column(BigIntegerPK, primary_key=True)
    received_at: Mapped[datetime] = mapped_column(index=True)
    api_key_id: Mapped[int] = mapped_column(ForeignKey("api_key.id"))
    # The client's Idempotency-Key header; the first response is replayed for a repeat.
    idempotency_key: Mapped[str | None] = mapped_column(String(255))
    request_hash: Mapped[str] = mapped_column(String(64))  # SHA-256 of the canonical body
    response: Mapped[dict[str, Any] | None]  # the body the first request was answered with
    model: Mapped[str] = mapped_column(String(200), index=True)
    method: Mapped[str] = mapped_column(String(16))
    job: Mapped[dict[str, Any]]  # the full job spec, as sent
    gpu_name: Mapped[str] = mapped_column(String(200))
    gpu_memory_total_bytes: Mapped[int] = mapped_column(BigInteger)
    measured_allocated_bytes: Mapped[int | None] = mapped_column(BigInteger)
    measured_reserved_bytes: Mapped[int | None] = mapped_column(BigInteger)
    measured_device_bytes: Mapped[int | None] = mapped_column(BigInteger)
    outcome: Mapped[Outcome] = mapped_column(_outcome())
    environment: Mapped[dict[str, Any]]  # torch, cuda, driver, ... as the node reported them
    node_id: Mapped[str] = mapped_column(String(200), index=True)
    run_id: Mapped[str] = mapped_column(String(200))

    ratios: Mapped[list[CalibrationRatio]] = relationship(
        back_populates="upload", lazy="selectin", passive_deletes=True
    )


class CalibrationRatio(Base):
    """measured / estimated at one level, for one upload and one estimator version.

    It carries the groups its upload belongs to (method, model, GPU, environment key, outcome:
    copies of the upload's, which never change) and its voter (the prefix of the key that
    uploaded it), so that a refit reads a group's runs from one index range
    (`ix_calibration_ratio_group`) without joining the uploads or the keys.
    """

    __tablename__ = "calibration_ratio"
    __table_args__ = (
        UniqueConstraint("upload_id", "level", "estimator_version"),
        Index("ix_calibration_ratio_estimator_version_level", "estimator_version", "level"),
        # A model's runs, by outcome, voter, then ratio: each voter's median, a model's counts
        # and ranked ratios from one range; a partition's completed runs in (model, voter)
        # order for its voters' medians.
        Index(
            "ix_calibration_ratio_group",
            "estimator_version",
            "method",
            "level",
            "model",
            "outcome",
            "voter",
            "ratio",
        ),
        CheckConstraint("estimated_bytes > 0", name="estimated_bytes_positive"),
        CheckConstraint("ratio > 0", name="ratio_positive"),
    )

    id: Mapped[int] = mapped_column(BigIntegerPK, primary_key=True)
    upload_id: Mapped[int] = mapped_column(ForeignKey("calibration_upload.id", ondelete="CASCADE"))
    estimator_version: Mapped[str] = mapped_column(String(64))
    level: Mapped[Level] = mapped_column(
        Enum(
            Level,
            name="level",
            native_enum=False,
            create_constraint=True,
            length=16,
            values_callable=_values,
        )
    )
    estimated_bytes: Mapped[int] = mapped_column(BigInteger)
    ratio: Mapped[float] = mapped_column(Float)
    method: Mapped[str] = mapped_column(String(16))
    model: Mapped[str] = mapped_column(String(200))
    # Who cast the vote: the prefix of the upload's key (not the node id its body names).
    voter: Mapped[str] = mapped_column(String(PREFIX_LENGTH))
    gpu_name: Mapped[str] = mapped_column(String(200))
    # The part of the upload's environment that splits a model's factor (torch and CUDA,
    # major.minor: `service.calibration.factors.environment_key`).
    environment_key: Mapped[str] = mapped_column(String(200))
    outcome: Mapped[Outcome] = mapped_column(_outcome())
    # Why the ratio is far from what its group expected when it was derived; None when not.
    outlier_reason: Mapped[str | None] = mapped_column(String(500))
    computed_at: Mapped[datetime]

    upload: Mapped[CalibrationUpload] = relationship(back_populates="ratios")

    @property
    def is_outlier(self) -> bool:
        return self.outlier_reason is not None


class CalibrationFactor(Base):
    """One group's fitted factor for one estimator version: what replicas load and apply.

    A model's rows of a (version, method, level) and the partition's global row are replaced
    whenever a ratio of that model is added (see `CalibrationChange`); `model` and `variant`
    are '' where the group has none (the global scope; a model's own factor), so the unique
    key holds.
    """

    __tablename__ = "calibration_factor"
    __table_args__ = (
        Index(
            "ix_calibration_factor_group",
            "estimator_version",
            "method",
            "level",
            "scope",
            "model",
            "variant",
            unique=True,
        ),
    )

    id: Mapped[int] = mapped_column(BigIntegerPK, primary_key=True)
    estimator_version: Mapped[str] = mapped_column(String(64))
    method: Mapped[str] = mapped_column(String(16))
    level: Mapped[str] = mapped_column(String(16))
    scope: Mapped[str] = mapped_column(String(32))
    model: Mapped[str] = mapped_column(String(200))
    variant: Mapped[str] = mapped_column(String(200))
    ratio: Mapped[float] = mapped_column(Float)
    upper_multiplier: Mapped[float] = mapped_column(Float)
    nodes: Mapped[int] = mapped_column(Integer)
    models: Mapped[int] = mapped_column(Integer)
    rejected_nodes: Mapped[list[str]] = mapped_column(JSON)
    runs: Mapped[int] = mapped_column(Integer)
    oom_runs: Mapped[int] = mapped_column(Integer)
    log_spread: Mapped[float] = mapped_column(Float)
    clamped: Mapped[bool]
    fitted_at: Mapped[datetime]


class CalibrationVote(Base):
    """One voter's vote on one model's factor (the median of the log ratios of its completed
    runs) and how many completed runs it has, as the model's last refit found them: a refit
    of a partition's global factor reads these instead of every run. Replaced with the
    model's factors."""

    __tablename__ = "calibration_vote"
    __table_args__ = (
        Index(
            "ix_calibration_vote_pair",
            "estimator_version",
            "method",
            "level",
            "model",
            "voter",
            unique=True,
        ),
    )

    id: Mapped[int] = mapped_column(BigIntegerPK, primary_key=True)
    estimator_version: Mapped[str] = mapped_column(String(64))
    method: Mapped[str] = mapped_column(String(16))
    level: Mapped[str] = mapped_column(String(16))
    model: Mapped[str] = mapped_column(String(200))
    voter: Mapped[str] = mapped_column(String(PREFIX_LENGTH))
    log_vote: Mapped[float] = mapped_column(Float)
    completed_runs: Mapped[int] = mapped_column(Integer)


class CalibrationChange(Base):
    """A model whose factors in a ratio partition (version, method, level) are out of date,
    with the partition's global factor: written in the transaction that adds its ratios
    (insert only, so concurrent uploads never wait on each other), deleted by the refit that
    covered it. No model (NULL): every model of the partition is out of date."""

    __tablename__ = "calibration_change"
    __table_args__ = (Index("ix_calibration_change_estimator_version", "estimator_version"),)

    id: Mapped[int] = mapped_column(BigIntegerPK, primary_key=True)
    estimator_version: Mapped[str] = mapped_column(String(64))
    method: Mapped[str] = mapped_column(String(16))
    level: Mapped[str] = mapped_column(String(16))
    model: Mapped[str | None] = mapped_column(String(200))


class CalibrationRederivation(Base):
    """Progress of re-deriving every upload's ratios for one estimator version, committed
    with each batch, so the job resumes where it stopped: in the `derive` phase, uploads up
    to `cursor_id` are done; in the `flag` phase, ratios up to `cursor_id` are flagged."""

    __tablename__ = "calibration_rederivation"

    estimator_version: Mapped[str] = mapped_column(String(64), primary_key=True)
    # The newest upload when the job started: later ones got their ratios as they came in.
    through_upload_id: Mapped[int] = mapped_column(BigInteger)
    cursor_id: Mapped[int] = mapped_column(BigInteger)
    total: Mapped[int] = mapped_column(BigInteger)  # uploads without ratios at the start
    done: Mapped[int] = mapped_column(BigInteger)  # of them, uploads looked at so far
    derived: Mapped[int] = mapped_column(BigInteger)  # of them, uploads that got ratios
    phase: Mapped[str] = mapped_column(String(16))  # derive, flag, finished
    started_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    finished_at: Mapped[datetime | None]
