"""VramcastClient and AsyncVramcastClient against the real service on loopback, and retries
against a flaky server in front of it."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import uuid
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from tests.client.conftest import (
    SMALL_JOB,
    FlakyFactory,
    Service,
    free_port,
)
from vramcast_client import (
    AsyncVramcastClient,
    AuthenticationError,
    InvalidRequestError,
    Job,
    NotFoundError,
    RetryPolicy,
    ServerError,
    ServiceUnreachableError,
    UnexpectedResponseError,
    VramcastClient,
)
from vramcast_client.models import GpuOffer, Lora
from vramcast_client.retry import retry_after_s

FAST = RetryPolicy(attempts=3, backoff_s=0.01, max_backoff_s=0.05)


def upload_body(run_id: str) -> dict[str, Any]:
    return {
        "job": SMALL_JOB,
        "gpu": {"name": "NVIDIA A100-SXM4-80GB", "memory_total_bytes": 85_899_345_920},
        "measured": {"allocated_bytes": 6 * 1024**3, "reserved_bytes": 7 * 1024**3},
        "outcome": "completed",
        "environment": {"torch": "2.5.1", "cuda": "12.4", "world_size": 1},
        "node_id": "gpu-node-17",
        "run_id": run_id,
    }


# The service's answers, typed ---------------------------------------------------------------


def test_estimate_is_typed_and_matches_the_raw_answer(service: Service) -> None:
    job = Job(model="Qwen/Qwen2.5-0.5B", batch_size=2, seq_len=512, lora=Lora(r=16))
    with VramcastClient(service.url) as client:
        estimate = client.estimate(job)
    raw = httpx.post(f"{service.url}/v1/estimates", json=job.to_json()).json()
    assert estimate.model == raw["model"] == "Qwen/Qwen2.5-0.5B"
    assert estimate.peak.device_bytes_upper == raw["peak"]["device_bytes_upper"]
    assert 0 < estimate.peak.allocated_bytes <= estimate.peak.reserved_bytes
    assert estimate.peak.reserved_bytes <= estimate.peak.device_bytes
    assert sum(estimate.components.values()) == estimate.estimated.allocated_bytes
    assert estimate.params.trainable < estimate.params.total
    assert estimate.estimator_version == raw["estimator_version"]
    assert estimate.calibration.state == raw["calibration"]["state"] == "fresh"


def test_batch_fit_check_and_catalogs(service: Service) -> None:
    with VramcastClient(service.url) as client:
        batch = client.estimate_batch([SMALL_JOB, {**SMALL_JOB, "model": "no-such/model"}])
        fit = client.fit_check(
            SMALL_JOB, gpus=["A100-80GB", GpuOffer(memory_mib=16_384, price_per_hour=0.5)]
        )
        models = client.models()
        model = client.model("Qwen/Qwen2.5-0.5B")
        gpus = client.gpus()

    assert (batch.succeeded, batch.failed) == (1, 1)
    assert batch.results[0].ok and batch.results[0].estimate is not None
    failed = batch.results[1]
    assert not failed.ok and failed.status == 404
    assert failed.problem is not None and failed.problem.kind == "unknown-model"

    assert len(fit.results) == 2 and fit.results[0].gpu.requested == "A100-80GB"
    assert fit.fits_all and fit.results[0].max_batch_size >= 2
    assert fit.results[0].required_bytes == fit.job.peak.device_bytes_upper
    assert fit.cheapest is not None and fit.cheapest.index == 1

    assert "Qwen/Qwen2.5-0.5B" in {m.id for m in models.models}
    assert model.id == "Qwen/Qwen2.5-0.5B" and model.architecture.model_type == "qwen2"
    assert any(g.name == "A100-80GB" for g in gpus.gpus)


def test_problems_become_exceptions_with_their_detail(service: Service) -> None:
    with VramcastClient(service.url, retry=FAST) as client:
        with pytest.raises(NotFoundError) as unknown:
            client.estimate({**SMALL_JOB, "model": "Qwen/Qwen2.5-0.6B"})
        with pytest.raises(InvalidRequestError) as invalid:
            client.estimate({**SMALL_JOB, "batch_size": 0})
        with pytest.raises(NotFoundError):
            client.model("nobody/nothing")

    problem = unknown.value.problem
    assert unknown.value.status == 404 and unknown.value.attempts == 1
    assert problem.kind == "unknown-model" and problem.suggestions
    assert "Qwen/Qwen2.5-0.6B" in str(unknown.value)
    assert invalid.value.problem.errors is not None
    assert invalid.value.problem.errors[0].loc == ["body", "batch_size"]
    assert "batch_size" in str(invalid.value)


def test_a_typed_job_is_checked_before_it_is_sent() -> None:
    with pytest.raises(ValidationError):
        Job(model="Qwen/Qwen2.5-0.5B", batch_size=2, seq_len=512, optim="adamw")  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        Job.model_validate({**SMALL_JOB, "batch_sise": 2})


def test_async_client(service: Service) -> None:
    async def calls() -> tuple[Any, ...]:
        async with AsyncVramcastClient(service.url, retry=FAST) as client:
            estimate, fit, gpus = await asyncio.gather(
                client.estimate(SMALL_JOB),
                client.fit_check(SMALL_JOB, ["A100-80GB"]),
                client.gpus(),
            )
            with pytest.raises(NotFoundError):
                await client.model("nobody/nothing")
            return estimate, fit, gpus

    estimate, fit, gpus = asyncio.run(calls())
    assert estimate.peak.device_bytes_upper == fit.job.peak.device_bytes_upper
    assert gpus.gpus


def test_upload_is_stored_once_and_replayed(service: Service) -> None:
    run_id = f"client-{uuid.uuid4().hex[:8]}-rank0"
    key = f"test-{uuid.uuid4()}"
    with VramcastClient(service.url, api_key=service.upload_key) as client:
        first = client.upload_calibration(upload_body(run_id), idempotency_key=key)
        again = client.upload_calibration(upload_body(run_id), idempotency_key=key)
    assert not first.replayed and again.replayed
    assert again.id == first.id and first.model == "Qwen/Qwen2.5-0.5B"
    assert {r.level for r in first.ratios} == {"allocated", "reserved"}
    assert len(service.store.uploads(run_id)) == 1

    with VramcastClient(service.url) as anonymous, pytest.raises(AuthenticationError) as denied:
        anonymous.upload_calibration(upload_body(run_id), idempotency_key=key)
    assert denied.value.status == 401


# Retries ---------------------------------------------------------------------------------


def test_retries_5xx_then_succeeds(flaky: FlakyFactory) -> None:
    server = flaky([503, 500])
    with VramcastClient(server.url, retry=FAST) as client:
        estimate = client.estimate(SMALL_JOB)
    assert estimate.model == "Qwen/Qwen2.5-0.5B"
    assert len(server.requests) == 3


def test_retries_a_dropped_connection(flaky: FlakyFactory) -> None:
    server = flaky(["drop", "drop"])
    with VramcastClient(server.url, retry=FAST) as client:
        assert client.gpus().gpus
    assert len(server.requests) == 3


def test_a_4xx_is_not_retried(flaky: FlakyFactory) -> None:
    server = flaky([])
    with VramcastClient(server.url, retry=FAST) as client, pytest.raises(InvalidRequestError):
        client.estimate({**SMALL_JOB, "seq_len": -1})
    assert len(server.requests) == 1


def test_gives_up_after_the_last_attempt_with_the_problem(flaky: FlakyFactory) -> None:
    server = flaky([503, 503, 503, 503])
    with VramcastClient(server.url, retry=FAST) as client, pytest.raises(ServerError) as failed:
        client.estimate(SMALL_JOB)
    assert len(server.requests) == 3
    assert failed.value.attempts == 3 and failed.value.status == 503
    assert failed.value.problem.detail == "injected failure 503"
    assert failed.value.retry_after_s == 0.0


def test_retry_after_is_honoured_up_to_the_cap(flaky: FlakyFactory) -> None:
    server = flaky([503], retry_after="0.3")
    policy = RetryPolicy(attempts=2, backoff_s=0.0, max_backoff_s=10.0)
    started = time.monotonic()
    with VramcastClient(server.url, retry=policy) as client:
        client.gpus()
    assert time.monotonic() - started >= 0.3
    assert RetryPolicy(max_backoff_s=1.0).delay_s(1, retry_after_s=120.0) == 1.0


def test_upload_retry_is_stored_once(service: Service, flaky: FlakyFactory) -> None:
    """A 5xx after the service stored the upload (a lost answer) is retried with the same
    Idempotency-Key, and the service stores it once."""
    run_id = f"retried-{uuid.uuid4().hex[:8]}-rank0"
    server = flaky([502])
    with VramcastClient(server.url, api_key=service.upload_key, retry=FAST) as client:
        receipt = client.upload_calibration(upload_body(run_id), idempotency_key=run_id)
        replay = client.upload_calibration(upload_body(run_id), idempotency_key=run_id)
    assert [r[2]["idempotency-key"] for r in server.requests] == [run_id] * 3
    assert replay.replayed and replay.id == receipt.id
    assert len(service.store.uploads(run_id)) == 1


def test_async_retries(flaky: FlakyFactory) -> None:
    server = flaky(["drop", 504])

    async def call() -> int:
        async with AsyncVramcastClient(server.url, retry=FAST) as client:
            return len((await client.models()).models)

    assert asyncio.run(call()) > 0
    assert len(server.requests) == 3


def test_unreachable_service_raises_after_the_retries() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with VramcastClient(url, retry=FAST) as client, pytest.raises(ServiceUnreachableError) as down:
        client.estimate(SMALL_JOB)
    assert down.value.attempts == 3 and isinstance(down.value, ConnectionError)

    async def call() -> None:
        async with AsyncVramcastClient(url, retry=FAST) as client:
            await client.gpus()

    with pytest.raises(ServiceUnreachableError):
        asyncio.run(call())


def test_answers_that_are_not_the_api() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/gpus":
            return httpx.Response(200, json={"unexpected": True})
        return httpx.Response(502, text="<html>Bad Gateway</html>")

    transport = httpx.MockTransport(handler)
    with VramcastClient("http://vramcast.test", transport=transport, retry=FAST) as client:
        with pytest.raises(UnexpectedResponseError):
            client.gpus()
        with pytest.raises(ServerError) as gateway:
            client.models()
    assert gateway.value.problem.status == 502
    assert gateway.value.problem.detail == "<html>Bad Gateway</html>"


def test_retry_after_header_forms() -> None:
    def answer(value: str) -> httpx.Response:
        return httpx.Response(503, headers={"Retry-After": value})

    assert retry_after_s(answer("7")) == 7.0
    assert retry_after_s(answer("Wed, 21 Oct 2015 07:28:00 GMT")) == 0.0
    assert retry_after_s(answer("soon")) is None
    assert retry_after_s(httpx.Response(503)) is None


def test_importing_the_client_needs_no_ml_framework() -> None:
    """The client and the reporter import, and a client runs, with torch, transformers,
    peft and lightning unimportable; nothing of the service is imported."""
    script = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"torch", "transformers", "peft", "lightning", "pynvml"}:
            raise ImportError(f"{name} is blocked")
sys.meta_path.insert(0, Block())
import vramcast_client
from vramcast_client import Reporter, VramcastClient
from vramcast_client.measure import CudaProbe
assert CudaProbe().read() is None
Reporter(probe=CudaProbe(), spool_dir=sys.argv[1])
service = sorted(m for m in sys.modules if m == "service" or m.startswith("service."))
assert not service, service
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", script, "/nonexistent"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
