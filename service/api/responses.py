"""JSON responses serialised straight from response models.

Routes declare `response_model` for the schema and return this, so a model built from core
values is serialised once, not validated again.
"""

from __future__ import annotations

from fastapi.responses import Response
from pydantic import BaseModel

JSON_MEDIA_TYPE = "application/json"


def json_response(model: BaseModel, status_code: int = 200) -> Response:
    return Response(
        model.__pydantic_serializer__.to_json(model),
        status_code=status_code,
        media_type=JSON_MEDIA_TYPE,
    )
