"""Uploads end to end on both databases: stored raw, ratios derived, factors refit, replays."""

from __future__ import annotations

import base64
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import Engine, delete, func, select
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from service.calibration.factors import (
    FactorCache,
    FactorState,
    environment_key,
    load_factor_table,
)
from service.calibration.uploads import (
    IdempotencyKeyReusedError,
    InvalidCursorError,
    Submission,
    list_calibrations,
    rederive_ratios,
    submit_upload,
)
from service.core.calibration import (
    EMPTY_TABLE,
    FACTOR_MAX,
    MIN_NODES,
    FactorTable,
    ImplausibleMeasurementError,
    Level,
    Sample,
    Scope,
    fit_factor,
)
from service.store.db import create_session_factory
from service.store.keys import KeyScope, create_key
from service.store.models import ApiKey, CalibrationRatio, CalibrationUpload
from tests.store.factories import VERSION, fake_estimate, new_upload, node_key, render

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
MODEL = "meta-llama/Llama-3.1-8B"


@pytest.fixture
def api_key(session: Session) -> ApiKey:
    return create_key(session, scopes=[KeyScope.UPLOAD], name="nodes", now=NOW, nodes=["*"]).key


def submit(
    session: Session,
    api_key: ApiKey,
    upload: Any,
    *,
    idempotency_key: str | None = None,
    factors: FactorTable = EMPTY_TABLE,
) -> Submission:
    return submit_upload(
        session,
        upload,
        api_key_id=api_key.id,
        idempotency_key=idempotency_key,
        estimate=fake_estimate,
        factors=factors,
        render=render,
        now=lambda: NOW,
    )


def count(session: Session, table: type[CalibrationUpload] | type[CalibrationRatio]) -> int:
    return session.scalar(select(func.count()).select_from(table)) or 0


class TestSubmitUpload:
    def test_stores_the_raw_upload_and_a_ratio_per_measured_level(
        self, session: Session, api_key: ApiKey
    ) -> None:
        upload = new_upload(allocated_gib=18.0, reserved_gib=21.0, device_gib=24.0)
        result = submit(session, api_key, upload, idempotency_key="k")
        assert not result.replayed
        row = session.get(CalibrationUpload, result.upload_id)
        assert row is not None
        assert row.job == dict(upload.job)
        assert row.node_id == "gpu-node-17" and row.run_id == "job-4711-rank0"
        assert row.environment["driver"] == "550.54.15"
        assert row.response == result.body
        ratios = {r.level: r for r in row.ratios}
        # The stand-in estimates 20 GiB allocated, 22 reserved, 24 device.
        assert ratios[Level.ALLOCATED].ratio == pytest.approx(0.9)
        assert ratios[Level.RESERVED].ratio == pytest.approx(21 / 22, rel=1e-6)
        assert ratios[Level.DEVICE].ratio == pytest.approx(1.0, rel=1e-6)
        assert {r.estimator_version for r in row.ratios} == {VERSION}
        assert result.body["ratios"][0]["level"] == "allocated"

    def test_a_replay_returns_the_first_response_and_stores_nothing(
        self, session: Session, api_key: ApiKey
    ) -> None:
        first = submit(session, api_key, new_upload(), idempotency_key="k")
        again = submit(session, api_key, new_upload(), idempotency_key="k")
        assert again.replayed and again.body == first.body and again.upload_id == first.upload_id
        assert count(session, CalibrationUpload) == 1
        assert count(session, CalibrationRatio) == 1

    def test_reusing_a_key_with_another_body_is_refused(
        self, session: Session, api_key: ApiKey
    ) -> None:
        submit(session, api_key, new_upload(), idempotency_key="k")
        with pytest.raises(IdempotencyKeyReusedError, match="different request body"):
            submit(session, api_key, new_upload(device_gib=25.0), idempotency_key="k")
        assert count(session, CalibrationUpload) == 1

    def test_a_replay_is_compared_on_what_the_upload_means(
        self, session: Session, api_key: ApiKey
    ) -> None:
        # The same job with a default written out, and the environment's unknowns as null:
        # the same upload. The job is stored as the first sent it.
        upload = new_upload()
        meaning = {"model": upload.model, "spec": {"method": "lora", "batch_size": 1}}
        first = submit(
            session, api_key, replace(upload, canonical_job=meaning), idempotency_key="k"
        )
        spelled_out = replace(
            upload,
            job={**upload.job, "seq_len": 2048},
            environment={**upload.environment, "peft": None},
            canonical_job=dict(meaning),
        )
        again = submit(session, api_key, spelled_out, idempotency_key="k")
        assert again.replayed and again.upload_id == first.upload_id
        row = session.get(CalibrationUpload, first.upload_id)
        assert row is not None and row.job == dict(upload.job)
        other = replace(spelled_out, canonical_job={**meaning, "spec": {"batch_size": 2}})
        with pytest.raises(IdempotencyKeyReusedError):
            submit(session, api_key, other, idempotency_key="k")

    def test_an_upload_stored_with_its_bytes_print_is_replayed(
        self, session: Session, api_key: ApiKey
    ) -> None:
        # Uploads stored before prints were taken on meaning carry the print of their bytes.
        upload = replace(new_upload(), canonical_job={"spec": {"batch_size": 1}})
        first = submit(session, api_key, upload, idempotency_key="k")
        row = session.get(CalibrationUpload, first.upload_id)
        assert row is not None and row.request_hash == upload.fingerprint()
        row.request_hash = upload.fingerprint_as_sent()
        assert submit(session, api_key, upload, idempotency_key="k").replayed

    def test_without_a_key_every_upload_is_stored(self, session: Session, api_key: ApiKey) -> None:
        submit(session, api_key, new_upload())
        submit(session, api_key, new_upload())
        assert count(session, CalibrationUpload) == 2

    def test_impossible_peaks_are_refused_and_not_stored(
        self, session: Session, api_key: ApiKey
    ) -> None:
        upload = new_upload(allocated_gib=30.0, reserved_gib=25.0)
        with pytest.raises(ImplausibleMeasurementError, match="cannot exceed reserved"):
            submit(session, api_key, upload)
        with pytest.raises(ImplausibleMeasurementError, match="above the GPU"):
            submit(session, api_key, new_upload(device_gib=81.0))
        assert count(session, CalibrationUpload) == 0

    def test_far_but_possible_values_are_stored_and_marked(
        self, session: Session, api_key: ApiKey
    ) -> None:
        result = submit(session, api_key, new_upload(device_gib=60.0))
        row = session.get(CalibrationUpload, result.upload_id)
        assert row is not None and len(row.ratios) == 1
        assert row.ratios[0].is_outlier
        assert "above the uncalibrated estimate" in (row.ratios[0].outlier_reason or "")
        assert result.body["ratios"][0]["outlier"] == row.ratios[0].outlier_reason

    def test_an_upload_the_estimator_cannot_handle_is_kept(
        self, session: Session, api_key: ApiKey
    ) -> None:
        result = submit(session, api_key, new_upload(model="unknown/model"))
        assert result.body["estimate_error"] is not None
        assert result.body["estimator_version"] is None
        row = session.get(CalibrationUpload, result.upload_id)
        assert row is not None and row.ratios == []


def upload_fleet(
    session: Session,
    ratios_by_node: dict[str, list[float]],
    *,
    model: str = MODEL,
    gpu_name: str = "NVIDIA A100-SXM4-80GB",
) -> None:
    """Each node's runs, uploaded with the node's own key."""
    for node, ratios in ratios_by_node.items():
        for index, ratio in enumerate(ratios):
            upload = new_upload(
                model=model,
                estimate_gib=10.0,
                device_gib=12.0 * ratio,  # the stand-in's device estimate is 12 GiB
                node_id=node,
                run_id=f"{node}-{index}",
                gpu_name=gpu_name,
            )
            submit(session, node_key(session, node), upload)


class TestFactors:
    def test_factors_are_fit_from_the_stored_ratios(
        self, session: Session, api_key: ApiKey
    ) -> None:
        fleet = {"a": [1.10, 1.12], "b": [1.08], "c": [1.20, 1.11]}
        upload_fleet(session, fleet)
        table = load_factor_table(session, VERSION)
        found = table.lookup(model=MODEL, method="lora", level=Level.DEVICE)
        assert found is not None and found.key.scope is Scope.MODEL
        assert found.factor.nodes == 3 and found.factor.runs == 5
        # The votes' median, 1.11, moved toward 1 by 1.96 of its standard errors (the votes
        # 1.08, 1.11 and 1.154 spread by 4 %): the factor the core fits from these ratios.
        fitted = fit_factor(Sample(voter=n, ratio=r) for n, rs in fleet.items() for r in rs)
        assert fitted is not None
        assert found.factor.ratio == pytest.approx(fitted.ratio, rel=1e-6)
        assert 1.0 < found.factor.ratio < 1.11
        assert load_factor_table(session, "another-version") == EMPTY_TABLE

    def test_a_node_uploading_absurd_values_moves_no_factor_beyond_its_clamp(
        self, session: Session, api_key: ApiKey
    ) -> None:
        honest = {f"node-{i}": [1.05] for i in range(MIN_NODES)}
        upload_fleet(session, honest)
        before = load_factor_table(session, VERSION)
        # Possible values (under the GPU's total) that no honest node would measure.
        upload_fleet(session, {"rogue": [6.5] * 300})
        after = load_factor_table(session, VERSION)
        old = before.lookup(model=MODEL, method="lora", level=Level.DEVICE)
        new = after.lookup(model=MODEL, method="lora", level=Level.DEVICE)
        assert old is not None and new is not None
        assert new.factor.ratio == pytest.approx(old.factor.ratio)
        assert new.factor.ratio <= FACTOR_MAX
        assert new.factor.rejected_nodes == (node_key(session, "rogue").prefix,)
        rogue = session.scalars(
            select(CalibrationRatio)
            .join(CalibrationRatio.upload)
            .where(CalibrationUpload.node_id == "rogue")
        ).all()
        assert len(rogue) == 300 and all(r.is_outlier for r in rogue)

    def test_uploads_are_flagged_against_the_current_factor(
        self, session: Session, api_key: ApiKey
    ) -> None:
        upload_fleet(session, {f"n{i}": [1.45, 1.46] for i in range(4)})
        table = load_factor_table(session, VERSION)
        # 1.45 is far from the uncalibrated estimate but in line with the model's factor.
        usual = submit(session, api_key, new_upload(estimate_gib=10.0, device_gib=17.4))
        assert usual.body["ratios"][0]["outlier"] is not None
        calibrated = submit(
            session, api_key, new_upload(estimate_gib=10.0, device_gib=17.4), factors=table
        )
        assert calibrated.body["ratios"][0]["outlier"] is None

    def test_a_new_estimator_version_rederives_every_ratio(
        self, session: Session, api_key: ApiKey
    ) -> None:
        upload_fleet(session, {"a": [1.1], "b": [1.1], "c": [1.1]})
        submit(session, api_key, new_upload(model="unknown/model"))

        def estimate_v2(job: Any) -> Any:
            # The new estimator says 10 % more for the same jobs.
            estimate = fake_estimate(job, version="test-2")
            return replace(estimate, device_bytes=estimate.device_bytes * 11 // 10)

        assert rederive_ratios(session, estimate=estimate_v2, estimator_version="test-2") == 3
        table = load_factor_table(session, "test-2")
        found = table.lookup(model=MODEL, method="lora", level=Level.DEVICE)
        assert found is not None and found.factor.ratio == pytest.approx(1.0, rel=1e-6)
        # Done once: a second run finds nothing left to derive (the unknown model stays).
        assert rederive_ratios(session, estimate=estimate_v2, estimator_version="test-2") == 0

    def test_splits_by_gpu_when_the_data_show_it(self, session: Session, api_key: ApiKey) -> None:
        upload_fleet(session, {f"a{i}": [1.00] for i in range(3)}, gpu_name="A100")
        upload_fleet(session, {f"h{i}": [1.20] for i in range(3)}, gpu_name="H100")
        table = load_factor_table(session, VERSION)
        h100 = table.lookup(model=MODEL, method="lora", level=Level.DEVICE, gpu="H100")
        assert h100 is not None and h100.key.scope is Scope.MODEL_GPU
        assert h100.factor.ratio == pytest.approx(1.2, rel=1e-6)


def test_environment_key_keeps_torch_and_cuda_major_minor() -> None:
    assert environment_key({"torch": "2.5.1+cu124", "cuda": "12.4"}) == "torch 2.5, cuda 12.4"
    assert environment_key({}) == "torch ?, cuda ?"


class TestListCalibrations:
    def test_pages_newest_first_with_an_opaque_cursor(
        self, session: Session, api_key: ApiKey
    ) -> None:
        ids = [submit(session, api_key, new_upload(run_id=f"r{i}")).upload_id for i in range(5)]
        page = list_calibrations(session, limit=2)
        assert [u.id for u in page.uploads] == ids[:2:-1]
        assert page.next_cursor is not None and str(ids[3]) not in page.next_cursor
        page = list_calibrations(session, limit=2, cursor=page.next_cursor)
        assert [u.id for u in page.uploads] == ids[2:0:-1]
        assert page.next_cursor is not None
        last = list_calibrations(session, limit=2, cursor=page.next_cursor)
        assert [u.id for u in last.uploads] == ids[:1]
        assert last.next_cursor is None
        assert list_calibrations(session, limit=10, node_id="elsewhere").uploads == []

    @pytest.mark.parametrize(
        "number",
        [
            "1" + "0" * 29,  # beyond the id column's signed 64 bits
            str(2**63),
            "-5",
            "+5",
            " 5",
            "5_0",
            "\u0665",  # a digit of another script, which int() would read
            "0",
        ],
    )
    def test_refuses_a_cursor_no_upload_id_can_have(self, session: Session, number: str) -> None:
        cursor = base64.urlsafe_b64encode(f"before:{number}".encode()).decode().rstrip("=")
        with pytest.raises(InvalidCursorError):
            list_calibrations(session, limit=2, cursor=cursor)

    def test_the_largest_id_is_a_cursor(self, session: Session, api_key: ApiKey) -> None:
        uploaded = submit(session, api_key, new_upload()).upload_id
        cursor = base64.urlsafe_b64encode(f"before:{2**63 - 1}".encode()).decode()
        page = list_calibrations(session, limit=2, cursor=cursor)
        assert [u.id for u in page.uploads] == [uploaded]

    @pytest.mark.parametrize("cursor", ["", "xyz", "YWZ0ZXI6Mw", "!!", "\u00e9", "_w"])
    def test_refuses_a_foreign_cursor(self, session: Session, cursor: str) -> None:
        with pytest.raises(InvalidCursorError):
            list_calibrations(session, limit=2, cursor=cursor)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class TestFactorCache:
    def test_reloads_after_the_ttl_or_an_invalidation(self) -> None:
        loads: list[float] = []
        clock = FakeClock()

        def load() -> FactorTable:
            loads.append(clock.now)
            return EMPTY_TABLE

        cache = FactorCache(load, ttl_s=5.0, clock=clock)
        assert cache.get().state is FactorState.FRESH
        clock.now += 4.9
        cache.get()
        assert loads == [1000.0]
        clock.now += 0.2
        cache.get()
        assert loads == [1000.0, 1005.1]
        cache.invalidate()
        cache.get()
        assert len(loads) == 3

    def test_an_invalidation_during_a_load_is_not_lost(self) -> None:
        clock = FakeClock()
        cache: FactorCache
        loads = 0

        def load() -> FactorTable:
            nonlocal loads
            loads += 1
            if loads == 1:
                cache.invalidate()  # an upload stored while this load read the table
            return EMPTY_TABLE

        cache = FactorCache(load, ttl_s=5.0, clock=clock)
        cache.get()
        cache.get()
        assert loads == 2
        cache.get()
        assert loads == 2

    def test_peek_never_loads(self) -> None:
        clock = FakeClock()
        loads: list[float] = []

        def load() -> FactorTable:
            loads.append(clock.now)
            return EMPTY_TABLE

        cache = FactorCache(load, ttl_s=5.0, clock=clock)
        assert cache.peek().state is FactorState.NONE and cache.age_s(cache.peek()) is None
        assert loads == []
        cache.get()
        clock.now += 7.0
        assert cache.peek().state is FactorState.FRESH and loads == [1000.0]
        assert cache.age_s(cache.peek()) == 7.0

    def test_keeps_answering_with_the_last_factors_when_the_store_is_down(self) -> None:
        clock = FakeClock()
        table = FactorTable({})
        up = True

        def load() -> FactorTable:
            if not up:
                raise OperationalError("SELECT", {}, Exception("connection refused"))
            return table

        cache = FactorCache(load, ttl_s=5.0, retry_s=2.0, clock=clock)
        assert cache.get().table is table
        up = False
        clock.now += 6
        stale = cache.get()
        assert stale.state is FactorState.STALE and stale.table is table
        assert stale.error is not None and "unavailable" in stale.error
        assert stale.loaded_at == 1000.0
        up = True
        clock.now += 1  # within the retry delay: no new attempt
        assert cache.get().state is FactorState.STALE
        clock.now += 1.5
        assert cache.get().state is FactorState.FRESH

    def test_says_so_when_it_never_loaded(self) -> None:
        def load() -> FactorTable:
            raise OperationalError("SELECT", {}, Exception("connection refused"))

        snapshot = FactorCache(load, clock=FakeClock()).get()
        assert snapshot.state is FactorState.NONE and snapshot.table is EMPTY_TABLE

    def test_an_upload_reaches_every_replica_within_the_ttl(
        self, session: Session, api_key: ApiKey
    ) -> None:
        clock = FakeClock()

        def load() -> FactorTable:
            return load_factor_table(session, VERSION)

        replicas = [FactorCache(load, ttl_s=5.0, clock=clock) for _ in range(2)]
        for replica in replicas:
            assert replica.get().table == EMPTY_TABLE
        upload_fleet(session, {f"n{i}": [1.1] for i in range(3)})
        clock.now += 5.0
        for replica in replicas:
            found = replica.get().table.lookup(model=MODEL, method="lora", level=Level.DEVICE)
            assert found is not None


@pytest.fixture
def committed_key(engine: Engine) -> Iterator[ApiKey]:
    """A committed API key, for tests that need real concurrent transactions."""
    sessions = create_session_factory(engine)
    with sessions.begin() as session:
        key = create_key(
            session, scopes=[KeyScope.UPLOAD], name="race", now=NOW, nodes=["gpu-node-*"]
        ).key
    yield key
    with sessions.begin() as session:
        session.execute(delete(CalibrationUpload).where(CalibrationUpload.api_key_id == key.id))
        session.execute(delete(ApiKey).where(ApiKey.id == key.id))


def test_concurrent_replays_store_the_upload_exactly_once(
    engine: Engine, committed_key: ApiKey
) -> None:
    sessions = create_session_factory(engine)
    clients = 8
    start = threading.Barrier(clients)

    def client(index: int) -> Submission:
        start.wait()
        with sessions.begin() as session:
            return submit_upload(
                session,
                new_upload(),
                api_key_id=committed_key.id,
                idempotency_key="same-key",
                estimate=fake_estimate,
                factors=EMPTY_TABLE,
                render=render,
            )

    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(client, range(clients)))
    assert sum(not r.replayed for r in results) == 1
    assert len({r.upload_id for r in results}) == 1
    assert all(r.body == results[0].body for r in results)
    with sessions() as session:
        stored = session.scalars(
            select(CalibrationUpload).where(CalibrationUpload.api_key_id == committed_key.id)
        ).all()
        assert len(stored) == 1
        assert len(stored[0].ratios) == 1
