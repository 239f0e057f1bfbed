"""POST /v1/estimates read straight from the ASGI messages: what `Request` would read."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.requests import ClientDisconnect, Request

from service.api.routes.estimates import _body, _content_type


def _receiving(messages: list[dict[str, Any]]) -> Any:
    queue = list(messages)

    async def receive() -> dict[str, Any]:
        return queue.pop(0)

    return receive


def _read(messages: list[dict[str, Any]]) -> tuple[bytes, bytes]:
    async def both() -> tuple[bytes, bytes]:
        scope = {"type": "http", "headers": []}
        return await _body(_receiving(messages)), await Request(scope, _receiving(messages)).body()

    return asyncio.run(both())


@pytest.mark.parametrize(
    "messages",
    [
        [{"type": "http.request", "body": b'{"a": 1}', "more_body": False}],
        [{"type": "http.request"}],
        [
            {"type": "http.request", "body": b'{"a"', "more_body": True},
            {"type": "http.request", "body": b"", "more_body": True},
            {"type": "other"},
            {"type": "http.request", "body": b": 1}"},
        ],
    ],
)
def test_the_body_is_what_request_reads(messages: list[dict[str, Any]]) -> None:
    ours, theirs = _read(messages)
    assert ours == theirs


def test_a_client_gone_before_the_body_ends_is_a_disconnect() -> None:
    messages = [
        {"type": "http.request", "body": b"{", "more_body": True},
        {"type": "http.disconnect"},
    ]
    with pytest.raises(ClientDisconnect):
        _read(messages)


@pytest.mark.parametrize(
    "headers",
    [
        [],
        [(b"content-type", b"application/json")],
        [(b"host", b"x"), (b"content-type", b"Application/JSON; charset=utf-8")],
        [(b"content-type", b"text/plain"), (b"content-type", b"application/json")],
        [(b"content-type", "application/x\u00e9+json".encode("latin-1"))],
    ],
)
def test_the_content_type_is_what_request_reads(headers: list[tuple[bytes, bytes]]) -> None:
    scope = {"type": "http", "headers": headers}
    assert _content_type(scope) == Request(scope).headers.get("content-type")
