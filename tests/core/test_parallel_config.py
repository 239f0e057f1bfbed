"""DeepSpeed config JSON to ParallelSpec field values."""

from __future__ import annotations

import pytest

from service.core.errors import InvalidSpecError
from service.core.parallel_config import parallel_from_deepspeed
from service.core.spec import Offload, ParallelSpec, Strategy

# The shape of HF's example ds_config_zero3.json (docs "DeepSpeed" page).
ZERO3_AUTO = {
    "bf16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
}


def test_hf_zero3_example_maps_to_spec_fields() -> None:
    fields = parallel_from_deepspeed(ZERO3_AUTO)
    assert fields == {
        "strategy": Strategy.ZERO3,
        "offload": Offload.OPTIMIZER_AND_PARAMS,
        "reduce_bucket_size": None,
        "stage3_prefetch_bucket_size": None,
        "stage3_param_persistence_threshold": None,
        "stage3_max_live_parameters": 1_000_000_000,
        "overlap_comm": True,
        "contiguous_gradients": True,
    }
    spec = ParallelSpec(gpus=4, **fields)
    assert spec.strategy is Strategy.ZERO3


def test_zero2_with_numbers_and_optimizer_offload() -> None:
    fields = parallel_from_deepspeed(
        {
            "zero_optimization": {
                "stage": 2,
                "offload_optimizer": {"device": "cpu"},
                "allgather_bucket_size": 2e8,
                "reduce_bucket_size": 2e8,
                "overlap_comm": False,
            }
        }
    )
    assert fields["strategy"] is Strategy.ZERO2
    assert fields["offload"] is Offload.OPTIMIZER
    assert fields["reduce_bucket_size"] == fields["allgather_bucket_size"] == 200_000_000
    assert fields["overlap_comm"] is False
    ParallelSpec(gpus=2, **fields)


def test_left_out_hidden_size_keys_take_deepspeeds_defaults_not_auto() -> None:
    # A config that leaves them out runs with DeepSpeedZeroConfig's defaults; only "auto" asks
    # HF (or accelerate) to fill them from the hidden size.
    fields = parallel_from_deepspeed({"zero_optimization": {"stage": 3}})
    assert fields["reduce_bucket_size"] == 500_000_000
    assert fields["stage3_prefetch_bucket_size"] == 50_000_000
    assert fields["stage3_param_persistence_threshold"] == 100_000
    given = parallel_from_deepspeed({"zero_optimization": {"stage": 2, "reduce_bucket_size": 2e8}})
    assert given["reduce_bucket_size"] == 200_000_000


def test_no_zero_section_is_stage_0() -> None:
    assert parallel_from_deepspeed({"bf16": {"enabled": True}}) == {
        "strategy": Strategy.DDP,
        "offload": Offload.NONE,
    }


@pytest.mark.parametrize(
    ("zero", "key"),
    [
        ({"stage": 4}, "zero_optimization.stage"),
        ({"stage": "3"}, "zero_optimization.stage"),
        ({"stage": 3, "reduce_bucket_size": -1}, "zero_optimization.reduce_bucket_size"),
        ({"stage": 3, "reduce_bucket_size": "big"}, "zero_optimization.reduce_bucket_size"),
        ({"stage": 3, "allgather_bucket_size": "auto"}, "zero_optimization.allgather_bucket_size"),
        ({"stage": 2, "overlap_comm": "yes"}, "zero_optimization.overlap_comm"),
        (
            {"stage": 2, "offload_optimizer": {"device": "gpu"}},
            "zero_optimization.offload_optimizer.device",
        ),
        (
            {"stage": 3, "offload_param": {"device": "nvme"}},
            "zero_optimization.offload_param.device",
        ),
        (
            {"stage": 2, "offload_param": {"device": "cpu"}},
            "zero_optimization.offload_param.device",
        ),
        ({"stage": 3, "offload_optimizer": "cpu"}, "zero_optimization.offload_optimizer"),
    ],
)
def test_bad_values_name_the_json_key(zero: dict[str, object], key: str) -> None:
    with pytest.raises(InvalidSpecError) as info:
        parallel_from_deepspeed({"zero_optimization": zero})
    assert info.value.field == key


def test_not_an_object() -> None:
    with pytest.raises(InvalidSpecError):
        parallel_from_deepspeed([])  # type: ignore[arg-type]
    with pytest.raises(InvalidSpecError) as info:
        parallel_from_deepspeed({"zero_optimization": 3})
    assert info.value.field == "zero_optimization"
