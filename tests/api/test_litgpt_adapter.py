"""POST /v1/estimates with LitGPT's adapters: accepted under framework 'litgpt', a 422 naming
`method` under any other."""

from __future__ import annotations

from fastapi.testclient import TestClient

STABLELM = "stabilityai/stablelm-base-alpha-3b"


def test_api_accepts_the_methods_for_litgpt_and_422s_others(client: TestClient) -> None:
    job = {"model": STABLELM, "batch_size": 1, "seq_len": 256, "method": "llama-adapter-v2"}
    response = client.post("/v1/estimates", json={**job, "framework": "litgpt"})
    assert response.status_code == 200, response.text
    assert response.json()["params"]["trainable"] == 2_125_248
    response = client.post("/v1/estimates", json=job)
    assert response.status_code == 422
    assert [e["loc"] for e in response.json()["errors"]] == [["body", "method"]]
