"""Stored factors: kept equal to a full refit (`fit_table` on every ratio) as uploads come in,
refitted only where ratios changed, built for ratios stored before the upgrade, and re-derived
for a new estimator version by a job that resumes where it stopped."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import Connection, delete, func, insert, inspect, select, text
from sqlalchemy.orm import Session

from service.calibration.factors import (
    StoredRuns,
    _fit_changed,
    _store_refit,
    environment_key,
    fit_factor_table,
    load_factor_table,
    refresh_factors,
    stored_factor_table,
)
from service.calibration.uploads import (
    RederivePhase,
    RederiveProgress,
    rederivation_status,
    rederive_ratios,
    submit_upload,
)
from service.core.calibration import (
    EMPTY_TABLE,
    FACTOR_MAX,
    Level,
    Outcome,
    Sample,
    SampleRuns,
    Scope,
    Selection,
    Window,
)
from service.core.errors import UnknownModelError
from service.store.db import create_engine_from_url, create_session_factory
from service.store.keys import KeyScope, create_key
from service.store.migrate import downgrade, upgrade
from service.store.models import (
    ApiKey,
    CalibrationChange,
    CalibrationFactor,
    CalibrationRatio,
    CalibrationUpload,
)
from service.store.repositories import CalibrationRepository, RatioGroup
from tests.store.factories import VERSION, fake_estimate, new_upload, node_key, render

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
LATER = datetime(2026, 12, 1, 12, 5, tzinfo=UTC)
MODELS = ("org/alpha-7b", "org/beta-8b", "org/gamma-13b", "org/delta-3b")
GPUS = ("NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3")
TORCH = ("2.4.1", "2.5.1")
# Each model's true ratio: delta's lies above FACTOR_MAX, so its factor is clamped.
TRUE_RATIO = {"org/alpha-7b": 1.10, "org/beta-8b": 0.95, "org/gamma-13b": 1.15, "org/delta-3b": 1.8}
# Nodes on the H100 measure this much more, so a GPU split appears.
H100_EXTRA = 1.12
NODES = 9


@pytest.fixture
def api_key(session: Session) -> ApiKey:
    """A key for uploads that vote with no others (a model no other node runs)."""
    return create_key(session, scopes=[KeyScope.UPLOAD], name="fleet", now=NOW, nodes=["*"]).key


def _upload(session: Session, api_key: ApiKey, upload: Any, estimate: Any = fake_estimate) -> None:
    """Store `upload` with its node's own key (`api_key` for a node without one)."""
    key = api_key if upload.node_id == "gpu-node-17" else node_key(session, upload.node_id)
    submit_upload(
        session,
        upload,
        api_key_id=key.id,
        idempotency_key=None,
        estimate=estimate,
        factors=EMPTY_TABLE,
        render=render,
        now=lambda: NOW,
    )


def _fleet_round(session: Session, api_key: ApiKey, rng: random.Random, round_no: int) -> None:
    """One round of uploads: every node runs a few jobs of several models and methods, at all
    three levels; one node is rogue, and some runs die of OOM."""
    for node in range(NODES):
        node_id = f"node-{node}"
        gpu = GPUS[node % 2]
        torch = TORCH[(node // 2) % 2]
        for run in range(2):
            model = MODELS[rng.randrange(len(MODELS))]
            ratio = TRUE_RATIO[model] * rng.lognormvariate(0.0, 0.03)
            if gpu == GPUS[1] and model == MODELS[0]:
                ratio *= H100_EXTRA
            if node == NODES - 1:
                ratio *= 3.0  # a node whose measurements no other node shares
            estimate_gib = 10.0
            device_gib = 12.0 * ratio  # the stand-in's device estimate is 12 GiB
            upload = new_upload(
                model=model,
                estimate_gib=estimate_gib,
                device_gib=device_gib,
                allocated_gib=estimate_gib * ratio * rng.uniform(0.97, 1.0),
                reserved_gib=11.0 * ratio,
                node_id=node_id,
                run_id=f"{node_id}-{round_no}-{run}",
                gpu_name=gpu,
                torch=torch,
                outcome=Outcome.OOM if rng.random() < 0.1 else Outcome.COMPLETED,
            )
            if run == 1:
                upload = replace(upload, method="full", job={**upload.job, "method": "full"})
            _upload(session, api_key, upload)


def test_stored_factors_equal_a_full_refit_as_uploads_come_in(
    session: Session, api_key: ApiKey
) -> None:
    rng = random.Random(20261201)
    for round_no in range(6):
        _fleet_round(session, api_key, rng, round_no)
        stored = load_factor_table(session, VERSION)
        assert stored == fit_factor_table(session, VERSION), f"round {round_no}"
    # The data exercised every path of the fit: all scopes, rejection, clamps, OOM runs.
    scopes = {key.scope for key in stored.factors}
    assert {Scope.GLOBAL, Scope.MODEL, Scope.MODEL_GPU} <= scopes
    rogue = node_key(session, f"node-{NODES - 1}").prefix
    assert any(f.rejected_nodes == (rogue,) for f in stored.factors.values())
    assert any(f.clamped and f.ratio == FACTOR_MAX for f in stored.factors.values())
    assert {key.method for key in stored.factors} == {"lora", "full"}
    assert {key.level for key in stored.factors} == set(Level)


def test_a_load_refits_only_the_models_whose_ratios_changed(
    session: Session, api_key: ApiKey
) -> None:
    for node in range(3):
        for method in ("lora", "full"):
            for model in MODELS[:3]:
                upload = new_upload(
                    model=model,
                    node_id=f"n{node}",
                    run_id=f"{method}-{model}-{node}",
                    device_gib=26.4,
                )
                _upload(session, api_key, replace(upload, method=method))
    assert refresh_factors(session, VERSION, now=lambda: NOW) == 2
    assert session.scalar(select(func.count()).select_from(CalibrationChange)) == 0

    _upload(
        session,
        api_key,
        new_upload(model=MODELS[0], node_id="n9", run_id="one-more", device_gib=30.0),
    )
    changes = session.execute(
        select(CalibrationChange.method, CalibrationChange.level, CalibrationChange.model)
    ).all()
    assert [tuple(row) for row in changes] == [("lora", "device", MODELS[0])]
    assert refresh_factors(session, VERSION, now=lambda: LATER) == 1
    fitted = session.execute(
        select(
            CalibrationFactor.method,
            CalibrationFactor.scope,
            CalibrationFactor.model,
            CalibrationFactor.fitted_at,
        ).where(CalibrationFactor.level == "device")
    ).all()
    # The changed model's factor and its partition's global factor were refitted; the other
    # models' and the other method's were left as they were.
    refitted = {(row.method, row.scope, row.model) for row in fitted if row.fitted_at == LATER}
    assert refitted == {("lora", "model", MODELS[0]), ("lora", "global", "")}
    assert len(fitted) == 2 * (1 + 3)
    assert stored_factor_table(session, VERSION) == fit_factor_table(session, VERSION)
    assert refresh_factors(session, VERSION) == 0


def test_stored_factors_equal_a_full_refit_as_one_model_changes(
    session: Session, api_key: ApiKey
) -> None:
    # Rounds of uploads of one model only, after a fleet round of every model: each load
    # refits that model and the global factors, and keeps the others' stored factors. On
    # the older torch the model needs more, so its environments' factors split off.
    rng = random.Random(20261202)
    _fleet_round(session, api_key, rng, 0)
    load_factor_table(session, VERSION)
    model = MODELS[2]
    for round_no in range(1, 5):
        for node in range(NODES - 1):
            torch = TORCH[node % 2]
            for run in range(3):
                ratio = TRUE_RATIO[model] * rng.lognormvariate(0.0, 0.02)
                if torch == TORCH[0]:
                    ratio *= 1.15
                upload = new_upload(
                    model=model,
                    estimate_gib=10.0,
                    device_gib=12.0 * ratio,
                    node_id=f"node-{node}",
                    run_id=f"one-{round_no}-{node}-{run}",
                    gpu_name=GPUS[0],
                    torch=torch,
                    outcome=Outcome.OOM if rng.random() < 0.1 else Outcome.COMPLETED,
                )
                _upload(session, api_key, upload)
        changed = set(session.scalars(select(CalibrationChange.model)))
        assert changed == {model}
        stored = load_factor_table(session, VERSION)
        assert stored == fit_factor_table(session, VERSION), f"round {round_no}"
    # Each torch differs from the model's pooled runs: both environments split off.
    split = {
        (key.model, key.variant) for key in stored.factors if key.scope is Scope.MODEL_ENVIRONMENT
    }
    assert split == {(model, "torch 2.4, cuda 12.4"), (model, "torch 2.5, cuda 12.4")}


def test_a_refit_is_stored_only_while_none_of_its_changes_was_covered_by_another(
    session: Session, api_key: ApiKey
) -> None:
    # Two replicas fit what changed, one after the other upload; whichever stores first
    # wins, the other's fit is dropped, and what it alone saw is refitted by the next load.
    for node in range(3):
        for model in MODELS[:3]:
            upload = new_upload(model=model, node_id=f"n{node}", run_id=f"{model}-{node}")
            _upload(session, api_key, upload)
    load_factor_table(session, VERSION)
    _upload(session, api_key, new_upload(model=MODELS[0], node_id="n7", run_id="a"))
    first = _fit_changed(session, VERSION)
    _upload(session, api_key, new_upload(model=MODELS[1], node_id="n8", run_id="b"))
    second = _fit_changed(session, VERSION)
    assert _store_refit(session, VERSION, first, NOW) == 1
    # The second fit covers the first's change too, which is gone: it is not stored.
    assert _store_refit(session, VERSION, second, LATER) == 0
    changes = session.execute(select(CalibrationChange.model)).scalars().all()
    assert changes == [MODELS[1]]
    assert stored_factor_table(session, VERSION) != fit_factor_table(session, VERSION)
    assert refresh_factors(session, VERSION) == 1
    assert stored_factor_table(session, VERSION) == fit_factor_table(session, VERSION)


def test_the_store_answers_a_fit_s_questions_as_the_runs_in_memory_do(
    session: Session, api_key: ApiKey
) -> None:
    # Odd and even numbers of runs per node, ties, OOM runs, three models: the votes, counts
    # and ranked ratios the database gives equal those of the runs held in memory.
    rng = random.Random(7)
    held: list[tuple[str, Sample]] = []
    for index in range(120):
        model = MODELS[index % 3]
        node = f"node-{rng.randrange(7)}"
        ratio = round(rng.uniform(0.9, 1.3), 2)  # two decimals: many ties
        outcome = Outcome.OOM if rng.random() < 0.2 else Outcome.COMPLETED
        upload = new_upload(
            model=model,
            estimate_gib=10.0,
            device_gib=12.0 * ratio,
            node_id=node,
            run_id=f"run-{index}",
            outcome=outcome,
        )
        _upload(session, api_key, upload)
    for row in session.scalars(select(CalibrationRatio).where(CalibrationRatio.level == "device")):
        # Each ratio's voter is its upload's key.
        key = session.get(ApiKey, row.upload.api_key_id)
        assert key is not None and row.voter == key.prefix
        held.append((row.model, Sample(voter=row.voter, ratio=row.ratio, outcome=row.outcome)))
    group = RatioGroup(estimator_version=VERSION, method="lora", level="device")
    stored = StoredRuns(CalibrationRepository(session), group)
    memory = SampleRuns(held)
    assert stored.votes() == memory.votes()
    assert len({voter for _model, voter in memory.votes()}) == 7

    def voter(node: str) -> str:
        return node_key(session, node).prefix

    selections = [
        Selection(models=frozenset(MODELS[:3]), dropped=frozenset()),
        Selection(models=frozenset(MODELS[:2]), dropped=frozenset({(MODELS[0], voter("node-1"))})),
        Selection(
            models=frozenset({MODELS[2]}),
            dropped=frozenset({(MODELS[2], voter("node-0")), (MODELS[2], voter("node-5"))}),
        ),
    ]
    for selection in selections:
        completed = memory.completed(selection)
        assert stored.completed(selection) == completed > 0
        for bound in (1.0, 1.15, 1.25):
            assert stored.oom_above(selection, bound) == memory.oom_above(selection, bound)
        for rank in (0, 1, completed // 20, completed - 1):
            assert stored.largest(selection, rank) == memory.largest(selection, rank)
            assert stored.largest(selection, rank, Window(oom_above=1.1)) == memory.largest(
                selection, rank, Window(oom_above=1.1)
            )
        for cap in (1.05, 1.15, 1.3):
            assert stored.largest(selection, 0, Window(at_most=cap)) == memory.largest(
                selection, 0, Window(at_most=cap)
            )


# Environments nodes reported before the ratios carried their keys.
OLD_ENVIRONMENTS = ({}, {"torch": "2.4.1"}, {"torch": "2.5.1+cu124", "cuda": "12.4"})


def _insert_key(connection: Connection, prefix: str, scopes: list[str]) -> int:
    """A key as the schema stored keys before they named their nodes."""
    return connection.execute(
        insert(ApiKey).returning(ApiKey.id),
        {
            "prefix": prefix,
            "key_hash": prefix.ljust(64, "0"),
            "name": "",
            "scopes": scopes,
            "created_at": NOW,
        },
    ).scalar_one()


def _insert_ratios(
    connection: Connection,
    ratios: Sequence[float],
    *,
    model: str = "org/alpha-7b",
    one_key: bool = False,
) -> None:
    """One device-level LoRA ratio of `model` per node, each node with its own key (or all
    with one), written as the schema stored them before ratios carried their upload's groups
    and keys their nodes (no factor fitted)."""
    shared = _insert_key(connection, f"one{model[-2:]}", ["upload"]) if one_key else None
    for node, ratio in enumerate(ratios):
        key_id = shared or _insert_key(connection, f"old{node}{model[-2:]}", ["upload"])
        upload_id = connection.execute(
            insert(CalibrationUpload).returning(CalibrationUpload.id),
            {
                "received_at": NOW,
                "api_key_id": key_id,
                "request_hash": "0" * 64,
                "model": model,
                "method": "lora",
                "job": {},
                "gpu_name": GPUS[0],
                "gpu_memory_total_bytes": 80 * 2**30,
                "measured_device_bytes": int(ratio * 2**30),
                "outcome": Outcome.COMPLETED,
                "environment": OLD_ENVIRONMENTS[node % len(OLD_ENVIRONMENTS)],
                "node_id": f"node-{node}",
                "run_id": f"run-{node}",
            },
        ).scalar_one()
        connection.execute(
            insert(CalibrationRatio),
            {
                "upload_id": upload_id,
                "estimator_version": VERSION,
                "level": Level.DEVICE,
                "estimated_bytes": 2**30,
                "ratio": ratio,
                "computed_at": NOW,
            },
        )


def test_the_upgrade_builds_factors_for_ratios_stored_before_it(blank_database_url: str) -> None:
    upgrade(blank_database_url, "6f74beb0cf54")
    engine = create_engine_from_url(blank_database_url)
    try:
        with engine.begin() as connection:
            _insert_ratios(connection, (1.10, 1.12, 1.08))
        upgrade(blank_database_url)
        with create_session_factory(engine).begin() as session:
            table = load_factor_table(session, VERSION)
            assert table != EMPTY_TABLE
            assert table == fit_factor_table(session, VERSION)
            # Each ratio got its upload's groups, the environment's key as the service
            # derives it.
            ratios = session.scalars(select(CalibrationRatio)).all()
            assert len(ratios) == 3
            for row in ratios:
                upload = row.upload
                assert (row.method, row.model, row.gpu_name, row.outcome) == (
                    upload.method,
                    upload.model,
                    upload.gpu_name,
                    upload.outcome,
                )
                assert row.environment_key == environment_key(upload.environment)
                key = session.get(ApiKey, upload.api_key_id)
                assert key is not None and row.voter == key.prefix
                # A key stored before keys named their nodes uploads for any node.
                assert key.nodes == ["*"]
            assert {row.environment_key for row in ratios} == {
                "torch ?, cuda ?",
                "torch 2.4, cuda ?",
                "torch 2.5, cuda 12.4",
            }
    finally:
        engine.dispose()


def _stored_factor(model: str, ratio: float) -> dict[str, Any]:
    """A model's device-level LoRA factor as a refit stores it, three votes behind it."""
    return {
        "estimator_version": VERSION,
        "method": "lora",
        "level": "device",
        "scope": "model",
        "model": model,
        "variant": "",
        "ratio": ratio,
        "upper_multiplier": 1.2,
        "nodes": 3,
        "models": 1,
        "rejected_nodes": [],
        "runs": 3,
        "oom_runs": 0,
        "log_spread": 0.05,
        "clamped": False,
        "fitted_at": NOW,
    }


def test_the_upgrade_counts_one_vote_per_key_and_its_downgrade_one_per_node(
    blank_database_url: str,
) -> None:
    # Three nodes' runs under one key (org/alpha-7b) and under a key each (org/beta-8b).
    upgrade(blank_database_url, "6f74beb0cf54")
    engine = create_engine_from_url(blank_database_url)
    try:
        with engine.begin() as connection:
            _insert_ratios(connection, (0.9, 0.9, 0.9), model="org/alpha-7b", one_key=True)
            _insert_ratios(connection, (1.1, 1.1, 1.1), model="org/beta-8b")
            _insert_key(connection, "admin000", ["admin"])
            _insert_key(connection, "reader00", ["read"])
        upgrade(blank_database_url, "b7d2e4f19a06")
        with engine.begin() as connection:
            # The factor that one vote per node gave org/alpha-7b, stored and refitted.
            connection.execute(delete(CalibrationChange))
            connection.execute(insert(CalibrationFactor), _stored_factor("org/alpha-7b", 0.9))

        upgrade(blank_database_url)
        with create_session_factory(engine).begin() as session:
            table = load_factor_table(session, VERSION)
            assert table == fit_factor_table(session, VERSION)
            assert {key.model for key in table.factors} == {"org/beta-8b"}
            nodes = {key.prefix: key.nodes for key in session.scalars(select(ApiKey))}
            assert nodes["admin000"] == nodes["reader00"] == []
            assert nodes["one7b"] == nodes["old08b"] == ["*"]

        downgrade(blank_database_url, "b7d2e4f19a06")
        with engine.connect() as connection:
            rows = connection.execute(
                text(
                    "SELECT r.node_id, u.node_id FROM calibration_ratio r "
                    "JOIN calibration_upload u ON u.id = r.upload_id"
                )
            ).all()
            assert len(rows) == 6 and all(ratio == upload for ratio, upload in rows)
            assert "nodes" not in {c["name"] for c in inspect(connection).get_columns("api_key")}
        upgrade(blank_database_url)
    finally:
        engine.dispose()


def test_the_upgrade_refits_factors_stored_before_the_shift(blank_database_url: str) -> None:
    # A factor stored at its votes' median (1.10, the earlier fit) is refitted by the first
    # load after the upgrade: the three votes' spread moves the factor toward 1.
    upgrade(blank_database_url, "3c1d9e7a5b20")
    engine = create_engine_from_url(blank_database_url)
    try:
        with engine.begin() as connection:
            _insert_ratios(connection, (1.10, 1.14, 1.06))
            connection.execute(delete(CalibrationChange))
            connection.execute(insert(CalibrationFactor), _stored_factor("org/alpha-7b", 1.10))
        upgrade(blank_database_url)
        with create_session_factory(engine).begin() as session:
            table = load_factor_table(session, VERSION)
            assert table == fit_factor_table(session, VERSION)
            factor = table.lookup(model="org/alpha-7b", method="lora", level=Level.DEVICE)
            assert factor is not None and 1.0 <= factor.factor.ratio < 1.10
    finally:
        engine.dispose()


class Crash(Exception):
    """The job's process dies (raised from the estimator, mid-batch)."""


def test_rederivation_resumes_where_it_stopped_and_reports_progress(
    session: Session, api_key: ApiKey
) -> None:
    for node in range(4):
        for run in range(5):
            upload = new_upload(
                node_id=f"n{node}",
                run_id=f"r{node}-{run}",
                estimate_gib=10.0,
                device_gib=13.2 + 0.1 * run,
            )
            _upload(session, api_key, upload)
    _upload(session, api_key, new_upload(model="unknown/model", run_id="unknown"))
    seen: list[RederiveProgress] = []
    calls = 0

    def estimate_v2(job: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 8:
            raise Crash
        if job.get("model") == "unknown/model":
            raise UnknownModelError("unknown/model")
        estimate = fake_estimate(job, version="test-2")
        return replace(estimate, device_bytes=estimate.device_bytes * 11 // 10)

    with pytest.raises(Crash):
        rederive_ratios(
            session,
            estimate=estimate_v2,
            estimator_version="test-2",
            batch_size=3,
            progress=seen.append,
        )
    session.rollback()  # the process died: what it had not committed is gone
    stopped = rederivation_status(session, "test-2")
    assert stopped is not None and stopped.phase is RederivePhase.DERIVE
    assert stopped.total == 21 and stopped.done == 6 and stopped.derived == 6
    assert [p.done for p in seen] == [3, 6]

    derived = rederive_ratios(
        session,
        estimate=estimate_v2,
        estimator_version="test-2",
        batch_size=3,
        progress=seen.append,
    )
    assert derived == 20
    finished = rederivation_status(session, "test-2")
    assert finished is not None and finished.phase is RederivePhase.FINISHED
    assert finished.done == finished.total == 21 and finished.percent == 100.0
    # Resumed, not restarted: uploads derived before the crash were not estimated again.
    assert calls == 8 + 21 - 6
    assert [p.done for p in seen if p.phase is RederivePhase.DERIVE] == [3, 6, 9, 12, 15, 18, 21]
    assert seen[-1].phase is RederivePhase.FINISHED
    ratios = session.scalars(
        select(CalibrationRatio).where(CalibrationRatio.estimator_version == "test-2")
    ).all()
    assert len(ratios) == len({r.upload_id for r in ratios}) == 20
    # The job built the new version's factors, equal to a full refit.
    table = stored_factor_table(session, "test-2")
    assert table != EMPTY_TABLE and table == fit_factor_table(session, "test-2")
    # Flagged against those factors: none of these ratios is far from its model's.
    assert [r.outlier_reason for r in ratios] == [None] * len(ratios)
