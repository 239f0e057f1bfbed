"""Driving the web page: a page and the API requests it made, and what it must show.

Every number the page shows is compared with the API's own answer to the same job: the page
must never estimate anything itself.
"""

from __future__ import annotations

from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

GIB = 1024**3
READY = '#results[data-state="ready"]'
DESKTOP = {"width": 1280, "height": 900}
PHONE = {"width": 390, "height": 844}
SNAPSHOT = (Path(__file__).parent / "snapshot.js").read_text()


def gib(value: int) -> str:
    """The page's GiB text: JS toFixed(2) rounds the exact value half up."""
    exact = Decimal(abs(value)) / Decimal(GIB)
    return str(exact.quantize(Decimal("0.01"), rounding=ROUND_HALF_UP))


def fixed(value: float | None, digits: int) -> str:
    """JS toFixed(digits) of a number, or the page's dash for none."""
    if value is None:
        return "—"
    return str(Decimal(value).quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP))


def gib_text(value: int) -> str:
    return "< 0.01 GiB" if 0 < value < GIB / 200 else f"{gib(value)} GiB"


def signed_gib(value: int) -> str:
    return f"−{gib(value)}" if value < 0 else f"+{gib(value)}"


class Driver:
    """One browser page of the web app, with the API requests it made."""

    def __init__(self, page: Any, base_url: str) -> None:
        self.page = page
        self.base_url = base_url
        self.posts: list[tuple[str, Any]] = []
        self.requests: list[str] = []
        self.errors: list[str] = []
        page.on("request", self._record)
        page.on("pageerror", lambda error: self.errors.append(str(error)))

    def _record(self, request: Any) -> None:
        self.requests.append(request.url)
        if request.method == "POST":
            self.posts.append((urlsplit(request.url).path, request.post_data_json))

    def open(self, query: str = "") -> None:
        self.page.goto(f"{self.base_url}/{query}")
        self.wait_ready()

    def wait_ready(self) -> None:
        self.page.wait_for_selector(READY, timeout=20_000)

    def last_post(self, path: str) -> Any:
        bodies = [body for p, body in self.posts if p == path]
        assert bodies, f"the page posted nothing to {path}"
        return bodies[-1]

    def shown(self) -> dict[str, Any]:
        """What the page shows, read in one call (tests/web/snapshot.js)."""
        result: dict[str, Any] = self.page.evaluate(SNAPSHOT)
        return result

    def bytes_of(self, selector: str) -> int:
        return int(self.page.locator(selector).get_attribute("data-bytes"))

    def text(self, selector: str) -> str:
        return str(self.page.locator(selector).inner_text()).strip()

    def check_gpus(self, wanted: list[str]) -> None:
        """Leave exactly `wanted` checked, through the filter box and the checkboxes."""
        checked = self.page.locator("input.gpu-check:checked")
        for name in checked.evaluate_all("boxes => boxes.map((b) => b.value)"):
            if name not in wanted:
                self.page.locator(f'input.gpu-check[value="{name}"]').uncheck()
        for name in wanted:
            self.page.fill("#gpu-search", name)
            self.page.locator(f'input.gpu-check[value="{name}"]').check()
        self.page.fill("#gpu-search", "")

    def price(self, name: str, value: str) -> None:
        row = self.page.locator(".gpu-row", has=self.page.locator(f'input[value="{name}"]'))
        row.locator(".gpu-price").fill(value)


def merged(job: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """A job with a suggestion's `set` applied (nested objects merged field by field)."""
    out = dict(job)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def gpu_label(result: dict[str, Any]) -> str:
    """How the page names a fit-check result's GPU: a GPU given by its memory says so."""
    gpu = result["gpu"]
    if gpu["matched_by"] != "memory_mib":
        return str(gpu["name"])
    size = f"{gib(gpu['memory_bytes'])} GiB"
    if gpu["name"] is None:
        return f"by size: {size} (no catalog GPU of this size)"
    return f"matched by size: {size} → {gpu['driver_name'].removeprefix('NVIDIA ')}"


def assert_estimate_shown(shown: dict[str, Any], est: dict[str, Any]) -> None:
    peak = est["peak"]
    for level, key in (
        ("allocated", "allocated_bytes"),
        ("reserved", "reserved_bytes"),
        ("device", "device_bytes"),
        ("safe", "device_bytes_upper"),
    ):
        assert shown["levels"][level] == {"bytes": peak[key], "text": gib_text(peak[key])}
    assert peak["phase_words"] in shown["phase"]["text"]
    assert shown["phase"]["key"] == peak["phase"]
    parts = {k: v for k, v in {**est["components"], **est["overheads"]}.items() if v > 0}
    assert shown["legend"] == [
        {"key": k, "bytes": v, "text": gib_text(v)} for k, v in parts.items()
    ]
    assert f"Safe bound {gib(peak['device_bytes_upper'])} GiB" in shown["levelLabels"]
    # The hatched part is what the safe bound adds to the device level, not the bound itself.
    margin = peak["device_bytes_upper"] - peak["device_bytes"]
    assert shown["margin"] == {"bytes": margin, "text": gib_text(margin)}
    assert shown["marginLabel"] == "Safe bound: margin over device"
    calibration = est["calibration"]
    assert shown["calibration"]["applied"] == ("yes" if calibration["applied"] else "no")
    assert shown["calibration"]["scope"] == calibration["scope"]
    assert shown["calibration"]["samples"] == str(calibration["samples"])
    assert shown["calibration"]["nodes"] == str(calibration["nodes"])
    assert shown["calibration"]["factor"] == fixed(calibration["factor"], 3)
    assert shown["calibration"]["levels"] == [
        {
            "level": level["level"],
            "scope": level["scope"],
            "factor": fixed(level["factor"], 3),
            "samples": str(level["samples"]),
            "nodes": str(level["nodes"]),
        }
        for level in calibration["levels"]
    ]
    assert shown["calibration"]["state"] == calibration["state"]


def assert_fit_shown(shown: dict[str, Any], fit: dict[str, Any]) -> None:
    cheapest = fit["cheapest"]["index"] if fit["cheapest"] else None
    assert len(shown["fit"]) == len(fit["results"])
    for i, (row, result) in enumerate(zip(shown["fit"], fit["results"], strict=True)):
        assert row["gpu"] == result["gpu"]["name"]
        assert row["label"].startswith(gpu_label(result))
        assert row["fits"] is result["fits"]
        assert row["fitsText"].endswith("yes" if result["fits"] else "no")
        assert row["usable"] == {
            "bytes": result["usable_bytes"],
            "text": gib(result["usable_bytes"]),
        }
        assert row["headroom"] == {
            "bytes": result["headroom_bytes"],
            "text": signed_gib(result["headroom_bytes"]),
        }
        assert row["maxBatch"] == str(result["max_batch_size"])
        assert row["maxSeq"] == str(result["max_seq_len"])
        cost = result["cost_per_hour"]
        assert row["cost"].startswith("—" if cost is None else f"{cost:.2f}")
        assert row["cheapest"] is (i == cheapest)
        assert ("cheapest" in row["cost"]) is (i == cheapest)
    expected = {
        r["gpu"]["name"]: [
            {"bytes": s["required_bytes"], "fits": s["fits"], "set": s["set"]}
            for s in r["suggestions"]
        ]
        for r in fit["results"]
        if not r["fits"] and r["suggestions"]
    }
    assert {
        gpu: [{k: item[k] for k in ("bytes", "fits", "set")} for item in items]
        for gpu, items in shown["suggestions"].items()
    } == expected
    for result in fit["results"]:
        for item, suggestion in zip(
            shown["suggestions"].get(result["gpu"]["name"], []), result["suggestions"], strict=False
        ):
            assert suggestion["description"] in item["text"]


def assert_curves_shown(shown: dict[str, Any], api: httpx.Client, job: dict[str, Any]) -> None:
    """Both curves' points are the batch endpoint's answers, the job's own point marked."""
    jobs = []
    for chart, field in (("batch", "batch_size"), ("seq", "seq_len")):
        curve = shown["curves"][chart]
        assert curve["own"] == job[field]
        jobs += [{**job, field: p["x"]} for p in curve["points"]]
    answer = api.post("/v1/estimates:batch", json={"jobs": jobs}).json()
    expected = [r["estimate"]["peak"]["device_bytes_upper"] for r in answer["results"]]
    points = shown["curves"]["batch"]["points"] + shown["curves"]["seq"]["points"]
    assert [p["bytes"] for p in points] == expected


def assert_placement_shown(shown: dict[str, Any], placed: dict[str, Any]) -> None:
    """The placement table: one row per GPU type and strategy, as the API placed them."""
    rows = shown["placement"]
    assert rows is not None and len(rows) == len(placed["placements"])
    picks = {
        word: placed[word]["index"] for word in ("cheapest", "fewest") if placed[word] is not None
    }
    for i, (row, p) in enumerate(zip(rows, placed["placements"], strict=True)):
        assert (row["gpu"], row["strategy"], row["outcome"]) == (
            p["gpu"],
            p["strategy"],
            p["outcome"],
        )
        assert sorted(row["badges"]) == sorted(word for word, at in picks.items() if at == i)
        assert row["cheapest"] is (picks.get("cheapest") == i)
        if p["count"] is None:
            assert row["reason"] == p["reason"] and row["count"] is None
            continue
        assert row["count"] == str(p["count"]) and row["nodes"] == str(p["nodes"])
        assert row["perGpu"] == {"bytes": p["required_bytes"], "text": gib(p["required_bytes"])}
        assert row["cost"] == fixed(p["cost_per_hour"], 2)
