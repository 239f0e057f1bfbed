"""Votes belong to keys, over HTTP on SQLite and PostgreSQL.

One upload key naming three invented node ids moves no estimate, no safe bound and no
fit-check, however far its peaks lie from the estimates; three keys may move the bounds, but
never below the device peaks that support them. A key uploads only for its nodes, and an
operator lists keys with their uploads, revokes them and purges their uploads.
"""

from __future__ import annotations

import base64
import math
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from service.api.problems import ProblemType
from service.calibration.factors import fit_factor_table, stored_factor_table
from service.core.calibration import UPPER_MULTIPLIER_CEILING
from service.core.estimator import ESTIMATOR_VERSION
from service.store.keys import KeyScope
from tests.api.conftest import issue_key
from tests.api.test_calibrations import (
    A100_BYTES,
    A100_DRIVER_NAME,
    bearer,
    prefix,
    problem,
    reloaded_factors,
    stored_uploads,
)

# Three small models the uploads name, and one they do not.
UPLOADED = ("Qwen/Qwen2.5-0.5B", "microsoft/phi-2", "Qwen/Qwen2.5-1.5B")
OTHER = "mistralai/Mistral-7B-v0.1"
NODES = ("invented-1", "invented-2", "invented-3")
RUNS_PER_NODE = 2  # 3 models x 3 node ids x 2 runs: eighteen uploads
# Far below and far above the estimate, as no real run measures.
FAR = (0.001, 3.0)
FIT_GPUS = ["A100-80GB", "L4", "RTX4090"]


def job(model: str) -> dict[str, Any]:
    return {"model": model, "batch_size": 2, "seq_len": 512}


def answers(client: TestClient) -> dict[str, bytes]:
    """The estimate and the fit-check answer of each model's job, as sent."""
    found = {}
    for model in (*UPLOADED, OTHER):
        estimate = client.post("/v1/estimates", json=job(model))
        fit = client.post("/v1/fit-checks", json={"job": job(model), "gpus": FIT_GPUS})
        assert estimate.status_code == fit.status_code == 200, (estimate.text, fit.text)
        found[f"estimate {model}"] = estimate.content
        found[f"fit-check {model}"] = fit.content
    return found


def upload_far_peaks(client: TestClient, tokens: dict[str, str], far: float) -> dict[str, int]:
    """Every node's runs of every uploaded model's job at `far` times its device estimate,
    each with the node's token; returns the device peak uploaded per model."""
    peaks = {}
    for model in UPLOADED:
        estimated = client.post("/v1/estimates", json=job(model)).json()["estimated"]
        peaks[model] = peak = max(1, round(estimated["device_bytes"] * far))
        for node in NODES:
            for run in range(RUNS_PER_NODE):
                body = {
                    "job": job(model),
                    "gpu": {"name": A100_DRIVER_NAME, "memory_total_bytes": A100_BYTES},
                    "measured": {"device_bytes": peak},
                    "node_id": node,
                    "run_id": f"{node}-{model}-{run}",
                }
                response = client.post("/v1/calibrations", json=body, headers=bearer(tokens[node]))
                assert response.status_code == 201, response.text
    return peaks


@pytest.mark.parametrize("far", FAR)
def test_one_key_under_three_node_ids_moves_nothing(
    store_app: FastAPI, store_client: TestClient, far: float
) -> None:
    reloaded_factors(store_client, store_app)
    before = answers(store_client)
    token = issue_key(store_app, KeyScope.UPLOAD, nodes=["invented-*"])
    upload_far_peaks(store_client, dict.fromkeys(NODES, token), far)
    assert stored_uploads(store_app) == len(UPLOADED) * len(NODES) * RUNS_PER_NODE

    assert reloaded_factors(store_client, store_app)["factors"] == []
    for model in (*UPLOADED, OTHER):
        answer = store_client.post("/v1/estimates", json=job(model)).json()
        assert answer["peak"]["device_bytes_upper"] >= answer["estimated"]["device_bytes"]
        assert answer["calibration"]["applied"] is False
    # The model nobody uploaded for answers byte for byte as before, and so does every
    # fit-check (and every estimate).
    assert answers(store_client) == before


@pytest.mark.parametrize("far", FAR)
def test_three_keys_move_bounds_but_never_below_the_peaks_behind_them(
    store_app: FastAPI, store_client: TestClient, far: float
) -> None:
    reloaded_factors(store_client, store_app)
    before = {
        model: store_client.post("/v1/estimates", json=job(model)).json()
        for model in (*UPLOADED, OTHER)
    }
    tokens = {node: issue_key(store_app, KeyScope.UPLOAD, nodes=[node]) for node in NODES}
    peaks = upload_far_peaks(store_client, tokens, far)

    factors = reloaded_factors(store_client, store_app)["factors"]
    assert {(f["scope"], f["nodes"]) for f in factors} == {("model", 3), ("global", 3)}
    for model in (*UPLOADED, OTHER):
        answer = store_client.post("/v1/estimates", json=job(model)).json()
        peak, calibration = answer["peak"], answer["calibration"]
        assert calibration["scope"] == ("model" if model in UPLOADED else "global")
        # The bound is the calibrated device level times the factor's multiplier, whose
        # ratio over the estimate rises past the clamps' ceiling only to a supporting run.
        multiplier = calibration["upper_multiplier"]
        upper = peak["device_bytes_upper"]
        assert upper == max(math.ceil(peak["device_bytes"] * multiplier), peak["device_bytes"])
        ceiling = max(UPPER_MULTIPLIER_CEILING, far)
        assert calibration["factor"] * multiplier <= ceiling * (1 + 1e-12)
        assert upper != before[model]["peak"]["device_bytes_upper"]
        if model in UPLOADED:
            # Never below the device peaks that support it.
            assert upper >= peaks[model]


def test_a_key_uploads_only_for_its_nodes(store_app: FastAPI, store_client: TestClient) -> None:
    token = issue_key(store_app, KeyScope.UPLOAD, nodes=["gpu-node-*"])
    body = {
        "job": job(UPLOADED[0]),
        "gpu": {"name": A100_DRIVER_NAME, "memory_total_bytes": A100_BYTES},
        "measured": {"device_bytes": 6 * 2**30},
        "node_id": "gpu-node-7",
        "run_id": "r1",
    }
    assert (
        store_client.post("/v1/calibrations", json=body, headers=bearer(token)).status_code == 201
    )
    other = {**body, "node_id": "login-1"}
    refused = problem(store_client.post("/v1/calibrations", json=other, headers=bearer(token)), 403)
    assert refused["type"] == ProblemType.NODE_NOT_ALLOWED
    assert refused["node_id"] == "login-1" and "node_id 'login-1'" in refused["detail"]
    assert stored_uploads(store_app) == 1
    # An admin key uploads for any node id.
    admin = issue_key(store_app, KeyScope.ADMIN)
    assert (
        store_client.post("/v1/calibrations", json=other, headers=bearer(admin)).status_code == 201
    )


def test_operators_list_revoke_and_purge_keys(store_app: FastAPI, store_client: TestClient) -> None:
    admin = issue_key(store_app, KeyScope.ADMIN)
    tokens = {node: issue_key(store_app, KeyScope.UPLOAD, nodes=[node]) for node in NODES}
    extra = issue_key(store_app, KeyScope.UPLOAD, nodes=["invented-4"])
    tokens_all = {**tokens, "invented-4": extra}
    for index, (node, token) in enumerate(tokens_all.items()):
        for model in UPLOADED:
            estimated = store_client.post("/v1/estimates", json=job(model)).json()["estimated"]
            body = {
                "job": job(model),
                "gpu": {"name": A100_DRIVER_NAME, "memory_total_bytes": A100_BYTES},
                "measured": {"device_bytes": round(estimated["device_bytes"] * (1.1 + index / 50))},
                "node_id": node,
                "run_id": f"{node}-{model}",
            }
            response = store_client.post("/v1/calibrations", json=body, headers=bearer(token))
            assert response.status_code == 201, response.text

    assert problem(store_client.get("/v1/keys"), 401)["type"] == ProblemType.UNAUTHORIZED
    assert problem(store_client.get("/v1/keys", headers=bearer(extra)), 403)["scope"] == "admin"
    listed = store_client.get("/v1/keys", headers=bearer(admin))
    assert listed.status_code == 200, listed.text
    keys = {key["prefix"]: key for key in listed.json()["keys"]}
    assert keys[prefix(admin)]["uploads"] == 0 and keys[prefix(admin)]["nodes"] == []
    assert keys[prefix(extra)]["uploads"] == len(UPLOADED)
    assert keys[prefix(extra)]["nodes"] == ["invented-4"]
    assert keys[prefix(extra)]["scopes"] == ["upload"]
    assert keys[prefix(extra)]["last_upload_at"] is not None
    assert "vck_" not in listed.text

    before = reloaded_factors(store_client, store_app)["factors"]
    assert {f["nodes"] for f in before} == {4}
    path = f"/v1/keys/{prefix(extra)}"
    purged = store_client.delete(path, params={"purge": "true"}, headers=bearer(admin))
    assert purged.status_code == 200, purged.text
    assert purged.json()["purge"] == {"uploads": 3, "ratios": 3, "refitted": 1}
    with store_app.state.services.sessions() as session:
        stored = stored_factor_table(session, ESTIMATOR_VERSION)
        assert stored == fit_factor_table(session, ESTIMATOR_VERSION)
    assert {f["nodes"] for f in reloaded_factors(store_client, store_app)["factors"]} == {3}
    assert store_client.get("/v1/keys", headers=bearer(admin)).json()["keys"][-1]["prefix"] != (
        prefix(extra)
    )
    everything = store_client.get("/v1/keys", params={"all": "true"}, headers=bearer(admin))
    revoked = {key["prefix"]: key for key in everything.json()["keys"]}[prefix(extra)]
    assert revoked["revoked_at"] is not None and revoked["uploads"] == 0
    refused = store_client.post("/v1/calibrations", json={}, headers=bearer(extra))
    assert problem(refused, 401)["type"] == ProblemType.UNAUTHORIZED

    # Revoking without a purge keeps the uploads; again, it changes nothing.
    kept = f"/v1/keys/{prefix(tokens['invented-1'])}"
    for _ in range(2):
        again = store_client.delete(kept, headers=bearer(admin))
        assert again.status_code == 200 and again.json()["purge"] is None
    assert stored_uploads(store_app) == 3 * len(UPLOADED)
    missing = problem(store_client.delete("/v1/keys/0000ffff", headers=bearer(admin)), 404)
    assert "0000ffff" in missing["detail"]
    malformed = problem(store_client.delete("/v1/keys/NOT-A-KEY", headers=bearer(admin)), 422)
    assert malformed["errors"][0]["loc"] == ["path", "prefix"]


def test_a_retry_that_writes_out_defaults_is_replayed(
    store_app: FastAPI, store_client: TestClient
) -> None:
    from service.api.schemas import JobSpec
    from service.core.codec import spec_to_dict

    token = issue_key(store_app, KeyScope.UPLOAD)
    sent = job(UPLOADED[0])
    body = {
        "job": sent,
        "gpu": {"name": A100_DRIVER_NAME, "memory_total_bytes": A100_BYTES},
        "measured": {"device_bytes": 6 * 2**30},
        "environment": {"torch": "2.5.1+cu124"},
        "node_id": "n1",
        "run_id": "r1",
    }
    first = store_client.post("/v1/calibrations", json=body, headers=bearer(token, "k"))
    assert first.status_code == 201, first.text
    # Every default written out (the spec as the codec writes it), the order changed, and
    # the environment's unknowns sent as null.
    spec = JobSpec.model_validate(sent).to_spec()
    spelled_out = {**spec_to_dict(spec), "model": sent["model"]}
    assert JobSpec.model_validate(spelled_out).to_spec() == spec and spelled_out != sent
    retry = {
        **body,
        "job": spelled_out,
        "environment": {"cuda": None, "torch": "2.5.1+cu124"},
        "outcome": "completed",
    }
    again = store_client.post("/v1/calibrations", json=retry, headers=bearer(token, "k"))
    assert again.status_code == 200, again.text
    assert again.headers["Idempotent-Replayed"] == "true" and again.json() == first.json()
    assert stored_uploads(store_app) == 1
    # The upload is stored as it was first sent.
    [stored] = store_client.get("/v1/calibrations").json()["calibrations"]
    assert stored["job"] == {"model": {"id": sent["model"]}, "batch_size": 2, "seq_len": 512}
    # A retry that means another job is refused.
    other = {**retry, "job": {**spelled_out, "batch_size": 3}}
    reused = store_client.post("/v1/calibrations", json=other, headers=bearer(token, "k"))
    assert problem(reused, 422)["errors"][0]["type"] == "idempotency_key_reused"


@pytest.mark.parametrize("number", ["1" + "0" * 29, str(2**63)])
def test_a_cursor_beyond_the_id_column_is_a_422(store_client: TestClient, number: str) -> None:
    cursor = base64.urlsafe_b64encode(f"before:{number}".encode()).decode().rstrip("=")
    response = store_client.get("/v1/calibrations", params={"cursor": cursor})
    assert problem(response, 422)["errors"][0]["loc"] == ["query", "cursor"]
