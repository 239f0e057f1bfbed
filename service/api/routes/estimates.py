"""Estimates of a job's peak memory: one, or a batch."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute
from pydantic_core import to_json
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from service.api.answers import Answer
from service.api.batch_body import SharedSpec, known_key, read_known, read_shared, remember
from service.api.body import is_json, request_body, validate_body, validate_body_or
from service.api.budget import authorization
from service.api.deps import Services, estimation_for, services_of
from service.api.problems import responses
from service.api.responses import JSON_MEDIA_TYPE
from service.api.schemas import BatchIn, BatchOut, EstimateOut, JobsIn, JobSpec
from service.core.cold import ColdWorkRefused, refusing_cold_work

PREFIX = "/v1"
router = APIRouter(prefix=PREFIX, tags=["estimates"])
ESTIMATE_PATH = f"{PREFIX}/estimates"


@router.post(
    ESTIMATE_PATH.removeprefix(PREFIX),
    response_model=EstimateOut,
    summary="Estimate a job's peak GPU memory",
    description="The peak of one GPU of the job at the allocated, reserved and device levels, "
    "the safe bound, where the bytes go and when the peak happens.",
    responses=responses(404, 413, 415, 422, 429, 503),
    openapi_extra=request_body(JobSpec),
)
async def create_estimate(request: Request) -> Response:
    return await estimate_response(
        services_of(request),
        await request.body(),
        request.headers.get("content-type"),
        request.scope["headers"],
    )


async def estimate_response(
    services: Services,
    body: bytes,
    content_type: str | None,
    headers: Iterable[tuple[bytes, bytes]] = (),
) -> Response:
    """POST /v1/estimates' answer to `body`, sent as `content_type` with the request's
    `headers` (read only for cold work's caller: `budget`).

    Schedulers call this before every placement: the body is parsed by pydantic-core in one
    pass, the services are read directly (FastAPI's body and dependency resolution would cost
    more than the estimate), and a body asked before under the same calibration factors gets
    its kept answer. A warm estimate is made on the event loop; one that would run the step or
    replay the allocator (`core.cold`) is made in the thread pool, the event loop answering
    meanwhile (the kept answers are the event loop's alone), within a slot and the time for
    cold work (`budget`)."""
    cacheable = is_json(content_type)
    generation = services.factors.generation()
    if cacheable:
        kept = services.answers.get(body, generation)
        if kept is not None:
            services.metrics.count_estimate(kept.model)
            return Response(kept.content, media_type=JSON_MEDIA_TYPE)
    # A body that copies one read before at another shape shares its reading and its spec
    # (`batch_body.read_known`); any other is read in full, and remembered when valid.
    key = known_key(body) if cacheable else None
    known = None if key is None else read_known(key)
    spec: SharedSpec | None
    if known is not None:
        job, spec = known
    else:
        job = validate_body(body, content_type, JobSpec)
        spec = None if key is None else remember(key, job)
    # The answer's values are encoded in one pass, as the response model would write them.
    estimation = estimation_for(services)
    try:
        with refusing_cold_work():
            values = estimation.values(job, shared=spec)
    except ColdWorkRefused:
        async with services.cold_work.claim(authorization(headers)) as claim:
            await claim.admit()
            values = await run_in_threadpool(claim.run, estimation.values, job, shared=spec)
    content = to_json(values)
    if cacheable:
        services.answers.put(body, Answer(content, values["model"], generation))
    return Response(content, media_type=JSON_MEDIA_TYPE)


@router.post(
    "/estimates:batch",
    response_model=BatchOut,
    summary="Estimate up to 1000 jobs in one call",
    description="Results come in the jobs' order; a job that fails gets its own problem entry "
    "(status 404 or 422; 429 or 503 for one refused cold work) and the others are still "
    "answered.",
    responses=responses(413, 415, 422),
    openapi_extra=request_body(BatchIn),
)
async def create_estimates_batch(request: Request) -> Response:
    # A batch whose jobs are all valid is read once per distinct job (its copies at other
    # shapes share its reading: `batch_body.read_shared`), else in one pass of pydantic-core;
    # any other is read as FastAPI reads a `BatchIn` body, each job failing on its own. The
    # estimates share the request's lookups and are encoded in one pass; the work runs in the
    # thread pool, as a plain route's would, so that the event loop keeps answering meanwhile.
    # Its first job that runs a step or replays the allocator takes the request's slot for cold
    # work (`budget`), from the thread; the jobs its refusals stop get their own problems.
    services = services_of(request)
    body = await request.body()
    content_type = request.headers.get("content-type")
    estimation = estimation_for(services)

    def answer() -> bytes:
        shared = read_shared(body) if is_json(content_type) else None
        if shared is not None:
            return encode_batch(estimation.shared_results(shared))
        jobs = validate_body_or(body, content_type, JobsIn, BatchIn).jobs
        return to_json(estimation.batch(jobs))

    async with services.cold_work.claim(request.headers.get("authorization")) as claim:
        content = await run_in_threadpool(claim.run, answer)
    return Response(content, media_type=JSON_MEDIA_TYPE)


def encode_batch(results: Iterable[dict[str, Any]]) -> bytes:
    """The JSON of a `BatchOut` of `results`: what `to_json` writes of its values, each result
    encoded as it comes, so that a batch's answers are freed as they are encoded rather than
    all held (and walked by the garbage collector) until the end."""
    parts: list[bytes] = []
    failed = 0
    for result in results:
        parts.append(to_json(result))
        if result["problem"] is not None:
            failed += 1
    counts = to_json({"results": [], "succeeded": len(parts) - failed, "failed": failed})
    head, tail = counts.split(b"[]", 1)
    if not parts:
        return counts
    # The results' list written around them, so that the answer is joined in one copy.
    parts[0] = b"".join((head, b"[", parts[0]))
    parts[-1] = b"".join((parts[-1], b"]", tail))
    return b",".join(parts)


class EstimateShortcut:
    """POST /v1/estimates answered straight from the middleware (pure ASGI), as its endpoint
    answers it (`estimate_response`).

    Schedulers send this request before every placement, and the router's matching, request
    wrapping and dependency solving would cost a good part of what the estimate itself does.
    The request keeps everything else: it passes the same middleware (body limit, metrics,
    access log) labelled with the same route, its errors are answered by the app's handlers as
    the exception middleware would answer them, and those without one go on to the server-error
    middleware. Every other request goes to the router.
    """

    def __init__(self, app: ASGIApp, route: APIRoute, handlers: Mapping[Any, Any]) -> None:
        self.app = app
        self.route = route
        self.path = route.path
        self.handlers = handlers  # the app's, looked up when an error happens

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or _route_path(scope) != self.path:
            await self.app(scope, receive, send)
            return
        scope["route"] = self.route
        scope["endpoint"] = self.route.endpoint
        scope["path_params"] = {}
        try:
            # What the endpoint reads of its `Request`, read straight from the scope and the
            # messages: the request is made only for an error's handler.
            services: Services = scope["app"].state.services
            body = await _body(receive)
            response = await estimate_response(
                services, body, _content_type(scope), scope["headers"]
            )
        except Exception as exc:
            handler = self._handler(exc)
            if handler is None:
                raise
            request = Request(scope, receive)
            if inspect.iscoroutinefunction(handler):
                response = await handler(request, exc)
            else:
                response = await run_in_threadpool(handler, request, exc)
        await response(scope, receive, send)

    def _handler(self, exc: Exception) -> Any:
        """The handler the exception middleware would call: the app's for the closest class,
        none for those only the server-error middleware handles (`Exception`)."""
        for kind in type(exc).__mro__:
            if kind is Exception:
                return None
            if kind in self.handlers:
                return self.handlers[kind]
        return None


async def _body(receive: Receive) -> bytes:
    """The request's body, as `Request.body` reads it: ClientDisconnect if the client goes
    away first."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.request":
            chunk: bytes = message.get("body", b"")
            if chunk:
                chunks.append(chunk)
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)
        elif message["type"] == "http.disconnect":
            raise ClientDisconnect()


def _content_type(scope: Scope) -> str | None:
    """The request's first Content-Type, as `request.headers.get("content-type")` reads it."""
    for name, value in scope["headers"]:
        if name == b"content-type":
            found: str = value.decode("latin-1")
            return found
    return None


def _route_path(scope: Scope) -> str:
    """The path the router matches: the request's, less the app's root path (as Starlette's
    routing reads it)."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root) and path != root and path[len(root)] == "/":
        return path[len(root) :]
    return path


def estimate_route() -> APIRoute:
    """The POST /v1/estimates route: the one the router would put in the request's scope."""
    for route in router.routes:
        if (
            isinstance(route, APIRoute)
            and route.path == ESTIMATE_PATH
            and "POST" in (route.methods or ())
        ):
            if route.dependencies or route.dependant.dependencies:
                # The shortcut calls the endpoint itself: a dependency would be skipped.
                raise RuntimeError(
                    f"{ESTIMATE_PATH} has dependencies, which EstimateShortcut would not run"
                )
            return route
    raise LookupError("no estimate route")
