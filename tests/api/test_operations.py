"""GET /livez, /readyz, /metrics."""

from __future__ import annotations

from dataclasses import replace

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from service.store.db import create_engine_from_url
from tests.api.conftest import SMALL_JOB, make_app


def test_livez(client: TestClient) -> None:
    response = client.get("/livez")
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "checks": {}}


def test_readyz_checks_catalogs_and_database(client: TestClient) -> None:
    response = client.get("/readyz")
    assert response.status_code == 200
    assert response.json() == {
        "status": "ok",
        "checks": {"models": True, "gpus": True, "database": True, "writes": True, "factors": True},
        "reasons": {},
    }


def test_readyz_is_503_when_the_database_is_down() -> None:
    app = make_app()
    unreachable = create_engine_from_url("postgresql+psycopg://nobody:x@127.0.0.1:1/none")
    app.state.services = replace(app.state.services, engine=unreachable)
    with TestClient(app) as client:
        response = client.get("/readyz")
    assert response.status_code == 503
    assert response.json()["status"] == "unavailable"
    assert response.json()["checks"]["database"] is False
    assert response.json()["reasons"]["database"].startswith("the database cannot be reached")


def _sample(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def test_metrics_count_requests_per_route_and_estimates_per_model(client: TestClient) -> None:
    for _ in range(3):
        client.post("/v1/estimates", json=SMALL_JOB)
    client.post("/v1/estimates", json={**SMALL_JOB, "model": "nope/nothing"})
    client.get("/v1/models/Qwen/Qwen2.5-7B")
    client.get("/no/such/path")
    client.post("/v1/estimates:batch", json={"jobs": [SMALL_JOB, SMALL_JOB]})
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    requests = "vramcast_http_requests_total"
    assert _sample(text, requests, route="/v1/estimates", status="200", method="POST") == 3
    assert _sample(text, requests, route="/v1/estimates", status="404", method="POST") == 1
    assert _sample(text, requests, route="/v1/models/{model_id:path}", status="200") == 1
    assert _sample(text, requests, route="unmatched", status="404") == 1
    assert _sample(text, "vramcast_estimates_total", model="Qwen/Qwen2.5-0.5B") == 5
    latency = "vramcast_http_request_duration_seconds_count"
    assert _sample(text, latency, route="/v1/estimates", method="POST") == 4


def test_apps_do_not_share_metrics() -> None:
    with TestClient(make_app()) as first, TestClient(make_app()) as second:
        first.post("/v1/estimates", json=SMALL_JOB)
        text = second.get("/metrics").text
    assert _sample(text, "vramcast_estimates_total", model="Qwen/Qwen2.5-0.5B") == 0
