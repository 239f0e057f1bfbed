"""A DeepSpeed config JSON, as users pass it to HF Trainer (`--deepspeed ds_config.json`), read
into ParallelSpec field values.

Keys follow DeepSpeed v0.19.5's `zero_optimization` section (deepspeed/runtime/zero/config.py
DeepSpeedZeroConfig, offload_config.py DeepSpeedZeroOffloadOptimizerConfig and
DeepSpeedZeroOffloadParamConfig). "auto" values stay None: HF's DeepSpeed integration fills them
from the model (transformers/integrations/deepspeed.py), as the estimator does. A hidden-size
key the config leaves out is not "auto": DeepSpeed takes its own default for it
(DeepSpeedZeroConfig's field defaults), and so does the spec read from the config.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from service.core.errors import InvalidSpecError
from service.core.spec import (
    ZERO3_PARAM_PERSISTENCE_THRESHOLD,
    ZERO3_PREFETCH_BUCKET_SIZE,
    ZERO_REDUCE_BUCKET_SIZE,
    Offload,
    Strategy,
)

AUTO = "auto"
STAGES = {0: Strategy.DDP, 1: Strategy.ZERO1, 2: Strategy.ZERO2, 3: Strategy.ZERO3}
# zero_optimization keys copied as element counts (the ParallelSpec field of the same name);
# DeepSpeed also accepts the stage-3 names without their "stage3_" prefix (aliases).
COUNT_KEYS = {
    "reduce_bucket_size": "reduce_bucket_size",
    "allgather_bucket_size": "allgather_bucket_size",
    "stage3_prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "stage3_max_live_parameters": "stage3_max_live_parameters",
    "max_live_parameters": "stage3_max_live_parameters",
    "stage3_param_persistence_threshold": "stage3_param_persistence_threshold",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
}
# Fields whose "auto" HF fills (others must be numbers), with DeepSpeed's default for a config
# that leaves the key out (deepspeed/runtime/zero/config.py DeepSpeedZeroConfig).
AUTO_FIELDS = {
    "reduce_bucket_size": ZERO_REDUCE_BUCKET_SIZE,
    "stage3_prefetch_bucket_size": ZERO3_PREFETCH_BUCKET_SIZE,
    "stage3_param_persistence_threshold": ZERO3_PARAM_PERSISTENCE_THRESHOLD,
}
BOOL_KEYS = ("contiguous_gradients", "overlap_comm")
OFFLOAD_DEVICES = ("none", "cpu", "nvme")


def _where(key: str) -> str:
    return f"zero_optimization.{key}"


def _count(value: Any, key: str, field: str) -> int | None:
    if value == AUTO:
        if field in AUTO_FIELDS:
            return None
        raise InvalidSpecError(_where(key), "HF fills 'auto' only for the hidden-size based keys")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidSpecError(_where(key), f"must be a number or 'auto', got {value!r}")
    if value != int(value) or value < 0:
        raise InvalidSpecError(_where(key), f"must be a whole number, 0 or more, got {value!r}")
    return int(value)


def _device(section: Any, key: str) -> str:
    if section is None:
        return "none"
    if not isinstance(section, Mapping):
        raise InvalidSpecError(_where(key), "must be an object with a 'device' key")
    device = section.get("device", "none")
    if device is None:
        return "none"
    if device not in OFFLOAD_DEVICES:
        raise InvalidSpecError(
            _where(f"{key}.device"), f"must be one of {', '.join(OFFLOAD_DEVICES)}, got {device!r}"
        )
    if device == "nvme":
        raise InvalidSpecError(_where(f"{key}.device"), "NVMe offload is not modelled")
    return str(device)


def parallel_from_deepspeed(config: Mapping[str, Any]) -> dict[str, Any]:
    """ParallelSpec field values from a DeepSpeed config (without `gpus`: the config does not
    say how many GPUs run it). Unknown keys are ignored; bad values raise InvalidSpecError
    naming the JSON key."""
    if not isinstance(config, Mapping):
        raise InvalidSpecError("deepspeed", "must be a JSON object")
    zero = config.get("zero_optimization", {})
    if zero is None:
        zero = {}
    if not isinstance(zero, Mapping):
        raise InvalidSpecError("zero_optimization", "must be an object")
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in STAGES:
        raise InvalidSpecError(_where("stage"), f"must be 0, 1, 2 or 3, got {stage!r}")
    out: dict[str, Any] = {"strategy": STAGES[stage]}

    optimizer = _device(zero.get("offload_optimizer"), "offload_optimizer")
    params = _device(zero.get("offload_param"), "offload_param")
    if params == "cpu":
        if stage != 3:
            raise InvalidSpecError(
                _where("offload_param.device"), "parameter offload needs stage 3"
            )
        if optimizer != "cpu":
            raise InvalidSpecError(
                _where("offload_param.device"),
                "parameter offload without optimizer offload is not modelled",
            )
        out["offload"] = Offload.OPTIMIZER_AND_PARAMS
    elif optimizer == "cpu":
        if stage == 0:
            raise InvalidSpecError(
                _where("offload_optimizer.device"), "optimizer offload needs ZeRO stage 1, 2 or 3"
            )
        out["offload"] = Offload.OPTIMIZER
    else:
        out["offload"] = Offload.NONE

    for key, field in COUNT_KEYS.items():
        if key in zero:
            value = _count(zero[key], key, field)
            if value is not None or field in AUTO_FIELDS:
                out[field] = value
    if stage:
        for field, default in AUTO_FIELDS.items():
            out.setdefault(field, default)
    for key in BOOL_KEYS:
        if key not in zero:
            continue
        value = zero[key]
        if value is None:
            continue
        if not isinstance(value, bool):
            raise InvalidSpecError(_where(key), f"must be true or false, got {value!r}")
        out[key] = value
    return out


# An FSDP config as HF Trainer takes it (TrainingArguments.fsdp_config, transformers 5.24
# training_args.py `_fsdp_plugin_args`) or as `accelerate config` writes it (the same keys with
# an `fsdp_` prefix, accelerate 1.15 utils/dataclasses.py FullyShardedDataParallelPlugin).
FSDP_DEFAULT_VERSION = 2  # HF Trainer's default `fsdp_config["version"]`
ACCELERATE_DEFAULT_VERSION = 1  # accelerate's, for a config without `fsdp_version`
FSDP1_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
FSDP_BOOL_KEYS = ("use_orig_params", "limit_all_gathers", "forward_prefetch")


def _bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
        return value.lower() in ("true", "yes", "1")
    raise InvalidSpecError(key, f"must be true or false, got {value!r}")


def parallel_from_fsdp(config: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """ParallelSpec field values, and job field values (`gradient_checkpointing` from FSDP's
    activation checkpointing), from an FSDP config. Keys may carry accelerate's `fsdp_` prefix;
    unknown keys are ignored; bad values raise InvalidSpecError naming the key as given."""
    if not isinstance(config, Mapping):
        raise InvalidSpecError("fsdp_config", "must be a JSON object")
    given = {
        (key[len("fsdp_") :] if isinstance(key, str) and key.startswith("fsdp_") else key): (
            key,
            value,
        )
        for key, value in config.items()
    }
    prefixed = any(isinstance(key, str) and key.startswith("fsdp_") for key in config)
    default = ACCELERATE_DEFAULT_VERSION if prefixed else FSDP_DEFAULT_VERSION
    version_key, version = given.get("version", ("version", default))
    if isinstance(version, str) and version.isdigit():
        version = int(version)
    if version not in (1, 2) or isinstance(version, bool):
        raise InvalidSpecError(version_key, f"must be 1 or 2, got {version!r}")
    out: dict[str, Any] = {"strategy": Strategy.FSDP if version == 1 else Strategy.FSDP2}
    job: dict[str, Any] = {}
    for name in ("reshard_after_forward", "sharding_strategy"):
        if name not in given:
            continue
        key, value = given[name]
        if version == 2:
            if name == "sharding_strategy":
                raise InvalidSpecError(key, "FSDP2 takes reshard_after_forward (true or false)")
            out["reshard_after_forward"] = _bool(value, key)
            continue
        text = str(value).upper()
        if text.isdigit() and 1 <= int(text) <= len(FSDP1_STRATEGIES):
            text = FSDP1_STRATEGIES[int(text) - 1]  # torch's ShardingStrategy numbering
        if text not in FSDP1_STRATEGIES:
            raise InvalidSpecError(
                key, f"must be one of {', '.join(FSDP1_STRATEGIES)}, got {value!r}"
            )
        out["sharding_strategy"] = text
    for name in ("cpu_offload", "offload_params"):
        if name in given:
            key, value = given[name]
            if _bool(value, key):
                out["offload"] = Offload.OPTIMIZER_AND_PARAMS
    if version == 1 and "backward_prefetch" not in given:
        # Neither HF Trainer nor accelerate prefetch unless told to (transformers
        # training_args.py: "NO_PREFETCH"; accelerate's plugin: None).
        out["backward_prefetch"] = "NO_PREFETCH"
    if "backward_prefetch" in given:
        key, value = given["backward_prefetch"]
        text = "NO_PREFETCH" if value is None else str(value).upper()
        if text not in ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"):
            raise InvalidSpecError(
                key, f"must be BACKWARD_PRE, BACKWARD_POST or NO_PREFETCH, got {value!r}"
            )
        out["backward_prefetch"] = text
    for name in FSDP_BOOL_KEYS:
        if name in given:
            key, value = given[name]
            out[name] = _bool(value, key)
    if "activation_checkpointing" in given:
        key, value = given["activation_checkpointing"]
        job["gradient_checkpointing"] = _bool(value, key)
    return out, job
