"""Request bodies validated by pydantic-core straight from their bytes.

FastAPI decodes a body with `json.loads`, validates the Python objects and resolves the body as
a dependency; for the routes a scheduler calls before every placement, `validate_body` parses
and validates in one pass of pydantic-core and answers the same errors, located under "body".
`request_body` documents such a body in OpenAPI exactly as a declared body parameter would be.
A body sent as anything but JSON is refused with 415 (`require_json`), on every JSON route.
"""

from __future__ import annotations

import json
from email.message import Message
from typing import Any, TypeVar

from fastapi import HTTPException, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from service.api import problems
from service.api.problems import ProblemError

M = TypeVar("M", bound=BaseModel)
F = TypeVar("F", bound=BaseModel)


# The models `request_body` documents, by schema name: the app's OpenAPI document lists those
# that no declared parameter or response brings in (`app._openapi`).
DOCUMENTED_BODIES: dict[str, type[BaseModel]] = {}


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a required JSON body of `model`, listed among the schemas."""
    DOCUMENTED_BODIES[model.__name__] = model
    return {
        "requestBody": {
            "content": {
                "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}
            },
            "required": True,
        }
    }


def validate_body(body: bytes, content_type: str | None, model: type[M]) -> M:
    """`body` as `model`, or a `RequestValidationError` located under "body".

    As FastAPI does, a body without a content type, or with a JSON one (application/json,
    application/*+json), is parsed as JSON; any other is refused with 415 (a `ProblemError`);
    an empty body is a missing field.
    """
    check_json(content_type)
    if not body:
        raise _missing_body()
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_context=False)
        raise RequestValidationError(
            [{**error, "loc": ("body", *error["loc"])} for error in errors]
        ) from None


def validate_body_or(body: bytes, content_type: str | None, fast: type[F], model: type[M]) -> F | M:
    """`body` as `fast` when it is that in one pass of pydantic-core from its bytes; else as
    `model`, read exactly as FastAPI reads a declared body parameter (`json.loads`, then
    validation of the Python values), with FastAPI's errors located under "body".

    For a body whose usual form validates as a stricter model (a batch whose every job is
    valid): the usual body is read at pydantic-core's speed, any other answers as before.
    """
    check_json(content_type)
    if not body:
        raise _missing_body()
    try:
        return fast.model_validate_json(body)
    except ValidationError:
        pass
    try:
        value = json.loads(body)
    except json.JSONDecodeError as exc:
        raise RequestValidationError(
            [
                {
                    "type": "json_invalid",
                    "loc": ("body", exc.pos),
                    "msg": "JSON decode error",
                    "input": {},
                    "ctx": {"error": exc.msg},
                }
            ],
            body=exc.doc,
        ) from None
    except Exception as exc:  # not UTF-8, nested past the decoder's depth: FastAPI's 400
        raise HTTPException(status_code=400, detail="There was an error parsing the body") from exc
    try:
        return model.model_validate(value, from_attributes=True)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        raise RequestValidationError(
            [{**error, "loc": ("body", *error["loc"])} for error in errors], body=value
        ) from None


def _missing_body() -> RequestValidationError:
    """An empty body, as FastAPI reports a required body that is absent."""
    return RequestValidationError(
        [{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}]
    )


def check_json(content_type: str | None) -> None:
    """Raises the 415 problem unless a body of this content type is read as JSON."""
    if not is_json(content_type):
        raise ProblemError(problems.unsupported_media_type(content_type or ""))


async def require_json(request: Request) -> None:
    """A route dependency: the 415 problem for a body sent as anything but JSON."""
    check_json(request.headers.get("content-type"))


def is_json(content_type: str | None) -> bool:
    """Whether FastAPI would parse a body of this content type as JSON."""
    if not content_type or content_type == "application/json":
        return True
    message = Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )
