"""Bodies of the calibration routes: uploads from training nodes, their listing, the factors.

An upload maps to the calibration package's `NewUpload`; what it returns maps back explicitly.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BeforeValidator,
    ConfigDict,
    Field,
    JsonValue,
    StringConstraints,
)

from service.api.schemas.base import In, Out, integers
from service.api.schemas.jobs import MAX_MEMORY_MIB, JobSpec
from service.calibration.factors import FactorSnapshot, FactorState
from service.calibration.uploads import (
    MAX_PAGE,
    CalibrationPage,
    NewUpload,
    RatioResult,
    UploadReceipt,
)
from service.core.calibration import (
    FACTOR_MAX,
    FACTOR_MIN,
    MIN_MODELS,
    SHIFT_Z,
    UPPER_MULTIPLIER_CEILING,
    UPPER_MULTIPLIER_MIN,
    Factor,
    GroupKey,
    Level,
    Measured,
    Outcome,
    Scope,
)
from service.core.codec import spec_to_dict
from service.core.errors import EstimatorError
from service.core.units import MIB
from service.store.models import CalibrationRatio, CalibrationUpload

# What a stored column holds (service/store/models.py): longer values are refused with a 422.
MAX_NAME = 200
MAX_REPORTED_BYTES = MAX_MEMORY_MIB * MIB  # 4 TiB, the largest GPU total a request may give
MAX_VERSION = 64
DEFAULT_PAGE = 50
MAX_FACTORS = 100_000
MAX_RATIOS = 3 * 64  # three levels per estimator version; versions are few

NodeName = Annotated[
    str,
    StringConstraints(min_length=1, max_length=MAX_NAME, pattern=r"^[^\x00-\x1f\x7f]+$"),
]
VersionText = Annotated[
    str, StringConstraints(max_length=MAX_VERSION, pattern=r"^[^\x00-\x1f\x7f]*$")
]
PeakBytes = Annotated[int, Field(ge=1, le=MAX_REPORTED_BYTES)]
# A listing cursor as `encode_cursor` writes it: "before:<upload id>" in unpadded base64url,
# the id from 1 up to 17 digits (far more uploads than a store holds; below 2**63, the store's
# largest id). Base64 writes three bytes as four characters: "before" is "YmVmb3Jl"; ':' and
# the id's first digit (1-9) start with "Oj" and one of [EIMQUYcgk]; the second digit is one of
# [w-z0-5]; then every three digits are four characters, the first two spelling the first
# digit (0-9: M or N then D, T, j or z; O then D or T), the third the second digit, the fourth
# the third; one or two digits left over end as two or three characters.
_THREE_DIGITS = "(?:[MN][DTjz]|O[DT])[AEIMQUYcgk][w-z0-5]"
_ONE_LEFT = "(?:[MN][AQgw]|O[AQ])"
_TWO_LEFT = "(?:[MN][DTjz]|O[DT])[AEIMQUYcgk]"
CURSOR_PATTERN = (
    rf"^YmVmb3JlOj[EIMQUYcgk](?:[w-z0-5](?:{_THREE_DIGITS}){{0,4}}"
    rf"(?:{_THREE_DIGITS}|{_ONE_LEFT}|{_TWO_LEFT})?)?$"
)
_DATE_TIME = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}")


def _date_time_text(value: Any) -> Any:
    """Only RFC 3339 text: pydantic would also read a number as seconds since 1970."""
    if not isinstance(value, str) or not _DATE_TIME.match(value):
        raise ValueError("must be an RFC 3339 date-time with a zone, e.g. 2026-11-29T12:00:00Z")
    return value


def _within_utc(value: datetime) -> datetime:
    """A time the store can hold: the store keeps UTC, and years 1 to 9999 only."""
    try:
        value.astimezone(UTC)
    except OverflowError:
        raise ValueError("must lie between the years 1 and 9999 in UTC") from None
    return value


DateTimeText = Annotated[
    AwareDatetime, BeforeValidator(_date_time_text), AfterValidator(_within_utc)
]


# ---------------------------------------------------------------------------------------------
# Uploads


class ReportedGpuIn(In):
    """The GPU the run used, as its driver reports it."""

    integer_fields = integers("memory_total_bytes")

    name: NodeName = Field(description="The name nvidia-smi prints, e.g. 'NVIDIA A100-SXM4-80GB'.")
    memory_total_bytes: PeakBytes = Field(description="Total memory the driver reports, bytes.")


class MeasuredIn(In):
    """Peaks one rank measured, bytes; leave out a level that was not measured."""

    integer_fields = integers("allocated_bytes", "reserved_bytes", "device_bytes")
    # at least one level given, not null (the calibration's checks refuse none)
    model_config = ConfigDict(
        json_schema_extra={
            "anyOf": [
                {"required": [level], "properties": {level: {"type": "integer"}}}
                for level in ("allocated_bytes", "reserved_bytes", "device_bytes")
            ]
        }
    )

    allocated_bytes: PeakBytes | None = Field(
        default=None, description="torch.cuda.max_memory_allocated() over the run."
    )
    reserved_bytes: PeakBytes | None = Field(
        default=None, description="torch.cuda.max_memory_reserved() over the run."
    )
    device_bytes: PeakBytes | None = Field(
        default=None, description="The process's peak as NVML (nvidia-smi) reports it."
    )

    def to_core(self) -> Measured:
        return Measured(
            allocated_bytes=self.allocated_bytes,
            reserved_bytes=self.reserved_bytes,
            device_bytes=self.device_bytes,
        )


class EnvironmentIn(In):
    """The software a peak was measured with; leave out what the node does not know."""

    integer_fields = integers("world_size")

    torch: VersionText | None = Field(
        default=None, description="torch.__version__, e.g. '2.5.1+cu124'."
    )
    cuda: VersionText | None = Field(default=None, description="torch.version.cuda, e.g. '12.4'.")
    driver: VersionText | None = Field(default=None, description="The NVIDIA driver's version.")
    transformers: VersionText | None = Field(default=None, description="transformers.__version__.")
    peft: VersionText | None = Field(default=None, description="peft.__version__.")
    bitsandbytes: VersionText | None = Field(default=None, description="bitsandbytes.__version__.")
    world_size: int | None = Field(
        default=None, ge=1, le=1_000_000, description="Ranks of the job (torch.distributed)."
    )


def canonical_job(job: JobSpec, model: str) -> dict[str, Any]:
    """The job as the estimator reads it: the model as the upload names it (the catalog's id,
    or the config as sent), the core spec with every default written out (the codec's form)
    and the GPU it names. Bodies that differ only in defaults written out or left out give
    the same; a job whose spec is invalid (stored without ratios) gives its fields as
    validated, defaults written out."""
    try:
        spec = spec_to_dict(job.to_spec())
    except EstimatorError:
        spec = job.model_dump(mode="json", exclude={"model", "gpu"})
    ref = job.model
    return {
        "model": model if ref.hf_config is None else {"hf_config": ref.hf_config},
        "spec": spec,
        "gpu": None if job.gpu is None else job.gpu.model_dump(mode="json", exclude_none=True),
    }


class CalibrationUploadIn(In):
    """One rank's measured peaks for a job, and where they came from."""

    job: JobSpec = Field(description="The job, exactly as for POST /v1/estimates.")
    gpu: ReportedGpuIn = Field(description="The GPU the rank ran on.")
    measured: MeasuredIn = Field(description="The measured peaks; at least one level.")
    outcome: Outcome = Field(
        default=Outcome.COMPLETED,
        description="completed, or oom: the run died and its peak is a lower bound.",
    )
    environment: EnvironmentIn = Field(
        default_factory=EnvironmentIn, description="Versions that change memory use."
    )
    node_id: NodeName = Field(
        description="The training node: one the key may upload for (403 otherwise). A factor "
        "counts one vote per key, whatever node ids its uploads name."
    )
    run_id: NodeName = Field(description="The run and rank, e.g. 'job-4711-rank0'.")

    def to_upload(self, *, model: str, gpu_name: str) -> NewUpload:
        """The upload, its model and GPU named as estimates name them."""
        return NewUpload(
            job=self.job.model_dump(mode="json", exclude_unset=True),
            canonical_job=canonical_job(self.job, model),
            model=model,
            method=self.job.method.value,
            gpu_name=gpu_name,
            gpu_memory_total_bytes=self.gpu.memory_total_bytes,
            measured=self.measured.to_core(),
            outcome=self.outcome,
            environment=self.environment.model_dump(mode="json", exclude_unset=True),
            node_id=self.node_id,
            run_id=self.run_id,
        )


class AppliedFactorOut(Out):
    """The factor an upload's ratio was compared with."""

    scope: Scope = Field(description="Where the factor comes from: model_gpu, model, global ...")
    ratio: float = Field(
        ge=FACTOR_MIN, le=FACTOR_MAX, description="The factor, measured/estimated."
    )
    nodes: int = Field(ge=0, description="Voters (distinct upload keys) whose vote counted.")


class UploadRatioOut(Out):
    """measured / estimated at one level of an upload."""

    level: Level = Field(description="allocated, reserved or device.")
    measured_bytes: int = Field(ge=1, description="What the node measured.")
    estimated_bytes: int = Field(ge=1, description="What the estimator gives for the job.")
    ratio: float = Field(gt=0.0, description="measured_bytes / estimated_bytes.")
    outlier: bool = Field(description="Far from what its group expects (kept, but flagged).")
    outlier_reason: str | None = Field(
        default=None, max_length=500, description="Why it is an outlier; null when it is not."
    )
    factor: AppliedFactorOut | None = Field(
        default=None, description="The factor it was compared with; null: the uncalibrated one."
    )

    @classmethod
    def from_core(cls, result: RatioResult) -> UploadRatioOut:
        applied = result.factor
        return cls(
            level=result.level,
            measured_bytes=result.measured_bytes,
            estimated_bytes=result.estimated_bytes,
            ratio=result.ratio,
            outlier=result.outlier_reason is not None,
            outlier_reason=result.outlier_reason,
            factor=None
            if applied is None
            else AppliedFactorOut(
                scope=applied.key.scope, ratio=applied.factor.ratio, nodes=applied.factor.nodes
            ),
        )


class CalibrationReceiptOut(Out):
    """What an upload stored; a replay (same Idempotency-Key and body) answers the same."""

    id: int = Field(ge=1, description="The stored upload.")
    received_at: datetime = Field(description="When the upload was stored (UTC).")
    model: str = Field(max_length=MAX_NAME, description="The model the upload calibrates.")
    estimator_version: str | None = Field(
        max_length=MAX_VERSION, description="Version of the estimate; null: none could be made."
    )
    estimate_error: str | None = Field(
        max_length=2048,
        description="Why the job could not be estimated (the upload is kept for a later "
        "estimator); null when it was.",
    )
    ratios: list[UploadRatioOut] = Field(max_length=3, description="One per measured level.")

    @classmethod
    def from_core(cls, model: str, receipt: UploadReceipt) -> CalibrationReceiptOut:
        return cls(
            id=receipt.upload_id,
            received_at=receipt.received_at,
            model=model,
            estimator_version=receipt.estimator_version,
            estimate_error=receipt.estimate_error,
            ratios=[UploadRatioOut.from_core(result) for result in receipt.ratios],
        )


# ---------------------------------------------------------------------------------------------
# The listing


class CalibrationFilterIn(In):
    """Which uploads to list, newest first."""

    limit: int = Field(default=DEFAULT_PAGE, ge=1, le=MAX_PAGE, description="Uploads per page.")
    model: str | None = Field(
        default=None, min_length=1, max_length=256, description="Only this model (id or alias)."
    )
    node_id: NodeName | None = Field(default=None, description="Only this training node.")
    since: DateTimeText | None = Field(
        default=None, description="Only uploads received at or after this time (with a zone)."
    )
    cursor: str | None = Field(
        default=None,
        min_length=1,
        max_length=64,
        pattern=CURSOR_PATTERN,
        description="`next_cursor` of the previous page.",
    )


class ReportedGpuOut(Out):
    name: str = Field(max_length=MAX_NAME, description="Catalog name, or the driver's if unknown.")
    memory_total_bytes: int = Field(ge=1, description="Total memory the driver reported.")


class MeasuredOut(Out):
    allocated_bytes: int | None = Field(description="Measured allocated peak; null: not measured.")
    reserved_bytes: int | None = Field(description="Measured reserved peak; null: not measured.")
    device_bytes: int | None = Field(description="Measured device peak; null: not measured.")


class StoredRatioOut(Out):
    """A ratio derived from an upload by one estimator version."""

    estimator_version: str = Field(max_length=MAX_VERSION, description="The estimator's version.")
    level: Level = Field(description="allocated, reserved or device.")
    estimated_bytes: int = Field(ge=1, description="The estimate at this level.")
    ratio: float = Field(gt=0.0, description="measured / estimated.")
    outlier_reason: str | None = Field(
        max_length=500, description="Why it is an outlier; null when it is not."
    )

    @classmethod
    def from_row(cls, row: CalibrationRatio) -> StoredRatioOut:
        return cls(
            estimator_version=row.estimator_version,
            level=row.level,
            estimated_bytes=row.estimated_bytes,
            ratio=row.ratio,
            outlier_reason=row.outlier_reason,
        )


class CalibrationRecordOut(Out):
    """A stored upload, as the node sent it, with the ratios derived from it."""

    id: int = Field(ge=1, description="The upload.")
    received_at: datetime = Field(description="When it was stored (UTC).")
    model: str = Field(max_length=MAX_NAME, description="The model it calibrates.")
    method: str = Field(max_length=16, description="full, lora or qlora.")
    job: dict[str, JsonValue] = Field(description="The job, as sent.")
    gpu: ReportedGpuOut = Field(description="The GPU.")
    measured: MeasuredOut = Field(description="The measured peaks.")
    outcome: Outcome = Field(description="completed or oom.")
    environment: dict[str, JsonValue] = Field(description="The environment, as sent.")
    node_id: str = Field(max_length=MAX_NAME, description="The training node.")
    run_id: str = Field(max_length=MAX_NAME, description="The run and rank.")
    ratios: list[StoredRatioOut] = Field(
        max_length=MAX_RATIOS, description="measured / estimated per level and estimator version."
    )

    @classmethod
    def from_row(cls, row: CalibrationUpload) -> CalibrationRecordOut:
        return cls(
            id=row.id,
            received_at=row.received_at,
            model=row.model,
            method=row.method,
            job=row.job,
            gpu=ReportedGpuOut(name=row.gpu_name, memory_total_bytes=row.gpu_memory_total_bytes),
            measured=MeasuredOut(
                allocated_bytes=row.measured_allocated_bytes,
                reserved_bytes=row.measured_reserved_bytes,
                device_bytes=row.measured_device_bytes,
            ),
            outcome=row.outcome,
            environment=row.environment,
            node_id=row.node_id,
            run_id=row.run_id,
            ratios=[
                StoredRatioOut.from_row(ratio)
                for ratio in sorted(row.ratios, key=lambda r: (r.estimator_version, r.level))
            ],
        )


class CalibrationPageOut(Out):
    """Uploads, newest first."""

    calibrations: list[CalibrationRecordOut] = Field(
        max_length=MAX_PAGE, description="This page's uploads."
    )
    next_cursor: str | None = Field(
        max_length=64, description="Pass as `cursor` for the next (older) page; null: the last."
    )

    @classmethod
    def from_core(cls, page: CalibrationPage) -> CalibrationPageOut:
        return cls(
            calibrations=[CalibrationRecordOut.from_row(row) for row in page.uploads],
            next_cursor=page.next_cursor,
        )


# ---------------------------------------------------------------------------------------------
# Factors


class FactorOut(Out):
    """One group's factor: estimates are multiplied by `ratio`, the safe bound further by
    `upper_multiplier`."""

    scope: Scope = Field(description="model_gpu, model_environment, model or global.")
    method: str = Field(max_length=16, description="full, lora or qlora.")
    level: Level = Field(description="allocated, reserved or device.")
    model: str | None = Field(max_length=MAX_NAME, description="The model; null: global.")
    variant: str | None = Field(
        max_length=MAX_NAME, description="The GPU or environment of a split group; null: none."
    )
    ratio: float = Field(
        ge=FACTOR_MIN,
        le=FACTOR_MAX,
        description="measured / estimated: the median of the votes, moved toward 1 by "
        f"{SHIFT_Z:.2f} standard errors of that median (1 where the votes disagree as much "
        "as they differ from 1).",
    )
    upper_multiplier: float = Field(
        ge=UPPER_MULTIPLIER_MIN,
        description="The safe bound above the factor: an upper prediction bound on the measured "
        "ratios over the larger of the votes' median and the factor, wide for few votes, at "
        f"most {UPPER_MULTIPLIER_CEILING} times the factor but never below a completed run of "
        "the voters kept (one far above their votes aside), and above all but 5 % of the OOM "
        "runs.",
    )
    nodes: int = Field(ge=0, description="Voters (distinct upload keys) whose vote counted.")
    models: int = Field(
        ge=1,
        description=f"Models whose vote counted: 1 unless the scope is global ({MIN_MODELS} or "
        "more).",
    )
    rejected_nodes: list[str] = Field(
        max_length=10_000,
        description="Voters (the prefixes of upload keys) whose vote was too far from the others.",
    )
    runs: int = Field(ge=0, description="Completed runs of the voters kept.")
    oom_runs: int = Field(ge=0, description="OOM runs that raised the safe bound.")
    clamped: bool = Field(description="The factor or its spread hit a clamp.")

    @classmethod
    def from_core(cls, key: GroupKey, factor: Factor) -> FactorOut:
        return cls(
            scope=key.scope,
            method=key.method,
            level=key.level,
            model=key.model,
            variant=key.variant,
            rejected_nodes=list(factor.rejected_nodes),
            **{name: getattr(factor, name) for name in _FACTOR_VALUES},
        )


# The fields a factor's answer takes from the core's Factor as they are.
_FACTOR_VALUES = ("ratio", "upper_multiplier", "nodes", "models", "runs", "oom_runs", "clamped")


class FactorTableOut(Out):
    """The factors this replica applies to estimates and fit-checks."""

    state: FactorState = Field(
        description="fresh: loaded from the store within the cache's TTL; stale: the store is "
        "unreachable and these are the last factors loaded; none: nothing could be loaded."
    )
    age_s: float | None = Field(
        ge=0.0, le=1e9, description="Seconds since the factors were loaded; null: never."
    )
    error: str | None = Field(
        max_length=512, description="Why the last load failed, while not fresh."
    )
    estimator_version: str = Field(
        max_length=MAX_VERSION, description="The estimator version whose ratios they fit."
    )
    table_id: str | None = Field(
        max_length=64,
        description="The identity of this factor table (a digest of its factors), as "
        "estimates name the table they applied; null: never loaded.",
    )
    factors: list[FactorOut] = Field(max_length=MAX_FACTORS, description="Every group's factor.")

    @classmethod
    def from_core(
        cls, snapshot: FactorSnapshot, *, age_s: float | None, estimator_version: str
    ) -> FactorTableOut:
        return cls(
            state=snapshot.state,
            age_s=age_s,
            error=snapshot.error,
            estimator_version=estimator_version,
            table_id=snapshot.table_id,
            factors=[
                FactorOut.from_core(key, factor)
                for key, factor in sorted(
                    snapshot.table.factors.items(), key=lambda kv: _order(kv[0])
                )
            ],
        )


def _order(key: GroupKey) -> tuple[str, str, str, str, str]:
    return (key.model or "", key.method, key.level, key.scope, key.variant or "")


def receipt_body(model: str, receipt: UploadReceipt) -> dict[str, Any]:
    """The 201 body stored with an upload, so that a replay answers the same bytes."""
    return CalibrationReceiptOut.from_core(model, receipt).model_dump(mode="json")
