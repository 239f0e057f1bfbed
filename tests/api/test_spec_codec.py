"""The API's job schema and the core's spec codec accept the same specs, build the same
TrainingSpec from them, and refuse the same ones, naming the same field with the same reason.

Values are of their JSON types: the codec does not take the strings pydantic's lax mode reads
as numbers or booleans ("4", "on")."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from service.api.schemas import JobSpec
from service.core.codec import spec_from_dict
from service.core.errors import InvalidSpecError
from service.core.spec import TrainingSpec

# Each field: values inside its bounds, on them, just past them, and of the wrong type.
integers = st.integers(-2, 3) | st.integers(4000, 5000) | st.integers(10**6, 10**7)
numbers = st.floats(-1.0, 2.0) | st.floats(9e5, 2e6) | integers
fields: dict[str, st.SearchStrategy[Any]] = {
    "method": st.sampled_from(
        [
            "full",
            "lora",
            "qlora",
            "ia3",
            "ln-tuning",
            "prompt-tuning",
            "prefix-tuning",
            "lora-fa",
            "vera",
            "loha",
            "lokr",
            "adalora",
            "oft",
            "half",
        ]
    ),
    "batch_size": integers | st.just(2.5) | st.just(2.0),
    "seq_len": integers,
    "gradient_accumulation_steps": integers,
    "max_grad_norm": numbers,
    "autocast": st.booleans() | st.none(),
    "lora": st.none()
    | st.fixed_dictionaries(
        {},
        optional={
            "r": integers,
            "lora_alpha": integers,
            "lora_dropout": st.none() | numbers,
            "target_modules": st.none()
            | st.sampled_from(["all-linear", "q_proj"])
            | st.lists(st.sampled_from(["q_proj", "v_proj", "bad name", ""]), max_size=3),
            "modules_to_save": st.lists(
                st.sampled_from(["embed_tokens", "lm_head", "foo", "", 3]), max_size=3
            ),
        },
    ),
    "ia3": st.none()
    | st.fixed_dictionaries(
        {},
        optional={
            "target_modules": st.none()
            | st.lists(st.sampled_from(["k_proj", "down_proj", "bad name", ""]), max_size=3),
            "feedforward_modules": st.none()
            | st.lists(st.sampled_from(["down_proj", "up_proj", 3]), max_size=2),
        },
    ),
    "prompt_tuning": st.none()
    | st.fixed_dictionaries({}, optional={"num_virtual_tokens": integers}),
    "prefix_tuning": st.none()
    | st.fixed_dictionaries(
        {},
        optional={
            "num_virtual_tokens": integers,
            "prefix_projection": st.booleans() | st.just("yes"),
            "encoder_hidden_size": st.none() | integers,
        },
    ),
    "ln_tuning": st.none()
    | st.fixed_dictionaries(
        {},
        optional={"target_modules": st.none() | st.sampled_from([["norm"], ["norm", 3], []])},
    ),
    "vera": st.none()
    | st.fixed_dictionaries(
        {},
        optional={
            "r": integers,
            "vera_dropout": numbers,
            "d_initial": numbers,
            "projection_prng_key": integers,
            "save_projection": st.booleans() | st.none(),
            "target_modules": st.none()
            | st.sampled_from(["all-linear", "q_proj"])
            | st.lists(st.sampled_from(["q_proj", "v_proj", "bad name", ""]), max_size=3),
        },
    ),
    "loha": st.none()
    | st.fixed_dictionaries(
        {},
        optional={"r": integers, "alpha": integers, "rank_dropout": numbers},
    ),
    "lokr": st.none()
    | st.fixed_dictionaries(
        {},
        optional={"r": integers, "decompose_factor": integers, "decompose_both": st.booleans()},
    ),
    "objective": st.sampled_from(["sft", "dpo", "orpo", "cpo", "kto", "simpo-ish"]),
    "dpo": st.none()
    | st.fixed_dictionaries(
        {},
        optional={
            "precompute_ref_log_probs": st.booleans() | st.none(),
            "max_completion_length": st.none() | integers,
        },
    ),
    "kto": st.none()
    | st.fixed_dictionaries(
        {},
        optional={
            "precompute_ref_log_probs": st.booleans() | st.none(),
            "loss_type": st.sampled_from(["kto", "apo_zero_unpaired", "sigmoid"]),
        },
    ),
    "oft": st.none()
    | st.fixed_dictionaries(
        {},
        optional={
            "r": integers,
            "oft_block_size": integers,
            "coft": st.booleans(),
            "num_cayley_neumann_terms": integers,
        },
    ),
    "adalora": st.none()
    | st.fixed_dictionaries(
        {},
        optional={
            "init_r": integers,
            "target_r": integers,
            "lora_dropout": numbers,
            "tinit": integers,
            "total_step": st.none() | integers,
            "beta1": numbers,
        },
    ),
    "parallel": st.fixed_dictionaries(
        {},
        optional={
            "gpus": integers,
            "strategy": st.sampled_from(["ddp", "fsdp", "fsdp2", "zero2", "zero3", "zero4"]),
            "offload": st.sampled_from(["none", "optimizer", "optimizer_and_params"]),
            "gpus_per_node": st.none() | integers,
            "sharding_strategy": st.sampled_from(["FULL_SHARD", "HYBRID_SHARD", "full_shard"]),
            "reduce_bucket_size": st.none() | integers,
            "stage3_param_persistence_threshold": st.none() | integers,
            "overlap_comm": st.none() | st.booleans(),
        },
    ),
    "allocator": st.fixed_dictionaries(
        {},
        optional={
            "max_split_size_mb": st.none() | integers,
            "roundup_power2_divisions": integers,
            "garbage_collection_threshold": numbers,
        },
    ),
}


def _api(job: dict[str, Any]) -> TrainingSpec | list[tuple[str, str]]:
    """The API's spec, or its refusals as (dotted field, reason)."""
    try:
        return JobSpec.model_validate({"model": "m", **job}).to_spec()
    except ValidationError as exc:
        return [(".".join(str(p) for p in e["loc"]), e["msg"]) for e in exc.errors()]
    except InvalidSpecError as exc:
        return [(exc.field, exc.reason)]


@settings(max_examples=80)
@given(st.fixed_dictionaries({}, optional=fields))
def test_the_codec_agrees_with_the_api(job: dict[str, Any]) -> None:
    job = {"batch_size": 2, "seq_len": 16, **job}
    api = _api(job)
    try:
        spec = spec_from_dict(job)
    except InvalidSpecError as exc:
        assert isinstance(api, list), f"the API accepts what the codec refuses: {exc}"
        fields_and_reasons = [(f.split(".list[")[0].split(".literal[")[0], r) for f, r in api]
        assert (exc.field, exc.reason) in fields_and_reasons or any(
            f.startswith(exc.field) and r == exc.reason for f, r in fields_and_reasons
        ), (exc.field, exc.reason, api)
    else:
        assert api == spec


def test_an_unmodelled_objective_is_named_before_a_bad_combination() -> None:
    # an objective TRL names but the estimate does not model, beside an offload DDP cannot do:
    # both readers name the objective
    job = {
        "batch_size": 2,
        "seq_len": 16,
        "method": "full",
        "objective": "cpo",
        "parallel": {"offload": "optimizer"},
    }
    api = _api(job)
    assert isinstance(api, list)
    assert [field for field, _ in api] == ["objective"]
    try:
        spec_from_dict(job)
    except InvalidSpecError as exc:
        assert (exc.field, exc.reason) == api[0]
    else:
        raise AssertionError("the codec accepts an unmodelled objective")
