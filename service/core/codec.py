"""A training spec as JSON values and back, with the checks and limits the REST API applies.

`spec_to_dict` writes every field (enums by value, tuples as lists, nested specs as objects);
`spec_from_dict` reads such a dict, fields it lacks taking their defaults, and raises
InvalidSpecError naming the first field that is wrong and why, in the words the API uses for
the same input (a too large batch size is "Input should be less than or equal to 4096").
Values must have their JSON types: unlike the API's lax parsing, strings are not read as
numbers or booleans.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from typing import Any

from service.core.allocator import AllocatorConfig
from service.core.errors import InvalidSpecError
from service.core.libs.torch_allocator import MIN_SPLIT_SETTING_MB
from service.core.limits import (
    MAX_ALLOC_SETTING_MB,
    MAX_BATCH_SIZE,
    MAX_BUCKET_CAP_MB,
    MAX_ENCODER_HIDDEN_SIZE,
    MAX_GPUS,
    MAX_GRAD_NORM,
    MAX_GRADIENT_ACCUMULATION,
    MAX_IMAGE_SIDE,
    MAX_IMAGES_PER_SAMPLE,
    MAX_LORA_ALPHA,
    MAX_LORA_R,
    MAX_MODULE_NAME_CHARS,
    MAX_MODULES,
    MAX_NUM_LABELS,
    MAX_PRNG_KEY,
    MAX_ROUNDUP_POWER2_DIVISIONS,
    MAX_SEQ_LEN,
    MAX_TRAINING_STEPS,
    MAX_VIRTUAL_TOKENS,
    MAX_ZERO_ELEMENTS,
    MODULE_NAME_PATTERN,
)
from service.core.spec import (
    ALL_LINEAR,
    DELTA_OPTIONS,
    METHOD_OPTIONS,
    SAVABLE_MODULES,
    AttnImpl,
    DpoSpec,
    Framework,
    FsdpBackwardPrefetch,
    FsdpSharding,
    LoraSpec,
    LossImpl,
    Method,
    Objective,
    Offload,
    Optim,
    ParallelSpec,
    QuantSpec,
    QuantType,
    SdpaKernel,
    Strategy,
    TrainingSpec,
    objective_from,
)
from service.core.spec_delta import AdaLoraSpec, BoftSpec, LohaSpec, LokrSpec, OftSpec, VeraSpec
from service.core.spec_grpo import GrpoSpec
from service.core.spec_kto import KtoLossType, KtoSpec
from service.core.spec_orpo import OrpoSpec
from service.core.spec_prompt import IA3Spec, LnTuningSpec, PrefixTuningSpec, PromptTuningSpec
from service.core.spec_vision import VisionInputs
from service.core.stack import VERSION_PATTERN, Stack, preset
from service.core.units import DType

# One field's check: (JSON value, dotted field name) -> the spec's value, or InvalidSpecError.
Check = Callable[[Any, str], Any]

_MODULE_NAME = re.compile(MODULE_NAME_PATTERN)


# -- spec -> dict ---------------------------------------------------------------------------


def spec_to_dict(spec: TrainingSpec) -> dict[str, Any]:
    """The spec as plain JSON values, every field included, in the spec's field order; the
    encoder-only `num_labels`, the encoder-decoder `target_length`, the options of PEFT's
    methods besides LoRA and the quantization's `bits`, `group_size` and `desc_act` only when
    set."""
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

# The spec's fields, in order.
SPEC_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(TrainingSpec) if f.init)
# Written only when set: the options of one model kind, method or objective.
_WHEN_SET = frozenset(
    {
        "num_labels",
        "target_length",
        *METHOD_OPTIONS.values(),
        *DELTA_OPTIONS.values(),
        "dpo",
        "kto",
        "grpo",
        "orpo",
        "vision",
    }
)
# Written only when on.
_WHEN_ON = frozenset(
    {"optimizer_in_backward", "activation_offloading", "packing", "torch_compile", "liger_kernel"}
)


def spec_field(spec: TrainingSpec, name: str) -> Any:
    """One field of `spec_to_dict(spec)`, or OMITTED where it leaves the field out."""
    value = _plain(getattr(spec, name))
    if (name in _WHEN_SET and value is None) or (name in _WHEN_ON and not value):
        return OMITTED
    if name == "objective" and spec.objective is Objective.SFT:
        return OMITTED  # written when another objective is asked for
    if name == "quantization" and isinstance(value, dict):  # GPTQ/AWQ/HQQ options when set
        for option in ("bits", "group_size"):
            if value.get(option) is None:
                value.pop(option, None)
        if not value.get("desc_act"):
            value.pop("desc_act", None)
    return value


def _plain(value: Any) -> Any:
    names = _field_names(value.__class__)
    if names is not None:
        return {name: _plain(getattr(value, name)) for name in names}
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
    checked = _object(TrainingSpec, _TRAINING, required=("batch_size", "seq_len"))(data, "")
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


def _integer(*, ge: int | None = None, le: int | None = None) -> Check:
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


def _choice(kind: type[enum.Enum]) -> Check:
    values = [member.value for member in kind]
    quoted = [f"'{v}'" for v in values]
    words = quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"

    def check(value: Any, field: str) -> enum.Enum:
        if isinstance(value, kind):
            return value
        if not isinstance(value, str) or value not in values:
            raise InvalidSpecError(field, f"Input should be {words}")
        return kind(value)

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


def _savable_module(value: Any, field: str) -> str:
    if not isinstance(value, str) or value not in SAVABLE_MODULES:
        words = " or ".join(f"'{name}'" for name in SAVABLE_MODULES)
        raise InvalidSpecError(field, f"Input should be {words}")
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


def _object(kind: type, checks: Mapping[str, Check], *, required: tuple[str, ...] = ()) -> Check:
    """A JSON object of `kind`'s fields; unknown keys are refused, absent ones take defaults."""

    def check(value: Any, field: str) -> Any:
        prefix = f"{field}." if field else ""
        if not isinstance(value, Mapping):
            raise InvalidSpecError(field, "Input should be an object")
        for key in value:
            if key not in checks:
                raise InvalidSpecError(f"{prefix}{key}", "Extra inputs are not permitted")
        kwargs: dict[str, Any] = {}
        for name, check_field in checks.items():
            if name in value:
                kwargs[name] = check_field(value[name], f"{prefix}{name}")
            elif name in required:
                raise InvalidSpecError(f"{prefix}{name}", "Field required")
        return _Unbuilt(kind, kwargs)

    return check


_LORA: dict[str, Check] = {
    "r": _integer(ge=1, le=MAX_LORA_R),
    "lora_alpha": _integer(ge=1, le=MAX_LORA_ALPHA),
    "lora_dropout": _optional(_number(ge=0.0, lt=1.0)),
    "target_modules": _target_modules,
    "modules_to_save": _module_names(min_length=0, item=_savable_module),
    "adapter_dtype": _optional(_choice(DType)),
    "use_dora": _boolean,
    "use_rslora": _boolean,
}
_IA3: dict[str, Check] = {
    "target_modules": _optional(_module_names(min_length=1)),
    "feedforward_modules": _optional(_module_names(min_length=0)),
}
_LN_TUNING: dict[str, Check] = {
    "target_modules": _optional(_module_names(min_length=1)),
}
_PROMPT_TUNING: dict[str, Check] = {
    "num_virtual_tokens": _integer(ge=1, le=MAX_VIRTUAL_TOKENS),
}
_PREFIX_TUNING: dict[str, Check] = {
    "num_virtual_tokens": _integer(ge=1, le=MAX_VIRTUAL_TOKENS),
    "prefix_projection": _boolean,
    "encoder_hidden_size": _optional(_integer(ge=1, le=MAX_ENCODER_HIDDEN_SIZE)),
}
# VeRA's options (service/core/spec_delta.py VeraSpec); its rank bounded as LoRA's.
_VERA: dict[str, Check] = {
    "r": _integer(ge=1, le=MAX_LORA_R),
    "target_modules": _target_modules,
    "vera_dropout": _number(ge=0.0, lt=1.0),
    "d_initial": _number(ge=-1e6, le=1e6),
    "projection_prng_key": _integer(ge=0, le=MAX_PRNG_KEY),
    "save_projection": _boolean,
}
# LoHa's options (service/core/spec_delta.py LohaSpec); rank and alpha bounded as LoRA's.
_LOHA: dict[str, Check] = {
    "r": _integer(ge=1, le=MAX_LORA_R),
    "alpha": _integer(ge=1, le=MAX_LORA_ALPHA),
    "rank_dropout": _number(ge=0.0, lt=1.0),
    "module_dropout": _number(ge=0.0, lt=1.0),
    "target_modules": _target_modules,
}
# LoKr's options (service/core/spec_delta.py LokrSpec).
_LOKR: dict[str, Check] = {
    "r": _integer(ge=1, le=MAX_LORA_R),
    "alpha": _integer(ge=1, le=MAX_LORA_ALPHA),
    "rank_dropout": _number(ge=0.0, lt=1.0),
    "module_dropout": _number(ge=0.0, lt=1.0),
    "decompose_both": _boolean,
    "decompose_factor": _integer(ge=-1, le=MAX_LORA_R),
    "rank_dropout_scale": _boolean,
    "target_modules": _target_modules,
}
# AdaLoRA's options (service/core/spec_delta.py AdaLoraSpec); ranks and alpha bounded as LoRA's.
_ADALORA: dict[str, Check] = {
    "init_r": _integer(ge=1, le=MAX_LORA_R),
    "target_r": _integer(ge=1, le=MAX_LORA_R),
    "lora_alpha": _integer(ge=1, le=MAX_LORA_ALPHA),
    "lora_dropout": _number(ge=0.0, lt=1.0),
    "target_modules": _target_modules,
    "orth_reg_weight": _number(ge=0.0, le=1e6),
    "tinit": _integer(ge=0, le=MAX_TRAINING_STEPS),
    "tfinal": _integer(ge=0, le=MAX_TRAINING_STEPS),
    "deltaT": _integer(ge=1, le=MAX_TRAINING_STEPS),
    "beta1": _number(ge=0.0, lt=1.0),
    "beta2": _number(ge=0.0, lt=1.0),
    "total_step": _optional(_integer(ge=1, le=MAX_TRAINING_STEPS)),
}
# OFT's options (service/core/spec_delta.py OftSpec); block counts and sizes bounded as LoRA's rank.
_OFT: dict[str, Check] = {
    "r": _integer(ge=0, le=MAX_LORA_R),
    "oft_block_size": _integer(ge=0, le=MAX_LORA_R),
    "module_dropout": _number(ge=0.0, lt=1.0),
    "target_modules": _target_modules,
    "coft": _boolean,
    "eps": _number(ge=0.0, le=1.0),
    "block_share": _boolean,
    "use_cayley_neumann": _boolean,
    "num_cayley_neumann_terms": _integer(ge=1, le=64),
}


def _boft_bias(value: Any, field: str) -> str:
    """BOFTConfig.bias: 'none', 'all' or 'boft_only' (peft/tuners/boft/config.py)."""
    if value not in ("none", "all", "boft_only"):
        raise InvalidSpecError(field, "Input should be 'none', 'all' or 'boft_only'")
    return str(value)


# BOFT's options (service/core/spec_delta.py BoftSpec); block counts and sizes bounded as
# LoRA's rank.
_BOFT: dict[str, Check] = {
    "boft_block_size": _integer(ge=0, le=MAX_LORA_R),
    "boft_block_num": _integer(ge=0, le=MAX_LORA_R),
    "boft_n_butterfly_factor": _integer(ge=1, le=16),
    "boft_dropout": _number(ge=0.0, lt=1.0),
    "bias": _boft_bias,
    "target_modules": _target_modules,
}
_QUANTIZATION: dict[str, Check] = {
    "type": _choice(QuantType),
    "double_quant": _boolean,
    "compute_dtype": _optional(_choice(DType)),
    "prepare_kbit": _boolean,
    # GPTQ/AWQ bits, HQQ nbits; GPTQ/AWQ/HQQ group_size (-1: GPTQ/AWQ one group per row);
    # quant_formats.check_quant_options names the values each format takes
    "bits": _optional(_integer(ge=1, le=8)),
    "group_size": _optional(_integer(ge=-1, le=1 << 20)),
    "desc_act": _boolean,
}
_PARALLEL: dict[str, Check] = {
    "gpus": _integer(ge=1, le=MAX_GPUS),
    "strategy": _choice(Strategy),
    "offload": _choice(Offload),
    "gpus_per_node": _optional(_integer(ge=1, le=MAX_GPUS)),
    "bucket_cap_mb": _integer(ge=1, le=MAX_BUCKET_CAP_MB),
    "gradient_as_bucket_view": _boolean,
    "sharding_strategy": _choice(FsdpSharding),
    "use_orig_params": _boolean,
    "limit_all_gathers": _boolean,
    "forward_prefetch": _boolean,
    "backward_prefetch": _choice(FsdpBackwardPrefetch),
    "reshard_after_forward": _boolean,
    "reduce_bucket_size": _optional(_integer(ge=1, le=MAX_ZERO_ELEMENTS)),
    "allgather_bucket_size": _integer(ge=1, le=MAX_ZERO_ELEMENTS),
    "stage3_prefetch_bucket_size": _optional(_integer(ge=1, le=MAX_ZERO_ELEMENTS)),
    "stage3_max_live_parameters": _integer(ge=1, le=MAX_ZERO_ELEMENTS),
    "stage3_param_persistence_threshold": _optional(_integer(ge=0, le=MAX_ZERO_ELEMENTS)),
    "contiguous_gradients": _boolean,
    "overlap_comm": _optional(_boolean),
}


def _version(value: Any, field: str) -> str:
    if not isinstance(value, str) or not VERSION_PATTERN.match(value):
        raise InvalidSpecError(field, "Input should be a version such as '1.2.3'")
    return value


_STACK: dict[str, Check] = {
    "transformers": _version,
    "peft": _version,
    "bitsandbytes": _version,
    "torch": _version,
}


def _stack(value: Any, field: str) -> Any:
    """A preset's name ('hf-5.24') or the versions (absent ones: the traced stack's)."""
    if isinstance(value, str):
        return preset(value, field)
    if not isinstance(value, Mapping):
        raise InvalidSpecError(field, "Input should be a preset's name or an object of versions")
    return _object(Stack, _STACK)(value, field)


_ALLOCATOR: dict[str, Check] = {
    "max_split_size_mb": _optional(_integer(ge=MIN_SPLIT_SETTING_MB, le=MAX_ALLOC_SETTING_MB)),
    "max_non_split_rounding_mb": _optional(
        _integer(ge=MIN_SPLIT_SETTING_MB, le=MAX_ALLOC_SETTING_MB)
    ),
    "roundup_power2_divisions": _integer(ge=0, le=MAX_ROUNDUP_POWER2_DIVISIONS),
    "garbage_collection_threshold": _number(ge=0.0, lt=1.0),
    "expandable_segments": _boolean,
    "per_process_memory_fraction": _optional(_number(ge=0.0, le=1.0)),
}


def _objective(value: Any, field: str) -> Objective:
    if not isinstance(value, str):
        raise InvalidSpecError(field, "must be a string")
    return objective_from(value)


_DPO: dict[str, Check] = {
    "precompute_ref_log_probs": _boolean,
    "max_completion_length": _optional(_integer(ge=1, le=MAX_SEQ_LEN)),
}
_KTO: dict[str, Check] = {
    "precompute_ref_log_probs": _boolean,
    "loss_type": _choice(KtoLossType),
}
# GRPOConfig's names (spec_grpo.py); what is not modelled is refused by the spec's checks.
_GRPO: dict[str, Check] = {
    "num_generations": _integer(ge=1, le=MAX_BATCH_SIZE),
    "max_prompt_length": _optional(_integer(ge=1, le=MAX_SEQ_LEN)),
    "max_completion_length": _integer(ge=1, le=MAX_SEQ_LEN),
    "beta": _number(ge=0.0),
    "num_iterations": _integer(ge=1),
    "use_vllm": _boolean,
}
_ORPO: dict[str, Check] = {"disable_dropout": _boolean}
_VISION: dict[str, Check] = {
    "images_per_sample": _integer(ge=1, le=MAX_IMAGES_PER_SAMPLE),
    "image_height": _optional(_integer(ge=1, le=MAX_IMAGE_SIDE)),
    "image_width": _optional(_integer(ge=1, le=MAX_IMAGE_SIDE)),
    "image_tokens": _optional(_integer(ge=1, le=MAX_SEQ_LEN)),
    "min_pixels": _optional(_integer(ge=1, le=MAX_IMAGE_SIDE**2)),
    "max_pixels": _optional(_integer(ge=1, le=MAX_IMAGE_SIDE**2)),
}
_TRAINING: dict[str, Check] = {
    "method": _choice(Method),
    "batch_size": _integer(ge=1, le=MAX_BATCH_SIZE),
    "seq_len": _integer(ge=1, le=MAX_SEQ_LEN),
    "lora": _optional(_object(LoraSpec, _LORA)),
    "quantization": _optional(_object(QuantSpec, _QUANTIZATION)),
    "ia3": _optional(_object(IA3Spec, _IA3)),
    "ln_tuning": _optional(_object(LnTuningSpec, _LN_TUNING)),
    "prompt_tuning": _optional(
        _object(PromptTuningSpec, _PROMPT_TUNING, required=("num_virtual_tokens",))
    ),
    "prefix_tuning": _optional(
        _object(PrefixTuningSpec, _PREFIX_TUNING, required=("num_virtual_tokens",))
    ),
    "dtype": _choice(DType),
    "autocast": _boolean,
    "optim": _choice(Optim),
    "gradient_accumulation_steps": _integer(ge=1, le=MAX_GRADIENT_ACCUMULATION),
    "max_grad_norm": _number(ge=0, le=MAX_GRAD_NORM),
    "gradient_checkpointing": _boolean,
    "optimizer_in_backward": _boolean,
    "activation_offloading": _boolean,
    "attn_implementation": _choice(AttnImpl),
    "sdpa_kernel": _choice(SdpaKernel),
    "loss": _optional(_choice(LossImpl)),
    "framework": _choice(Framework),
    "packing": _boolean,
    "torch_compile": _boolean,
    "liger_kernel": _boolean,
    "parallel": _object(ParallelSpec, _PARALLEL),
    "allocator": _object(AllocatorConfig, _ALLOCATOR),
    "num_labels": _optional(_integer(ge=1, le=MAX_NUM_LABELS)),
    "target_length": _optional(_integer(ge=1, le=MAX_SEQ_LEN)),
    "stack": _stack,
    "vera": _optional(_object(VeraSpec, _VERA)),
    "loha": _optional(_object(LohaSpec, _LOHA)),
    "lokr": _optional(_object(LokrSpec, _LOKR)),
    "dpo": _optional(_object(DpoSpec, _DPO)),
    "kto": _optional(_object(KtoSpec, _KTO)),
    "grpo": _optional(_object(GrpoSpec, _GRPO)),
    "orpo": _optional(_object(OrpoSpec, _ORPO)),
    "adalora": _optional(_object(AdaLoraSpec, _ADALORA)),
    "oft": _optional(_object(OftSpec, _OFT)),
    "boft": _optional(_object(BoftSpec, _BOFT)),
    "vision": _optional(_object(VisionInputs, _VISION)),
    # read after the option objects, as the API names a bad option before the objective (its
    # objective is a string until to_spec)
    "objective": _objective,
}


@lru_cache(maxsize=256)
def _field_names(kind: Any) -> tuple[str, ...] | None:
    """The fields a dataclass is made with, in order (those made on construction, such as a
    cached hash, are not its values); None for any other type."""
    if not dataclasses.is_dataclass(kind):
        return None
    return tuple(f.name for f in dataclasses.fields(kind) if f.init)
