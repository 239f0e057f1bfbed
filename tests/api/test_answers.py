"""Kept answers to repeated estimate bodies: the same bytes, counted, and never stale."""

from __future__ import annotations

import json

from fastapi.testclient import TestClient

from service.api.answers import MAX_KEPT_BODY_BYTES, Answer, AnswerCache
from service.api.app import create_app
from service.api.settings import Settings
from service.calibration.provider import CachedFactors, CalibratedPeaks, FactorProvider
from service.core.result import Levels
from tests.api.conftest import SMALL_JOB, make_app
from tests.api.test_operations import _sample


def _answer(content: bytes, generation: object) -> Answer:
    return Answer(content=content, model="m", generation=generation)


class TestAnswerCache:
    def test_gives_back_what_it_kept_for_the_same_generation_only(self) -> None:
        cache, now, later = AnswerCache(4), object(), object()
        cache.put(b"body", _answer(b"answer", now))
        kept = cache.get(b"body", now)
        assert kept is not None and kept.content == b"answer"
        assert cache.get(b"body", later) is None
        assert cache.get(b"other", now) is None
        assert (cache.hits, cache.misses) == (1, 2)

    def test_the_least_recently_used_leaves_first(self) -> None:
        cache, gen = AnswerCache(2), object()
        cache.put(b"a", _answer(b"1", gen))
        cache.put(b"b", _answer(b"2", gen))
        assert cache.get(b"a", gen) is not None  # a is now the most recent
        cache.put(b"c", _answer(b"3", gen))
        assert len(cache) == 2
        assert cache.get(b"b", gen) is None
        assert cache.get(b"a", gen) is not None and cache.get(b"c", gen) is not None

    def test_keeps_nothing_when_off_or_for_long_bodies(self) -> None:
        gen = object()
        off = AnswerCache(0)
        off.put(b"a", _answer(b"1", gen))
        assert len(off) == 0
        on = AnswerCache(8)
        on.put(b"x" * (MAX_KEPT_BODY_BYTES + 1), _answer(b"1", gen))
        assert len(on) == 0


def test_a_repeated_body_gets_the_same_answer_and_is_counted() -> None:
    app = make_app()
    body = json.dumps(SMALL_JOB).encode()
    headers = {"content-type": "application/json"}
    with TestClient(app) as client:
        first = client.post("/v1/estimates", content=body, headers=headers)
        second = client.post("/v1/estimates", content=body, headers=headers)
        text = client.get("/metrics").text
    assert first.status_code == second.status_code == 200
    assert second.content == first.content
    assert app.state.services.answers.hits == 1
    assert _sample(text, "vramcast_estimates_total", model="Qwen/Qwen2.5-0.5B") == 2


def test_a_kept_answer_never_excuses_a_body_that_is_not_json() -> None:
    body = json.dumps(SMALL_JOB).encode()
    with TestClient(make_app()) as client:
        assert client.post("/v1/estimates", content=body).status_code == 200
        refused = client.post("/v1/estimates", content=body, headers={"content-type": "text/plain"})
    assert refused.status_code == 415
    assert refused.json()["content_type"] == "text/plain"


def test_errors_are_not_kept() -> None:
    app = make_app()
    with TestClient(app) as client:
        for _ in range(2):
            response = client.post("/v1/estimates", json={**SMALL_JOB, "model": "nope/nothing"})
            assert response.status_code == 404
    assert len(app.state.services.answers) == 0


def test_new_factors_make_kept_answers_stale() -> None:
    class Switchable(FactorProvider):
        """Doubles the device level once switched; each switch is a new generation."""

        def __init__(self, factors: CachedFactors) -> None:
            self.factors = factors
            self.scale = 1
            self._generation = object()

        def switch(self) -> None:
            self.scale = 2
            self._generation = object()

        def generation(self) -> object:
            return self._generation

        def peaks(
            self, estimate: Levels, *, model: str, method: str, gpu: str | None
        ) -> CalibratedPeaks:
            base = self.factors.peaks(estimate, model=model, method=method, gpu=gpu)
            return CalibratedPeaks(
                allocated_bytes=base.allocated_bytes,
                reserved_bytes=base.reserved_bytes,
                device_bytes=base.device_bytes * self.scale,
                device_bytes_upper=base.device_bytes_upper * self.scale,
                calibration=base.calibration,
            )

    settings = Settings(database_url="sqlite://")
    plain = create_app(settings).state.services.factors
    assert isinstance(plain, CachedFactors)
    provider = Switchable(plain)
    with TestClient(create_app(settings, factor_provider=provider)) as client:
        before = client.post("/v1/estimates", json=SMALL_JOB).json()
        provider.switch()
        after = client.post("/v1/estimates", json=SMALL_JOB).json()
    assert after["peak"]["device_bytes"] == 2 * before["peak"]["device_bytes"]


def test_the_cache_can_be_turned_off() -> None:
    app = create_app(Settings(database_url="sqlite://", estimate_cache_entries=0))
    with TestClient(app) as client:
        for _ in range(2):
            assert client.post("/v1/estimates", json=SMALL_JOB).status_code == 200
    assert len(app.state.services.answers) == 0 and app.state.services.answers.hits == 0
