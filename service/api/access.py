"""Request ids and access logs (pure ASGI, the outermost layer: every answer passes it).

Every response carries `X-Request-ID`: the request's own when it sent a sane one (a proxy's or a
client's id, so that one request is followed across services), else a new one. Every request
is logged when its response ends, as one JSON object on the `vramcast.access` logger: the
request id, method, route template (never the raw path, which can carry anything), status and
latency in milliseconds.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
import uuid
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

ACCESS_LOGGER = "vramcast.access"
REQUEST_ID_HEADER = "X-Request-ID"
# An id a caller sends is kept when it is this sane: visible ASCII without quotes or
# separators a log reader could trip over, at most 128 characters (a UUID, a trace id, a
# proxy's request id); anything else is replaced by a new UUID.
_SANE_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:/+=@-]{1,128}")
# Label for requests that matched no route, as the metrics label them.
UNMATCHED_ROUTE = "unmatched"

logger = logging.getLogger(ACCESS_LOGGER)


def request_id_of(scope: Scope) -> str:
    """The request's id: the `X-Request-ID` it sent when sane, else a new one."""
    for name, value in scope["headers"]:
        if name == b"x-request-id":
            sent: bytes = value
            if _SANE_REQUEST_ID.fullmatch(sent):
                return sent.decode("ascii")
            break
    return uuid.uuid4().hex


class AccessMiddleware:
    """Gives each request an id, echoes it on the response and logs the request once."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        request_id = request_id_of(scope)
        scope.setdefault("state", {})["request_id"] = request_id
        header = (REQUEST_ID_HEADER.lower().encode(), request_id.encode("ascii"))
        status = 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [h for h in message.get("headers", []) if h[0].lower() != header[0]]
                message = {**message, "headers": [*headers, header]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            if logger.isEnabledFor(logging.INFO):
                route = getattr(scope.get("route"), "path", None) or UNMATCHED_ROUTE
                fields: dict[str, Any] = {
                    "request_id": request_id,
                    "method": scope["method"],
                    "route": route,
                    "status": status,
                    "latency_ms": round((time.perf_counter() - start) * 1000, 3),
                }
                logger.info(json.dumps(fields, separators=(",", ":")), extra={"access": fields})


class StderrLines(logging.Handler):
    """Writes each record's message as one line to the current `sys.stderr`."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:
            self.handleError(record)


def configure_access_log() -> None:
    """JSON lines on stderr for the access logger, unless logging set it up already (then its
    handlers, or the root's, are left as they are)."""
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = StderrLines()
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
