"""`vramcast fit`: exit 0 fits, 1 does not fit, 2 undecided; `vramcast serve` is registered."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from service.api.schemas import JobSpec
from service.cli.main import build_parser, main
from service.cli.options import job_fields, spec_from_args
from service.cli.server import EXIT_DOES_NOT_FIT, EXIT_FITS, EXIT_UNDECIDED, run_fit
from service.core.spec import LoraSpec, Method, QuantSpec, TrainingSpec
from tests.api.conftest import make_app
from vramcast_client.client import VramcastClient
from vramcast_client.retry import NO_RETRY

SMALL = ["Qwen/Qwen2.5-0.5B", "-b", "2", "-s", "512"]
BIG = ["Qwen/Qwen2.5-7B", "--method", "full", "-b", "8", "-s", "4096"]


@pytest.fixture(scope="module")
def service() -> Iterator[TestClient]:
    with TestClient(make_app()) as client:
        yield client


def _through(service: TestClient) -> httpx.MockTransport:
    """A transport that hands each request to the app under test."""

    def handler(request: httpx.Request) -> httpx.Response:
        answer = service.request(
            request.method, request.url.path, content=request.content, headers=request.headers
        )
        headers = {"content-type": answer.headers.get("content-type", "application/json")}
        return httpx.Response(answer.status_code, headers=headers, content=answer.content)

    return httpx.MockTransport(handler)


def _fit(service: TestClient, *argv: str) -> int:
    args = build_parser().parse_args(["fit", *argv])
    transport = _through(service)
    with VramcastClient("http://testserver", transport=transport, retry=NO_RETRY) as client:
        return run_fit(args, client)


def test_fits_exits_0(service: TestClient, capsys: pytest.CaptureFixture[str]) -> None:
    assert _fit(service, *SMALL, "--gpu", "NVIDIA L4") == EXIT_FITS
    assert "L4: fits" in capsys.readouterr().out


def test_does_not_fit_exits_1_with_changes(
    service: TestClient, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _fit(service, *BIG, "--gpu", "L4") == EXIT_DOES_NOT_FIT
    assert "does not fit" in capsys.readouterr().out


def test_every_gpu_must_fit_unless_any(service: TestClient) -> None:
    gpus = ["--gpu", "H200", "--gpu-memory-mib", "10240"]
    job = ["Qwen/Qwen2.5-7B", "-b", "4", "-s", "2048", "--gradient-checkpointing"]
    assert _fit(service, *job, *gpus) == EXIT_DOES_NOT_FIT
    assert _fit(service, *job, *gpus, "--any") == EXIT_FITS


def test_json_prints_the_answer(service: TestClient, capsys: pytest.CaptureFixture[str]) -> None:
    assert _fit(service, *SMALL, "--gpu", "L4", "--json") == EXIT_FITS
    answer = json.loads(capsys.readouterr().out)
    assert answer["results"][0]["gpu"]["name"] == "L4"


def test_json_is_the_services_answer_as_sent(
    service: TestClient, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["Qwen/Qwen2.5-7B", "-b", "4", "-s", "2048", "--gpu", "H200", "--gpu", "L4"]
    assert _fit(service, *argv, "--json") == EXIT_DOES_NOT_FIT
    spec = spec_from_args(build_parser().parse_args(["fit", *argv]))
    body = {
        "job": {"model": "Qwen/Qwen2.5-7B", **job_fields(spec)},
        "gpus": [{"name": "H200"}, {"name": "L4"}],
    }
    answer = service.post("/v1/fit-checks", json=body).json()
    assert capsys.readouterr().out == json.dumps(answer, indent=2) + "\n"


@pytest.mark.parametrize(
    "argv",
    [
        [*SMALL],  # no GPU
        [*SMALL, "--gpu", "A100-81GB"],  # unknown GPU: the service answers 404
        ["nope/nothing", "-b", "1", "-s", "1", "--gpu", "L4"],  # unknown model
        [*SMALL, "--r", "0", "--gpu", "L4"],  # invalid option
        [*SMALL, "--gpu-memory-mib", "12", "--gpu", "L4"],  # the service answers 422
    ],
)
def test_bad_input_exits_2(
    service: TestClient, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert _fit(service, *argv) == EXIT_UNDECIDED
    assert "vramcast fit:" in capsys.readouterr().err


def test_unreachable_service_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["fit", *SMALL, "--gpu", "L4", "--url", "http://127.0.0.1:1", "--timeout", "2"])
    assert code == EXIT_UNDECIDED
    assert "unreachable" in capsys.readouterr().err


def test_an_answer_that_is_not_a_fit_check_exits_2() -> None:
    def handler(_request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"unexpected": True})

    transport = httpx.MockTransport(handler)
    with VramcastClient("http://x", transport=transport, retry=NO_RETRY) as client:
        args = build_parser().parse_args(["fit", *SMALL, "--gpu", "L4"])
        assert run_fit(args, client) == EXIT_UNDECIDED


@pytest.mark.parametrize(
    "spec",
    [
        TrainingSpec(batch_size=2, seq_len=64),
        TrainingSpec(
            method=Method.QLORA,
            batch_size=1,
            seq_len=8,
            lora=LoraSpec(r=4, target_modules=("q_proj", "v_proj"), modules_to_save=("lm_head",)),
            quantization=QuantSpec(double_quant=True),
            gradient_checkpointing=True,
        ),
        TrainingSpec(method=Method.FULL, batch_size=1, seq_len=8),
    ],
)
def test_job_fields_round_trip_through_the_api_schema(spec: TrainingSpec) -> None:
    body: dict[str, Any] = {"model": "Qwen/Qwen2.5-0.5B", **job_fields(spec)}
    assert JobSpec.model_validate(body).to_spec() == spec


def test_cli_options_map_to_the_api_job() -> None:
    args = build_parser().parse_args(["fit", *SMALL, "--r", "16", "--gpu", "L4"])
    spec = spec_from_args(args)
    assert JobSpec.model_validate({"model": "m", **job_fields(spec)}).to_spec() == spec


def test_serve_is_registered() -> None:
    args = build_parser().parse_args(["serve", "--port", "9000"])
    assert args.port == 9000 and args.host is None
