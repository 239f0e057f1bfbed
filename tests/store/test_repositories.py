"""Repositories on SQLite and PostgreSQL, each test in a rolled-back transaction."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError, StatementError
from sqlalchemy.orm import Session

from service.core.calibration import Level, Outcome
from service.store.keys import KeyScope, create_key
from service.store.models import ApiKey, CalibrationRatio, CalibrationUpload
from service.store.repositories import (
    ApiKeyRepository,
    CalibrationRepository,
    DuplicateIdempotencyKeyError,
)
from tests.store.factories import A100_80GB

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


@pytest.fixture
def api_key(session: Session) -> ApiKey:
    return create_key(session, scopes=[KeyScope.UPLOAD], name="nodes", now=T0, nodes=["*"]).key


def upload_row(api_key: ApiKey, **changes: object) -> CalibrationUpload:
    values: dict[str, object] = {
        "received_at": T0,
        "api_key_id": api_key.id,
        "idempotency_key": None,
        "request_hash": "0" * 64,
        "model": "meta-llama/Llama-3.1-8B",
        "method": "lora",
        "job": {"model": "meta-llama/Llama-3.1-8B", "method": "lora", "seq_len": 2048},
        "gpu_name": "NVIDIA A100-SXM4-80GB",
        "gpu_memory_total_bytes": A100_80GB,
        "measured_allocated_bytes": 60_000_000_000,
        "measured_reserved_bytes": 64_000_000_000,
        "measured_device_bytes": 66_000_000_000,
        "outcome": Outcome.COMPLETED,
        "environment": {"torch": "2.5.1", "cuda": "12.4"},
        "node_id": "gpu-node-17",
        "run_id": "job-4711-rank0",
    }
    values.update(changes)
    return CalibrationUpload(**values)


def ratio_row(
    upload: CalibrationUpload, voter: str = "3a5c0f1e", **changes: object
) -> CalibrationRatio:
    values: dict[str, object] = {
        "upload_id": upload.id,
        "estimator_version": "v1",
        "level": Level.DEVICE,
        "estimated_bytes": 60_000_000_000,
        "ratio": 1.1,
        "method": upload.method,
        "model": upload.model,
        "voter": voter,
        "gpu_name": upload.gpu_name,
        "environment_key": "torch 2.5, cuda 12.4",
        "outcome": upload.outcome,
        "outlier_reason": None,
        "computed_at": T0,
    }
    values.update(changes)
    return CalibrationRatio(**values)


class TestApiKeyRepository:
    def test_finds_by_hash_and_prefix_and_lists_live_keys(
        self, session: Session, api_key: ApiKey
    ) -> None:
        repository = ApiKeyRepository(session)
        assert repository.get_by_hash(api_key.key_hash) is api_key
        assert repository.get_by_prefix(api_key.prefix) is api_key
        assert repository.list_keys() == [api_key]
        repository.revoke(api_key, T0 + timedelta(hours=1))
        assert repository.list_keys() == []
        assert repository.list_keys(include_revoked=True) == [api_key]

    def test_timestamps_come_back_timezone_aware(self, session: Session, api_key: ApiKey) -> None:
        ApiKeyRepository(session).revoke(api_key, datetime(2026, 11, 29, 13, 0, tzinfo=UTC))
        session.expire_all()
        key = session.get(ApiKey, api_key.id)
        assert key is not None and key.revoked_at is not None
        assert key.created_at == T0 and key.created_at.tzinfo is not None
        assert key.revoked_at == datetime(2026, 11, 29, 13, 0, tzinfo=UTC)

    def test_naive_timestamps_are_refused(self, session: Session, api_key: ApiKey) -> None:
        api_key.revoked_at = datetime(2026, 11, 29, 13, 0)
        with pytest.raises(StatementError, match="timezone-aware"):
            session.flush()


class TestCalibrationRepository:
    def test_keeps_the_raw_upload(self, session: Session, api_key: ApiKey) -> None:
        repository = CalibrationRepository(session)
        stored = repository.add_upload(upload_row(api_key, idempotency_key="abc"))
        session.expire_all()
        again = repository.find_by_idempotency_key(api_key.id, "abc")
        assert again is not None and again.id == stored.id
        assert again.job == {"model": "meta-llama/Llama-3.1-8B", "method": "lora", "seq_len": 2048}
        assert again.gpu_memory_total_bytes == A100_80GB  # beyond 32 bits
        assert again.measured_device_bytes == 66_000_000_000
        assert again.outcome is Outcome.COMPLETED
        assert again.environment == {"torch": "2.5.1", "cuda": "12.4"}
        assert again.received_at == T0

    def test_an_idempotency_key_is_stored_once_per_api_key(
        self, session: Session, api_key: ApiKey
    ) -> None:
        repository = CalibrationRepository(session)
        first = repository.add_upload(upload_row(api_key, idempotency_key="k1"))
        with pytest.raises(DuplicateIdempotencyKeyError) as caught:
            repository.add_upload(upload_row(api_key, idempotency_key="k1", run_id="other"))
        assert caught.value.existing.id == first.id
        # The savepoint kept the transaction usable, and nothing was stored twice.
        other_key = create_key(
            session, scopes=[KeyScope.UPLOAD], name="other", now=T0, nodes=["*"]
        ).key
        repository.add_upload(upload_row(other_key, idempotency_key="k1"))
        repository.add_upload(upload_row(api_key))
        repository.add_upload(upload_row(api_key))
        keyed = session.scalars(
            select(CalibrationUpload).where(CalibrationUpload.idempotency_key == "k1")
        ).all()
        assert sorted(u.api_key_id for u in keyed) == sorted([api_key.id, other_key.id])
        assert len(session.scalars(select(CalibrationUpload)).all()) == 4

    @pytest.mark.parametrize(
        "changes",
        [
            {"measured_allocated_bytes": 70_000_000_000},  # above reserved
            {"measured_device_bytes": A100_80GB + 1},  # above the GPU
            {"measured_reserved_bytes": 0, "measured_allocated_bytes": None},
            {
                "measured_allocated_bytes": None,
                "measured_reserved_bytes": None,
                "measured_device_bytes": None,
            },
        ],
    )
    def test_the_schema_refuses_impossible_peaks(
        self, session: Session, api_key: ApiKey, changes: dict[str, object]
    ) -> None:
        with pytest.raises(IntegrityError):
            CalibrationRepository(session).add_upload(upload_row(api_key, **changes))

    def test_lists_newest_first_with_filters_and_a_keyset_cursor(
        self, session: Session, api_key: ApiKey
    ) -> None:
        repository = CalibrationRepository(session)
        rows = [
            repository.add_upload(
                upload_row(
                    api_key,
                    received_at=T0 + timedelta(minutes=i),
                    node_id=f"node-{i % 2}",
                    model="m-a" if i < 4 else "m-b",
                )
            )
            for i in range(6)
        ]
        ids = [row.id for row in rows]
        assert [u.id for u in repository.list_uploads(limit=3)] == ids[::-1][:3]
        assert [u.id for u in repository.list_uploads(limit=3, before_id=ids[3])] == ids[2::-1]
        assert [u.id for u in repository.list_uploads(limit=9, model="m-b")] == ids[:3:-1]
        assert [u.id for u in repository.list_uploads(limit=9, node_id="node-1")] == [
            ids[5],
            ids[3],
            ids[1],
        ]
        since = T0 + timedelta(minutes=4)
        assert [u.id for u in repository.list_uploads(limit=9, since=since)] == ids[:3:-1]

    def test_ratios_are_unique_per_level_and_version(
        self, session: Session, api_key: ApiKey
    ) -> None:
        repository = CalibrationRepository(session)
        upload = repository.add_upload(upload_row(api_key))
        repository.add_ratios([ratio_row(upload), ratio_row(upload, estimator_version="v2")])
        with pytest.raises(IntegrityError), session.begin_nested():
            repository.add_ratios([ratio_row(upload)])

    def test_observations_and_missing_ratios_are_per_version(
        self, session: Session, api_key: ApiKey
    ) -> None:
        repository = CalibrationRepository(session)
        first = repository.add_upload(upload_row(api_key, node_id="a"))
        second = repository.add_upload(upload_row(api_key, node_id="b"))
        repository.add_ratios(
            [
                ratio_row(first, ratio=1.1),
                ratio_row(first, level=Level.ALLOCATED, ratio=0.9),
                ratio_row(second, ratio=1.3, estimator_version="v2"),
            ]
        )
        v1 = repository.observations("v1")
        assert sorted((o.node_id, o.voter, o.level, o.ratio) for o in v1) == [
            ("a", api_key.prefix, Level.ALLOCATED, 0.9),
            ("a", api_key.prefix, Level.DEVICE, 1.1),
        ]
        assert v1[0].environment == {"torch": "2.5.1", "cuda": "12.4"}
        assert [u.id for u in repository.uploads_without_ratios("v1")] == [second.id]
        assert [u.id for u in repository.uploads_without_ratios("v2")] == [first.id]
        assert repository.uploads_without_ratios("v2", after_id=first.id) == []

    def test_deleting_an_upload_deletes_its_ratios(self, session: Session, api_key: ApiKey) -> None:
        repository = CalibrationRepository(session)
        upload = repository.add_upload(upload_row(api_key))
        repository.add_ratios([ratio_row(upload)])
        session.expunge_all()
        session.execute(delete(CalibrationUpload))
        assert session.scalars(select(CalibrationRatio)).all() == []

    def test_an_upload_needs_an_existing_api_key(self, session: Session, api_key: ApiKey) -> None:
        with pytest.raises(IntegrityError):
            CalibrationRepository(session).add_upload(upload_row(api_key, api_key_id=10_000))


class TestKeyUploads:
    def test_usage_counts_each_key_s_uploads(self, session: Session, api_key: ApiKey) -> None:
        reader = create_key(session, scopes=[KeyScope.READ], name="reader", now=T0).key
        uploads = CalibrationRepository(session)
        uploads.add_upload(upload_row(api_key))
        uploads.add_upload(upload_row(api_key, received_at=T0 + timedelta(hours=1)))
        keys = ApiKeyRepository(session)
        usage = [(u.key.id, u.uploads, u.last_upload_at) for u in keys.usage()]
        assert usage == [(api_key.id, 2, T0 + timedelta(hours=1)), (reader.id, 0, None)]
        last = keys.usage()[0].last_upload_at
        assert last is not None and last.tzinfo is not None
        keys.revoke(api_key, T0)
        assert [u.key.id for u in keys.usage()] == [reader.id]
        assert [u.key.id for u in keys.usage(include_revoked=True)] == [api_key.id, reader.id]

    def test_deleting_a_key_s_uploads_names_the_groups_they_fed(
        self, session: Session, api_key: ApiKey
    ) -> None:
        other = create_key(session, scopes=[KeyScope.UPLOAD], name="o", now=T0, nodes=["*"]).key
        repository = CalibrationRepository(session)
        first = repository.add_upload(upload_row(api_key))
        second = repository.add_upload(upload_row(api_key, model="org/phi-2", method="full"))
        kept = repository.add_upload(upload_row(other))
        repository.add_ratios(
            [
                ratio_row(first),
                ratio_row(first, estimator_version="v2"),
                ratio_row(second, level=Level.RESERVED),
                ratio_row(kept, voter=other.prefix),
            ]
        )
        purged = repository.delete_uploads_of_key(api_key.id)
        assert (purged.uploads, purged.ratios) == (2, 3)
        assert purged.touched == {
            ("v1", "lora", "device", "meta-llama/Llama-3.1-8B"),
            ("v2", "lora", "device", "meta-llama/Llama-3.1-8B"),
            ("v1", "full", "reserved", "org/phi-2"),
        }
        session.expunge_all()
        assert [u.id for u in session.scalars(select(CalibrationUpload))] == [kept.id]
        assert [r.upload_id for r in session.scalars(select(CalibrationRatio))] == [kept.id]
