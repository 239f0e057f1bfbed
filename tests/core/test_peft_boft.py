"""PEFT's BOFT: its blocks and butterfly factors as PEFT checks them, what its spec refuses, and
what it changes against the frozen model on a tiny Llama-style model (the reference traces
*__boft__* check the bytes, tests/core/test_references.py)."""

from __future__ import annotations

import pytest

from service.core.errors import InvalidSpecError
from service.core.estimator import estimate, layer_saved_bytes
from service.core.result import Component
from service.core.spec import LoraSpec, Method, TrainingSpec, resolve
from service.core.spec.delta import BoftSpec
from tests.core.test_estimator import ARCH

QV = ("q_proj", "v_proj")
LAYERS = 2  # the tiny model's; q_proj and v_proj take its hidden size, 64
HIDDEN = 64
OUTS = (64, 32)  # q_proj's and v_proj's outputs (4 heads, 2 key/value heads of 16)


def _spec(boft: BoftSpec, **changes: object) -> TrainingSpec:
    base: dict[str, object] = {"method": Method.BOFT, "batch_size": 2, "seq_len": 8, "boft": boft}
    base.update(changes)
    return TrainingSpec(**base)  # type: ignore[arg-type]


def _blk(nbytes: int) -> int:
    return -(-nbytes // 512) * 512


def test_a_block_size_or_count_sets_the_other() -> None:
    assert BoftSpec().blocks(896) == (1, 224, 4)
    assert BoftSpec(boft_block_size=0, boft_block_num=8).blocks(64) == (1, 8, 8)
    assert BoftSpec(boft_block_size=8, boft_n_butterfly_factor=3).blocks(2048) == (3, 256, 8)


@pytest.mark.parametrize(
    ("options", "in_features", "field"),
    [
        ({"boft_block_size": 6}, 64, "boft.boft_block_size"),
        ({"boft_block_size": 0, "boft_block_num": 6}, 64, "boft.boft_block_size"),
        # 8 blocks of 8: three factors need the blocks a multiple of 4 (they are), two even
        # block sizes... but 4 factors need a multiple of 8 and 16 blocks
        ({"boft_block_size": 8, "boft_n_butterfly_factor": 5}, 64, "boft.boft_n_butterfly_factor"),
        (
            {"boft_block_size": 0, "boft_block_num": 3, "boft_n_butterfly_factor": 2},
            96,
            "boft.boft_n_butterfly_factor",
        ),
    ],
)
def test_combinations_peft_refuses_are_refused(
    options: dict[str, int], in_features: int, field: str
) -> None:
    with pytest.raises(InvalidSpecError) as caught:
        BoftSpec(**options).blocks(in_features)  # type: ignore[arg-type]
    assert caught.value.field == field


def test_boft_trains_full_blocks_and_a_scale_and_freezes_the_permutations() -> None:
    boft = BoftSpec(boft_block_size=8, boft_n_butterfly_factor=2, target_modules=QV)
    est = estimate(ARCH, _spec(boft))
    lora = TrainingSpec(
        method=Method.LORA, batch_size=2, seq_len=8, lora=LoraSpec(target_modules=QV)
    )
    frozen = estimate(ARCH, lora).components[Component.FROZEN_WEIGHTS]
    # q_proj and v_proj: boft_R (2 factors x 8 blocks x 8 x 8) and boft_s (one per output),
    # in each of 2 layers
    assert est.params.trainable == LAYERS * sum(2 * 8 * 8 * 8 + out for out in OUTS)
    trained = LAYERS * sum(_blk(2 * 8 * 8 * 8 * 4) + _blk(out * 4) for out in OUTS)
    assert est.components[Component.TRAINABLE_PARAMS] == trained
    # boft_P: (2, 64, 64) fp32 per adapted linear, and the model's two one-element tensors
    perms = LAYERS * 2 * _blk(2 * HIDDEN * HIDDEN * 4) + 2 * 512
    assert est.components[Component.FROZEN_WEIGHTS] == frozen + perms


def test_boft_keeps_the_rotation_products_and_the_base_output() -> None:
    b, s = 2, 8
    one = resolve(_spec(BoftSpec(boft_block_size=8, target_modules=QV)))
    two = resolve(_spec(BoftSpec(boft_block_size=8, boft_n_butterfly_factor=2, target_modules=QV)))
    square = _blk(HIDDEN * HIDDEN * 2)  # one in x in matrix in bf16
    # a second factor: its half permutation copy, and the bmms' two-factor product the chained
    # matmul keeps, on q_proj and v_proj
    expected = 2 * (square + _blk(2 * HIDDEN * HIDDEN * 2))
    assert layer_saved_bytes(ARCH, two, b, s) - layer_saved_bytes(ARCH, one, b, s) == expected


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"boft_block_size": 4, "boft_block_num": 4}, "boft.boft_block_size"),
        ({"boft_block_size": 0}, "boft.boft_block_size"),
        ({"boft_n_butterfly_factor": 0}, "boft.boft_n_butterfly_factor"),
        ({"boft_dropout": 0.1}, "boft.boft_dropout"),
        ({"bias": "boft_only"}, "boft.bias"),
        ({"target_modules": ()}, "boft.target_modules"),
    ],
)
def test_boft_refuses_what_it_does_not_model(options: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidSpecError) as caught:
        BoftSpec(**options)  # type: ignore[arg-type]
    assert caught.value.field == field


def test_boft_options_need_the_method() -> None:
    with pytest.raises(InvalidSpecError) as caught:
        TrainingSpec(method=Method.LORA, batch_size=1, seq_len=8, boft=BoftSpec())
    assert caught.value.field == "boft"
