"""/docs and /redoc name only the service's own assets, and the service serves them."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

from service.api.docs import ASSETS_PATH


@pytest.mark.parametrize(
    ("page", "assets"),
    [
        ("/docs", {"swagger-ui-bundle.js", "swagger-ui.css", "favicon.png"}),
        ("/redoc", {"redoc.standalone.js", "favicon.png"}),
    ],
)
def test_docs_pages_load_only_local_assets(client: TestClient, page: str, assets: set[str]) -> None:
    response = client.get(page)
    assert response.status_code == 200
    html = response.text
    assert "http://" not in html
    assert "https://" not in html
    named = set(re.findall(rf'(?:src|href)="{ASSETS_PATH}/([^"]+)"', html))
    assert named == assets
    assert "/openapi.json" in html
    for name in assets:
        asset = client.get(f"{ASSETS_PATH}/{name}")
        assert asset.status_code == 200
        assert len(asset.content) > 1000 or name == "favicon.png"


def test_the_bundles_are_swagger_ui_5_and_redoc_2(client: TestClient) -> None:
    swagger = client.get(f"{ASSETS_PATH}/swagger-ui-bundle.js").text
    assert "SwaggerUIBundle" in swagger
    # OpenAPI 3.1, which FastAPI writes, needs Swagger UI 5.
    assert "openapi;version=3.1" in swagger
    redoc = client.get(f"{ASSETS_PATH}/redoc.standalone.js").text
    assert "Redoc" in redoc[:2000]
    assert client.get("/redoc").headers["content-security-policy"] == "img-src 'self' data:"
    assert client.get("/openapi.json").json()["openapi"].startswith("3.1")
