"""Every error the API returns, as RFC 9457 `application/problem+json`, from this one module.

Problem types (the `type` member; tag URIs, RFC 4151, identify them without a web page):

| type                  | status | when                                                        |
|-----------------------|--------|-------------------------------------------------------------|
| invalid-request       | 422    | the body or a parameter fails the schema or a spec check;   |
|                       |        | `errors` gives each field's path                            |
| unknown-model         | 404    | a model id is in no catalog; `suggestions` are the closest  |
| unknown-gpu           | 404    | a GPU name is in no catalog; `suggestions` are the closest  |
| body-too-large        | 413    | the body is over the configured limit (`max_body_bytes`)    |
| unsupported-media-type| 415    | a body that is not JSON; `content_type` names what was sent |
| unauthorized          | 401    | no API key, or an unknown or revoked one (WWW-Authenticate) |
| forbidden             | 403    | the key lacks the scope the route needs; `scope` names it   |
| node-not-allowed      | 403    | an upload names a node id its key was not made for;         |
|                       |        | `node_id` names it                                          |
| store-unavailable     | 503    | the calibration store cannot be reached or did not answer   |
|                       |        | in time; retry after the `Retry-After` header's seconds     |
|                       |        | (also `retry_after_s`)                                      |
| store-read-only       | 503    | the store answers but refuses writes (read-only, disk       |
|                       |        | full); the detail names why; retry after `Retry-After`      |
| busy                  | 503    | no slot for cold work (a step's run, an allocator replay)   |
|                       |        | freed in time; retry after `Retry-After`                    |
| anonymous-share-taken | 429    | the slots for cold work open to callers without an API key  |
|                       |        | are taken; send a key or retry after `Retry-After`          |
| budget-exceeded       | 503    | the request's time for cold work ran out; what it computed  |
|                       |        | is kept and a retry after `Retry-After` continues from it   |
| about:blank           | any    | plain HTTP errors (unknown path, method not allowed)        |
| internal-error        | 500    | a bug; the detail never carries a traceback                 |
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from enum import StrEnum
from http import HTTPStatus
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.routing import iter_route_contexts
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
    SerializerFunctionWrapHandler,
    model_serializer,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Route

from service.api.access import REQUEST_ID_HEADER
from service.calibration.uploads import IdempotencyKeyReusedError, InvalidCursorError
from service.catalog.gpus import UnknownGpuError
from service.core.calibration import ImplausibleMeasurementError
from service.core.cold import ColdWorkOverBudget, ColdWorkRefused
from service.core.errors import (
    EstimatorError,
    InvalidConfigError,
    InvalidSpecError,
    UnknownModelError,
)
from service.store.db import store_unreachable, write_refusal
from service.store.keys import NodeNotAllowedError

PROBLEM_MEDIA_TYPE = "application/problem+json"
_TYPE_PREFIX = "tag:vramcast.dev,2025:problem:"

# Sizes of what a problem echoes back; requests can carry anything up to the body limit.
MAX_ERRORS = 100
MAX_LOC_DEPTH = 32
MAX_LOC_PART = 128
MAX_POINTER = 4096
MAX_FIELD_DETAIL = 1024
MAX_KIND = 128
MAX_DETAIL = 2048
MAX_NAME = 256
MAX_INSTANCE = 2048

# Seconds a client waits before retrying when the store is unreachable: a database restart
# or failover takes seconds, and a training node's upload can wait.
RETRY_AFTER_S = 5
# Seconds to wait after a request's time for cold work ran out: what it computed is kept, so
# asking again soon continues from there.
CONTINUE_AFTER_S = 1
# Seconds to wait when no slot for cold work freed in time: a cold estimate or fit-check holds
# its slot for about a second (docs/benchmarks.md: the first fit-check of a job, 1.0 s).
BUSY_RETRY_AFTER_S = 2

logger = logging.getLogger(__name__)


class ProblemType(StrEnum):
    INVALID_REQUEST = _TYPE_PREFIX + "invalid-request"
    UNKNOWN_MODEL = _TYPE_PREFIX + "unknown-model"
    UNKNOWN_GPU = _TYPE_PREFIX + "unknown-gpu"
    BODY_TOO_LARGE = _TYPE_PREFIX + "body-too-large"
    UNSUPPORTED_MEDIA_TYPE = _TYPE_PREFIX + "unsupported-media-type"
    UNAUTHORIZED = _TYPE_PREFIX + "unauthorized"
    FORBIDDEN = _TYPE_PREFIX + "forbidden"
    NODE_NOT_ALLOWED = _TYPE_PREFIX + "node-not-allowed"
    STORE_UNAVAILABLE = _TYPE_PREFIX + "store-unavailable"
    STORE_READ_ONLY = _TYPE_PREFIX + "store-read-only"
    BUSY = _TYPE_PREFIX + "busy"
    ANONYMOUS_SHARE_TAKEN = _TYPE_PREFIX + "anonymous-share-taken"
    BUDGET_EXCEEDED = _TYPE_PREFIX + "budget-exceeded"
    INTERNAL_ERROR = _TYPE_PREFIX + "internal-error"
    BLANK = "about:blank"


Loc = tuple[str | int, ...]


class FieldError(BaseModel):
    """One invalid input, located by its path in the request."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    loc: list[str | int] = Field(
        description="Path of the field: 'body' or 'path' first, then keys and list indexes.",
        max_length=MAX_LOC_DEPTH,
    )
    pointer: str = Field(
        description="The same path as a JSON Pointer into the body (RFC 6901), '' for the root.",
        max_length=MAX_POINTER,
    )
    detail: str = Field(description="Why the value is invalid.", max_length=MAX_FIELD_DETAIL)
    type: str = Field(description="Machine-readable error kind.", max_length=MAX_KIND)


class Problem(BaseModel):
    """An RFC 9457 problem detail, with the extension members this API defines."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: str = Field(description="URI identifying the problem type.", max_length=256)
    title: str = Field(description="Short summary of the problem type.", max_length=256)
    status: int = Field(description="The HTTP status code.", ge=400, le=599)
    detail: str = Field(description="This occurrence, in words.", max_length=MAX_DETAIL)
    instance: str | None = Field(
        default=None,
        description="The request path this problem occurred at.",
        max_length=MAX_INSTANCE,
    )
    errors: list[FieldError] | None = Field(
        default=None,
        description="invalid-request: each invalid field (the first 100).",
        max_length=MAX_ERRORS,
    )
    model: str | None = Field(
        default=None, description="unknown-model: the id that was asked for.", max_length=MAX_NAME
    )
    gpu: str | None = Field(
        default=None, description="unknown-gpu: the name that was asked for.", max_length=MAX_NAME
    )
    suggestions: list[str] | None = Field(
        default=None,
        description="unknown-model, unknown-gpu: the closest catalog entries.",
        max_length=16,
    )
    max_body_bytes: int | None = Field(
        default=None, description="body-too-large: the limit in bytes.", ge=0
    )
    content_type: str | None = Field(
        default=None,
        description="unsupported-media-type: the content type the request sent.",
        max_length=MAX_NAME,
    )
    scope: str | None = Field(
        default=None, description="forbidden: the scope the key lacks.", max_length=32
    )
    node_id: str | None = Field(
        default=None,
        description="node-not-allowed: the node id the key may not upload for.",
        max_length=MAX_NAME,
    )
    retry_after_s: int | None = Field(
        default=None,
        description="store-unavailable, store-read-only, busy, anonymous-share-taken, "
        "budget-exceeded: seconds to wait (as Retry-After).",
        ge=0,
    )

    @model_serializer(mode="wrap")
    def _without_absent_members(self, handler: SerializerFunctionWrapHandler) -> Any:
        # Extension members a problem type does not use are left out, not sent as null.
        return {k: v for k, v in handler(self).items() if v is not None}

    @classmethod
    def __get_pydantic_json_schema__(
        cls, schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        # The serializer above only drops absent members: document the fields themselves.
        if handler.mode == "serialization":
            schema = cast(CoreSchema, {k: v for k, v in schema.items() if k != "serialization"})
        return handler(schema)


class ProblemError(Exception):
    """Raised anywhere in the API to answer with `problem`."""

    def __init__(self, problem: Problem) -> None:
        super().__init__(problem.detail)
        self.problem = problem


def _pointer(loc: Sequence[str | int]) -> str:
    parts = list(loc[1:]) if loc and loc[0] in ("body", "path", "query", "header") else list(loc)
    escaped = (str(p).replace("~", "~0").replace("/", "~1") for p in parts)
    return "".join("/" + part for part in escaped)


def _clip(text: str, limit: int) -> str:
    """Text cut to `limit` characters: a problem echoes input, and input can be anything."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def field_error(loc: Sequence[str | int], detail: str, kind: str) -> FieldError:
    kept = [p if isinstance(p, int) else _clip(p, MAX_LOC_PART) for p in loc[:MAX_LOC_DEPTH]]
    return FieldError(
        loc=kept,
        pointer=_clip(_pointer(kept), MAX_POINTER),
        detail=_clip(detail, MAX_FIELD_DETAIL),
        type=_clip(kind, MAX_KIND),
    )


def invalid_request(errors: Sequence[FieldError]) -> Problem:
    where = ", ".join(".".join(str(p) for p in e.loc) for e in errors[:3])
    more = f" and {len(errors) - 3} more" if len(errors) > 3 else ""
    return Problem(
        type=ProblemType.INVALID_REQUEST,
        title="The request is invalid",
        status=HTTPStatus.UNPROCESSABLE_ENTITY,
        detail=_clip(f"invalid input at {where}{more}" if errors else "invalid input", MAX_DETAIL),
        errors=list(errors[:MAX_ERRORS]),
    )


def invalid_field(loc: Sequence[str | int], detail: str, kind: str = "value_error") -> Problem:
    return invalid_request([field_error(loc, detail, kind)])


def body_too_large(limit: int) -> Problem:
    return Problem(
        type=ProblemType.BODY_TOO_LARGE,
        title="The request body is too large",
        status=HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
        detail=f"the body is over the limit of {limit} bytes",
        max_body_bytes=limit,
    )


def unsupported_media_type(content_type: str) -> Problem:
    sent = _clip(content_type, MAX_NAME)
    return Problem(
        type=ProblemType.UNSUPPORTED_MEDIA_TYPE,
        title="The request body is not JSON",
        status=HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
        detail=_clip(
            f"the body's content type is {sent!r}; send it as application/json", MAX_DETAIL
        ),
        content_type=sent,
    )


def unauthorized(detail: str) -> Problem:
    return Problem(
        type=ProblemType.UNAUTHORIZED,
        title="An API key is needed",
        status=HTTPStatus.UNAUTHORIZED,
        detail=detail,
    )


def forbidden(scope: str) -> Problem:
    return Problem(
        type=ProblemType.FORBIDDEN,
        title="The API key lacks a scope",
        status=HTTPStatus.FORBIDDEN,
        detail=f"this request needs a key with the {scope!r} scope",
        scope=scope,
    )


def node_not_allowed(node_id: str) -> Problem:
    named = _clip(node_id, MAX_NAME)
    return Problem(
        type=ProblemType.NODE_NOT_ALLOWED,
        title="The API key may not upload for this node",
        status=HTTPStatus.FORBIDDEN,
        detail=_clip(
            f"this key was made for other node ids than node_id {named!r}; upload with the "
            "node's own key",
            MAX_DETAIL,
        ),
        node_id=named,
    )


def store_unavailable() -> Problem:
    return Problem(
        type=ProblemType.STORE_UNAVAILABLE,
        title="The calibration store is unavailable",
        status=HTTPStatus.SERVICE_UNAVAILABLE,
        detail="the database cannot be reached or did not answer in time; estimates still "
        "answer, uploads must be retried",
        retry_after_s=RETRY_AFTER_S,
    )


def store_read_only(reason: str) -> Problem:
    return Problem(
        type=ProblemType.STORE_READ_ONLY,
        title="The calibration store refuses writes",
        status=HTTPStatus.SERVICE_UNAVAILABLE,
        detail=_clip(
            f"{reason}; estimates and reads still answer, uploads must be retried", MAX_DETAIL
        ),
        retry_after_s=RETRY_AFTER_S,
    )


def busy(wait_s: float) -> Problem:
    return Problem(
        type=ProblemType.BUSY,
        title="Cold work is busy",
        status=HTTPStatus.SERVICE_UNAVAILABLE,
        detail=f"this request needs a job's step run or the allocator replayed, and no slot for "
        f"such work freed within {wait_s:g} s; answers already computed are not delayed",
        retry_after_s=BUSY_RETRY_AFTER_S,
    )


def anonymous_share_taken(wait_s: float) -> Problem:
    return Problem(
        type=ProblemType.ANONYMOUS_SHARE_TAKEN,
        title="The share of cold work open to callers without an API key is taken",
        status=HTTPStatus.TOO_MANY_REQUESTS,
        detail=f"this request needs a job's step run or the allocator replayed, and the slots "
        f"for such work open to callers without an API key stayed taken for {wait_s:g} s; "
        "send an API key (Authorization: Bearer) for the larger share, or ask again later",
        retry_after_s=BUSY_RETRY_AFTER_S,
    )


def budget_exceeded(seconds: float) -> Problem:
    return Problem(
        type=ProblemType.BUDGET_EXCEEDED,
        title="The request's time for cold work ran out",
        status=HTTPStatus.SERVICE_UNAVAILABLE,
        detail=f"this request ran jobs' steps and allocator replays for its {seconds:g} s; what "
        "it computed is kept, and asking again continues from there",
        retry_after_s=CONTINUE_AFTER_S,
    )


def from_exception(exc: Exception, loc_prefix: Loc = ("body",)) -> Problem:
    """The problem for any error; `loc_prefix` locates the job that a core error is about."""
    match exc:
        case ProblemError():
            return exc.problem
        case RequestValidationError():
            return invalid_request(_validation_errors(exc.errors()))
        case StarletteHTTPException(status_code=HTTPStatus.BAD_REQUEST):
            # FastAPI's only 400: a body it cannot decode (not UTF-8), which is invalid input.
            return invalid_field(("body",), "the body is not valid UTF-8 JSON", "json_invalid")
        case StarletteHTTPException():
            return http_problem(
                exc.status_code, exc.detail if isinstance(exc.detail, str) else None
            )
        case UnknownModelError():
            return Problem(
                type=ProblemType.UNKNOWN_MODEL,
                title="Unknown model",
                status=HTTPStatus.NOT_FOUND,
                detail=_clip(str(exc), MAX_DETAIL),
                model=_clip(exc.model_id, MAX_NAME),
                suggestions=list(exc.suggestions),
            )
        case UnknownGpuError():
            return Problem(
                type=ProblemType.UNKNOWN_GPU,
                title="Unknown GPU",
                status=HTTPStatus.NOT_FOUND,
                detail=_clip(str(exc), MAX_DETAIL),
                gpu=_clip(exc.name, MAX_NAME),
                suggestions=list(exc.suggestions),
            )
        case InvalidSpecError():
            loc = (*loc_prefix, *exc.field.split("."))
            return invalid_field(loc, exc.reason, "invalid_spec")
        case ImplausibleMeasurementError():
            loc = (*loc_prefix, *exc.field.split("."))
            return invalid_field(loc, exc.reason, "implausible_measurement")
        case NodeNotAllowedError():
            return node_not_allowed(exc.node_id)
        case IdempotencyKeyReusedError():
            loc = ("header", "Idempotency-Key")
            return invalid_field(loc, _clip(str(exc), MAX_FIELD_DETAIL), "idempotency_key_reused")
        case InvalidCursorError():
            return invalid_field(("query", "cursor"), "not a cursor this service issued", "cursor")
        case DBAPIError() if (refusal := write_refusal(exc)) is not None:
            return store_read_only(refusal)
        case ColdWorkOverBudget():
            return budget_exceeded(exc.seconds)
        case DBAPIError() | PoolTimeoutError() if store_unreachable(exc):
            return store_unavailable()
        case InvalidConfigError():
            loc = (*loc_prefix, "model", "hf_config", *exc.field.split("."))
            return invalid_field(loc, exc.reason, "invalid_config")
        case EstimatorError():
            return invalid_field(loc_prefix, _clip(str(exc), MAX_FIELD_DETAIL), "invalid_spec")
    return internal_error()


def internal_error() -> Problem:
    return Problem(
        type=ProblemType.INTERNAL_ERROR,
        title="Internal error",
        status=HTTPStatus.INTERNAL_SERVER_ERROR,
        detail="the service failed to answer this request; it has been logged",
    )


def http_problem(status: int, detail: str | None = None) -> Problem:
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Error"
    return Problem(
        type=ProblemType.BLANK,
        title=phrase,
        status=status,
        detail=_clip(detail or phrase, MAX_DETAIL),
    )


def render(problem: Problem, instance: str | None = None) -> Response:
    """The HTTP response carrying `problem`, with the headers its type calls for."""
    if instance is not None and problem.instance is None:
        problem = problem.model_copy(update={"instance": _clip(instance, MAX_INSTANCE)})
    body = problem.model_dump_json().encode()
    headers: dict[str, str] = {}
    if problem.type == ProblemType.UNAUTHORIZED:
        headers["WWW-Authenticate"] = 'Bearer realm="vramcast"'
    if problem.retry_after_s is not None:
        headers["Retry-After"] = str(problem.retry_after_s)
    return Response(
        body, status_code=problem.status, media_type=PROBLEM_MEDIA_TYPE, headers=headers
    )


def _validation_errors(errors: Sequence[Any]) -> list[FieldError]:
    found: list[FieldError] = []
    for err in errors:
        loc = tuple(p for p in err.get("loc", ()) if isinstance(p, str | int))
        found.append(field_error(loc, str(err.get("msg", "invalid")), str(err.get("type", ""))))
    return found


async def _on_error(request: Request, exc: Exception) -> Response:
    problem = from_exception(exc)
    # The id the response carries (`access.AccessMiddleware`), to find the request's log lines.
    request_id = getattr(request.state, "request_id", None)
    if problem.type == ProblemType.INTERNAL_ERROR:
        logger.error(
            "unhandled error on %s %s (request %s)",
            request.method,
            request.url.path,
            request_id,
            exc_info=exc,
        )
    elif problem.type in (ProblemType.STORE_UNAVAILABLE, ProblemType.STORE_READ_ONLY):
        logger.warning(
            "store unavailable on %s %s (request %s): %s",
            request.method,
            request.url.path,
            request_id,
            exc,
        )
    response = render(problem, request.url.path)
    if request_id is not None:
        # A 500 is answered outside every middleware: the id is set here for it.
        response.headers[REQUEST_ID_HEADER] = request_id
    if isinstance(exc, StarletteHTTPException) and exc.headers:
        response.headers.update(exc.headers)
    if problem.status == HTTPStatus.METHOD_NOT_ALLOWED:
        response.headers["Allow"] = _allowed_methods(request)
    return response


def _allowed_methods(request: Request) -> str:
    """Every method the path answers: Starlette's 405 names only the first route's, and a
    path may have several routes (GET and POST /v1/calibrations)."""
    methods = {
        method
        for context in iter_route_contexts(request.app.routes)
        if isinstance(context.route, Route) and context.route.methods
        if context.route.matches(request.scope)[0] is not Match.NONE
        for method in context.route.methods
    }
    return ", ".join(sorted(methods))


def install(app: FastAPI) -> None:
    """Route every error the app can raise through this module."""
    for kind in (
        RequestValidationError,
        StarletteHTTPException,
        ProblemError,
        EstimatorError,
        UnknownGpuError,
        IdempotencyKeyReusedError,
        InvalidCursorError,
        NodeNotAllowedError,
        DBAPIError,
        PoolTimeoutError,
        ColdWorkRefused,
        Exception,
    ):
        app.add_exception_handler(kind, _on_error)


def responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses=` entries for the problem statuses a route can answer."""
    words = {
        401: "No API key, or an unknown or revoked one.",
        403: "The API key lacks the scope this route needs (or, for an upload, may not upload "
        "for its node_id).",
        404: "Unknown model or GPU; `suggestions` lists the closest catalog entries.",
        413: "The body is over the configured limit.",
        415: "The body is not sent as JSON (`Content-Type: application/json`).",
        422: "Invalid input; `errors` locates each invalid field.",
        429: "The slots for cold work open to callers without an API key are taken; send a key "
        "or retry after `Retry-After` seconds.",
        503: "The calibration store is unreachable or refuses writes; on estimates and "
        "fit-checks also: no slot for cold work freed in time, or the request's time for cold "
        "work ran out (what it computed is kept). Retry after `Retry-After` seconds.",
    }
    retry_after = {"description": "Seconds to wait.", "schema": {"type": "integer"}}
    headers = {
        401: {"WWW-Authenticate": {"description": "Bearer", "schema": {"type": "string"}}},
        429: {"Retry-After": retry_after},
        503: {"Retry-After": retry_after},
    }
    return {
        status: {
            "description": words.get(status, HTTPStatus(status).phrase),
            "content": {PROBLEM_MEDIA_TYPE: {"schema": {"$ref": "#/components/schemas/Problem"}}},
            **({"headers": headers[status]} if status in headers else {}),
        }
        for status in statuses
    }
