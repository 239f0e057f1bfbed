"""Calibration uploads end to end: store the raw upload, derive its ratios, list uploads,
and purge a key's.

The estimator comes in as a callable (job spec JSON -> Estimate), so this module needs
neither the catalog nor the API. Callers own the transaction: these functions flush, the
request boundary commits once, before the 201.

An upload is stored only when its key may speak for the node id it names
(`service.store.keys.speaks_for`), and its ratios vote as the key (its prefix), whatever
node id they name. A retry with the same Idempotency-Key is compared on what the upload
means, not on its bytes: the job in its canonical form (every default written out), as the
caller gives it, so a retry that writes out a default the first left out is the same upload.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy.orm import Session

from service.calibration.factors import environment_key, refresh_factors, stored_factor_table
from service.core.calibration import (
    EMPTY_TABLE,
    AppliedFactor,
    FactorTable,
    Level,
    Measured,
    Outcome,
    check_measured,
    estimated_at,
    flag_outlier,
)
from service.core.errors import EstimatorError
from service.core.result import Estimate
from service.store.keys import NodeNotAllowedError, revoke_key, speaks_for
from service.store.models import (
    MAX_ROW_ID,
    ApiKey,
    CalibrationRatio,
    CalibrationRederivation,
    CalibrationUpload,
)
from service.store.repositories import (
    ApiKeyRepository,
    CalibrationRepository,
    DuplicateIdempotencyKeyError,
)

EstimateFn = Callable[[Mapping[str, Any]], Estimate]
Clock = Callable[[], datetime]

MAX_PAGE = 500
# Digits of the largest upload id: a cursor's number is read only up to this length.
_ID_DIGITS = len(str(MAX_ROW_ID))


def utc_now() -> datetime:
    return datetime.now(UTC)


class IdempotencyKeyReusedError(ValueError):
    """An Idempotency-Key came back with a different body (422)."""

    def __init__(self, idempotency_key: str) -> None:
        super().__init__(
            f"Idempotency-Key {idempotency_key!r} was already used with a different request body"
        )
        self.idempotency_key = idempotency_key


class InvalidCursorError(ValueError):
    """A listing cursor this service did not issue."""


@dataclass(frozen=True, slots=True, kw_only=True)
class NewUpload:
    """A calibration upload as the node sent it (the API maps its body to this)."""

    job: Mapping[str, Any]  # the job spec, exactly as for an estimate
    model: str
    method: str
    gpu_name: str
    gpu_memory_total_bytes: int
    measured: Measured
    outcome: Outcome
    environment: Mapping[str, Any]
    node_id: str
    run_id: str
    # The job as the estimator reads it, every default written out (the API's: its core spec
    # through the codec), which replays are compared on; None: the job as sent.
    canonical_job: Mapping[str, Any] | None = None

    def fingerprint(self) -> str:
        """SHA-256 of the canonical JSON of what the upload means: the canonical job, and the
        environment without the values it leaves unknown (null). Bodies that differ only in
        the defaults they write out, or in key order and spacing, print alike."""
        job = self.job if self.canonical_job is None else self.canonical_job
        known = {name: value for name, value in self.environment.items() if value is not None}
        return self._print(job, known)

    def fingerprint_as_sent(self) -> str:
        """SHA-256 of the canonical JSON of the upload as sent: the print uploads stored
        before prints were taken on meaning carry."""
        return self._print(self.job, self.environment)

    def _print(self, job: Mapping[str, Any], environment: Mapping[str, Any]) -> str:
        canonical = {
            "job": job,
            "model": self.model,
            "method": self.method,
            "gpu": {"name": self.gpu_name, "memory_total_bytes": self.gpu_memory_total_bytes},
            "measured": {level.value: value for level, value in self.measured.levels().items()},
            "outcome": self.outcome.value,
            "environment": environment,
            "node_id": self.node_id,
            "run_id": self.run_id,
        }
        text = json.dumps(canonical, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True, slots=True, kw_only=True)
class RatioResult:
    level: Level
    measured_bytes: int
    estimated_bytes: int
    ratio: float
    outlier_reason: str | None
    factor: AppliedFactor | None  # the factor the ratio was compared with, if any


@dataclass(frozen=True, slots=True, kw_only=True)
class UploadReceipt:
    """What a stored upload produced; the API renders it as the 201 body."""

    upload_id: int
    received_at: datetime
    estimator_version: str | None  # None when the estimate failed
    ratios: tuple[RatioResult, ...]
    estimate_error: str | None  # why no ratio could be derived (e.g. an unknown model)


@dataclass(frozen=True, slots=True, kw_only=True)
class Submission:
    upload_id: int
    body: dict[str, Any]  # the response body: the first one, for a replay
    replayed: bool


def derive_ratios(
    upload: CalibrationUpload | NewUpload,
    estimate: Estimate,
    factors: FactorTable,
) -> list[RatioResult]:
    """measured / estimated for each level the upload measured, flagged against `factors`."""
    measured = (
        upload.measured
        if isinstance(upload, NewUpload)
        else Measured(
            allocated_bytes=upload.measured_allocated_bytes,
            reserved_bytes=upload.measured_reserved_bytes,
            device_bytes=upload.measured_device_bytes,
        )
    )
    results = []
    for level, measured_bytes in measured.levels().items():
        estimated_bytes = estimated_at(estimate, level)
        if estimated_bytes <= 0:
            continue
        ratio = measured_bytes / estimated_bytes
        applied = factors.lookup(
            model=upload.model,
            method=upload.method,
            level=level,
            gpu=upload.gpu_name,
            environment=environment_key(upload.environment),
        )
        results.append(
            RatioResult(
                level=level,
                measured_bytes=measured_bytes,
                estimated_bytes=estimated_bytes,
                ratio=ratio,
                outlier_reason=flag_outlier(ratio, upload.outcome, applied),
                factor=applied,
            )
        )
    return results


def _ratio_rows(
    upload: CalibrationUpload,
    voter: str,
    version: str,
    results: Sequence[RatioResult],
    now: datetime,
) -> list[CalibrationRatio]:
    """The rows of an upload's ratios, each with the upload's groups and its voter (the
    prefix of its key)."""
    key = environment_key(upload.environment)
    return [
        CalibrationRatio(
            upload_id=upload.id,
            estimator_version=version,
            level=result.level,
            estimated_bytes=result.estimated_bytes,
            ratio=result.ratio,
            method=upload.method,
            model=upload.model,
            voter=voter,
            gpu_name=upload.gpu_name,
            environment_key=key,
            outcome=upload.outcome,
            outlier_reason=result.outlier_reason,
            computed_at=now,
        )
        for result in results
    ]


def _replay(existing: CalibrationUpload, upload: NewUpload) -> Submission:
    """The first answer to an upload with the same Idempotency-Key, if it meant the same (an
    upload stored before prints were taken on meaning: if it was sent alike)."""
    same = existing.request_hash in (upload.fingerprint(), upload.fingerprint_as_sent())
    if not same or existing.response is None:
        raise IdempotencyKeyReusedError(existing.idempotency_key or "")
    return Submission(upload_id=existing.id, body=existing.response, replayed=True)


def _uploader(session: Session, api_key_id: int, node_id: str) -> ApiKey:
    """The key an upload comes with; NodeNotAllowedError when it may not speak for the node
    id the upload names."""
    key = session.get(ApiKey, api_key_id)
    if key is None:
        raise ValueError(f"no API key with id {api_key_id}")
    if not speaks_for(key, node_id):
        raise NodeNotAllowedError(node_id, key.prefix)
    return key


def submit_upload(
    session: Session,
    upload: NewUpload,
    *,
    api_key_id: int,
    idempotency_key: str | None,
    estimate: EstimateFn,
    factors: FactorTable,
    render: Callable[[UploadReceipt], dict[str, Any]],
    now: Clock = utc_now,
) -> Submission:
    """Store an upload and its ratios, or replay the first response for a repeated key.

    Raises NodeNotAllowedError for a node id the key may not speak for and
    ImplausibleMeasurementError for peaks that cannot be true (nothing stored), and
    IdempotencyKeyReusedError for a known key with another meaning. The caller commits.
    """
    voter = _uploader(session, api_key_id, upload.node_id).prefix
    check_measured(upload.measured, gpu_memory_total_bytes=upload.gpu_memory_total_bytes)
    repository = CalibrationRepository(session)
    if idempotency_key is not None:
        existing = repository.find_by_idempotency_key(api_key_id, idempotency_key)
        if existing is not None:
            return _replay(existing, upload)
    received_at = now()
    row = CalibrationUpload(
        received_at=received_at,
        api_key_id=api_key_id,
        idempotency_key=idempotency_key,
        request_hash=upload.fingerprint(),
        model=upload.model,
        method=upload.method,
        job=dict(upload.job),
        gpu_name=upload.gpu_name,
        gpu_memory_total_bytes=upload.gpu_memory_total_bytes,
        measured_allocated_bytes=upload.measured.allocated_bytes,
        measured_reserved_bytes=upload.measured.reserved_bytes,
        measured_device_bytes=upload.measured.device_bytes,
        outcome=upload.outcome,
        environment=dict(upload.environment),
        node_id=upload.node_id,
        run_id=upload.run_id,
    )
    try:
        repository.add_upload(row)
    except DuplicateIdempotencyKeyError as duplicate:
        # A concurrent request with the same key won the insert; answer as its replay.
        return _replay(duplicate.existing, upload)

    # The raw upload is stored; an estimator that cannot handle its spec (a model not in
    # the catalog yet) leaves it without ratios until a later version re-derives them.
    version: str | None = None
    results: list[RatioResult] = []
    error: str | None = None
    try:
        estimated = estimate(upload.job)
    except EstimatorError as failure:
        error = str(failure)
    else:
        version = estimated.estimator_version
        results = derive_ratios(upload, estimated, factors)
        repository.add_ratios(_ratio_rows(row, voter, version, results, received_at))
        if results:
            repository.mark_changed(
                version, {(upload.method, r.level.value, upload.model) for r in results}
            )
    receipt = UploadReceipt(
        upload_id=row.id,
        received_at=received_at,
        estimator_version=version,
        ratios=tuple(results),
        estimate_error=error,
    )
    body = render(receipt)
    repository.set_response(row, body)
    return Submission(upload_id=row.id, body=body, replayed=False)


class RederivePhase(StrEnum):
    DERIVE = "derive"  # deriving the ratios of uploads that have none of the version
    FLAG = "flag"  # flagging the derived ratios against the factors they gave
    FINISHED = "finished"


@dataclass(frozen=True, slots=True, kw_only=True)
class RederiveProgress:
    """Where a re-derivation stands (committed, so a restart resumes from here)."""

    estimator_version: str
    phase: RederivePhase
    total: int  # uploads that had no ratio of the version when the job started
    done: int  # of them, uploads looked at
    derived: int  # of them, uploads that got ratios (the others' jobs the estimator rejects)
    started_at: datetime
    finished_at: datetime | None

    @property
    def percent(self) -> float:
        return 100.0 if self.total == 0 else 100.0 * self.done / self.total


def _progress(job: CalibrationRederivation) -> RederiveProgress:
    return RederiveProgress(
        estimator_version=job.estimator_version,
        phase=RederivePhase(job.phase),
        total=job.total,
        done=job.done,
        derived=job.derived,
        started_at=job.started_at,
        finished_at=job.finished_at,
    )


def rederivation_status(session: Session, estimator_version: str) -> RederiveProgress | None:
    """The last (or running) re-derivation of `estimator_version`, or None if none ran."""
    job = CalibrationRepository(session).rederivation(estimator_version)
    return None if job is None else _progress(job)


def _start_rederivation(
    repository: CalibrationRepository, estimator_version: str, now: datetime
) -> CalibrationRederivation:
    job = repository.rederivation(estimator_version)
    through = repository.newest_upload_id()
    total = repository.count_uploads_without_ratios(estimator_version, through_id=through)
    if job is None:
        job = CalibrationRederivation(estimator_version=estimator_version)
        repository.session.add(job)
    job.through_upload_id = through
    job.cursor_id = 0
    job.total = total
    job.done = job.derived = 0
    job.phase = RederivePhase.DERIVE.value
    job.started_at = job.updated_at = now
    job.finished_at = None
    repository.session.flush()
    return job


def rederive_ratios(
    session: Session,
    *,
    estimate: EstimateFn,
    estimator_version: str,
    batch_size: int = 500,
    now: Clock = utc_now,
    progress: Callable[[RederiveProgress], None] | None = None,
) -> int:
    """Derive ratios of `estimator_version` for every upload that has none, as a job that
    commits after each batch and resumes where it stopped (a crash, a restart); returns how
    many uploads the job gave ratios. `progress` is told after each batch.

    The job covers the uploads stored when it started (later ones got their ratios as they
    came in). Its ratios are first flagged against no factor; once all are derived, the
    partitions they changed are refitted and the ratios are flagged against those factors.
    A finished job's second run starts afresh and finds only uploads still without ratios.
    """
    repository = CalibrationRepository(session)
    job = repository.rederivation(estimator_version)
    if job is None or job.phase == RederivePhase.FINISHED.value:
        job = _start_rederivation(repository, estimator_version, now())
        session.commit()

    def step() -> None:
        job.updated_at = now()
        session.commit()
        if progress is not None:
            progress(_progress(job))

    while job.phase == RederivePhase.DERIVE.value:
        batch = repository.uploads_without_ratios(
            estimator_version,
            after_id=job.cursor_id,
            through_id=job.through_upload_id,
            limit=batch_size,
        )
        if not batch:
            job.phase, job.cursor_id = RederivePhase.FLAG.value, 0
            refresh_factors(session, estimator_version)
            step()
            break
        voters = ApiKeyRepository(session).prefixes(upload.api_key_id for upload in batch)
        for upload in batch:
            try:
                estimated = estimate(upload.job)
            except EstimatorError:
                continue
            if estimated.estimator_version != estimator_version:
                raise ValueError(
                    f"the estimator is {estimated.estimator_version!r}, not {estimator_version!r}"
                )
            results = derive_ratios(upload, estimated, EMPTY_TABLE)
            rows = _ratio_rows(upload, voters[upload.api_key_id], estimator_version, results, now())
            repository.add_ratios(rows)
            if results:
                job.derived += 1
                repository.mark_changed(
                    estimator_version,
                    {(upload.method, r.level.value, upload.model) for r in results},
                )
        job.cursor_id = batch[-1].id
        job.done += len(batch)
        step()

    if job.phase == RederivePhase.FLAG.value:
        refresh_factors(session, estimator_version)
        table = stored_factor_table(session, estimator_version)
        while ratios := repository.ratios_after(
            estimator_version,
            after_id=job.cursor_id,
            through_upload_id=job.through_upload_id,
            limit=batch_size,
        ):
            for row in ratios:
                upload = row.upload
                applied = table.lookup(
                    model=upload.model,
                    method=upload.method,
                    level=row.level,
                    gpu=upload.gpu_name,
                    environment=environment_key(upload.environment),
                )
                row.outlier_reason = flag_outlier(row.ratio, upload.outcome, applied)
            job.cursor_id = ratios[-1].id
            step()
        job.phase, job.finished_at = RederivePhase.FINISHED.value, now()
        step()
    return job.derived


@dataclass(frozen=True, slots=True, kw_only=True)
class Purge:
    """What purging a key's uploads removed and refitted."""

    uploads: int
    ratios: int
    refitted: int  # partitions of the estimator version refitted at once


@dataclass(frozen=True, slots=True, kw_only=True)
class Revocation:
    key: ApiKey
    revoked_at: datetime  # when the key was first revoked
    purge: Purge | None  # None: the key's uploads were kept


def purge_key_uploads(session: Session, api_key_id: int, *, estimator_version: str) -> Purge:
    """Delete every upload of one key and its ratios, and refit the factors they fed: those of
    `estimator_version` at once, so the stored factors are `fit_factor_table`'s over what
    remains; other versions' at their next load. The caller commits."""
    repository = CalibrationRepository(session)
    purged = repository.delete_uploads_of_key(api_key_id)
    by_version: dict[str, set[tuple[str, str, str]]] = defaultdict(set)
    for version, method, level, model in purged.touched:
        by_version[version].add((method, level, model))
    for version, changes in sorted(by_version.items()):
        repository.mark_changed(version, changes)
    refitted = refresh_factors(session, estimator_version)
    return Purge(uploads=purged.uploads, ratios=purged.ratios, refitted=refitted)


def revoke(
    session: Session, prefix: str, *, purge: bool, estimator_version: str, now: datetime
) -> Revocation | None:
    """Revoke the key with this prefix (again: a no-op) and, with `purge`, delete its uploads
    and refit what they fed (`purge_key_uploads`); None when no key has the prefix. The
    caller commits."""
    key = revoke_key(session, prefix, now=now)
    if key is None:
        return None
    purged = (
        purge_key_uploads(session, key.id, estimator_version=estimator_version) if purge else None
    )
    return Revocation(key=key, revoked_at=key.revoked_at or now, purge=purged)


@dataclass(frozen=True, slots=True, kw_only=True)
class CalibrationPage:
    uploads: Sequence[CalibrationUpload]
    next_cursor: str | None  # pass back as `cursor` for the next (older) page


def encode_cursor(upload_id: int) -> str:
    return base64.urlsafe_b64encode(f"before:{upload_id}".encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> int:
    """The upload id a cursor from `encode_cursor` holds; InvalidCursorError for any other
    text, and for an id beyond what the id column holds (a signed 64-bit integer)."""
    try:
        text = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
    except ValueError as error:  # not base64 (binascii.Error), not ASCII, not UTF-8
        raise InvalidCursorError(f"invalid cursor {cursor!r}") from error
    tag, _, number = text.partition(":")
    # Only the digits `encode_cursor` writes: int() would also read signs, spaces,
    # underscores and other scripts' digits.
    if tag != "before" or not (number.isascii() and number.isdigit()) or len(number) > _ID_DIGITS:
        raise InvalidCursorError(f"invalid cursor {cursor!r}")
    upload_id = int(number)
    if not 1 <= upload_id <= MAX_ROW_ID:
        raise InvalidCursorError(f"invalid cursor {cursor!r}")
    return upload_id


def list_calibrations(
    session: Session,
    *,
    limit: int,
    model: str | None = None,
    node_id: str | None = None,
    since: datetime | None = None,
    cursor: str | None = None,
) -> CalibrationPage:
    """A page of uploads, newest first; raises InvalidCursorError for a foreign cursor."""
    if not 1 <= limit <= MAX_PAGE:
        raise ValueError(f"limit must be in [1, {MAX_PAGE}]")
    uploads = CalibrationRepository(session).list_uploads(
        limit=limit + 1,
        model=model,
        node_id=node_id,
        since=since,
        before_id=decode_cursor(cursor) if cursor is not None else None,
    )
    page = uploads[:limit]
    more = len(uploads) > limit
    return CalibrationPage(
        uploads=page, next_cursor=encode_cursor(page[-1].id) if more and page else None
    )
