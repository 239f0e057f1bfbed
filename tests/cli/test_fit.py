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
from service.cli.options import CliError, job_fields, spec_from_args
from service.cli.server import (
    EXIT_DOES_NOT_FIT,
    EXIT_FITS,
    EXIT_UNDECIDED,
    fit_request,
    placement_request,
    run_fit,
)
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


LLAMA_70B_FULL = [
    "meta-llama/Llama-3.1-70B",
    "--method",
    "full",
    "-b",
    "1",
    "-s",
    "4096",
    "--gradient-checkpointing",
]


def test_strategies_print_the_fewest_gpus_with_the_cheapest_marked(
    service: TestClient, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        *LLAMA_70B_FULL,
        "--gpu",
        "H100-SXM",
        "--gpu",
        "A100-80GB",
        "--price",
        "H100-SXM=3.0",
        "--price",
        "A100-80GB=1.8",
        "--strategies",
        "zero3, fsdp",
    ]
    # The exit status is that of the job as given (one GPU): it does not fit.
    assert _fit(service, *argv) == EXIT_DOES_NOT_FIT
    out = capsys.readouterr().out
    table = out[out.index("fewest GPUs (up to 64, 8 per node") :].splitlines()[1:]
    assert [line.split()[:2] for line in table] == [
        ["H100-SXM", "zero3"],
        ["H100-SXM", "fsdp"],
        ["A100-80GB", "zero3"],
        ["A100-80GB", "fsdp"],
    ]
    # Each line's count and cost are the service's answer; the cheapest line is marked.
    args = build_parser().parse_args(["fit", *argv])
    with VramcastClient("http://testserver", transport=_through(service)) as client:
        job, gpus = fit_request(args, spec_from_args(args))
        answer = client.fit_check(job, gpus, placement_request(args))
    assert answer.placement is not None and answer.placement.cheapest is not None
    for line, placed in zip(table, answer.placement.placements, strict=True):
        assert placed.count is not None and placed.cost_per_hour is not None
        assert f"{placed.count} GPUs" in line and f"{placed.cost_per_hour:.2f}/h" in line
    marked = [i for i, line in enumerate(table) if "cheapest" in line]
    assert marked == [answer.placement.cheapest.index]


def test_placement_options_are_checked_before_asking(
    service: TestClient, capsys: pytest.CaptureFixture[str]
) -> None:
    cases = [
        (["--strategies", "zero4"], "--strategies: 'zero4'"),
        (["--strategies", ","], "--strategies: none given"),
        (["--max-gpus", "0"], "--max-gpus"),
        (["--gpus-per-node", "0"], "--gpus-per-node"),
        (["--price", "L4=1"], "--price: 'L4'"),
        (["--price", "H100-SXM=cheap"], "--price: 'cheap'"),
        (["--max-gpus", "8", "--format", "slurm"], "not printed by --format"),
    ]
    for extra, message in cases:
        assert _fit(service, *SMALL, "--gpu", "H100-SXM", *extra) == EXIT_UNDECIDED, extra
        assert message in capsys.readouterr().err, extra


def test_a_strategy_the_job_cannot_use_is_reported_per_strategy(
    service: TestClient, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [*SMALL, "--method", "qlora", "--gpu", "L4", "--strategies", "zero3,ddp"]
    assert _fit(service, *argv, "--max-gpus", "4") == EXIT_FITS
    out = capsys.readouterr().out
    assert "zero3  not possible: QLoRA under zero3" in out
    assert "ddp       1 GPUs (1 node)" in out


def test_dora_and_rslora_options_reach_the_spec_and_the_job() -> None:
    args = build_parser().parse_args(["fit", *SMALL, "--use-dora", "--use-rslora", "--gpu", "L4"])
    spec = spec_from_args(args)
    assert spec.lora is not None and spec.lora.use_dora and spec.lora.use_rslora
    lora = job_fields(spec)["lora"]
    assert (lora["use_dora"], lora["use_rslora"]) == (True, True)
    plain = spec_from_args(build_parser().parse_args(["fit", *SMALL, "--gpu", "L4"]))
    assert plain.lora is not None and not plain.lora.use_dora


@pytest.mark.parametrize("method", ["lora-fa", "vera", "loha", "lokr", "adalora", "oft"])
def test_peft_methods_take_their_defaults_and_the_rank(method: str) -> None:
    plain = spec_from_args(build_parser().parse_args(["fit", *SMALL, "--method", method]))
    assert plain.method.value == method
    ranked = spec_from_args(
        build_parser().parse_args(["fit", *SMALL, "--method", method, "--r", "4"])
    )
    options = ranked.lora if method == "lora-fa" else getattr(ranked, method)
    assert options is not None and options.r == 4
    assert job_fields(ranked)["method"] == method


def test_lora_only_options_are_refused_for_vera() -> None:
    args = build_parser().parse_args(["fit", *SMALL, "--method", "vera", "--lora-alpha", "16"])
    with pytest.raises(CliError, match="--method lora"):
        spec_from_args(args)
