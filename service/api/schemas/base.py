"""The base classes of every request and response body, and the types they share."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, Strict, field_validator
from pydantic_core import PydanticCustomError

Bytes = Annotated[int, Field(ge=0, description="Bytes.")]


def _integer_only(value: Any) -> Any:
    # (a float with a fraction, or not finite, goes on to pydantic's own error for it)
    if isinstance(value, bool | str | bytes) or (isinstance(value, float) and value.is_integer()):
        raise PydanticCustomError("int_type", "Input should be a valid integer")
    return value


def integers(*fields: str) -> Any:
    """A model's validator that takes only integers for these integer fields.

    Request numbers and booleans are taken only as themselves (as the core's spec codec takes
    them): pydantic's lax mode would read JSON's true as the integer 1, "8" as 8 and 8.0 as 8.
    Checked around the fields rather than inside their type, so that their bounds stay
    pydantic's own, and the JSON schema's.
    """
    return field_validator(*fields, mode="before")(_integer_only)


# A number may be written as an integer (2 is 2.0), not as true or text; a boolean is only one.
Number = Annotated[float, Strict()]
Boolean = Annotated[bool, Strict()]


class In(BaseModel):
    """A request body: unknown fields are refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Out(BaseModel):
    """A response body."""

    model_config = ConfigDict(extra="forbid", frozen=True)
