"""A training spec as JSON values and back, with the checks and limits the REST API applies.

`spec_to_dict` writes every field (enums by value, tuples as lists, nested specs as objects);
`spec_from_dict` reads such a dict, fields it lacks taking their defaults, and raises
InvalidSpecError naming the first field that is wrong and why, in the words the API uses for
the same input (a too large batch size is "Input should be less than or equal to 4096").
Values must have their JSON types: unlike the API's lax parsing, strings are not read as
numbers or booleans.

Both directions follow the fields' declarations (service/core/fields.py `job_field`): each
field is read and checked by its declared type and bounds, in the declared order (the
objective last), and written unless its declaration leaves it out at its value.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from typing import Any

from service.core.errors import InvalidSpecError
from service.core.fields import (
    Declared,
    declared_fields,
    is_declared,
    is_enum,
    is_names,
    is_targets,
    omitted,
)
from service.core.limits import MAX_MODULE_NAME_CHARS, MAX_MODULES, MODULE_NAME_PATTERN
from service.core.spec import ALL_LINEAR, Objective, TrainingSpec, objective_from
from service.core.stack import VERSION_PATTERN, Stack, preset

# One field's check: (JSON value, dotted field name) -> the spec's value, or InvalidSpecError.
Check = Callable[[Any, str], Any]

_MODULE_NAME = re.compile(MODULE_NAME_PATTERN)


# -- spec -> dict ---------------------------------------------------------------------------


def spec_to_dict(spec: TrainingSpec) -> dict[str, Any]:
    """The spec as plain JSON values, every field included, in the spec's field order; those
    declared `omit` only where set (the encoder-only `num_labels`, the encoder-decoder
    `target_length`, the options of PEFT's methods besides LoRA and of the objectives, the
    quantization's `bits`, `group_size` and `desc_act`, the switches that are off)."""
    plain: dict[str, Any] = {}
    for name in SPEC_FIELDS:
        value = spec_field(spec, name)
        if value is not OMITTED:
            plain[name] = value
    return plain


class _Omitted(enum.Enum):
    OMITTED = "omitted"


# What `spec_field` gives for a field `spec_to_dict` leaves out.
OMITTED = _Omitted.OMITTED

# The spec's fields, in order, and their declarations (service/core/fields.py).
_DECLARED = {declared.name: declared for declared in declared_fields(TrainingSpec)}
SPEC_FIELDS: tuple[str, ...] = tuple(_DECLARED)


def spec_field(spec: TrainingSpec, name: str) -> Any:
    """One field of `spec_to_dict(spec)`, or OMITTED where it leaves the field out (as its
    declaration says: the options of one model kind, method or objective when set, switches
    when on, the objective when not SFT's)."""
    value = _plain(getattr(spec, name))
    return OMITTED if omitted(_DECLARED[name], value) else value


def _plain(value: Any) -> Any:
    kind = value.__class__
    if is_declared(kind):
        plain = {}
        for declared in declared_fields(kind):
            item = _plain(getattr(value, declared.name))
            if not omitted(declared, item):
                plain[declared.name] = item
        return plain
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


# -- dict -> spec ---------------------------------------------------------------------------


def spec_from_dict(data: Mapping[str, Any]) -> TrainingSpec:
    """The spec `data` describes; raises InvalidSpecError (dotted field, reason).

    As the API does, every field is checked on its own first; only then are the specs built,
    inner ones first, and their checks of fields against each other run."""
    checked = _object(TrainingSpec)(data, "")
    spec = _build(checked)
    assert isinstance(spec, TrainingSpec)
    return spec


@dataclasses.dataclass(frozen=True, slots=True)
class _Unbuilt:
    """A spec object whose fields passed their checks, not yet constructed."""

    kind: type
    fields: dict[str, Any]


def _build(value: Any) -> Any:
    if isinstance(value, _Unbuilt):
        return value.kind(**{name: _build(item) for name, item in value.fields.items()})
    return value


def _number_text(value: float) -> str:
    """A bound as the API prints it: 1e6 as 1000000, 1.0 as 1."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _bounds(value: float, field: str, ge: float | None, le: float | None, lt: float | None) -> None:
    if ge is not None and not value >= ge:
        raise InvalidSpecError(
            field, f"Input should be greater than or equal to {_number_text(ge)}"
        )
    if le is not None and not value <= le:
        raise InvalidSpecError(field, f"Input should be less than or equal to {_number_text(le)}")
    if lt is not None and not value < lt:
        raise InvalidSpecError(field, f"Input should be less than {_number_text(lt)}")


def _integer(*, ge: float | None = None, le: float | None = None) -> Check:
    def check(value: Any, field: str) -> int:
        # an integer only: not a boolean, and not a float even where it is whole (2.0)
        if isinstance(value, float):
            if not math.isfinite(value):
                raise InvalidSpecError(field, "Input should be a finite number")
            if not value.is_integer():
                raise InvalidSpecError(
                    field, "Input should be a valid integer, got a number with a fractional part"
                )
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidSpecError(field, "Input should be a valid integer")
        _bounds(value, field, ge, le, None)
        return value

    return check


def _number(*, ge: float | None = None, le: float | None = None, lt: float | None = None) -> Check:
    def check(value: Any, field: str) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidSpecError(field, "Input should be a valid number")
        if not math.isfinite(value):
            raise InvalidSpecError(field, "Input should be a finite number")
        _bounds(value, field, ge, le, lt)
        return float(value)

    return check


def _boolean(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidSpecError(field, "Input should be a valid boolean")
    return value


def _words(values: Sequence[str]) -> str:
    """The choices as the API names them: 'a', 'b' or 'c'."""
    quoted = [f"'{v}'" for v in values]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def _choice(kind: type[enum.Enum]) -> Check:
    values = [member.value for member in kind]
    words = _words(values)

    def check(value: Any, field: str) -> enum.Enum:
        if isinstance(value, kind):
            return value
        if not isinstance(value, str) or value not in values:
            raise InvalidSpecError(field, f"Input should be {words}")
        return kind(value)

    return check


def _one_of(values: tuple[str, ...]) -> Check:
    """A string among `values`."""
    words = _words(values)

    def check(value: Any, field: str) -> str:
        if not isinstance(value, str) or value not in values:
            raise InvalidSpecError(field, f"Input should be {words}")
        return value

    return check


def _optional(inner: Check) -> Check:
    def check(value: Any, field: str) -> Any:
        return None if value is None else inner(value, field)

    return check


def _module_name(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise InvalidSpecError(field, "Input should be a valid string")
    if not value:
        raise InvalidSpecError(field, "String should have at least 1 character")
    if len(value) > MAX_MODULE_NAME_CHARS:
        raise InvalidSpecError(
            field, f"String should have at most {MAX_MODULE_NAME_CHARS} characters"
        )
    if not _MODULE_NAME.match(value):
        raise InvalidSpecError(field, f"String should match pattern '{MODULE_NAME_PATTERN}'")
    return value


def _module_names(*, min_length: int, item: Check = _module_name) -> Check:
    def check(value: Any, field: str) -> tuple[str, ...]:
        if isinstance(value, str) or not isinstance(value, Sequence):
            raise InvalidSpecError(field, "Input should be a valid array")
        if len(value) < min_length:
            raise InvalidSpecError(
                field,
                f"List should have at least {min_length} item{'s' if min_length != 1 else ''} "
                f"after validation, not {len(value)}",
            )
        if len(value) > MAX_MODULES:
            raise InvalidSpecError(
                field,
                f"List should have at most {MAX_MODULES} items after validation, not {len(value)}",
            )
        return tuple(item(name, field) for name in value)

    return check


def _target_modules(value: Any, field: str) -> tuple[str, ...] | str | None:
    """'all-linear', a non-empty list of module names, or None (PEFT's default)."""
    if value is None or value == ALL_LINEAR:
        return value  # type: ignore[no-any-return]
    if isinstance(value, str):
        raise InvalidSpecError(field, f"Input should be '{ALL_LINEAR}'")
    names: tuple[str, ...] = _module_names(min_length=1)(value, field)
    return names


def _object(kind: type) -> Check:
    """A JSON object of `kind`'s fields; unknown keys are refused, absent ones take defaults,
    required ones must be there."""

    def check(value: Any, field: str) -> Any:
        checks = _checks(kind)
        prefix = f"{field}." if field else ""
        if not isinstance(value, Mapping):
            raise InvalidSpecError(field, "Input should be an object")
        for key in value:
            if key not in checks:
                raise InvalidSpecError(f"{prefix}{key}", "Extra inputs are not permitted")
        kwargs: dict[str, Any] = {}
        for name, (check_field, required) in checks.items():
            if name in value:
                kwargs[name] = check_field(value[name], f"{prefix}{name}")
            elif required:
                raise InvalidSpecError(f"{prefix}{name}", "Field required")
        return _Unbuilt(kind, kwargs)

    return check


def _version(value: Any, field: str) -> str:
    if not isinstance(value, str) or not VERSION_PATTERN.match(value):
        raise InvalidSpecError(field, "Input should be a version such as '1.2.3'")
    return value


def _stack(value: Any, field: str) -> Any:
    """A preset's name ('hf-5.24') or the versions (absent ones: the traced stack's)."""
    if isinstance(value, str):
        return preset(value, field)
    if not isinstance(value, Mapping):
        raise InvalidSpecError(field, "Input should be a preset's name or an object of versions")
    return _object(Stack)(value, field)


def _objective(value: Any, field: str) -> Objective:
    if not isinstance(value, str):
        raise InvalidSpecError(field, "must be a string")
    return objective_from(value)


@cache
def _checks(kind: type) -> dict[str, tuple[Check, bool]]:
    """Each of `kind`'s fields' check and whether it is required, in the order they are read:
    the declared order, those read last (the objective) after the rest."""
    declared = declared_fields(kind)
    ordered = [d for d in declared if not d.rules.read_last]
    ordered += [d for d in declared if d.rules.read_last]
    return {d.name: (_field_check(kind, d), d.required) for d in ordered}


def _field_check(owner: type, declared: Declared) -> Check:
    """The check of one declared field, from its type and rules."""
    kind, rules = declared.inner, declared.rules
    if is_targets(declared):
        return _target_modules
    check: Check
    if kind is Objective:
        check = _objective
    elif kind is Stack:
        check = _stack
    elif kind is bool:
        check = _boolean
    elif kind is int:
        le = rules.le if rules.le is not None else rules.unstated_le
        check = _integer(ge=rules.ge, le=le)
    elif kind is float:
        check = _number(ge=rules.ge, le=rules.le, lt=rules.lt)
    elif is_enum(kind):
        check = _choice(kind)
    elif kind is str and rules.choices:
        check = _one_of(rules.choices)
    elif kind is str and owner is Stack:
        check = _version
    elif is_names(kind):
        item = _module_name if rules.choices is None else _one_of(rules.choices)
        check = _module_names(min_length=rules.min_length or 0, item=item)
    elif is_declared(kind):
        check = _object(kind)
    else:
        raise TypeError(f"{owner.__name__}.{declared.name}: no check for {kind!r}")
    return _optional(check) if declared.optional else check
