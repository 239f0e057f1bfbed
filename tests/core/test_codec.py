"""The spec codec: every valid spec survives dict and JSON round trips; bad values are refused
naming the field and the reason."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.core.allocator import MIN_SPLIT_SETTING_MB, AllocatorConfig
from service.core.codec import spec_from_dict, spec_to_dict
from service.core.errors import InvalidSpecError
from service.core.limits import (
    MAX_ALLOC_SETTING_MB,
    MAX_BATCH_SIZE,
    MAX_BUCKET_CAP_MB,
    MAX_GPUS,
    MAX_GRAD_NORM,
    MAX_GRADIENT_ACCUMULATION,
    MAX_LORA_ALPHA,
    MAX_LORA_R,
    MAX_MODULES,
    MAX_SEQ_LEN,
    MAX_ZERO_ELEMENTS,
)
from service.core.quant_formats import (
    AWQ_BITS,
    AWQ_GROUP_SIZES,
    GPTQ_BITS,
    GPTQ_GROUP_SIZES,
    HQQ_BITS,
)
from service.core.spec import (
    ADAPTER_METHODS,
    ALL_LINEAR,
    DELTA_OPTIONS,
    DPO_METHODS,
    LORA_METHODS,
    METHOD_OPTIONS,
    SAVABLE_MODULES,
    SHARDING_STRATEGIES,
    ZERO_STAGES,
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
)
from service.core.spec.delta import AdaLoraSpec, BoftSpec, LohaSpec, LokrSpec, OftSpec, VeraSpec
from service.core.spec.kto import KtoLossType, KtoSpec
from service.core.spec.orpo import OrpoSpec
from service.core.spec.prompt import IA3Spec, LnTuningSpec, PrefixTuningSpec, PromptTuningSpec
from service.core.spec.vision import VisionInputs
from service.core.units import DType

module_names = st.from_regex(r"[A-Za-z0-9_.]{1,20}", fullmatch=True)
loras = st.builds(
    LoraSpec,
    r=st.integers(1, MAX_LORA_R),
    lora_alpha=st.integers(1, MAX_LORA_ALPHA),
    lora_dropout=st.none() | st.floats(0.0, 1.0, exclude_max=True),
    target_modules=st.none()
    | st.just(ALL_LINEAR)
    | st.lists(module_names, min_size=1, max_size=MAX_MODULES).map(tuple),
    modules_to_save=st.lists(st.sampled_from(SAVABLE_MODULES), max_size=2).map(tuple),
    adapter_dtype=st.none() | st.sampled_from(DType),
)
# bitsandbytes' formats (the others: `packed_quantizations`, each with its own options)
quantizations = st.builds(
    QuantSpec,
    type=st.sampled_from([QuantType.NF4, QuantType.FP4, QuantType.INT8]),
    double_quant=st.booleans(),
    compute_dtype=st.none() | st.sampled_from(DType),
    prepare_kbit=st.booleans(),
)
kbit_quantizations = st.builds(
    QuantSpec,
    type=st.sampled_from([QuantType.NF4, QuantType.FP4]),
    double_quant=st.booleans(),
    compute_dtype=st.none() | st.sampled_from(DType),
    prepare_kbit=st.booleans(),
)
packed_quantizations = st.one_of(
    st.builds(
        QuantSpec,
        type=st.just(QuantType.GPTQ),
        bits=st.none() | st.sampled_from(GPTQ_BITS),
        group_size=st.none() | st.sampled_from(GPTQ_GROUP_SIZES),
        desc_act=st.booleans(),
        prepare_kbit=st.booleans(),
    ),
    st.builds(
        QuantSpec,
        type=st.just(QuantType.AWQ),
        bits=st.none() | st.sampled_from(AWQ_BITS),
        group_size=st.none() | st.sampled_from(AWQ_GROUP_SIZES),
        prepare_kbit=st.booleans(),
    ),
    st.builds(
        QuantSpec,
        type=st.just(QuantType.HQQ),
        bits=st.none() | st.sampled_from(HQQ_BITS),
        group_size=st.none() | st.integers(1, 4096),
    ),
    st.builds(QuantSpec, type=st.just(QuantType.TORCHAO_FLOAT8), prepare_kbit=st.booleans()),
)
zero_elements = st.integers(1, MAX_ZERO_ELEMENTS)


@st.composite
def parallels(draw: st.DrawFn, strategies: list[Strategy] | None = None) -> ParallelSpec:
    strategy = draw(st.sampled_from(strategies or list(Strategy)))
    offloads = [Offload.NONE]
    if strategy in ZERO_STAGES:
        offloads.append(Offload.OPTIMIZER)
    if strategy in SHARDING_STRATEGIES:
        offloads.append(Offload.OPTIMIZER_AND_PARAMS)
    gpus = draw(st.integers(1, MAX_GPUS))
    sharding = draw(st.sampled_from(FsdpSharding))
    per_node = draw(st.none() | st.integers(1, MAX_GPUS))
    if sharding is FsdpSharding.HYBRID_SHARD and strategy is Strategy.FSDP:
        per_node = draw(st.sampled_from([d for d in (1, 2, 4, 8) if gpus % d == 0]))
    return ParallelSpec(
        gpus=gpus,
        strategy=strategy,
        offload=draw(st.sampled_from(offloads)),
        gpus_per_node=per_node,
        bucket_cap_mb=draw(st.integers(1, MAX_BUCKET_CAP_MB)),
        gradient_as_bucket_view=draw(st.booleans()),
        sharding_strategy=sharding,
        use_orig_params=draw(st.booleans()),
        limit_all_gathers=draw(st.booleans()),
        forward_prefetch=draw(st.booleans()),
        backward_prefetch=draw(st.sampled_from(FsdpBackwardPrefetch)),
        reshard_after_forward=draw(st.booleans()),
        reduce_bucket_size=draw(st.none() | zero_elements),
        allgather_bucket_size=draw(zero_elements),
        stage3_prefetch_bucket_size=draw(st.none() | zero_elements),
        stage3_max_live_parameters=draw(zero_elements),
        stage3_param_persistence_threshold=draw(st.none() | st.integers(0, MAX_ZERO_ELEMENTS)),
        contiguous_gradients=draw(st.booleans()),
        overlap_comm=draw(st.none() | st.booleans()),
    )


split_sizes = st.none() | st.integers(MIN_SPLIT_SETTING_MB, MAX_ALLOC_SETTING_MB)
allocators = st.builds(
    AllocatorConfig,
    max_split_size_mb=split_sizes,
    max_non_split_rounding_mb=split_sizes,
    roundup_power2_divisions=st.sampled_from([0, 1, 2, 4, 8, 16, 1024]),
    garbage_collection_threshold=st.floats(0.0, 1.0, exclude_max=True),
    expandable_segments=st.booleans(),
    per_process_memory_fraction=st.none() | st.floats(0.0, 1.0),
)


tuner_module_names = st.lists(
    st.sampled_from(["k_proj", "v_proj", "down_proj", "norm"]), min_size=1
)
ia3s = st.builds(
    IA3Spec,
    target_modules=st.none() | tuner_module_names.map(tuple),
    feedforward_modules=st.none(),
)
ln_tunings = st.builds(LnTuningSpec, target_modules=st.none() | tuner_module_names.map(tuple))
prompt_tunings = st.builds(PromptTuningSpec, num_virtual_tokens=st.integers(1, 1000))
prefix_tunings = st.builds(
    PrefixTuningSpec, num_virtual_tokens=st.integers(1, 1000), prefix_projection=st.just(False)
) | st.builds(
    PrefixTuningSpec,
    num_virtual_tokens=st.integers(1, 1000),
    prefix_projection=st.just(True),
    encoder_hidden_size=st.none() | st.integers(1, 4096),
)
veras = st.builds(
    VeraSpec,
    r=st.integers(1, MAX_LORA_R),
    target_modules=st.none()
    | st.just(ALL_LINEAR)
    | st.lists(module_names, min_size=1, max_size=MAX_MODULES).map(tuple),
    d_initial=st.floats(-1.0, 1.0),
    projection_prng_key=st.integers(0, 2**31),
    save_projection=st.booleans(),
)
# The PEFT methods beside LoRA: PEFT's own step on one GPU, without autocast.
DELTA_METHODS = (
    Method.BOFT,
    Method.LORA_FA,
    Method.VERA,
    Method.LOHA,
    Method.LOKR,
    Method.ADALORA,
    Method.OFT,
)
lokrs = st.builds(
    LokrSpec,
    r=st.integers(1, MAX_LORA_R),
    alpha=st.integers(1, MAX_LORA_ALPHA),
    decompose_both=st.booleans(),
    decompose_factor=st.just(-1) | st.integers(1, 64),
    rank_dropout_scale=st.booleans(),
)
lohas = st.builds(
    LohaSpec,
    r=st.integers(1, MAX_LORA_R),
    alpha=st.integers(1, MAX_LORA_ALPHA),
    target_modules=st.none()
    | st.just(ALL_LINEAR)
    | st.lists(module_names, min_size=1, max_size=MAX_MODULES).map(tuple),
)

adaloras = st.builds(
    AdaLoraSpec,
    init_r=st.integers(8, MAX_LORA_R),
    target_r=st.integers(1, 8),
    lora_alpha=st.integers(1, MAX_LORA_ALPHA),
    target_modules=st.none() | st.just(ALL_LINEAR),
    orth_reg_weight=st.floats(0.0, 1.0),
    tinit=st.integers(0, 100),
    tfinal=st.integers(0, 100),
    deltaT=st.integers(1, 10),
    total_step=st.none() | st.integers(201, 10_000),
)

ofts = st.builds(
    OftSpec,
    r=st.integers(1, 64),
    oft_block_size=st.just(0),
    target_modules=st.none() | st.just(ALL_LINEAR),
) | st.builds(OftSpec, r=st.just(0), oft_block_size=st.integers(1, 256))

bofts = st.builds(
    BoftSpec,
    boft_block_size=st.integers(1, 64),
    boft_n_butterfly_factor=st.integers(1, 4),
    target_modules=st.none() | st.just(ALL_LINEAR),
) | st.builds(BoftSpec, boft_block_size=st.just(0), boft_block_num=st.integers(1, 256))


@st.composite
def delta_specs(draw: st.DrawFn, method: Method) -> TrainingSpec:
    fa_loras = loras.filter(lambda lora: not lora.modules_to_save)
    return TrainingSpec(
        method=method,
        batch_size=draw(st.integers(1, MAX_BATCH_SIZE)),
        seq_len=draw(st.integers(1, MAX_SEQ_LEN)),
        lora=draw(st.none() | fa_loras) if method is Method.LORA_FA else None,
        vera=draw(st.none() | veras) if method is Method.VERA else None,
        loha=draw(st.none() | lohas) if method is Method.LOHA else None,
        lokr=draw(st.none() | lokrs) if method is Method.LOKR else None,
        adalora=draw(st.none() | adaloras) if method is Method.ADALORA else None,
        oft=draw(st.none() | ofts) if method is Method.OFT else None,
        boft=draw(st.none() | bofts) if method is Method.BOFT else None,
        dtype=draw(st.sampled_from(DType)),
        optim=draw(st.sampled_from((Optim.ADAMW_TORCH, Optim.ADAMW_TORCH_FUSED))),
        gradient_checkpointing=draw(st.booleans()),
        allocator=draw(allocators),
    )


@st.composite
def dpo_specs(draw: st.DrawFn) -> TrainingSpec:
    """Objectives 'dpo', 'reward', 'kto' and 'orpo': TRL's DPOTrainer, RewardTrainer,
    KTOTrainer or ORPOTrainer on one GPU, HF + PEFT, under bf16 autocast or without it (ORPO's
    QLoRA without); DPO's, KTO's and ORPO's settings with their objective only (KTO's KL batch
    with two examples at least)."""
    method = draw(st.sampled_from(DPO_METHODS))
    objective = draw(
        st.sampled_from((Objective.DPO, Objective.REWARD, Objective.KTO, Objective.ORPO))
    )
    orpo_settings = st.builds(OrpoSpec, disable_dropout=st.booleans())
    dpo_settings = st.builds(
        DpoSpec,
        precompute_ref_log_probs=st.booleans(),
        max_completion_length=st.none() | st.integers(1, MAX_SEQ_LEN),
    )
    kto_settings = st.builds(
        KtoSpec, precompute_ref_log_probs=st.booleans(), loss_type=st.sampled_from(KtoLossType)
    )
    kto = draw(st.none() | kto_settings) if objective is Objective.KTO else None
    kl = objective is Objective.KTO and (kto is None or kto.calculate_kl)
    dtype = draw(st.sampled_from(DType))
    # ORPOTrainer's QLoRA under bf16 (peft_module_casting_to_bf16) is not modelled
    orpo_qlora = objective is Objective.ORPO and method is Method.QLORA
    return TrainingSpec(
        method=method,
        objective=objective,
        dpo=draw(st.none() | dpo_settings) if objective is Objective.DPO else None,
        kto=kto,
        orpo=draw(st.none() | orpo_settings) if objective is Objective.ORPO else None,
        batch_size=draw(st.integers(2 if kl else 1, MAX_BATCH_SIZE)),
        seq_len=draw(st.integers(1, MAX_SEQ_LEN)),
        lora=draw(st.none() | loras) if method in LORA_METHODS else None,
        quantization=draw(st.none() | quantizations) if method is Method.QLORA else None,
        dtype=dtype,
        # bf16 mixed precision (TRL's default); fp16's gradient scaler is not modelled
        autocast=dtype is not DType.FP16 and not orpo_qlora and draw(st.booleans()),
        gradient_checkpointing=draw(st.booleans()),
        allocator=draw(allocators),
    )


@st.composite
def specs(draw: st.DrawFn) -> TrainingSpec:
    method = draw(st.sampled_from(Method))
    if method in DPO_METHODS and draw(st.integers(0, 3)) == 0:
        return draw(dpo_specs())
    if method in DELTA_METHODS:
        return draw(delta_specs(method))
    # PEFT's other methods are modelled with HF + PEFT on one GPU, without autocast
    other = method in METHOD_OPTIONS
    # LitGPT's adapters: LitGPT on one GPU, without autocast or checkpointing, a 4-bit base
    # (not LLM.int8) or none
    adapter = method in ADAPTER_METHODS
    return TrainingSpec(
        method=method,
        batch_size=draw(st.integers(1, MAX_BATCH_SIZE)),
        seq_len=draw(st.integers(1, MAX_SEQ_LEN)),
        lora=draw(st.none() | loras) if method in LORA_METHODS else None,
        quantization=draw(st.none() | quantizations)
        if method is Method.QLORA
        else draw(st.none() | kbit_quantizations)
        if adapter
        else None,
        ia3=draw(st.none() | ia3s) if method is Method.IA3 else None,
        ln_tuning=draw(st.none() | ln_tunings) if method is Method.LN_TUNING else None,
        prompt_tuning=draw(prompt_tunings) if method is Method.PROMPT_TUNING else None,
        prefix_tuning=draw(prefix_tunings) if method is Method.PREFIX_TUNING else None,
        dtype=draw(st.sampled_from(DType)),
        autocast=False if other or adapter else draw(st.booleans()),
        optim=draw(st.sampled_from(Optim)),
        gradient_accumulation_steps=draw(st.integers(1, MAX_GRADIENT_ACCUMULATION)),
        max_grad_norm=draw(st.floats(0.0, MAX_GRAD_NORM)),
        gradient_checkpointing=False
        if adapter or method is Method.PREFIX_TUNING
        else draw(st.booleans()),
        attn_implementation=draw(st.sampled_from(AttnImpl)),
        sdpa_kernel=draw(st.sampled_from(SdpaKernel)),
        loss=draw(st.none() | st.sampled_from(LossImpl)),
        framework=Framework.HF
        if other
        else Framework.LITGPT
        if adapter
        else draw(st.sampled_from(Framework)),
        parallel=ParallelSpec()
        if other or adapter
        else draw(
            parallels(
                [s for s in Strategy if s not in SHARDING_STRATEGIES]
                if method is Method.QLORA
                else None
            )
        ),
        allocator=draw(allocators),
    )


@settings(max_examples=80)
@given(specs())
def test_every_spec_round_trips_through_json(spec: TrainingSpec) -> None:
    data = spec_to_dict(spec)
    assert spec_from_dict(data) == spec
    assert spec_from_dict(json.loads(json.dumps(data))) == spec


def _made(make: Any) -> tuple[str, Any]:
    """What `make()` returns, or the field and reason of the InvalidSpecError it raises."""
    try:
        return ("spec", make())
    except InvalidSpecError as exc:
        return ("refused", (exc.field, str(exc)))


@settings(max_examples=120)
@given(specs(), st.integers(-2, MAX_BATCH_SIZE), st.integers(-2, MAX_SEQ_LEN))
def test_a_spec_at_another_shape_is_the_replaced_one(
    spec: TrainingSpec, batch: int, seq: int
) -> None:
    # with_shape skips the checks that do not read the shape: it must give what replace()
    # gives, the same spec or the same refusal, field for field
    fast = _made(lambda: spec.with_shape(batch, seq))
    slow = _made(lambda: dataclasses.replace(spec, batch_size=batch, seq_len=seq))
    assert fast == slow
    if fast[0] == "spec":
        assert hash(fast[1]) == hash(slow[1])
        assert spec_to_dict(fast[1]) == spec_to_dict(slow[1])


# What the fit-check changes in a job (fit.py's suggestions), each drawn at random.
_CHANGES = st.one_of(
    st.builds(lambda optim: {"optim": optim}, st.sampled_from(Optim)),
    st.builds(lambda on: {"gradient_checkpointing": on}, st.booleans()),
    st.builds(lambda m: {"method": m, "quantization": None, "lora": None}, st.sampled_from(Method)),
    st.builds(
        lambda b, g: {"batch_size": b, "gradient_accumulation_steps": g},
        st.integers(-1, 64),
        st.integers(-1, 64),
    ),
    st.builds(lambda gpus: {"parallel": ParallelSpec(gpus=gpus)}, st.integers(1, 8)),
)


@settings(max_examples=120)
@given(specs(), _CHANGES)
def test_a_changed_spec_is_the_replaced_one(spec: TrainingSpec, changes: dict[str, Any]) -> None:
    fast = _made(lambda: spec.changed(**changes))
    slow = _made(lambda: dataclasses.replace(spec, **changes))
    assert fast == slow
    if fast[0] == "spec":
        assert hash(fast[1]) == hash(slow[1])
        assert fast[1].shape_free_hash() == slow[1].shape_free_hash()


def test_a_kto_spec_at_another_shape_checks_its_smallest_batch() -> None:
    spec = TrainingSpec(batch_size=2, seq_len=512, objective=Objective.KTO)
    assert spec.with_shape(3, 256) == dataclasses.replace(spec, batch_size=3, seq_len=256)
    with pytest.raises(InvalidSpecError, match="batch_size"):
        spec.with_shape(1, 256)


@given(
    packed_quantizations,
    loras,
    st.integers(1, MAX_BATCH_SIZE),
    st.integers(1, MAX_SEQ_LEN),
    st.booleans(),
)
def test_gptq_awq_hqq_and_torchao_bases_round_trip_through_json(
    quant: QuantSpec, lora: LoraSpec, batch: int, seq: int, ckpt: bool
) -> None:
    spec = TrainingSpec(
        method=Method.QLORA,
        batch_size=batch,
        seq_len=seq,
        dtype=DType.FP16,
        lora=dataclasses.replace(lora, use_dora=False),
        quantization=quant,
        gradient_checkpointing=ckpt,
    )
    data = spec_to_dict(spec)
    assert spec_from_dict(json.loads(json.dumps(data))) == spec


@settings(max_examples=80)
@given(specs())
def test_the_dict_names_every_field_in_order(spec: TrainingSpec) -> None:
    data = spec_to_dict(spec)
    names = [f.name for f in dataclasses.fields(TrainingSpec) if f.init]
    if spec.num_labels is None:  # encoder-only: written when set
        names.remove("num_labels")
    if spec.target_length is None:  # encoder-decoder only: written when set
        names.remove("target_length")
    for name in (
        *METHOD_OPTIONS.values(),
        *DELTA_OPTIONS.values(),
        "dpo",
        "kto",
        "orpo",
        "grpo",
        "vision",
    ):  # when set
        if getattr(spec, name) is None:
            names.remove(name)
    if spec.objective is Objective.SFT:  # written when another objective is asked for
        names.remove("objective")
    # written when on
    for name in (
        "optimizer_in_backward",
        "activation_offloading",
        "packing",
        "torch_compile",
        "liger_kernel",
    ):
        if not getattr(spec, name):
            names.remove(name)
    assert list(data) == names
    assert list(data["allocator"]) == [f.name for f in dataclasses.fields(AllocatorConfig)]


def test_vision_inputs_are_written_when_set_and_read_back() -> None:
    vision = VisionInputs(images_per_sample=2, image_height=448, image_width=672)
    spec = TrainingSpec(batch_size=2, seq_len=1024, vision=vision)
    data = spec_to_dict(spec)
    assert data["vision"]["image_width"] == 672
    assert spec_from_dict(data) == spec
    assert "vision" not in spec_to_dict(TrainingSpec(batch_size=2, seq_len=16))


def test_num_labels_is_written_when_set_and_read_back() -> None:
    spec = TrainingSpec(batch_size=2, seq_len=16, num_labels=5)
    assert spec_to_dict(spec)["num_labels"] == 5
    assert spec_from_dict(spec_to_dict(spec)) == spec
    with pytest.raises(InvalidSpecError, match="num_labels"):
        spec_from_dict({"batch_size": 2, "seq_len": 16, "num_labels": 0})


def test_left_out_fields_take_their_defaults() -> None:
    assert spec_from_dict({"batch_size": 2, "seq_len": 16}) == TrainingSpec(
        batch_size=2, seq_len=16
    )


BASE: dict[str, Any] = {"batch_size": 2, "seq_len": 512}


@pytest.mark.parametrize(
    ("change", "field", "reason"),
    [
        ({"batch_size": 10**9}, "batch_size", "Input should be less than or equal to 4096"),
        ({"batch_size": 0}, "batch_size", "Input should be greater than or equal to 1"),
        ({"batch_size": "2"}, "batch_size", "Input should be a valid integer"),
        (
            {"batch_size": 2.5},
            "batch_size",
            "Input should be a valid integer, got a number with a fractional part",
        ),
        ({"seq_len": None}, "seq_len", "Input should be a valid integer"),
        ({"max_grad_norm": 1e7}, "max_grad_norm", "Input should be less than or equal to 1000000"),
        ({"max_grad_norm": float("inf")}, "max_grad_norm", "Input should be a finite number"),
        ({"lora": {"lora_dropout": 1.0}}, "lora.lora_dropout", "Input should be less than 1"),
        ({"lora": {"target_modules": "x"}}, "lora.target_modules", "Input should be 'all-linear'"),
        (
            {"lora": {"target_modules": []}},
            "lora.target_modules",
            "List should have at least 1 item after validation, not 0",
        ),
        (
            {"lora": {"modules_to_save": ["x"] * 65}},
            "lora.modules_to_save",
            "List should have at most 64 items after validation, not 65",
        ),
        ({"lora": 5}, "lora", "Input should be an object"),
        (
            {"method": "nope"},
            "method",
            "Input should be 'full', 'lora', 'qlora', 'lora-fa', 'vera', 'loha', 'lokr', "
            "'adalora', 'oft', 'boft', 'ia3', 'ln-tuning', 'prompt-tuning', 'prefix-tuning', "
            "'llama-adapter' or 'llama-adapter-v2'",
        ),
        ({"method": "lora", "ia3": {}}, "ia3", "ia3 options need method 'ia3'"),
        (
            {"method": "prompt-tuning", "prompt_tuning": {}},
            "prompt_tuning.num_virtual_tokens",
            "Field required",
        ),
        (
            {"method": "prefix-tuning", "prefix_tuning": {}},
            "prefix_tuning.num_virtual_tokens",
            "Field required",
        ),
        (
            {"method": "prefix-tuning", "prefix_tuning": {"num_virtual_tokens": 0}},
            "prefix_tuning.num_virtual_tokens",
            "Input should be greater than or equal to 1",
        ),
        (
            {
                "method": "prefix-tuning",
                "prefix_tuning": {"num_virtual_tokens": 8},
                "gradient_checkpointing": True,
            },
            "gradient_checkpointing",
            "PEFT's prefix tuning does not work with checkpointing",
        ),
        (
            {
                "method": "prefix-tuning",
                "prefix_tuning": {"num_virtual_tokens": 8, "encoder_hidden_size": 64},
            },
            "prefix_tuning.encoder_hidden_size",
            "needs prefix_projection=True",
        ),
        (
            {"method": "ia3", "ia3": {"target_modules": []}},
            "ia3.target_modules",
            "List should have at least 1 item after validation, not 0",
        ),
        ({"autocast": "yes"}, "autocast", "Input should be a valid boolean"),
        (
            {"parallel": {"gpus": 2000}},
            "parallel.gpus",
            "Input should be less than or equal to 1024",
        ),
        (
            {"allocator": {"roundup_power2_divisions": 3}},
            "allocator.roundup_power2_divisions",
            "must be 0 or a power of two",
        ),
        ({"surprise": 1}, "surprise", "Extra inputs are not permitted"),
        ({"lora": {"rank": 8}}, "lora.rank", "Extra inputs are not permitted"),
        (
            {"method": "full", "lora": {}},
            "lora",
            "LoRA options need method 'lora', 'qlora' or 'lora-fa'",
        ),
        ({"method": "lora", "vera": {}}, "vera", "vera options need method 'vera'"),
        (
            {"method": "vera", "vera": {"r": 0}},
            "vera.r",
            "Input should be greater than or equal to 1",
        ),
    ],
)
def test_bad_values_name_the_field_and_the_reason(
    change: dict[str, Any], field: str, reason: str
) -> None:
    with pytest.raises(InvalidSpecError) as caught:
        spec_from_dict({**BASE, **change})
    assert (caught.value.field, caught.value.reason) == (field, reason)


def test_the_job_size_is_required() -> None:
    with pytest.raises(InvalidSpecError) as caught:
        spec_from_dict({"batch_size": 2})
    assert (caught.value.field, caught.value.reason) == ("seq_len", "Field required")
