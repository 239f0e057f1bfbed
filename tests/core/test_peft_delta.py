"""PEFT's methods beside LoRA: what each spec accepts and refuses, and what each changes in the
estimate of a tiny Llama-style model (the reference traces check the bytes,
tests/core/test_references.py)."""

from __future__ import annotations

import pytest

from service.core.errors import InvalidSpecError
from service.core.estimator import estimate, kronecker_factors, layer_saved_bytes
from service.core.result import Component
from service.core.spec import (
    Framework,
    LoraSpec,
    Method,
    Optim,
    QuantSpec,
    TrainingSpec,
    resolve,
)
from service.core.spec.delta import LohaSpec, LokrSpec, VeraSpec
from tests.core.test_estimator import ARCH, LORA_QV


def _spec(method: Method, **changes: object) -> TrainingSpec:
    base: dict[str, object] = {"method": method, "batch_size": 2, "seq_len": 8}
    base.update(changes)
    return TrainingSpec(**base)  # type: ignore[arg-type]


def _blk(nbytes: int) -> int:
    return -(-nbytes // 512) * 512


# -- LoRA-FA --------------------------------------------------------------------------------


def test_lora_fa_trains_only_b() -> None:
    lora = estimate(ARCH, _spec(Method.LORA, lora=LORA_QV))
    fa = estimate(ARCH, _spec(Method.LORA_FA, lora=LORA_QV))
    # lora_A of q_proj and v_proj (4 x 64 each) in each of the 2 layers stops training
    assert lora.params.trainable - fa.params.trainable == 2 * 2 * 4 * 64
    assert fa.params.trainable == 2 * 4 * (64 + 32)
    assert fa.components[Component.FROZEN_WEIGHTS] - lora.components[
        Component.FROZEN_WEIGHTS
    ] == 2 * 2 * _blk(4 * 64 * 4)


def test_lora_fa_keeps_no_input_for_a_frozen_lora_a() -> None:
    b, s = 2, 8
    lora = layer_saved_bytes(ARCH, resolve(_spec(Method.LORA, lora=LORA_QV)), b, s)
    fa = layer_saved_bytes(ARCH, resolve(_spec(Method.LORA_FA, lora=LORA_QV)), b, s)
    # q_proj and v_proj each saved their input's fp32 cast (16 tokens x 64 features)
    assert lora - fa == 2 * _blk(16 * 64 * 4)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"optim": Optim.ADAMW_BNB_8BIT}, "optim"),
        ({"lora": LoraSpec(r=4, use_dora=True)}, "lora.use_dora"),
        ({"lora": LoraSpec(r=4, modules_to_save=("lm_head",))}, "lora.modules_to_save"),
        ({"quantization": QuantSpec()}, "quantization"),
        ({"autocast": True}, "autocast"),
        ({"framework": Framework.LITGPT}, "framework"),
    ],
)
def test_lora_fa_refuses_what_it_does_not_model(changes: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidSpecError) as caught:
        _spec(Method.LORA_FA, **changes)
    assert caught.value.field == field


def test_lora_fa_on_an_encoder_is_refused() -> None:
    from service.catalog.models import default_catalog

    bert = default_catalog().resolve("google-bert/bert-base-uncased").arch
    with pytest.raises(InvalidSpecError) as caught:
        estimate(bert, _spec(Method.LORA_FA, seq_len=128))
    assert caught.value.field == "method"


# -- VeRA -----------------------------------------------------------------------------------


def test_vera_trains_two_vectors_per_adapted_linear_beside_shared_projections() -> None:
    vera = estimate(ARCH, _spec(Method.VERA, vera=VeraSpec(r=16)))
    lora = estimate(ARCH, _spec(Method.LORA, lora=LoraSpec(r=16)))
    # PEFT's default targets q_proj (64 -> 64) and v_proj (64 -> 32) in each of 2 layers:
    # lambda_b (out) and lambda_d (r) each
    assert vera.params.trainable == 2 * ((64 + 16) + (32 + 16))
    # vera_A (16 x 64) and vera_B (64 x 16), fp32, once for the model; LoRA's A and B trained
    projections = 2 * _blk(16 * 64 * 4)
    assert (
        vera.components[Component.FROZEN_WEIGHTS] - lora.components[Component.FROZEN_WEIGHTS]
        == projections
    )


def test_vera_keeps_the_projections_outputs_not_the_input() -> None:
    b, s = 2, 8
    lora = layer_saved_bytes(ARCH, resolve(_spec(Method.LORA, lora=LoraSpec(r=16))), b, s)
    vera = layer_saved_bytes(ARCH, resolve(_spec(Method.VERA, vera=VeraSpec(r=16))), b, s)
    # per adapted linear, 16 tokens: LoRA keeps the fp32 input (64) and A's output (16);
    # VeRA keeps vera_A's output (16) and vera_B's (the linear's outputs), fp32
    per_lora = sum(_blk(16 * 64 * 4) + _blk(16 * 16 * 4) for _ in range(2))
    per_vera = sum(_blk(16 * 16 * 4) + _blk(16 * out * 4) for out in (64, 32))
    assert lora - vera == per_lora - per_vera


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"vera": {"r": 0}}, "vera.r"),
        ({"vera": {"vera_dropout": 0.1}}, "vera.vera_dropout"),
        ({"vera": {"target_modules": "q_proj"}}, "vera.target_modules"),
        ({"lora": LoraSpec(r=4)}, "lora"),
        ({"quantization": QuantSpec()}, "quantization"),
        ({"autocast": True}, "autocast"),
        ({"framework": Framework.TORCHTUNE}, "framework"),
    ],
)
def test_vera_refuses_what_it_does_not_model(changes: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidSpecError) as caught:
        options = changes.get("vera")
        if isinstance(options, dict):
            changes = {"vera": VeraSpec(**options)}
        _spec(Method.VERA, **changes)
    assert caught.value.field == field


def test_vera_options_need_method_vera() -> None:
    with pytest.raises(InvalidSpecError) as caught:
        _spec(Method.LORA, vera=VeraSpec())
    assert caught.value.field == "vera"


def test_vera_targets_missing_from_the_model_name_vera() -> None:
    with pytest.raises(InvalidSpecError) as caught:
        estimate(ARCH, _spec(Method.VERA, vera=VeraSpec(target_modules=("query",))))
    assert caught.value.field == "vera.target_modules"


# -- LoHa -----------------------------------------------------------------------------------


def test_loha_trains_two_low_rank_pairs_per_adapted_linear() -> None:
    loha = estimate(ARCH, _spec(Method.LOHA, loha=LohaSpec(r=4)))
    # q_proj (64 -> 64) and v_proj (64 -> 32) in each of 2 layers: 2 * r * (in + out) each
    assert loha.params.trainable == 2 * (2 * 4 * (64 + 64) + 2 * 4 * (64 + 32))


def test_loha_keeps_the_input_cast_and_the_full_size_delta_weight() -> None:
    b, s = 2, 8
    lora = layer_saved_bytes(ARCH, resolve(_spec(Method.LORA, lora=LoraSpec(r=4))), b, s)
    loha = layer_saved_bytes(ARCH, resolve(_spec(Method.LOHA, loha=LohaSpec(r=4))), b, s)
    # per adapted linear: LoRA keeps A's output (16 tokens x r 4, fp32) beside the input's
    # fp32 cast both keep; LoHa keeps the fp32 delta weight (64 x out) instead
    assert loha - lora == sum(_blk(64 * out * 4) - _blk(16 * 4 * 4) for out in (64, 32))


def test_loha_delta_grows_with_the_weight_not_the_tokens() -> None:
    short = estimate(ARCH, _spec(Method.LOHA, loha=LohaSpec(r=4), seq_len=8))
    lora_short = estimate(ARCH, _spec(Method.LORA, lora=LoraSpec(r=4), seq_len=8))
    long = estimate(ARCH, _spec(Method.LOHA, loha=LohaSpec(r=4), seq_len=64))
    lora_long = estimate(ARCH, _spec(Method.LORA, lora=LoraSpec(r=4), seq_len=64))
    gap_short = (
        short.components[Component.ACTIVATIONS] - lora_short.components[Component.ACTIVATIONS]
    )
    gap_long = long.components[Component.ACTIVATIONS] - lora_long.components[Component.ACTIVATIONS]
    # LoRA's A outputs grow with the tokens, LoHa's deltas do not
    assert gap_long < gap_short


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"r": 0}, "loha.r"),
        ({"alpha": 0}, "loha.alpha"),
        ({"rank_dropout": 0.1}, "loha.rank_dropout"),
        ({"module_dropout": 0.1}, "loha.module_dropout"),
        ({"target_modules": ()}, "loha.target_modules"),
    ],
)
def test_loha_options_are_checked(options: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidSpecError) as caught:
        LohaSpec(**options)  # type: ignore[arg-type]
    assert caught.value.field == field


def test_loha_options_need_method_loha_and_loha_takes_no_quantization() -> None:
    with pytest.raises(InvalidSpecError) as caught:
        _spec(Method.VERA, loha=LohaSpec())
    assert caught.value.field == "loha"
    with pytest.raises(InvalidSpecError) as caught:
        _spec(Method.LOHA, quantization=QuantSpec())
    assert caught.value.field == "quantization"


# -- LoKr -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dimension", "factor", "expected"),
    [
        (256, -1, (16, 16)),  # peft/tuners/lokr/layer.py factorization's docstring
        (128, -1, (8, 16)),
        (127, -1, (1, 127)),
        (128, 4, (4, 32)),
        (3072, 4, (4, 768)),
        (896, -1, (28, 32)),
    ],
)
def test_kronecker_factors_are_peft_s(
    dimension: int, factor: int, expected: tuple[int, int]
) -> None:
    assert kronecker_factors(dimension, factor) == expected


def test_lokr_trainable_parameters_match_peft_s_count() -> None:
    from service.catalog.models import default_catalog

    # the published Llama-3.2-3B LoKr row: r 32, decompose_factor 4 on q_proj and v_proj,
    # 2,294,656 trainable parameters as PEFT counted them
    arch = default_catalog().resolve("meta-llama/Llama-3.2-3B").arch
    lokr = LokrSpec(r=32, alpha=64, decompose_factor=4, target_modules=("q_proj", "v_proj"))
    est = estimate(arch, _spec(Method.LOKR, lokr=lokr, seq_len=128))
    assert est.params.trainable == 2_294_656


def test_lokr_keeps_the_delta_and_the_built_factor() -> None:
    b, s = 2, 8
    loha = layer_saved_bytes(ARCH, resolve(_spec(Method.LOHA, loha=LohaSpec(r=4))), b, s)
    lokr = layer_saved_bytes(ARCH, resolve(_spec(Method.LOKR, lokr=LokrSpec(r=4))), b, s)
    # both keep the input's cast and the full-size delta; LoKr also keeps w2 = w2_a @ w2_b
    # (q_proj: 64 = 8 x 8 on each side, v_proj's 32 outputs 4 x 8; r 4 < 8 / 2 is false, so
    # w2 is whole) -- nothing more with these shapes
    assert lokr == loha
    pair = layer_saved_bytes(ARCH, resolve(_spec(Method.LOKR, lokr=LokrSpec(r=1))), b, s)
    # r 1 < 4: w2 a rank-1 pair whose (8 x 8) product each linear keeps
    assert pair - lokr == 2 * _blk(8 * 8 * 4)


def test_lokr_options_are_checked() -> None:
    with pytest.raises(InvalidSpecError) as caught:
        LokrSpec(decompose_factor=0)
    assert caught.value.field == "lokr.decompose_factor"
    with pytest.raises(InvalidSpecError) as caught:
        _spec(Method.LOHA, lokr=LokrSpec())
    assert caught.value.field == "lokr"
