"""The base classes of every request and response body, and the types they share."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, Strict

Bytes = Annotated[int, Field(ge=0, description="Bytes.")]

# Request numbers and booleans are taken only as themselves: pydantic's lax mode would read
# JSON's true as the integer 1, "8" as 8, 8.0 as 8 and "yes" or 1 as true. A float field
# still takes an integer (2 is 2.0).
StrictInt = Annotated[int, Strict()]
StrictFloat = Annotated[float, Strict()]
StrictBool = Annotated[bool, Strict()]


class In(BaseModel):
    """A request body: unknown fields are refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Out(BaseModel):
    """A response body."""

    model_config = ConfigDict(extra="forbid", frozen=True)
