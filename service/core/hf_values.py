"""Typed reads of a config.json mapping and the module records the parsers build, shared by
every parser (service/core/hf_config.py, service/core/hf_t5.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from service.core.architecture import Linear, LinearKind
from service.core.errors import InvalidConfigError


def _linear(
    name: str, kind: LinearKind, in_features: int, out_features: int, *, bias: bool = False
) -> Linear:
    """One nn.Linear of a layer, as the parsers list them."""
    return Linear(
        name=name, in_features=in_features, out_features=out_features, bias=bias, kind=kind
    )


class _Config:
    """Typed reads of a config.json mapping, naming the field on error."""

    def __init__(self, raw: Mapping[str, Any]) -> None:
        self.raw = raw

    def integer(self, *names: str, default: int | None = None) -> int:
        for name in names:
            value = self.raw.get(name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidConfigError(name, f"must be a non-negative integer, got {value!r}")
            return value
        if default is None:
            raise InvalidConfigError(names[0], "is required")
        return default

    def boolean(self, name: str, default: bool) -> bool:
        value = self.raw.get(name, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise InvalidConfigError(name, f"must be true or false, got {value!r}")
        return value

    def string(self, name: str, default: str) -> str:
        value = self.raw.get(name, default)
        if not isinstance(value, str):
            raise InvalidConfigError(name, f"must be a string, got {value!r}")
        return value

    def float_or_none(self, name: str) -> float | None:
        value = self.raw.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidConfigError(name, f"must be a number, got {value!r}")
        return float(value)


def _dropout(c: _Config, name: str, default: float) -> float:
    value = c.float_or_none(name)
    if value is None:
        return default
    if not 0.0 <= value < 1.0:
        raise InvalidConfigError(name, f"must be in [0, 1), got {value!r}")
    return value
