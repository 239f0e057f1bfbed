"""The interactive API docs, `/docs` (Swagger UI) and `/redoc` (ReDoc), served from the package.

FastAPI's own pages load Swagger UI and ReDoc from a CDN, which a cluster without internet
access cannot reach. Here both pages load their scripts and styles from the service itself:
the assets are those the `fastapi-offline` distribution ships (Swagger UI 5 and ReDoc 2, the
builds FastAPI's pages name), mounted as static files, so the pages need no network beyond
the service.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.openapi.docs import (
    get_redoc_html,
    get_swagger_ui_html,
    get_swagger_ui_oauth2_redirect_html,
)
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

# The distribution and folder that hold the assets, read through importlib's resources.
ASSETS_PACKAGE = "fastapi_offline"
ASSETS_DIRECTORY = "static"
ASSETS_PATH = "/docs-assets"
SWAGGER_URL = "/docs"
REDOC_URL = "/redoc"
OAUTH2_REDIRECT_URL = "/docs/oauth2-redirect"
REDOC_IMAGES_POLICY = "img-src 'self' data:"
# Swagger UI's validator badge would send the schema's URL to swagger.io: off.
SWAGGER_UI_PARAMETERS = {"validatorUrl": None}


def mount_docs(app: FastAPI) -> None:
    """Serve `/docs` and `/redoc` from local assets (build the app with `docs_url=None,
    redoc_url=None`, so that FastAPI adds no CDN pages of its own)."""
    app.mount(
        ASSETS_PATH,
        StaticFiles(packages=[(ASSETS_PACKAGE, ASSETS_DIRECTORY)]),
        name="docs-assets",
    )

    def asset(request: Request, name: str) -> str:
        return f"{request.scope.get('root_path', '')}{ASSETS_PATH}/{name}"

    def openapi_url(request: Request) -> str:
        return f"{request.scope.get('root_path', '')}{app.openapi_url}"

    async def swagger_ui(request: Request) -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=openapi_url(request),
            title=f"{app.title} - Swagger UI",
            swagger_js_url=asset(request, "swagger-ui-bundle.js"),
            swagger_css_url=asset(request, "swagger-ui.css"),
            swagger_favicon_url=asset(request, "favicon.png"),
            oauth2_redirect_url=OAUTH2_REDIRECT_URL,
            swagger_ui_parameters=SWAGGER_UI_PARAMETERS,
        )

    async def oauth2_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    async def redoc(request: Request) -> HTMLResponse:
        page = get_redoc_html(
            openapi_url=openapi_url(request),
            title=f"{app.title} - ReDoc",
            redoc_js_url=asset(request, "redoc.standalone.js"),
            redoc_favicon_url=asset(request, "favicon.png"),
            with_google_fonts=False,
        )
        # ReDoc's sidebar shows its maker's logo from their CDN (and drops it when it cannot
        # load): images come from the service only, so the page never reaches outside.
        page.headers["Content-Security-Policy"] = REDOC_IMAGES_POLICY
        return page

    app.add_api_route(SWAGGER_URL, swagger_ui, methods=["GET"], include_in_schema=False)
    app.add_api_route(
        OAUTH2_REDIRECT_URL, oauth2_redirect, methods=["GET"], include_in_schema=False
    )
    app.add_api_route(REDOC_URL, redoc, methods=["GET"], include_in_schema=False)
