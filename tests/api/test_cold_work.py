"""Cold work's time and slots (api/budget.py, core/cold.py) over HTTP: a request past its time
for cold work is a 503 whose retry continues from what it computed; with the slots taken, a
keyless caller is refused while a keyed one is served; a batch answers the jobs its refusals
do not stop; warm requests never ask for a slot."""

from __future__ import annotations

import asyncio
import json
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from httpx import Response

from service.api.budget import Caller, ColdWorkSlots
from service.api.problems import ProblemType
from service.api.settings import Settings
from service.core.estimator import forget_compiled_steps
from service.core.reserved import clear_replay_caches
from service.store.keys import KeyScope
from service.store.migrate import upgrade
from tests.api.conftest import SMALL_JOB, issue_key, make_app

# The least time for cold work the settings take: a cold fit-check of BIG_JOB replays the
# allocator for about a second on 2 CPUs (docs/benchmarks.md), many times this.
SHORT_BUDGET_S = Settings.model_fields["cold_work_budget_s"].metadata[0].ge
# Far more retries than the cold work takes pieces (each retry does at least one): a retry
# that did not continue from what the ones before computed would never end.
MAX_TRIES = 200
BIG_JOB: dict[str, Any] = {
    "model": "Qwen/Qwen2.5-7B",
    "batch_size": 4,
    "seq_len": 2048,
    "lora": {"r": 16, "target_modules": "all-linear"},
}
FIT_CHECK = {"job": BIG_JOB, "gpus": ["T4", "L4", "A100-80GB", "H100-SXM"]}
# An estimate between the powers of two of batch and sequence: four replays of a 70B step.
BIG_ESTIMATE = {
    "model": "meta-llama/Llama-3.1-70B",
    "method": "full",
    "batch_size": 3,
    "seq_len": 1500,
    "gradient_checkpointing": True,
}
QUICK_WAIT_S = 0.05  # the slot tests' wait: they fill the slots first, nothing frees one


@pytest.fixture(autouse=True)
def _cold() -> None:
    clear_replay_caches()
    forget_compiled_steps()


def _retried(client: TestClient, path: str, body: dict[str, Any]) -> tuple[Response, int]:
    """The answer to `body` asked until it is not a 503, and how many 503s came first; each a
    budget-exceeded problem with its Retry-After."""
    for refused in range(MAX_TRIES):
        response = client.post(path, json=body)
        if response.status_code != 503:
            return response, refused
        problem = response.json()
        assert problem["type"] == ProblemType.BUDGET_EXCEEDED, problem
        assert response.headers["retry-after"] == str(problem["retry_after_s"])
        assert "kept" in problem["detail"] and "continues" in problem["detail"]
    raise AssertionError(f"still refused after {MAX_TRIES} tries: no retry continued")


def _counted(client: TestClient, metric: str, label: str) -> float:
    """A counter's value in the app's /metrics."""
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(f"{metric}_total{{{label}}}"):
            return float(line.split()[-1])
    raise AssertionError(f"no {metric}{{{label}}} in /metrics")


def _made_warm(client: TestClient, job: dict[str, Any]) -> None:
    """`job` estimated at its shape and another, which records its step: warm from then on.
    (Through the batch route: POST /v1/estimates keeps the jobs of bodies it read, and with
    them the steps they compiled before the test forgot them.)"""
    jobs = [job, {**job, "seq_len": job["seq_len"] + 1}]
    assert client.post("/v1/estimates:batch", json={"jobs": jobs}).json()["failed"] == 0


def _answered_in_one_go(path: str, body: dict[str, Any]) -> bytes:
    """The answer of an app with the default time, every replay and step made anew."""
    clear_replay_caches()
    forget_compiled_steps()
    with TestClient(make_app()) as client:
        response = client.post(path, json=body)
        assert response.status_code == 200, response.text
        return response.content


@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/fit-checks", FIT_CHECK), ("/v1/estimates", BIG_ESTIMATE)],
    ids=["fit-check", "estimate"],
)
def test_cold_work_past_its_time_is_a_503_and_asking_again_continues_to_the_answer(
    path: str, body: dict[str, Any]
) -> None:
    with TestClient(make_app(cold_work_budget_s=SHORT_BUDGET_S)) as client:
        response, refused = _retried(client, path, body)
        assert response.status_code == 200, response.text
        assert refused >= 1, "the cold work fitted in its time: nothing was refused"
        assert _counted(client, "vramcast_cold_work_refusals", 'reason="budget"') == refused
    # what the refused requests kept is what one request computes in one go
    assert response.content == _answered_in_one_go(path, body)


def test_a_batch_answers_its_jobs_done_and_refuses_the_rest_each_on_its_own() -> None:
    """Cold jobs past the batch's time get their own 503; a warm job after them and a bad job
    are answered as ever; asking again continues with the jobs refused."""
    shapes = [(b, s) for b in (1, 2, 4, 8) for s in (512, 1024, 2048, 4096)]
    jobs: list[dict[str, Any]] = [{**BIG_JOB, "batch_size": b, "seq_len": s} for b, s in shapes]
    warm = {**SMALL_JOB, "seq_len": 256}
    jobs += [warm, {**SMALL_JOB, "batch_size": 0}]
    with TestClient(make_app()) as warmer:  # (in its own time: the steps and replays are shared)
        _made_warm(warmer, warm)
    with TestClient(make_app(cold_work_budget_s=SHORT_BUDGET_S)) as client:
        answer = client.post("/v1/estimates:batch", json={"jobs": jobs}).json()
        statuses = [result["status"] for result in answer["results"]]
        assert statuses[-2:] == [200, 422]
        assert 503 in statuses and statuses[0] == 200, statuses  # (a first piece always runs)
        refused = [r["problem"] for r in answer["results"] if r["status"] == 503]
        assert {p["type"] for p in refused} == {ProblemType.BUDGET_EXCEEDED}
        assert all(p["retry_after_s"] >= 1 for p in refused)
        assert (answer["succeeded"], answer["failed"]) == (statuses.count(200), len(refused) + 1)
        done = answer["succeeded"]
        for _ in range(MAX_TRIES):
            answer = client.post("/v1/estimates:batch", json={"jobs": jobs}).json()
            assert answer["succeeded"] >= done  # what was done stays done
            done = answer["succeeded"]
            if answer["failed"] == 1:
                break
        assert answer["failed"] == 1, "a retried batch never finished its jobs"
        # one refusal counted per request refused, not per job
        assert _counted(client, "vramcast_cold_work_refusals", 'reason="budget"') >= 1
    clear_replay_caches()
    forget_compiled_steps()
    with TestClient(make_app()) as fresh:
        for result, job in zip(answer["results"][:-1], jobs, strict=False):
            assert result["estimate"] == fresh.post("/v1/estimates", json=job).json()


@pytest.fixture
def keyed_app() -> Iterator[FastAPI]:
    """An app on a store of its own (its keys), two slots of which one for keyless callers,
    and a short wait."""
    with tempfile.TemporaryDirectory() as directory:
        url = f"sqlite:///{Path(directory) / 'store.db'}"
        upgrade(url)
        app = make_app(
            database_url=url,
            cold_work_slots=2,
            cold_work_anonymous_slots=1,
            cold_work_wait_s=QUICK_WAIT_S,
        )
        yield app
        app.state.services.engine.dispose()


def _slots(app: FastAPI) -> ColdWorkSlots:
    slots: ColdWorkSlots = app.state.services.cold_work.slots
    return slots


class _Cold:
    """Cold estimates: each a shape of SMALL_JOB's model never asked before, its replays and
    step forgotten, so that it runs the step and replays the allocator."""

    def __init__(self, client: TestClient) -> None:
        self.client = client
        self.seq_len = 300

    def post(self, token: str | None = None) -> Response:
        clear_replay_caches()
        forget_compiled_steps()
        self.seq_len += 1
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        body = {**SMALL_JOB, "seq_len": self.seq_len}
        return self.client.post("/v1/estimates", json=body, headers=headers)


def test_with_the_keyless_share_taken_a_keyless_caller_is_refused_and_a_keyed_one_served(
    keyed_app: FastAPI,
) -> None:
    read_key = issue_key(keyed_app, KeyScope.READ)
    upload_key = issue_key(keyed_app, KeyScope.UPLOAD)
    slots = _slots(keyed_app)
    with TestClient(keyed_app) as client:
        cold = _Cold(client)
        assert cold.post().status_code == 200  # a slot free for keyless callers
        # a long cold request of a keyless caller holds the keyless callers' share
        assert client.portal.call(slots.acquire, Caller.ANONYMOUS, 0) is None
        for token in (None, "vck_unknown_key", "not-even-a-key"):
            refused = cold.post(token)
            assert refused.status_code == 429, refused.text
            assert refused.json()["type"] == ProblemType.ANONYMOUS_SHARE_TAKEN
            assert refused.headers["retry-after"] == str(refused.json()["retry_after_s"])
        for token in (read_key, upload_key):  # any live key, whatever its scope
            response = cold.post(token)
            assert response.status_code == 200, response.text
        # a long cold request of a keyed caller holds the last slot: every caller waits
        assert client.portal.call(slots.acquire, Caller.KEYED, 0) is None
        busy = cold.post(read_key)
        assert busy.status_code == 503 and busy.json()["type"] == ProblemType.BUSY
        assert cold.post().status_code == 429
        client.portal.call(slots.release, Caller.KEYED)
        client.portal.call(slots.release, Caller.ANONYMOUS)
        assert cold.post().status_code == 200  # slots given back are handed out again
        assert (slots.held, slots.held_anonymous) == (0, 0)
        counted = {
            reason: _counted(client, "vramcast_cold_work_refusals", f'reason="{reason}"')
            for reason in ("anonymous_share", "busy", "budget")
        }
        assert counted == {"anonymous_share": 4, "busy": 1, "budget": 0}
        admitted = _counted(client, "vramcast_cold_work_admissions", 'caller="keyed"')
        assert admitted == 2


def test_a_waiting_request_gets_the_first_slot_given_back(keyed_app: FastAPI) -> None:
    slots = _slots(keyed_app)
    with TestClient(keyed_app) as client:
        assert client.portal.call(slots.acquire, Caller.ANONYMOUS, 0) is None

        async def wait_then_free() -> Any:
            # a keyless request waiting for the share while the holder gives its slot back
            waiting = asyncio.ensure_future(slots.acquire(Caller.ANONYMOUS, 30.0))
            await asyncio.sleep(0)
            held_while_waiting = slots.held
            slots.release(Caller.ANONYMOUS)
            return held_while_waiting, await waiting

        assert client.portal.call(wait_then_free) == (1, None)
        assert (slots.held, slots.held_anonymous) == (1, 1)
        client.portal.call(slots.release, Caller.ANONYMOUS)


def test_a_batch_refused_a_slot_answers_its_warm_jobs_and_asks_for_a_slot_once(
    keyed_app: FastAPI,
) -> None:
    slots = _slots(keyed_app)
    warm = {**SMALL_JOB, "seq_len": 256}
    with TestClient(keyed_app) as client:
        _made_warm(client, warm)
        assert client.portal.call(slots.acquire, Caller.ANONYMOUS, 0) is None
        asked = slots.asked
        cold = [{**BIG_JOB, "seq_len": s} for s in (700, 900, 1100)]
        answer = client.post("/v1/estimates:batch", json={"jobs": [warm, *cold, warm]}).json()
        assert [r["status"] for r in answer["results"]] == [200, 429, 429, 429, 200]
        assert answer["results"][1]["problem"]["type"] == ProblemType.ANONYMOUS_SHARE_TAKEN
        assert slots.asked == asked + 1  # once for the batch
        client.portal.call(slots.release, Caller.ANONYMOUS)
        assert slots.held == 0


def test_warm_requests_never_ask_for_a_slot() -> None:
    app = make_app(cold_work_slots=2, cold_work_anonymous_slots=1)
    slots = _slots(app)
    estimate = {**SMALL_JOB, "seq_len": 384}
    fit = {"job": estimate, "gpus": ["L4", "A100-80GB"]}
    batch = {"jobs": [estimate, {**estimate, "batch_size": 3}]}
    with TestClient(app) as client:
        for path, body in (("/v1/estimates", estimate), ("/v1/fit-checks", fit)):
            for _ in range(3):  # a new job's step is recorded at its second shape
                assert client.post(path, json=body).status_code == 200
        assert client.post("/v1/estimates:batch", json=batch).json()["failed"] == 0
        assert slots.asked >= 1  # the cold ones did
        # every slot taken: warm requests are answered all the same, without asking
        client.portal.call(slots.acquire, Caller.ANONYMOUS, 0)
        client.portal.call(slots.acquire, Caller.KEYED, 0)
        asked = slots.asked
        for _ in range(5):
            assert client.post("/v1/estimates", json=estimate).status_code == 200
            assert client.post("/v1/estimates", json={**estimate, "seq_len": 400}).is_success
            assert client.post("/v1/fit-checks", json=fit).status_code == 200
            assert client.post("/v1/estimates:batch", json=batch).json()["failed"] == 0
        assert slots.asked == asked
        assert _counted(client, "vramcast_cold_work_refusals", 'reason="busy"') == 0


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def test_with_the_store_unreachable_a_key_counts_as_none() -> None:
    url = f"postgresql+psycopg://vramcast@127.0.0.1:{_closed_port()}/vramcast"
    app = make_app(
        database_url=url, cold_work_slots=2, cold_work_anonymous_slots=1, cold_work_wait_s=2.0
    )
    slots = _slots(app)
    with TestClient(app) as client:
        cold = _Cold(client)
        token = "vck_00000000_" + "x" * 43
        assert cold.post(token).status_code == 200  # answered, as a keyless caller
        client.portal.call(slots.acquire, Caller.ANONYMOUS, 0)
        refused = cold.post(token)
        assert refused.status_code == 429, refused.text
        assert json.loads(refused.content)["type"] == ProblemType.ANONYMOUS_SHARE_TAKEN
        client.portal.call(slots.release, Caller.ANONYMOUS)
