"""Typed reads of a config.json mapping, the module records the parsers build, and the
descriptor of a model family that service/core/arch/hf_config.py reads configs with."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from service.core.arch import Linear, LinearKind, MlpKind, ModelArch
from service.core.errors import InvalidConfigError


def linear(
    name: str, kind: LinearKind, in_features: int, out_features: int, *, bias: bool = False
) -> Linear:
    """One nn.Linear of a layer, as the parsers list them."""
    return Linear(
        name=name, in_features=in_features, out_features=out_features, bias=bias, kind=kind
    )


class Config:
    """Typed reads of a config.json mapping, naming the field on error. A read without a
    default falls back on `defaults` (the family's configuration class defaults), keyed by the
    first name read."""

    def __init__(self, raw: Mapping[str, Any], defaults: Mapping[str, Any] | None = None) -> None:
        self.raw = raw
        self.defaults: Mapping[str, Any] = defaults or {}

    def integer(self, *names: str, default: int | None = None) -> int:
        for name in names:
            value = self.raw.get(name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidConfigError(name, f"must be a non-negative integer, got {value!r}")
            return value
        if default is None:
            default = self.defaults.get(names[0])
        if default is None:
            raise InvalidConfigError(names[0], "is required")
        return int(default)

    def boolean(self, name: str, default: bool | None = None) -> bool:
        if default is None:
            default = bool(self.defaults[name])
        value = self.raw.get(name, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise InvalidConfigError(name, f"must be true or false, got {value!r}")
        return value

    def string(self, name: str, default: str | None = None) -> str:
        if default is None:
            default = str(self.defaults[name])
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


def dropout(c: Config, name: str, default: float) -> float:
    """A dropout probability of the config, in [0, 1)."""
    value = c.float_or_none(name)
    if value is None:
        return default
    if not 0.0 <= value < 1.0:
        raise InvalidConfigError(name, f"must be in [0, 1), got {value!r}")
    return value


@dataclass(frozen=True)
class Flag:
    """A boolean the config sets: true when any of its keys is (each read with the family's
    default)."""

    keys: tuple[str, ...]

    def read(self, c: Config) -> bool:
        return any(c.boolean(key) for key in self.keys)


def flag(*keys: str) -> Flag:
    return Flag(keys)


def resolve(value: bool | Flag, c: Config) -> bool:
    """A descriptor's boolean: fixed, or read from the config."""
    return value.read(c) if isinstance(value, Flag) else value


@dataclass(frozen=True)
class LinearSpec:
    """One nn.Linear of a layer: its module name, kind, and its in/out features as a dimension
    of the layer (hf_config.layer_dims: h, i, 2i, 3h, q*d, kv*d, qkv*d)."""

    name: str
    kind: LinearKind
    in_features: str
    out_features: str
    bias: bool | Flag = False


# A hook on the fields of the ModelArch being read (service/core/arch/hf_structure.py holds them).
Fields = dict[str, Any]
FieldsHook = Callable[[Config, Fields], None]


@dataclass(frozen=True)
class Family:
    """How the config.json of some model types maps onto a ModelArch: the defaults of their
    configuration class (where they differ from hf_config.COMMON_DEFAULTS), the keys their
    sizes are read from, the layer's modules, and hooks only for structure no table holds."""

    model_types: tuple[str, ...]
    # the transformers (or remote-code) files the layout and defaults come from
    source: str
    linears: tuple[LinearSpec, ...] = ()
    # config defaults of the family's configuration class, read where the config omits a key
    defaults: Mapping[str, Any] = field(default_factory=dict)
    # keys of the MLP width, the first present wins; none: intermediate_ratio * hidden_size
    intermediate_keys: tuple[str, ...] = ("intermediate_size",)
    # MLP width as a multiple of hidden_size where the config omits it (0: required)
    intermediate_ratio: int = 0
    # the config's value is split over this many parallel input projections (Qwen v1's w1/w2)
    intermediate_divisor: int = 1
    # the key of the activation; None keeps defaults["hidden_act"] whatever the config says
    activation_key: str | None = "hidden_act"
    rms_norm: bool | Flag = True
    norms_per_layer: int = 2
    qk_norm: bool = False
    mlp: MlpKind = MlpKind.GATED
    parallel_residual: bool | Flag = False
    lm_head_bias: bool = False
    # the key of the residual dropout probability (0 where the config omits it or no key)
    residual_dropout_key: str | None = None
    # whether transformers applies the config's sliding_window on every layer
    sliding_window: bool = True
    # what the model is run as: "causal", "encoder" (sequence classification), "seq2seq"
    task: str = "causal"
    # before the common fields are read: checks and renamed keys
    prepare: Callable[[Config], Config] | None = None
    # after the common fields, before the layer's modules: head counts the family derives
    heads: FieldsHook | None = None
    # ModelArch fields every model of the family has, whatever its config
    arch_fields: Mapping[str, Any] = field(default_factory=dict)
    # after the layer's modules, in order: structure beyond them (experts, encoder heads, ...)
    structure: tuple[FieldsHook, ...] = ()
    # a reader of its own, for a layout nothing above describes (encoder-decoders)
    reader: Callable[[Config, str], ModelArch] | None = None
