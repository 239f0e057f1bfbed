"""No job the schema takes gets a 5xx: a property over the catalog's real models, every method,
objective and strategy, and shapes up to the schema's bounds; and the bodies that once did.

An estimate answers 200 or a problem (404, 422); a batch answers each job on its own, a bad job
as its own problem entry, as the single estimate answers it; a fit-check answers 200 or a
problem. A job beyond any GPU is answered without replaying the allocator, so extreme shapes
stay cheap.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.api.problems import PROBLEM_MEDIA_TYPE
from service.api.schemas.jobs import MAX_MEMORY_MIB
from service.catalog.models import default_catalog
from service.core.limits import (
    MAX_BATCH_SIZE,
    MAX_GPUS,
    MAX_GRADIENT_ACCUMULATION,
    MAX_SEQ_LEN,
)
from service.core.reserved import REPLAY_CEILING
from service.core.spec import (
    AttnImpl,
    Framework,
    LossImpl,
    Method,
    Objective,
    Offload,
    Optim,
    QuantType,
    Strategy,
)
from service.core.stack import STACK_PRESETS
from service.core.units import DType
from tests.api.conftest import SMALL_JOB, make_app

CATALOG_IDS = sorted(entry.id for entry in default_catalog().entries())
# A fit-check's GPUs: a catalog one, and the largest a request may describe.
FIT_GPUS: list[Any] = ["H100-SXM", {"memory_mib": MAX_MEMORY_MIB}]
PROBLEM_STATUSES = (404, 422)


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(make_app(), raise_server_exceptions=False) as test_client:
        yield test_client


def _edge(low: int, high: int, small: int) -> st.SearchStrategy[int]:
    """Integers in [low, high], weighted to the edges and to small values."""
    return st.one_of(
        st.sampled_from([low, high, high // 2 + 1]),
        st.integers(low, min(small, high)),
        st.integers(low, high),
    )


SHAPES = st.tuples(_edge(1, MAX_BATCH_SIZE, 8), _edge(1, MAX_SEQ_LEN, 4096))

# A job's options besides its model, method and objective: each job takes a few of them.
OPTIONS: dict[str, st.SearchStrategy[Any]] = {
    "gradient_accumulation_steps": _edge(1, MAX_GRADIENT_ACCUMULATION, 8),
    "gradient_checkpointing": st.booleans(),
    "dtype": st.sampled_from([d.value for d in DType]),
    "autocast": st.booleans(),
    "optim": st.sampled_from([o.value for o in Optim]),
    "loss": st.sampled_from([loss.value for loss in LossImpl]),
    "attn_implementation": st.sampled_from([a.value for a in AttnImpl]),
    "framework": st.sampled_from([f.value for f in Framework]),
    "liger_kernel": st.booleans(),
    "packing": st.booleans(),
    "quantization": st.fixed_dictionaries({"type": st.sampled_from([q.value for q in QuantType])}),
    "parallel": st.fixed_dictionaries(
        {
            "gpus": _edge(1, MAX_GPUS, 8),
            "strategy": st.sampled_from([s.value for s in Strategy]),
            "offload": st.sampled_from([o.value for o in Offload]),
        }
    ),
    "allocator": st.fixed_dictionaries({"expandable_segments": st.booleans()}),
    "stack": st.sampled_from(sorted(STACK_PRESETS)),
}
# What a vision-language model's job must say of its images.
VISION = st.fixed_dictionaries(
    {
        "images_per_sample": _edge(1, 16, 2),
        "image_height": st.sampled_from([224, 1024]),
        "image_width": st.sampled_from([224, 1024]),
    }
)
VISION_MODELS = {
    entry.id
    for entry in default_catalog().entries()
    if entry.arch.vision is not None or entry.arch.mllama is not None
}


@st.composite
def jobs(draw: st.DrawFn) -> dict[str, Any]:
    """A job on a catalog model, by any method and objective (the common ones more often, so
    that many jobs are valid), with up to three options."""
    model = draw(st.sampled_from(CATALOG_IDS))
    job: dict[str, Any] = {
        "model": model,
        "method": draw(
            st.one_of(
                st.sampled_from([Method.LORA.value, Method.QLORA.value, Method.FULL.value]),
                st.sampled_from([m.value for m in Method]),
            )
        ),
        "objective": draw(
            st.one_of(st.just(Objective.SFT.value), st.sampled_from([o.value for o in Objective]))
        ),
    }
    for name in draw(st.lists(st.sampled_from(sorted(OPTIONS)), max_size=3, unique=True)):
        job[name] = draw(OPTIONS[name])
    if model in VISION_MODELS:
        job["vision"] = draw(VISION)
    return job


def _handled(response: Any) -> Any:
    """The response's JSON: 200, or a problem+json of a client error (never a 5xx)."""
    assert response.status_code < 500, response.text
    if response.status_code != 200:
        assert response.status_code in PROBLEM_STATUSES, response.text
        assert response.headers["content-type"] == PROBLEM_MEDIA_TYPE
    return response.json()


# Each example is a new job, so its estimate and fit-check are cold (the step run, the allocator
# replayed at its shapes): a few dozen keep this test to seconds.
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(job=jobs(), shape=SHAPES, other=SHAPES)
def test_no_job_gets_a_server_error(
    client: TestClient, job: dict[str, Any], shape: tuple[int, int], other: tuple[int, int]
) -> None:
    job = {**job, "batch_size": shape[0], "seq_len": shape[1]}
    alone = client.post("/v1/estimates", json=job)
    estimate = _handled(alone)
    if alone.status_code == 200 and estimate["peak"]["allocated_bytes"] > REPLAY_CEILING:
        assert estimate["peak"]["reserved_bytes"] == estimate["peak"]["allocated_bytes"]

    copy = {**job, "batch_size": other[0], "seq_len": other[1]}
    batch = client.post("/v1/estimates:batch", json={"jobs": [job, copy, SMALL_JOB]})
    assert batch.status_code == 200, batch.text
    results = batch.json()["results"]
    assert [r["index"] for r in results] == [0, 1, 2]
    assert results[0]["status"] == alone.status_code
    assert results[2]["status"] == 200
    for result in results:
        assert result["status"] in (200, *PROBLEM_STATUSES), result
        assert (result["problem"] is None) == (result["status"] == 200)

    fit = client.post("/v1/fit-checks", json={"job": job, "gpus": FIT_GPUS})
    answer = _handled(fit)
    assert (fit.status_code == 200) == (alone.status_code == 200)
    if fit.status_code == 200 and answer["job"]["peak"]["allocated_bytes"] > REPLAY_CEILING:
        assert not any(result["fits"] for result in answer["results"])


# The bodies that got a 500 before: each answered with what it is.
ADALORA_FIT = {
    "job": {"model": "Qwen/Qwen2.5-14B", "method": "adalora", "batch_size": 10, "seq_len": 16},
    "gpus": ["RTX5090"],
}
PETABYTES = {
    "model": "tiiuae/falcon-7b",
    "method": "lora",
    "batch_size": 15,
    "seq_len": 951817,
    "allocator": {"expandable_segments": True},
}


def test_an_adalora_fit_check_whose_suggestion_fuses_the_loss(client: TestClient) -> None:
    response = client.post("/v1/fit-checks", json=ADALORA_FIT)
    assert response.status_code == 200, response.text
    [result] = response.json()["results"]
    assert not result["fits"]
    assert result["suggestions"]


def test_a_job_asking_for_petabytes_fits_no_gpu(client: TestClient) -> None:
    response = client.post("/v1/estimates", json={**PETABYTES, "gpu": "B200"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["peak"]["allocated_bytes"] > REPLAY_CEILING
    assert body["peak"]["reserved_bytes"] == body["peak"]["allocated_bytes"]
    assert body["gpu"]["fits"] is False
    assert any(a.startswith("reserved: not replayed") for a in body["assumptions"])
    fit = client.post("/v1/fit-checks", json={"job": PETABYTES, "gpus": FIT_GPUS})
    assert fit.status_code == 200, fit.text
    assert not any(result["fits"] for result in fit.json()["results"])


def test_a_batch_answers_the_petabyte_job_and_the_others(client: TestClient) -> None:
    bad = {**SMALL_JOB, "lora": {"target_modules": ["no_such_module"]}}
    unknown = {**SMALL_JOB, "model": "nope/no-such-model"}
    jobs = [PETABYTES, SMALL_JOB, bad, {**PETABYTES, "seq_len": 951_818}, unknown]
    response = client.post("/v1/estimates:batch", json={"jobs": jobs})
    assert response.status_code == 200, response.text
    body = response.json()
    assert [r["status"] for r in body["results"]] == [200, 200, 422, 200, 404]
    assert body["succeeded"] == 3 and body["failed"] == 2
    assert body["results"][2]["problem"]["errors"][0]["loc"][:3] == ["body", "jobs", 2]


def test_a_whole_float_is_not_an_integer(client: TestClient) -> None:
    response = client.post("/v1/estimates", json={**SMALL_JOB, "batch_size": 2.0})
    assert response.status_code == 422
    [error] = response.json()["errors"]
    assert error["loc"] == ["body", "batch_size"]
    batch = client.post("/v1/estimates:batch", json={"jobs": [{**SMALL_JOB, "seq_len": 512.0}]})
    [result] = batch.json()["results"]
    assert result["status"] == 422
    assert result["problem"]["errors"][0]["loc"] == ["body", "jobs", 0, "seq_len"]
