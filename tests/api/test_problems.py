"""Every error is RFC 9457 problem+json: 413 over the limit, plain HTTP errors, no tracebacks."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from service.api.app import create_app
from service.api.problems import PROBLEM_MEDIA_TYPE, ProblemType
from service.api.settings import Settings
from service.calibration.provider import AppliedCalibration, CalibratedPeaks, FactorProvider
from service.core.result import Estimate
from tests.api.conftest import SMALL_JOB, make_app

LIMIT = 4096


def _padded(size: int) -> bytes:
    body = json.dumps({**SMALL_JOB, "lora": {"modules_to_save": ["x" * 100] * (size // 100)}})
    return body.encode()


def test_default_limit_is_one_mib() -> None:
    assert Settings(database_url="sqlite://").max_body_bytes == 1024 * 1024


def test_declared_body_over_the_limit_is_413() -> None:
    with TestClient(make_app(max_body_bytes=LIMIT)) as client:
        response = client.post(
            "/v1/estimates",
            content=_padded(2 * LIMIT),
            headers={"content-type": "application/json"},
        )
    assert response.status_code == 413
    assert response.headers["content-type"] == PROBLEM_MEDIA_TYPE
    body = response.json()
    assert body["type"] == ProblemType.BODY_TOO_LARGE
    assert body["max_body_bytes"] == LIMIT


def test_streamed_body_over_the_limit_is_413() -> None:
    def chunks() -> Iterator[bytes]:
        data = _padded(4 * LIMIT)
        for start in range(0, len(data), 1000):
            yield data[start : start + 1000]

    with TestClient(make_app(max_body_bytes=LIMIT)) as client:
        response = client.post(
            "/v1/estimates", content=chunks(), headers={"content-type": "application/json"}
        )
    assert response.status_code == 413
    assert response.json()["type"] == ProblemType.BODY_TOO_LARGE


def test_body_under_the_limit_passes() -> None:
    with TestClient(make_app(max_body_bytes=LIMIT)) as client:
        response = client.post("/v1/estimates", json=SMALL_JOB)
    assert response.status_code == 200


def test_413_is_counted_in_metrics() -> None:
    with TestClient(make_app(max_body_bytes=LIMIT)) as client:
        client.post("/v1/estimates", content=_padded(2 * LIMIT))
        text = client.get("/metrics").text
    assert 'status="413"' in text


def test_unknown_path_is_a_404_problem(client: TestClient) -> None:
    response = client.get("/v2/nothing")
    assert response.status_code == 404
    assert response.headers["content-type"] == PROBLEM_MEDIA_TYPE
    assert response.json() == {
        "type": "about:blank",
        "title": "Not Found",
        "status": 404,
        "detail": "Not Found",
        "instance": "/v2/nothing",
    }


def test_wrong_method_is_a_405_problem_with_allow(client: TestClient) -> None:
    response = client.get("/v1/estimates")
    assert response.status_code == 405
    assert response.headers["content-type"] == PROBLEM_MEDIA_TYPE
    assert response.headers["allow"] == "POST"


class _Broken(FactorProvider):
    def peaks(
        self, estimate: Estimate, *, model: str, method: str, gpu: str | None
    ) -> CalibratedPeaks:
        raise RuntimeError("secret internals")

    def generation(self) -> object:
        return self


def test_a_bug_is_a_500_problem_without_a_traceback(caplog: pytest.LogCaptureFixture) -> None:
    app = create_app(Settings(database_url="sqlite://"), factor_provider=_Broken())
    with TestClient(app, raise_server_exceptions=False) as client:
        response = client.post("/v1/estimates", json=SMALL_JOB, headers={"X-Request-ID": "r-500"})
    assert response.status_code == 500
    assert response.headers["content-type"] == PROBLEM_MEDIA_TYPE
    assert response.json()["type"] == ProblemType.INTERNAL_ERROR
    assert "secret" not in response.text and "Traceback" not in response.text
    # The log has the traceback, under the id the answer carries.
    assert response.headers["X-Request-ID"] == "r-500"
    [logged] = [r for r in caplog.records if r.name == "service.api.problems"]
    assert "(request r-500)" in logged.getMessage()
    assert logged.exc_info is not None


def test_the_factor_provider_is_the_calibration_seam() -> None:
    class Doubled(FactorProvider):
        def peaks(
            self, estimate: Estimate, *, model: str, method: str, gpu: str | None
        ) -> CalibratedPeaks:
            return CalibratedPeaks(
                allocated_bytes=estimate.allocated_bytes,
                reserved_bytes=estimate.reserved_bytes,
                device_bytes=estimate.device_bytes * 2,
                device_bytes_upper=estimate.device_bytes_upper * 2,
                calibration=AppliedCalibration(
                    applied=True,
                    scope="model",
                    factor=2.0,
                    upper_multiplier=1.1,
                    nodes=3,
                    samples=9,
                ),
            )

        def generation(self) -> object:
            return self

    app = create_app(Settings(database_url="sqlite://"), factor_provider=Doubled())
    with TestClient(app) as client:
        body = client.post("/v1/estimates", json=SMALL_JOB).json()
        fit = client.post("/v1/fit-checks", json={"job": SMALL_JOB, "gpus": ["L4"]}).json()
    assert body["peak"]["device_bytes_upper"] == 2 * body["estimated"]["device_bytes_upper"]
    assert body["calibration"]["applied"] is True and body["calibration"]["scope"] == "model"
    assert fit["results"][0]["required_bytes"] == body["peak"]["device_bytes_upper"]
