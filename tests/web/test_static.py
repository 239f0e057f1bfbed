"""The page's files: served by the app beside the API, shipped in the package, self-contained."""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterator
from importlib import resources

import pytest
from fastapi.testclient import TestClient

from service.api.app import create_app
from service.api.settings import Settings
from tests.web.conftest import REPO_ROOT

STATIC_FILES = ("index.html", "app.js", "style.css")
# Any reference to another host: a scheme or a protocol-relative URL.
EXTERNAL_URL = re.compile(r"(?:https?:)?//[A-Za-z0-9.-]+\.[A-Za-z]{2,}")
ALLOWED_URLS = {"http://www.w3.org"}  # the SVG namespace, an identifier never fetched


@pytest.fixture
def client() -> Iterator[TestClient]:
    with TestClient(create_app(Settings(database_url="sqlite://"))) as test_client:
        yield test_client


def test_the_page_is_served_at_the_root(client: TestClient) -> None:
    response = client.get("/")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    assets = re.findall(r'(?:src|href)="(web/[^"]+)"', response.text)
    assert sorted(assets) == ["web/app.js", "web/style.css"]
    for asset in assets:
        served = client.get(f"/{asset}")
        assert served.status_code == 200, asset
        kind = "javascript" if asset.endswith(".js") else "css"
        assert kind in served.headers["content-type"]


def test_the_api_is_not_shadowed_by_the_page(client: TestClient) -> None:
    assert client.get("/v1/gpus").status_code == 200
    missing = client.get("/v1/no-such-route")
    assert missing.status_code == 404
    assert missing.headers["content-type"].startswith("application/problem+json")
    assert client.get("/web/no-such-file.js").status_code == 404
    paths = client.get("/openapi.json").json()["paths"]
    assert "/" not in paths
    assert not any(path.startswith("/web") for path in paths)


def test_the_files_ship_in_the_package() -> None:
    static = resources.files("service.web").joinpath("static")
    for name in STATIC_FILES:
        assert static.joinpath(name).is_file(), name
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    package_data = pyproject["tool"]["setuptools"]["package-data"]
    assert package_data["service.web"] == ["static/*"]


@pytest.mark.parametrize("name", STATIC_FILES)
def test_the_page_loads_nothing_from_other_hosts(name: str) -> None:
    text = resources.files("service.web").joinpath("static", name).read_text(encoding="utf-8")
    found = {m.group(0) for m in EXTERNAL_URL.finditer(text)} - ALLOWED_URLS
    assert not found, f"{name} refers to other hosts: {sorted(found)}"


def test_every_objective_the_page_offers_is_answered(client: TestClient) -> None:
    """The Objective select's values, each posted as the page posts it (its defaults beside
    the objective): every one is an objective the API models."""
    page = (REPO_ROOT / "service" / "web" / "static" / "index.html").read_text(encoding="utf-8")
    select = re.search(r'<select id="objective"[^>]*>(.*?)</select>', page, re.S)
    assert select is not None
    values = re.findall(r'<option value="([^"]+)"', select.group(1))
    assert {"sft", "dpo", "reward", "kto", "orpo", "grpo"} <= set(values)
    for value in values:
        job: dict[str, object] = {
            "model": "Qwen/Qwen2.5-0.5B",
            "batch_size": 2,
            "seq_len": 512,
            "objective": value,
        }
        if value == "grpo":  # app.js: one prompt's group per step, half the sequence generated
            job["grpo"] = {"num_generations": 2, "max_completion_length": 256}
        response = client.post("/v1/estimates", json=job)
        assert response.status_code == 200, (value, response.text)
        if value == "grpo":
            generation = response.json()["generation"]
            assert generation["kv_cache_bytes"] > 0


def test_the_page_sends_grpo_settings_as_the_api_names_them() -> None:
    """app.js builds GRPO's settings by GRPOConfig's names, and shows their hint."""
    script = (REPO_ROOT / "service" / "web" / "static" / "app.js").read_text(encoding="utf-8")
    assert "job.grpo = {" in script and "num_generations:" in script
    assert '"/grpo/max_completion_length": "max_completion_length"' in script
    page = (REPO_ROOT / "service" / "web" / "static" / "index.html").read_text(encoding="utf-8")
    assert 'id="grpo-hint"' in page
