"""A DeepSpeed config JSON, as users pass it to HF Trainer (`--deepspeed ds_config.json`), read
into ParallelSpec field values.

Keys follow DeepSpeed v0.19.5's `zero_optimization` section (deepspeed/runtime/zero/config.py
DeepSpeedZeroConfig, offload_config.py DeepSpeedZeroOffloadOptimizerConfig and
DeepSpeedZeroOffloadParamConfig). "auto" values stay None: HF's DeepSpeed integration fills them
from the model (transformers/integrations/deepspeed.py), as the estimator does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from service.core.errors import InvalidSpecError
from service.core.spec import Offload, Strategy

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
# Fields whose "auto" HF fills; others must be numbers.
AUTO_FIELDS = {
    "reduce_bucket_size",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
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
