"""The manual at /manual/: the built site's pages, or a problem naming `make docs`."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient

from service.api.manual import DEFAULT_MANUAL_DIR
from service.api.problems import PROBLEM_MEDIA_TYPE
from tests.api.conftest import make_app

INDEX = "<!doctype html><title>vramcast</title><p>the manual</p>\n"
PAGE = "<!doctype html><title>Settings</title><p>VRAMCAST_MANUAL_DIR</p>\n"


def _built(site: Path) -> Path:
    (site / "settings").mkdir(parents=True)
    (site / "index.html").write_text(INDEX, encoding="utf-8")
    (site / "settings" / "index.html").write_text(PAGE, encoding="utf-8")
    return site


def test_the_built_manual_is_served(tmp_path: Path) -> None:
    site = _built(tmp_path / "site")
    with TestClient(make_app(manual_dir=site)) as client:
        index = client.get("/manual/")
        assert index.status_code == 200
        assert index.headers["content-type"].startswith("text/html")
        assert index.text == INDEX
        assert client.get("/manual/settings/").text == PAGE
        redirected = client.get("/manual", follow_redirects=False)
        assert redirected.is_redirect
        assert redirected.headers["location"].endswith("/manual/")


def test_a_missing_page_of_the_built_manual_is_a_404(tmp_path: Path) -> None:
    site = _built(tmp_path / "site")
    with TestClient(make_app(manual_dir=site)) as client:
        assert client.get("/manual/no-such-page/").status_code == 404


def test_the_manual_not_built_is_a_problem_naming_make_docs(tmp_path: Path) -> None:
    missing = tmp_path / "not-built"
    with TestClient(make_app(manual_dir=missing)) as client:
        for path in ("/manual/", "/manual/settings/", "/manual/assets/site.css"):
            answer = client.get(path)
            assert answer.status_code == 404, path
            assert answer.headers["content-type"] == PROBLEM_MEDIA_TYPE
            problem = answer.json()
            assert problem["status"] == 404
            assert "make docs" in problem["detail"]
        # Built after start-up: served without a restart.
        _built(missing)
        assert client.get("/manual/").text == INDEX


def test_the_default_is_beside_the_web_page() -> None:
    assert DEFAULT_MANUAL_DIR.parts[-3:] == ("service", "web", "manual")


def test_the_manual_is_not_in_the_api_schema(tmp_path: Path) -> None:
    with TestClient(make_app(manual_dir=tmp_path)) as client:
        paths = client.get("/openapi.json").json()["paths"]
    assert not [path for path in paths if path.startswith("/manual")]
