"""POST and GET /v1/calibrations, GET /v1/factors, on SQLite and PostgreSQL: keys and scopes,
idempotent uploads, implausible peaks, listing, and factors reaching estimates."""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import delete, event, func, select

from service.api.app import create_app
from service.api.problems import PROBLEM_MEDIA_TYPE, ProblemType
from service.api.settings import Settings
from service.cli.main import main as vramcast
from service.core.calibration import (
    FACTOR_MAX,
    FACTOR_MIN,
    MIN_NODES,
    UPPER_MULTIPLIER_CEILING,
)
from service.core.estimator import ESTIMATOR_VERSION
from service.store.keys import KeyScope, revoke_key
from service.store.models import CalibrationRatio, CalibrationUpload
from tests.api.conftest import SMALL_JOB, issue_key

A100_DRIVER_NAME = "NVIDIA A100-SXM4-80GB"
A100_BYTES = 85_899_345_920
# Waiting for a replica's factors to reload: an invalidation is acted on at the next tick (1 s).
RELOAD_TIMEOUT_S = 10.0


def estimated_device_bytes(client: TestClient, job: dict[str, Any] = SMALL_JOB) -> int:
    value: int = client.post("/v1/estimates", json=job).json()["estimated"]["device_bytes"]
    return value


def upload_body(
    *,
    device_bytes: int | None,
    node_id: str = "node-1",
    run_id: str = "run-1",
    job: dict[str, Any] = SMALL_JOB,
    **measured: int,
) -> dict[str, Any]:
    levels = {"device_bytes": device_bytes, **measured}
    return {
        "job": job,
        "gpu": {"name": A100_DRIVER_NAME, "memory_total_bytes": A100_BYTES},
        "measured": {name: value for name, value in levels.items() if value is not None},
        "environment": {"torch": "2.5.1+cu124", "cuda": "12.4", "driver": "550.54.15"},
        "node_id": node_id,
        "run_id": run_id,
    }


def bearer(token: str, idempotency_key: str | None = None) -> dict[str, str]:
    headers = {"Authorization": f"Bearer {token}"}
    if idempotency_key is not None:
        headers["Idempotency-Key"] = idempotency_key
    return headers


def problem(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == PROBLEM_MEDIA_TYPE
    body: dict[str, Any] = response.json()
    assert body["status"] == status
    return body


def stored_uploads(app: FastAPI) -> int:
    with app.state.services.sessions() as session:
        count: int = session.scalar(select(func.count()).select_from(CalibrationUpload))
        return count


def reloaded_factors(client: TestClient, app: FastAPI) -> dict[str, Any]:
    """GET /v1/factors once the replica has reloaded its factors with all that is stored.

    Uploads make their replica reload at its next tick (1 s); this one is asked for here, so
    the test knows the reload began after its uploads.
    """
    cache = app.state.services.factor_cache
    since = time.monotonic()
    cache.invalidate()
    deadline = since + RELOAD_TIMEOUT_S
    while (cache.peek().loaded_at or -math.inf) < since and time.monotonic() < deadline:
        time.sleep(0.05)
    factors: dict[str, Any] = client.get("/v1/factors").json()
    return factors


def prefix(token: str) -> str:
    """The prefix of a key's token (`vck_<prefix>_<secret>`): the key's voter id."""
    return token.split("_")[1]


def upload_fleet(
    client: TestClient, app: FastAPI, ratios: dict[str, list[float]], estimate: int
) -> dict[str, str]:
    """Each node's runs, uploaded with a key of its own (made here); returns the tokens."""
    tokens = {node: issue_key(app, KeyScope.UPLOAD, nodes=[node]) for node in ratios}
    for node, node_ratios in ratios.items():
        for index, ratio in enumerate(node_ratios):
            body = upload_body(
                device_bytes=round(estimate * ratio), node_id=node, run_id=f"{node}-{index}"
            )
            response = client.post("/v1/calibrations", json=body, headers=bearer(tokens[node]))
            assert response.status_code == 201, response.text
    return tokens


class TestUpload:
    def test_is_stored_with_a_ratio_per_measured_level(
        self, store_app: FastAPI, store_client: TestClient
    ) -> None:
        token = issue_key(store_app, KeyScope.UPLOAD)
        estimate = estimated_device_bytes(store_client)
        body = upload_body(device_bytes=round(estimate * 1.1), reserved_bytes=round(estimate * 0.9))
        job = {**SMALL_JOB, "model": "qwen/qwen2.5-0.5b"}  # an alias, as a node may send it
        response = store_client.post(
            "/v1/calibrations", json={**body, "job": job}, headers=bearer(token)
        )
        assert response.status_code == 201, response.text
        receipt = response.json()
        assert receipt["model"] == "Qwen/Qwen2.5-0.5B"
        assert receipt["estimator_version"] == ESTIMATOR_VERSION
        assert receipt["estimate_error"] is None
        ratios = {r["level"]: r for r in receipt["ratios"]}
        assert set(ratios) == {"reserved", "device"}
        assert ratios["device"]["estimated_bytes"] == estimate
        assert ratios["device"]["ratio"] == pytest.approx(1.1, rel=1e-6)
        assert ratios["device"]["outlier"] is False and ratios["device"]["factor"] is None

        listed = store_client.get("/v1/calibrations").json()["calibrations"]
        assert [item["id"] for item in listed] == [receipt["id"]]
        stored = listed[0]
        assert stored["job"] == {
            "model": {"id": "qwen/qwen2.5-0.5b"},
            "batch_size": 2,
            "seq_len": 512,
        }
        assert stored["gpu"] == {"name": "A100-80GB", "memory_total_bytes": A100_BYTES}
        assert stored["measured"]["device_bytes"] == round(estimate * 1.1)
        assert stored["measured"]["allocated_bytes"] is None
        assert stored["environment"]["torch"] == "2.5.1+cu124"
        assert {r["level"] for r in stored["ratios"]} == {"reserved", "device"}

    def test_commits_once(self, store_app: FastAPI, store_client: TestClient) -> None:
        token = issue_key(store_app, KeyScope.UPLOAD)
        commits: list[object] = []

        def count(connection: object) -> None:
            commits.append(connection)

        engine = store_app.state.services.engine
        event.listen(engine, "commit", count)
        try:
            response = store_client.post(
                "/v1/calibrations", json=upload_body(device_bytes=10**10), headers=bearer(token)
            )
        finally:
            event.remove(engine, "commit", count)
        assert response.status_code == 201
        assert len(commits) == 1

    def test_needs_a_key_with_the_upload_scope(
        self, store_app: FastAPI, store_client: TestClient
    ) -> None:
        body = upload_body(device_bytes=10**10)
        missing = problem(store_client.post("/v1/calibrations", json=body), 401)
        assert missing["type"] == ProblemType.UNAUTHORIZED
        unknown = store_client.post("/v1/calibrations", json=body, headers=bearer("vck_x_y"))
        assert problem(unknown, 401)["type"] == ProblemType.UNAUTHORIZED
        assert unknown.headers["WWW-Authenticate"].startswith("Bearer")

        reader = issue_key(store_app, KeyScope.READ)
        refused = problem(
            store_client.post("/v1/calibrations", json=body, headers=bearer(reader)), 403
        )
        assert refused["type"] == ProblemType.FORBIDDEN and refused["scope"] == "upload"

        uploader = issue_key(store_app, KeyScope.UPLOAD)
        with store_app.state.services.sessions.begin() as session:
            revoke_key(session, uploader.split("_")[1], now=datetime.now(UTC))
        revoked = store_client.post("/v1/calibrations", json=body, headers=bearer(uploader))
        assert problem(revoked, 401)["detail"] == "the API key is unknown or revoked"

        admin = issue_key(store_app, KeyScope.ADMIN)
        ok = store_client.post("/v1/calibrations", json=body, headers=bearer(admin))
        assert ok.status_code == 201
        assert stored_uploads(store_app) == 1

    def test_a_retry_is_answered_alike_and_stored_once(
        self, store_app: FastAPI, store_client: TestClient
    ) -> None:
        token = issue_key(store_app, KeyScope.UPLOAD)
        body = upload_body(device_bytes=10**10)
        first = store_client.post("/v1/calibrations", json=body, headers=bearer(token, "run-1"))
        again = store_client.post("/v1/calibrations", json=body, headers=bearer(token, "run-1"))
        assert first.status_code == 201 and "Idempotent-Replayed" not in first.headers
        assert again.status_code == 200 and again.headers["Idempotent-Replayed"] == "true"
        assert again.json() == first.json()
        assert stored_uploads(store_app) == 1

        other = upload_body(device_bytes=10**10 + 1)
        reused = store_client.post("/v1/calibrations", json=other, headers=bearer(token, "run-1"))
        errors = problem(reused, 422)["errors"]
        assert errors[0]["loc"] == ["header", "Idempotency-Key"]
        assert errors[0]["type"] == "idempotency_key_reused"
        # Keys are per API key: another key's "run-1" is another upload.
        second = issue_key(store_app, KeyScope.UPLOAD)
        assert (
            store_client.post(
                "/v1/calibrations", json=other, headers=bearer(second, "run-1")
            ).status_code
            == 201
        )
        assert stored_uploads(store_app) == 2

    @pytest.mark.parametrize(
        ("measured", "loc"),
        [
            ({"device_bytes": A100_BYTES + 1}, ["body", "measured", "device_bytes"]),
            (
                {"allocated_bytes": 20 * 2**30, "reserved_bytes": 10 * 2**30},
                ["body", "measured", "allocated_bytes"],
            ),
            ({}, ["body", "measured"]),
        ],
    )
    def test_implausible_peaks_are_422_naming_the_field(
        self,
        store_app: FastAPI,
        store_client: TestClient,
        measured: dict[str, int],
        loc: list[str],
    ) -> None:
        token = issue_key(store_app, KeyScope.UPLOAD)
        body = {**upload_body(device_bytes=None), "measured": measured}
        errors = problem(
            store_client.post("/v1/calibrations", json=body, headers=bearer(token)), 422
        )["errors"]
        assert errors[0]["loc"] == loc
        assert errors[0]["type"] == "implausible_measurement"
        assert stored_uploads(store_app) == 0

    def test_a_job_the_estimator_cannot_handle_is_kept_without_ratios(
        self, store_app: FastAPI, store_client: TestClient
    ) -> None:
        token = issue_key(store_app, KeyScope.UPLOAD)
        job = {**SMALL_JOB, "model": "acme/unreleased-7b"}
        response = store_client.post(
            "/v1/calibrations",
            json=upload_body(device_bytes=10**10, job=job),
            headers=bearer(token),
        )
        assert response.status_code == 201, response.text
        receipt = response.json()
        assert receipt["model"] == "acme/unreleased-7b"
        assert receipt["ratios"] == [] and receipt["estimator_version"] is None
        assert "unknown model" in receipt["estimate_error"]


class TestListing:
    def test_pages_newest_first_and_filters(
        self, store_app: FastAPI, store_client: TestClient
    ) -> None:
        token = issue_key(store_app, KeyScope.UPLOAD)
        for index in range(5):
            body = upload_body(
                device_bytes=10**10 + index, node_id=f"node-{index % 2}", run_id=f"run-{index}"
            )
            assert (
                store_client.post("/v1/calibrations", json=body, headers=bearer(token)).status_code
                == 201
            )

        seen: list[str] = []
        cursor: str | None = None
        while True:
            params: dict[str, Any] = {"limit": 2, **({"cursor": cursor} if cursor else {})}
            page = store_client.get("/v1/calibrations", params=params).json()
            seen += [item["run_id"] for item in page["calibrations"]]
            cursor = page["next_cursor"]
            if cursor is None:
                break
        assert seen == [f"run-{index}" for index in reversed(range(5))]

        def runs(**params: Any) -> list[str]:
            response = store_client.get("/v1/calibrations", params=params)
            assert response.status_code == 200, response.text
            return [item["run_id"] for item in response.json()["calibrations"]]

        assert runs(node_id="node-1") == ["run-3", "run-1"]
        assert len(runs(model="qwen2.5-0.5b")) == 5  # an alias finds the catalog id
        assert runs(model="Qwen/Qwen2.5-7B") == []
        future = datetime.now(UTC) + timedelta(hours=1)
        assert runs(since=future.isoformat()) == []
        past = datetime.now(UTC) - timedelta(hours=1)
        assert len(runs(since=past.isoformat())) == 5

    @pytest.mark.parametrize(
        ("params", "loc"),
        [
            ({"cursor": "bm90LWEtY3Vyc29y"}, ["query", "cursor"]),
            ({"since": "2026-11-29T12:00:00"}, ["query", "since"]),
            ({"since": "0001-01-01T00:00:00+00:01"}, ["query", "since"]),
            ({"since": "9999-12-31T23:59:00-00:01"}, ["query", "since"]),
            ({"limit": 0}, ["query", "limit"]),
            ({"page": 2}, ["query", "page"]),
        ],
    )
    def test_refuses_what_it_did_not_issue(
        self, store_client: TestClient, params: dict[str, Any], loc: list[str]
    ) -> None:
        response = store_client.get("/v1/calibrations", params=params)
        assert problem(response, 422)["errors"][0]["loc"] == loc


class TestFactors:
    def test_three_nodes_calibrate_estimates_and_fit_checks(
        self, store_app: FastAPI, store_client: TestClient
    ) -> None:
        estimate = estimated_device_bytes(store_client)
        upload_fleet(
            store_client,
            store_app,
            {"node-a": [1.19, 1.21], "node-b": [1.2], "node-c": [1.2, 1.22, 1.18]},
            estimate,
        )
        table = reloaded_factors(store_client, store_app)
        assert table["state"] == "fresh" and table["estimator_version"] == ESTIMATOR_VERSION
        model = next(
            f for f in table["factors"] if f["scope"] == "model" and f["level"] == "device"
        )
        assert model["model"] == "Qwen/Qwen2.5-0.5B" and model["method"] == "lora"
        assert model["ratio"] == pytest.approx(1.2, rel=1e-3) and model["runs"] == 6

        job = {**SMALL_JOB, "gpu": "A100-80GB"}
        body = store_client.post("/v1/estimates", json=job).json()
        calibration = body["calibration"]
        assert calibration["applied"] is True and calibration["state"] == "fresh"
        assert calibration["scope"] == "model" and calibration["nodes"] == MIN_NODES
        assert calibration["factor"] == pytest.approx(model["ratio"])
        assert calibration["levels"] == [
            {
                "level": "device",
                "scope": "model",
                "factor": model["ratio"],
                "nodes": MIN_NODES,
                "samples": 6,
                "models": 1,
            }
        ]
        # the factor scales this job's own estimate (the A100's row, not the upload's)
        own = body["estimated"]["device_bytes"]
        assert body["peak"]["device_bytes"] == math.ceil(own * model["ratio"])
        fit = store_client.post("/v1/fit-checks", json={"job": SMALL_JOB, "gpus": ["L4"]}).json()
        assert fit["job"]["calibration"] == calibration
        # a fit-check weighs every GPU by the unnamed-GPU row, as an estimate without `gpu`
        plain = store_client.post("/v1/estimates", json=SMALL_JOB).json()
        [result] = fit["results"]
        assert result["required_bytes"] == plain["peak"]["device_bytes_upper"]

        # and so do its curves: the largest sequence fits, one token more does not
        def bound(seq_len: int) -> int:
            job = {**SMALL_JOB, "seq_len": seq_len}
            answer = store_client.post("/v1/estimates", json=job).json()
            assert answer["calibration"] == calibration
            upper: int = answer["peak"]["device_bytes_upper"]
            return upper

        longest = result["max_seq_len"]
        assert bound(longest) <= result["usable_bytes"] < bound(longest + 1)

    def test_a_node_uploading_a_thousand_absurd_values_moves_no_factor_beyond_its_clamp(
        self, store_app: FastAPI, store_client: TestClient
    ) -> None:
        estimate = estimated_device_bytes(store_client)
        honest = {f"node-{index}": [1.05] for index in range(MIN_NODES)}
        upload_fleet(store_client, store_app, honest, estimate)
        before = reloaded_factors(store_client, store_app)
        # Possible (under the GPU's total), but no real run of this job measures them.
        absurd = A100_BYTES
        assert absurd / estimate > 5 * FACTOR_MAX
        rogue = upload_fleet(
            store_client, store_app, {"rogue": [absurd / estimate] * 1000}, estimate
        )["rogue"]
        listed = store_client.get("/v1/calibrations", params={"node_id": "rogue", "limit": 1})
        assert listed.json()["calibrations"][0]["ratios"][0]["outlier_reason"]

        after = reloaded_factors(store_client, store_app)
        for factor in after["factors"]:
            assert FACTOR_MIN <= factor["ratio"] <= FACTOR_MAX
            assert factor["upper_multiplier"] <= UPPER_MULTIPLIER_CEILING
            assert factor["rejected_nodes"] == [prefix(rogue)]
        assert [f["ratio"] for f in after["factors"]] == [f["ratio"] for f in before["factors"]]

        body = store_client.post("/v1/estimates", json=SMALL_JOB).json()
        assert body["peak"]["device_bytes"] <= math.ceil(estimate * FACTOR_MAX)
        assert body["calibration"]["factor"] == pytest.approx(1.05, rel=1e-6)


class TestReadKeys:
    def test_reads_need_a_read_key_by_default(self, database_url: str) -> None:
        app = create_app(Settings(database_url=database_url))
        with TestClient(app) as client:
            reader = issue_key(app, KeyScope.READ)
            uploader = issue_key(app, KeyScope.UPLOAD)
            for path in ("/v1/calibrations", "/v1/factors"):
                assert problem(client.get(path), 401)["type"] == ProblemType.UNAUTHORIZED
                assert problem(client.get(path, headers=bearer(uploader)), 403)["scope"] == "read"
                assert client.get(path, headers=bearer(reader)).status_code == 200
            assert client.post("/v1/estimates", json=SMALL_JOB).status_code == 200

    def test_require_read_key_false_opens_them(
        self, database_url: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("VRAMCAST_REQUIRE_READ_KEY", "false")
        with TestClient(create_app(Settings(database_url=database_url))) as client:
            assert client.get("/v1/calibrations").status_code == 200
            assert client.get("/v1/factors").status_code == 200


def test_vramcast_db_rederive_derives_what_a_version_lacks(
    store_app: FastAPI,
    store_client: TestClient,
    database_url: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    token = issue_key(store_app, KeyScope.UPLOAD)
    for index in range(2):
        body = upload_body(device_bytes=10**10 + index, run_id=f"run-{index}")
        assert (
            store_client.post("/v1/calibrations", json=body, headers=bearer(token)).status_code
            == 201
        )
    unknown = upload_body(device_bytes=10**10, job={**SMALL_JOB, "model": "acme/unreleased-7b"})
    assert (
        store_client.post("/v1/calibrations", json=unknown, headers=bearer(token)).status_code
        == 201
    )
    # As if the uploads had come in under an older estimator.
    with store_app.state.services.sessions.begin() as session:
        session.execute(delete(CalibrationRatio))

    assert vramcast(["db", "rederive", "--database-url", database_url]) == 0
    assert (
        capsys.readouterr().out
        == f"derived ratios of 2 uploads for estimator {ESTIMATOR_VERSION}\n"
    )
    listed = store_client.get("/v1/calibrations").json()["calibrations"]
    assert [len(item["ratios"]) for item in listed] == [0, 1, 1]
    assert vramcast(["db", "rederive", "--database-url", database_url]) == 0
    assert capsys.readouterr().out.startswith("derived ratios of 0 uploads")
