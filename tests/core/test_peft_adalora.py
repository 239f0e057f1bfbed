"""PEFT's AdaLoRA: what its spec accepts and refuses, and what it changes against LoRA at the
same rank on a tiny Llama-style model (the reference traces check the bytes,
tests/core/test_references.py)."""

from __future__ import annotations

import pytest

from service.core.errors import InvalidSpecError
from service.core.estimator import ALLOCATOR_BUFFERS, adalora_parts, estimate, layer_saved_bytes
from service.core.result import Component
from service.core.spec import Framework, LoraSpec, Method, ParallelSpec, TrainingSpec, resolve
from service.core.spec.delta import AdaLoraSpec, VeraSpec
from tests.core.test_estimator import ARCH

QV = ("q_proj", "v_proj")
ADALORA_QV = AdaLoraSpec(init_r=4, target_r=2, target_modules=QV)
LORA_QV = LoraSpec(r=4, target_modules=QV)
# the tiny model: 2 layers, hidden 64, q_proj 64 -> 64, v_proj 64 -> 32
LAYERS, HIDDEN, Q_OUT, V_OUT = 2, 64, 64, 32


def _spec(method: Method, **changes: object) -> TrainingSpec:
    base: dict[str, object] = {"method": method, "batch_size": 2, "seq_len": 8}
    if method is Method.ADALORA:
        base["adalora"] = ADALORA_QV
    else:
        base["lora"] = LORA_QV
    base.update(changes)
    return TrainingSpec(**base)  # type: ignore[arg-type]


def _blk(nbytes: int) -> int:
    return -(-nbytes // 512) * 512


def test_adalora_trains_a_b_e_and_the_rank_count() -> None:
    lora = estimate(ARCH, _spec(Method.LORA))
    ada = estimate(ARCH, _spec(Method.ADALORA))
    # per adapted linear: lora_E (init_r) and ranknum (one element) beside LoRA's A and B
    assert ada.params.trainable - lora.params.trainable == LAYERS * 2 * (4 + 1)
    assert (
        ada.components[Component.TRAINABLE_PARAMS] - lora.components[Component.TRAINABLE_PARAMS]
        == LAYERS * 2 * 2 * 512
    )


def test_adalora_keeps_the_scaled_output_the_product_and_the_divisor() -> None:
    b, s = 2, 8
    tokens = b * s
    lora = layer_saved_bytes(ARCH, resolve(_spec(Method.LORA)), b, s)
    ada = layer_saved_bytes(ARCH, resolve(_spec(Method.ADALORA)), b, s)
    scaled = _blk(tokens * Q_OUT * 4) + _blk(tokens * V_OUT * 4)
    products = 2 * _blk(4 * HIDDEN * 4)  # A * E of q_proj and v_proj
    divisors = 2 * 512
    assert ada - lora == scaled + products + divisors


def test_the_rank_allocator_keeps_three_copies_of_every_adapter_parameter() -> None:
    parts = adalora_parts(ARCH, resolve(_spec(Method.ADALORA)))
    per_layer = sum(
        _blk(4 * HIDDEN * 4) + _blk(out * 4 * 4) + _blk(4 * 4) for out in (Q_OUT, V_OUT)
    )
    assert parts.allocator_state == ALLOCATOR_BUFFERS * LAYERS * per_layer
    # the penalty's gradient of each lora_A and lora_B waits from the start of backward
    assert parts.penalty_gradients == LAYERS * sum(
        _blk(4 * HIDDEN * 4) + _blk(out * 4 * 4) for out in (Q_OUT, V_OUT)
    )
    assert adalora_parts(ARCH, resolve(_spec(Method.LORA))).allocator_state == 0


def test_adalora_state_is_lora_state_and_the_allocator_buffers() -> None:
    lora = estimate(ARCH, _spec(Method.LORA))
    ada = estimate(ARCH, _spec(Method.ADALORA))
    parts = adalora_parts(ARCH, resolve(_spec(Method.ADALORA)))
    # fused AdamW: exp_avg, exp_avg_sq and step for lora_E and ranknum of each linear
    adamw_extra = LAYERS * 2 * 3 * 2 * 512
    extra = ada.components[Component.OPTIMIZER_STATE] - lora.components[Component.OPTIMIZER_STATE]
    assert extra == parts.allocator_state + adamw_extra


def test_adalora_without_options_takes_peft_defaults() -> None:
    rs = resolve(TrainingSpec(method=Method.ADALORA, batch_size=1, seq_len=8))
    assert rs.adalora == AdaLoraSpec()
    assert rs.lora is not None and rs.lora.r == 12
    assert any("AdaLoRA options not given" in note for note in rs.assumptions)


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"lora_dropout": 0.1}, "adalora.lora_dropout"),
        ({"init_r": 4, "target_r": 8}, "adalora.target_r"),
        ({"tinit": 10, "tfinal": 10, "total_step": 20}, "adalora.total_step"),
        ({"beta1": 1.0}, "adalora.beta1"),
        ({"target_modules": "q_proj"}, "adalora.target_modules"),
    ],
)
def test_adalora_options_refuse_what_peft_or_the_model_does_not_take(
    options: dict[str, object], field: str
) -> None:
    with pytest.raises(InvalidSpecError) as caught:
        AdaLoraSpec(**options)  # type: ignore[arg-type]
    assert caught.value.field == field


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"vera": VeraSpec()}, "vera"),
        ({"lora": LORA_QV}, "lora"),
        ({"autocast": True}, "autocast"),
        ({"framework": Framework.LITGPT}, "framework"),
        ({"parallel": ParallelSpec(gpus=2)}, "parallel.gpus"),
    ],
)
def test_adalora_refuses_what_it_does_not_model(changes: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidSpecError) as caught:
        _spec(Method.ADALORA, **changes)
    assert caught.value.field == field


def test_adalora_options_need_the_method() -> None:
    with pytest.raises(InvalidSpecError) as caught:
        _spec(Method.LORA, adalora=ADALORA_QV)
    assert caught.value.field == "adalora"
