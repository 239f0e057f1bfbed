"""The README and the manual (docs/) as a new user reads them: the settings table is the settings
class's, the estimate and batch examples are answered as they say, and `vramcast` is on PATH
before it is first used."""

from __future__ import annotations

import json
import re
from pathlib import Path

from fastapi.testclient import TestClient

from service.api.settings import Settings, settings_table

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
SETTINGS_PAGE = DOCS / "settings.md"
API_PAGE = DOCS / "api.md"
TABLE = re.compile(r"<!-- settings-table:start -->\n(.*?)<!-- settings-table:end -->", re.S)
BATCH = re.compile(r"curl -s localhost:8000/v1/estimates:batch [^\n]*-d '(.*?)'\n```", re.S)
ESTIMATE = re.compile(r"curl -s localhost:8000/v1/estimates [^\n]*\n\s*-d '(.*?)'\n```", re.S)
NAV_PAGE = re.compile(r"^\s*- (?:[^:\n]+: )?(\S+\.md)\s*$", re.M)


def _manual_in_reading_order() -> list[Path]:
    """The manual's pages in mkdocs.yml's nav order."""
    nav = NAV_PAGE.findall((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    assert nav, "mkdocs.yml lists no pages in its nav"
    return [DOCS / page for page in nav]


def test_the_settings_table_is_the_settings_class() -> None:
    found = TABLE.search(SETTINGS_PAGE.read_text(encoding="utf-8"))
    assert found, "docs/settings.md has no settings table between its markers"
    assert found.group(1) == settings_table(), (
        "docs/settings.md's settings table differs from the settings: paste the output of "
        "`python -m service.api.settings --markdown` between its markers"
    )
    for name in Settings.model_fields:
        assert f"`VRAMCAST_{name.upper()}`" in found.group(1)


def test_the_batch_example_is_answered_as_the_manual_says(client: TestClient) -> None:
    found = BATCH.search(API_PAGE.read_text(encoding="utf-8"))
    assert found, "docs/api.md has no batch example"
    body = json.loads(found.group(1))
    assert len(body["jobs"]) == 3
    answer = client.post("/v1/estimates:batch", json=body).json()
    assert [r["status"] for r in answer["results"]] == [200, 200, 422]
    assert (answer["succeeded"], answer["failed"]) == (2, 1)
    [error] = answer["results"][2]["problem"]["errors"]
    assert error["loc"] == ["body", "jobs", 2, "batch_size"]
    assert error["detail"] == "Input should be a valid integer"


def test_the_estimate_examples_are_answered(client: TestClient) -> None:
    for page in (README, API_PAGE):
        bodies = ESTIMATE.findall(page.read_text(encoding="utf-8"))
        assert bodies, f"{page.name} has no POST /v1/estimates example"
        for body in bodies:
            answer = client.post("/v1/estimates", json=json.loads(body))
            assert answer.status_code == 200, (page.name, answer.json())


def test_the_virtualenv_is_activated_before_vramcast_is_first_run() -> None:
    for pages in ([README], _manual_in_reading_order()):
        text = "".join(page.read_text(encoding="utf-8") for page in pages)
        blocks = re.findall(r"```\n(.*?)```", text, re.S)
        commands = [
            line.removeprefix("$ ").strip()
            for block in blocks
            for line in block.splitlines()
            if re.match(r"(\$ )?(\. \.venv/bin/activate|vramcast |VRAMCAST_\S+ vramcast )", line)
        ]
        assert commands[0] == ". .venv/bin/activate", (pages[0].name, commands[:3])
