"""README's REST API section as a new user reads it: the settings table is the settings class's,
the batch example is answered as it says, and `vramcast` is on PATH before it is first used."""

from __future__ import annotations

import json
import re
from pathlib import Path

from fastapi.testclient import TestClient

from service.api.settings import Settings, settings_table

README = Path(__file__).resolve().parents[2] / "README.md"
TABLE = re.compile(r"<!-- settings-table:start -->\n(.*?)<!-- settings-table:end -->", re.S)
BATCH = re.compile(r"curl -s localhost:8000/v1/estimates:batch [^\n]*-d '(.*?)'\n```", re.S)


def test_the_settings_table_is_the_settings_class() -> None:
    found = TABLE.search(README.read_text(encoding="utf-8"))
    assert found, "README.md has no settings table between its markers"
    assert found.group(1) == settings_table(), (
        "README.md's settings table differs from the settings: paste the output of "
        "`python -m service.api.settings --markdown` between its markers"
    )
    for name in Settings.model_fields:
        assert f"`VRAMCAST_{name.upper()}`" in found.group(1)


def test_the_batch_example_is_answered_as_the_readme_says(client: TestClient) -> None:
    found = BATCH.search(README.read_text(encoding="utf-8"))
    assert found, "README.md has no batch example"
    body = json.loads(found.group(1))
    assert len(body["jobs"]) == 3
    answer = client.post("/v1/estimates:batch", json=body).json()
    assert [r["status"] for r in answer["results"]] == [200, 200, 422]
    assert (answer["succeeded"], answer["failed"]) == (2, 1)
    [error] = answer["results"][2]["problem"]["errors"]
    assert error["loc"] == ["body", "jobs", 2, "batch_size"]
    assert error["detail"] == "Input should be a valid integer"


def test_the_virtualenv_is_activated_before_vramcast_is_first_run() -> None:
    text = README.read_text(encoding="utf-8")
    blocks = re.findall(r"```\n(.*?)```", text, re.S)
    commands = [
        line.removeprefix("$ ").strip()
        for block in blocks
        for line in block.splitlines()
        if re.match(r"(\$ )?(\. \.venv/bin/activate|vramcast |VRAMCAST_\S+ vramcast )", line)
    ]
    assert commands[0] == ". .venv/bin/activate", commands[:3]
