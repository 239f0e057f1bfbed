"""A job field declared once: its type (the dataclass annotation), default, bounds, the name of
the library setting it mirrors and its one-line doc.

The spec dataclasses declare each field with `job_field`; the JSON codec (codec.py) derives its
reading, writing and checks from `declared_fields`, and the API derives its request models
from the same declarations, so a field, its bounds and its doc are written in one place.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal

# What `job_field` gives for a field with no default: the request must name it.
REQUIRED: Any = dataclasses.MISSING
_KEY = "job_field"

# When the JSON writer leaves a field out: "none" when it is None, "off" when it is false,
# "default" when it is its default.
Omit = Literal["none", "off", "default"]


@dataclass(frozen=True, slots=True, kw_only=True)
class FieldRules:
    """What a declaration says of its field beside its type and default."""

    doc: str | None = None
    mirrors: str | None = None
    ge: float | None = None
    le: float | None = None
    lt: float | None = None
    # not infinite nor NaN (a number the API states as such: allow_inf_nan=False)
    finite: bool = False
    omit: Omit | None = None
    # a list's least length, and the names its items may be (None: module names)
    min_length: int | None = None
    choices: tuple[str, ...] | None = None
    # an enum stated inline in the API's schema (its values), not as a named schema
    inline: bool = False
    # an upper bound the codec checks that the API's schema does not state
    unstated_le: float | None = None
    # read after every other field (a reader names a bad field before a bad choice of it)
    read_last: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Declared:
    """One declared field of a spec dataclass, its type resolved."""

    name: str
    type: Any
    default: Any
    factory: Any
    rules: FieldRules

    @property
    def required(self) -> bool:
        return self.default is REQUIRED and self.factory is REQUIRED

    @property
    def optional(self) -> bool:
        """Whether None is one of its values."""
        return type(None) in _members(self.type)

    @property
    def inner(self) -> Any:
        """Its type without None."""
        members = [m for m in _members(self.type) if m is not type(None)]
        if len(members) == 1:
            return members[0]
        return self.type

    def default_value(self) -> Any:
        """Its default (made, where a factory makes it)."""
        return self.factory() if self.factory is not REQUIRED else self.default


def job_field(
    default: Any = REQUIRED,
    *,
    doc: str | None,
    mirrors: str | None = None,
    ge: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    finite: bool = False,
    omit: Omit | None = None,
    min_length: int | None = None,
    choices: tuple[str, ...] | None = None,
    inline: bool = False,
    unstated_le: float | None = None,
    read_last: bool = False,
    factory: Any = REQUIRED,
) -> Any:
    """A dataclass field with its declaration: `default` (or a `factory` making it), `doc` (one
    line, the API's description), the library setting it `mirrors`, its bounds (`ge`, `le`,
    `lt`; `finite`) and when the JSON writer leaves it out (`omit`)."""
    rules = FieldRules(
        doc=doc,
        mirrors=mirrors,
        ge=ge,
        le=le,
        lt=lt,
        finite=finite,
        omit=omit,
        min_length=min_length,
        choices=choices,
        inline=inline,
        unstated_le=unstated_le,
        read_last=read_last,
    )
    metadata = {_KEY: rules}
    if factory is not REQUIRED:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@cache
def declared_fields(kind: type) -> tuple[Declared, ...]:
    """`kind`'s declared fields, in order; TypeError if one of its fields is not declared."""
    hints = typing.get_type_hints(kind)
    found = []
    for field in dataclasses.fields(kind):
        if not field.init:
            continue
        rules = field.metadata.get(_KEY)
        if not isinstance(rules, FieldRules):
            raise TypeError(f"{kind.__name__}.{field.name} is not declared with job_field")
        found.append(
            Declared(
                name=field.name,
                type=hints[field.name],
                default=field.default,
                factory=field.default_factory,
                rules=rules,
            )
        )
    return tuple(found)


def is_declared(kind: Any) -> bool:
    """Whether `kind` is a dataclass whose fields are declared."""
    return isinstance(kind, type) and dataclasses.is_dataclass(kind)


def is_enum(kind: Any) -> bool:
    return isinstance(kind, type) and issubclass(kind, enum.Enum)


def is_names(kind: Any) -> bool:
    """Whether `kind` is a tuple of names (`tuple[str, ...]`)."""
    return typing.get_origin(kind) is tuple and typing.get_args(kind) == (str, ...)


def is_targets(declared: Declared) -> bool:
    """A PEFT `target_modules`: a tuple of names, 'all-linear' or None."""
    members = set(_members(declared.type))
    return str in members and type(None) in members and any(map(is_names, members))


def omitted(declared: Declared, value: Any) -> bool:
    """Whether the JSON writer leaves out this field at `value` (its plain JSON value)."""
    omit = declared.rules.omit
    if omit == "none":
        return value is None
    if omit == "off":
        return not value
    if omit == "default":
        default = declared.default_value()
        return bool(value == (default.value if isinstance(default, enum.Enum) else default))
    return False


def _members(kind: Any) -> tuple[Any, ...]:
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        return typing.get_args(kind)
    return (kind,)
