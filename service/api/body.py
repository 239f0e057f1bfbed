"""Request bodies validated by pydantic-core straight from their bytes.

FastAPI decodes a body with `json.loads`, validates the Python objects and resolves the body as
a dependency; for the routes a scheduler calls before every placement, `validate_body` parses
and validates in one pass of pydantic-core and answers the same errors, located under "body".
`request_body` documents such a body in OpenAPI exactly as a declared body parameter would be.
"""

from __future__ import annotations

from email.message import Message
from typing import Any, TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a required JSON body of `model` (a schema the app already lists)."""
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

    As FastAPI does: a body without a content type, or with a JSON one (application/json,
    application/*+json), is parsed as JSON; any other body is validated as raw bytes (and so
    refused); an empty body is a missing field.
    """
    if not body:
        raise RequestValidationError(
            [{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}]
        )
    try:
        if is_json(content_type):
            return model.model_validate_json(body)
        return model.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_context=False)
        raise RequestValidationError(
            [{**error, "loc": ("body", *error["loc"])} for error in errors]
        ) from None


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
