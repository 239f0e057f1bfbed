"""The base classes of every request and response body, and the types they share."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

Bytes = Annotated[int, Field(ge=0, description="Bytes.")]


class In(BaseModel):
    """A request body: unknown fields are refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Out(BaseModel):
    """A response body."""

    model_config = ConfigDict(extra="forbid", frozen=True)
