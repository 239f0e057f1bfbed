"""End-to-end: measured peaks uploaded by training nodes show on the page as the calibration
behind its numbers. A service of its own, so its factors never reach the other tests."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from service.store.keys import KeyScope
from tests.web.conftest import issue_key, running_service
from tests.web.pages import Driver, assert_estimate_shown

QUERY = "?model=Qwen%2FQwen2.5-0.5B&batch_size=2&seq_len=512&gpu="
A100 = {"name": "NVIDIA A100-SXM4-80GB", "memory_total_bytes": 85_899_345_920}
# measured / estimated per node and run: three nodes, each with its own key, the fewest a factor
# needs.
NODE_RATIOS = {"node-a": [1.06, 1.07], "node-b": [1.08], "node-c": [1.05]}
# An upload makes its replica reload the factors at its next tick (1 s).
RELOAD_TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def calibrated(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, dict[str, str]]]:
    """A service of its own and an upload key for each node."""
    database_url = f"sqlite:///{tmp_path_factory.mktemp('web-calibrated') / 'vramcast.db'}"
    with running_service(database_url) as base_url:
        yield (
            base_url,
            {node: issue_key(database_url, KeyScope.UPLOAD, nodes=[node]) for node in NODE_RATIOS},
        )


def upload_fleet(client: httpx.Client, tokens: dict[str, str], job: dict[str, Any]) -> None:
    estimated = client.post("/v1/estimates", json=job).json()["estimated"]
    for node, ratios in NODE_RATIOS.items():
        for run, ratio in enumerate(ratios):
            body = {
                "job": job,
                "gpu": A100,
                "measured": {
                    level: round(estimated[level] * ratio)
                    for level in ("allocated_bytes", "reserved_bytes", "device_bytes")
                },
                "node_id": node,
                "run_id": f"{node}-run-{run}",
            }
            response = client.post(
                "/v1/calibrations",
                json=body,
                headers={"Authorization": f"Bearer {tokens[node]}"},
            )
            assert response.status_code == 201, response.text


def calibrated_estimate(client: httpx.Client, job: dict[str, Any]) -> dict[str, Any]:
    deadline = time.monotonic() + RELOAD_TIMEOUT_S
    while True:
        estimate: dict[str, Any] = client.post("/v1/estimates", json=job).json()
        if estimate["calibration"]["applied"] or time.monotonic() > deadline:
            return estimate
        time.sleep(0.2)


def test_the_calibration_behind_the_numbers(
    calibrated: tuple[str, dict[str, str]], open_page: Callable[[str], Driver]
) -> None:
    base_url, tokens = calibrated
    d = open_page(base_url)
    d.open(QUERY)
    job = d.last_post("/v1/estimates")
    shown = d.shown()
    assert shown["calibration"]["applied"] == "no"
    assert shown["calibration"]["levels"] == []

    with httpx.Client(base_url=base_url, timeout=30.0) as client:
        upload_fleet(client, tokens, job)
        estimate = calibrated_estimate(client, job)
    calibration = estimate["calibration"]
    assert calibration["applied"], calibration
    assert calibration["nodes"] == len(NODE_RATIOS)
    assert calibration["samples"] == sum(len(r) for r in NODE_RATIOS.values())

    d.page.reload()
    d.wait_ready()
    shown = d.shown()
    assert_estimate_shown(shown, estimate)
    assert {level["level"] for level in shown["calibration"]["levels"]} == {
        "allocated",
        "reserved",
        "device",
    }
    assert "corrected" in d.text("#calibration-text")
