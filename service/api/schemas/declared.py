"""Request models made from the core's field declarations (service/core/fields.py): each field's
type, default, bounds and description come from its `job_field`, and `to_spec` builds the core
spec from the model's values, so a job field is written once, in the core."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import Field, StringConstraints, create_model

from service.api.schemas.base import Boolean, In, Number, integers
from service.core import fields
from service.core.fields import Declared, declared_fields
from service.core.limits import MAX_MODULE_NAME_CHARS, MAX_MODULES, MODULE_NAME_PATTERN
from service.core.spec import ALL_LINEAR
from service.core.stack import VERSION_PATTERN

ModuleName = Annotated[
    str,
    StringConstraints(min_length=1, max_length=MAX_MODULE_NAME_CHARS, pattern=MODULE_NAME_PATTERN),
    Field(description="A module name as transformers names it, e.g. 'q_proj'."),
]
ModuleList = Annotated[list[ModuleName], Field(min_length=1, max_length=MAX_MODULES)]
Version = Annotated[
    str,
    StringConstraints(min_length=1, max_length=64, pattern=VERSION_PATTERN.pattern),
    Field(description="A release version, e.g. '4.48.0'."),
]

# One field as create_model takes it: its annotation and its FieldInfo (pydantic's `Field`).
FieldDefinition = tuple[Any, Any]
Model = TypeVar("Model", bound="DeclaredIn")

# The request model of each core spec dataclass made so far: a nested spec's field takes it.
_MODELS: dict[type, type[DeclaredIn]] = {}


class DeclaredIn(In):
    """A request model made from a core spec dataclass's declarations (`declared_model`)."""

    spec_kind: ClassVar[type]

    def to_spec(self) -> Any:
        """The core spec of these values; the spec of the defaults, made once, when no field
        is given (every such request shares it: the specs are frozen)."""
        if not self.model_fields_set:
            return _default_spec(type(self))
        return self.spec_kind(**self.spec_values())

    def spec_values(self, read: Mapping[str, Callable[[], Any]] | None = None) -> dict[str, Any]:
        """The core spec's fields, from this model's values, in the spec's field order (the
        nested specs built in it); `read` makes those it names instead."""
        values: dict[str, Any] = {}
        for declared in declared_fields(self.spec_kind):
            make = (read or {}).get(declared.name)
            value = getattr(self, declared.name)
            values[declared.name] = make() if make else core_value(declared, value)
        return values


_DEFAULT_SPECS: dict[type, Any] = {}


def _default_spec(model: type[DeclaredIn]) -> Any:
    if model not in _DEFAULT_SPECS:
        made = model()
        _DEFAULT_SPECS[model] = model.spec_kind(**made.spec_values())
    return _DEFAULT_SPECS[model]


def core_value(declared: Declared, value: Any) -> Any:
    """A field's value as the core spec takes it: nested specs built, lists as tuples, enums
    stated inline as their members, numbers as floats."""
    if value is None:
        return None
    if isinstance(value, DeclaredIn):
        return value.to_spec()
    if isinstance(value, list):
        return tuple(value)
    kind = declared.inner
    if fields.is_enum(kind) and not isinstance(value, kind):
        return kind(value)
    if kind is float:
        return float(value)
    return value


def declared_model(
    name: str,
    kind: type,
    *,
    doc: str,
    base: type[Model],
    extra: Mapping[str, FieldDefinition] | None = None,
    order: Sequence[str] = (),
) -> type[Model]:
    """The request model `name` of the core spec dataclass `kind`: a field for each declared
    one, typed and bounded as declared, with `extra` fields beside (or in place of) them;
    the fields in `order` first, in that order, then the rest in the declared order. Integer
    fields take only integers (`base.integers`)."""
    made: dict[str, FieldDefinition] = {d.name: api_field(d) for d in declared_fields(kind)}
    made.update(extra or {})
    ordered = {name: made[name] for name in order}
    ordered.update({name: field for name, field in made.items() if name not in ordered})
    integer_fields = [
        d.name for d in declared_fields(kind) if d.inner is int and d.name not in (extra or {})
    ]
    validators = {"integer_fields": integers(*integer_fields)} if integer_fields else {}
    model: type[Model] = create_model(  # type: ignore[call-overload]
        name,
        __base__=base,
        __doc__=doc,
        __module__=base.__module__,
        __validators__=validators,
        **ordered,
    )
    model.spec_kind = kind
    _MODELS[kind] = model
    return model


def api_field(declared: Declared) -> FieldDefinition:
    """One declared field as a pydantic field: its type, default, bounds and description."""
    rules = declared.rules
    annotation, constraints = _api_type(declared)
    if declared.optional:
        annotation = annotation | None
    if rules.doc is not None:
        constraints["description"] = rules.doc
    for bound in ("ge", "le", "lt"):
        if (value := getattr(rules, bound)) is not None:
            constraints[bound] = value
    if rules.finite:
        constraints["allow_inf_nan"] = False
    if declared.required:
        return annotation, Field(**constraints)
    if fields.is_declared(declared.inner) and not declared.optional:
        return annotation, Field(default_factory=_MODELS[declared.inner], **constraints)
    if fields.is_names(declared.inner) and not declared.optional:
        return annotation, Field(default_factory=list, **constraints)
    default = declared.default
    if rules.inline and default is not None:
        default = default.value
    return annotation, Field(default=default, **constraints)


def _api_type(declared: Declared) -> tuple[Any, dict[str, Any]]:
    """The field's type as the API states it, and the constraints that go with it."""
    kind, rules = declared.inner, declared.rules
    if fields.is_targets(declared):
        return _literal((ALL_LINEAR,)) | ModuleList, {}
    if fields.is_names(kind):
        if rules.choices is not None:
            return _list_of(_literal(rules.choices)), {"max_length": MAX_MODULES}
        if rules.min_length:
            return ModuleList, {}
        return list[ModuleName], {"max_length": MAX_MODULES}
    if kind is bool:
        return Boolean, {}
    if kind is float:
        return Number, {}
    if kind is str:
        if rules.choices is not None:
            return _literal(rules.choices), {}
        return Version, {}
    if fields.is_enum(kind) and rules.inline:
        return _literal(tuple(member.value for member in kind)), {}
    if fields.is_declared(kind):
        return _MODELS[kind], {}
    return kind, {}


def _literal(values: tuple[Any, ...]) -> Any:
    """`Literal[values]`: exactly one of them."""
    return Literal.__getitem__(values)


def _list_of(item: Any) -> Any:
    """`list[item]`."""
    return list.__class_getitem__(item)
