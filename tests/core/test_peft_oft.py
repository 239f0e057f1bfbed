"""PEFT's OFT: its blocks as PEFT adjusts them, what its spec refuses, and what it changes
against the frozen model on a tiny Llama-style model (the reference traces check the bytes,
tests/core/test_references.py)."""

from __future__ import annotations

import pytest

from service.core.errors import InvalidSpecError
from service.core.estimator import OFT_SERIES_SAVED, estimate, layer_saved_bytes
from service.core.result import Component
from service.core.spec import LoraSpec, Method, TrainingSpec, resolve
from service.core.spec.delta import OftSpec, oft_blocks
from tests.core.test_estimator import ARCH

QV = ("q_proj", "v_proj")
LAYERS = 2  # the tiny model's; q_proj and v_proj take its hidden size, 64


def _spec(oft: OftSpec, **changes: object) -> TrainingSpec:
    base: dict[str, object] = {"method": Method.OFT, "batch_size": 2, "seq_len": 8, "oft": oft}
    base.update(changes)
    return TrainingSpec(**base)  # type: ignore[arg-type]


def _blk(nbytes: int) -> int:
    return -(-nbytes // 512) * 512


@pytest.mark.parametrize(
    ("in_features", "wanted", "blocks"),
    [(64, 8, 8), (64, 6, 4), (64, 7, 8), (96, 5, 4), (64, 100, 64), (3072, 32, 32)],
)
def test_blocks_move_to_the_nearest_divisor(in_features: int, wanted: int, blocks: int) -> None:
    assert oft_blocks(in_features, wanted) == blocks


def test_a_rank_or_a_block_size_sets_the_other() -> None:
    assert OftSpec(r=8, oft_block_size=0).blocks(64) == (8, 8)
    assert OftSpec(oft_block_size=16).blocks(64) == (4, 16)


def test_oft_trains_one_skew_triangle_per_block() -> None:
    est = estimate(ARCH, _spec(OftSpec(r=4, oft_block_size=0, target_modules=QV)))
    # q_proj and v_proj: 4 blocks of 16, each 16 * 15 / 2 entries, in each of 2 layers
    assert est.params.trainable == LAYERS * 2 * 4 * (16 * 15 // 2)
    assert est.components[Component.TRAINABLE_PARAMS] == LAYERS * 2 * _blk(4 * 120 * 4)


def test_oft_keeps_the_input_cast_and_the_series() -> None:
    b, s = 2, 8
    tokens = b * s
    oft = resolve(_spec(OftSpec(r=4, oft_block_size=0, target_modules=QV)))
    lora = resolve(
        TrainingSpec(
            method=Method.LORA, batch_size=b, seq_len=s, lora=LoraSpec(r=4, target_modules=QV)
        )
    )
    square = _blk(4 * 16 * 16 * 4)
    # q_proj and v_proj each: the fp32 cast (LoRA keeps it too), Q, Q², Q³ and the rotation,
    # against LoRA's rank-4 output of lora_A
    expected = 2 * ((OFT_SERIES_SAVED + 1) * square - _blk(tokens * 4 * 4))
    assert layer_saved_bytes(ARCH, oft, b, s) - layer_saved_bytes(ARCH, lora, b, s) == expected


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"r": 4, "oft_block_size": 16}, "oft.r"),
        ({"r": 0, "oft_block_size": 0}, "oft.r"),
        ({"module_dropout": 0.1}, "oft.module_dropout"),
        ({"coft": True}, "oft.coft"),
        ({"block_share": True}, "oft.block_share"),
        ({"use_cayley_neumann": False}, "oft.use_cayley_neumann"),
        ({"num_cayley_neumann_terms": 3}, "oft.num_cayley_neumann_terms"),
    ],
)
def test_oft_refuses_what_it_does_not_model(options: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidSpecError) as caught:
        OftSpec(**options)  # type: ignore[arg-type]
    assert caught.value.field == field


def test_oft_options_need_the_method() -> None:
    with pytest.raises(InvalidSpecError) as caught:
        TrainingSpec(method=Method.LORA, batch_size=1, seq_len=8, oft=OftSpec())
    assert caught.value.field == "oft"
