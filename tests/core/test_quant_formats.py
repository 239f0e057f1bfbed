"""LoRA on GPTQ, AWQ, HQQ and torchao float8 bases: the stored bytes against each format's
documented packing, what each kernel keeps for backward, and what is refused.

None of these formats is traced (their kernels need CUDA and their libraries are not in the
tracer's stack): the expected numbers below are worked out here from the formats' layouts
(gptqmodel 7.3.4 PackableQuantLinear / AWQuantLinear buffers, hqq 0.2.8 Quantizer.quantize and
core/bitpack.py, torchao 0.19 Float8Tensor), not from the estimator's own functions.
"""

from __future__ import annotations

from typing import Any

import pytest

from service.catalog.models import default_catalog
from service.core.errors import InvalidSpecError
from service.core.estimator import estimate
from service.core.quant_formats import dequant_transient, packed_bytes
from service.core.spec import (
    ALL_LINEAR,
    LoraSpec,
    Method,
    ParallelSpec,
    QuantSpec,
    QuantType,
    TrainingSpec,
)
from service.core.units import DType

LLAMA_1B = default_catalog().resolve("meta-llama/Llama-3.2-1B").arch
MIB = 1024 * 1024


def _block(nbytes: int) -> int:
    """CUDA's caching allocator hands out multiples of 512 bytes."""
    return -(-nbytes // 512) * 512


@pytest.mark.parametrize(
    ("quant", "shape", "tensors"),
    [
        # GPTQ 4-bit, group 128, 4096 -> 4096: qweight int32 holds 8 codes per word along the
        # input (512 x 4096 words), qzeros 8 per word along the output (32 groups x 512
        # words), fp16 scales (32 x 4096), int32 g_idx (4096).
        (
            QuantSpec(type=QuantType.GPTQ),
            (4096, 4096),
            (8 * MIB, 32 * 512 * 4, 32 * 4096 * 2, 4096 * 4),
        ),
        # GPTQ 3-bit: 4096 * 3 / 32 = 384 rows of words; 11008 * 3 / 32 = 1032 zero words
        (
            QuantSpec(type=QuantType.GPTQ, bits=3),
            (4096, 11008),
            (384 * 11008 * 4, 32 * 1032 * 4, 32 * 11008 * 2, 4096 * 4),
        ),
        # GPTQ -1: one group for the whole input row
        (
            QuantSpec(type=QuantType.GPTQ, bits=8, group_size=-1, desc_act=True),
            (2048, 512),
            (512 * 512 * 4, 1 * 128 * 4, 1 * 512 * 2, 2048 * 4),
        ),
        # AWQ 4-bit GEMM, group 128, 4096 -> 11008: int32 words pack 8 outputs
        # (4096 x 1376), zeros likewise per group (32 x 1376), fp16 scales (32 x 11008).
        (
            QuantSpec(type=QuantType.AWQ),
            (4096, 11008),
            (4096 * 1376 * 4, 32 * 1376 * 4, 32 * 11008 * 2),
        ),
        # HQQ 4-bit, group 64: two codes per uint8, a scale and a zero per 64 weights in the
        # model's dtype (fp16 here): 16 Mi weights -> 8 MiB, 256 Ki groups x 2 B twice.
        (
            QuantSpec(type=QuantType.HQQ),
            (4096, 4096),
            (8 * MIB, 262144 * 2, 262144 * 2),
        ),
        # HQQ 3-bit: the 262144 group rows padded to 26215 words of ten codes, 64 wide
        (
            QuantSpec(type=QuantType.HQQ, bits=3),
            (4096, 4096),
            (26215 * 64 * 4, 262144 * 2, 262144 * 2),
        ),
        # HQQ 2-bit, group 128: four codes per byte
        (
            QuantSpec(type=QuantType.HQQ, bits=2, group_size=128),
            (2048, 8192),
            (2048 * 8192 // 4, 131072 * 2, 131072 * 2),
        ),
        # torchao float8 weight-only: one byte per weight, an fp32 scale per output row
        (
            QuantSpec(type=QuantType.TORCHAO_FLOAT8),
            (4096, 11008),
            (4096 * 11008, 11008 * 4),
        ),
    ],
)
def test_stored_bytes_follow_each_formats_packing(
    quant: QuantSpec, shape: tuple[int, int], tensors: tuple[int, ...]
) -> None:
    in_features, out_features = shape
    bits, group = quant.resolved_bits, quant.resolved_group_size
    assert packed_bytes(quant.type.value, bits, group, in_features, out_features, 2) == tensors


def _by_hand(quant: QuantSpec, k: int, n: int) -> int:
    """One linear's stored bytes from the layouts in the module docstring, each tensor
    rounded to the allocator's block."""
    if quant.type is QuantType.GPTQ:  # 4-bit, group 128
        parts = [k // 8 * n * 4, k // 128 * (n // 8) * 4, k // 128 * n * 2, k * 4]
    elif quant.type is QuantType.AWQ:  # 4-bit, group 128
        parts = [k * (n // 8) * 4, k // 128 * (n // 8) * 4, k // 128 * n * 2]
    elif quant.type is QuantType.HQQ:  # 4-bit, group 64, fp16 scale and zero
        parts = [k * n // 2, k * n // 64 * 2, k * n // 64 * 2]
    else:  # torchao float8
        parts = [k * n, n * 4]
    return sum(_block(p) for p in parts)


def test_the_frozen_weights_differ_by_each_formats_stored_tensors() -> None:
    """Whole Llama-3.2-1B in fp16 without k-bit preparation: what is not a quantized linear
    (embedding, norms) is alike, so two formats differ by their linears' stored tensors."""
    formats = [
        QuantSpec(type=QuantType.GPTQ),
        QuantSpec(type=QuantType.AWQ, prepare_kbit=False),
        QuantSpec(type=QuantType.HQQ),
        QuantSpec(type=QuantType.TORCHAO_FLOAT8),
    ]
    float8 = formats[-1]
    reference = _component(float8, True, "frozen_weights")
    for quant in formats[:-1]:
        per_layer = sum(
            _by_hand(quant, lin.in_features, lin.out_features * lin.count)
            - _by_hand(float8, lin.in_features, lin.out_features * lin.count)
            for lin in LLAMA_1B.linears
        )
        frozen = _component(quant, True, "frozen_weights")
        assert frozen - reference == LLAMA_1B.num_hidden_layers * per_layer


def _spec(quant: QuantSpec | None, ckpt: bool, **kwargs: Any) -> TrainingSpec:
    fields: dict[str, Any] = {
        "lora": LoraSpec(r=16, lora_alpha=32, target_modules=ALL_LINEAR),
        "dtype": DType.FP16,
        **kwargs,
    }
    return TrainingSpec(
        method=Method.QLORA if quant is not None else Method.LORA,
        batch_size=2,
        seq_len=512,
        gradient_checkpointing=ckpt,
        quantization=quant,
        **fields,
    )


def _component(quant: QuantSpec | None, ckpt: bool, name: str) -> int:
    return estimate(LLAMA_1B, _spec(quant, ckpt)).components[name]


def test_the_frozen_weights_change_by_the_groups_packed_tensors() -> None:
    """GPTQ group 32 against 128: four times the zero words and scales in every linear; the
    rest of the model (embedding, norms, the untied-or-not head) is alike."""
    fine = _component(QuantSpec(type=QuantType.GPTQ, group_size=32), True, "frozen_weights")
    coarse = _component(QuantSpec(type=QuantType.GPTQ), True, "frozen_weights")
    per_layer = 0
    for lin in LLAMA_1B.linears:
        k, n = lin.in_features, lin.out_features * lin.count
        for groups_fine, groups_coarse in ((k // 32, k // 128),):
            per_layer += _block(groups_fine * n // 8 * 4) - _block(groups_coarse * n // 8 * 4)
            per_layer += _block(groups_fine * n * 2) - _block(groups_coarse * n * 2)
    assert fine - coarse == LLAMA_1B.num_hidden_layers * per_layer


def test_gptq_and_float8_keep_each_dequantized_weight_without_checkpointing() -> None:
    """TorchLinear's and Float8Tensor's matmul on the dequantized weight saves it for the
    input's gradient: beside plain LoRA, every linear's in x out fp16 weight, except the
    first layer's q/k/v, whose input takes no gradient. Checkpointing drops them with the
    layer's other saved tensors (the peak, the loss's gradient, sits outside the layers)."""
    per_layer = sum(
        _block(lin.in_features * lin.out_features * lin.count * 2) for lin in LLAMA_1B.linears
    )
    first_qkv = sum(
        _block(lin.in_features * lin.out_features * lin.count * 2)
        for lin in LLAMA_1B.linears
        if lin.kind.value == "attn_qkv"
    )
    expected = LLAMA_1B.num_hidden_layers * per_layer - first_qkv
    lora = _component(None, False, "activations")
    for quant in (QuantSpec(type=QuantType.GPTQ), QuantSpec(type=QuantType.TORCHAO_FLOAT8)):
        assert _component(quant, False, "activations") - lora == expected
        assert _component(quant, True, "activations") == _component(None, True, "activations")


def test_awq_and_hqq_keep_each_distinct_input_instead() -> None:
    """AwqGemmFn and HQQMatmulNoCacheMul save their input x: per layer the attention's and
    the MLP's normed inputs and the MLP product (fp16, each once however many linears read
    it; the attention output is saved by the attention already), not the first layer's
    attention input."""
    tokens = 2 * 512
    h, i = LLAMA_1B.hidden_size, LLAMA_1B.intermediate_size
    per_layer = _block(tokens * h * 2) * 2 + _block(tokens * i * 2)
    expected = LLAMA_1B.num_hidden_layers * per_layer - _block(tokens * h * 2)
    lora = _component(None, False, "activations")
    awq = QuantSpec(type=QuantType.AWQ, prepare_kbit=False)
    for quant in (awq, QuantSpec(type=QuantType.HQQ)):
        assert _component(quant, False, "activations") - lora == expected


@pytest.mark.parametrize(
    ("qtype", "expected"),
    [
        # TorchLinear's compiled dequantization writes only the weight matmul saves; backward
        # reuses it
        ("gptq", 0),
        # AwqGemmFn.backward: the fp16 weight and `repeat(batch_size, 1, 1)`: 1 + 4 copies
        ("awq", 4096 * 11008 * 2 * 5),
        # hqq Quantizer.dequantize: unpacked, minus zero, times scale, in bf16
        ("hqq", 4096 * 11008 * 2 * 3),
        # _dequantize_affine_float8: the fp32 copy and the fp32 product
        ("torchao-float8", 4096 * 11008 * 4 * 2),
    ],
)
def test_the_dequantization_in_flight_of_one_linear(qtype: str, expected: int) -> None:
    assert dequant_transient(qtype, 4096, 11008, 2, 4, 4 * 2048) == expected


def test_awq_dequantizes_in_forward_only_above_1024_rows() -> None:
    """AwqGemmFn.forward's FULL_DEQUANT_MATMUL_THRESHOLD: the fused kernel at 1024 rows or
    fewer, a dequantized fp16 weight above; backward always dequantizes and repeats."""
    one_row = dequant_transient("awq", 4096, 4096, 2, 1, 1024)
    assert one_row == 4096 * 4096 * 2 * 2  # backward: the weight and one repeat
    assert dequant_transient("awq", 4096, 4096, 2, 1, 4096) == one_row


def test_the_answer_states_the_format_it_modelled() -> None:
    answer = estimate(LLAMA_1B, _spec(QuantSpec(type=QuantType.GPTQ, bits=3), True))
    assert any(
        "GPTQ base (3-bit, group 128)" in a and "not traced" in a for a in answer.assumptions
    )
    assert any("kbit preparation leaves a gptq model" in a for a in answer.assumptions)
    hqq = estimate(LLAMA_1B, _spec(QuantSpec(type=QuantType.HQQ), True))
    assert any("HQQ base (4-bit, group 64" in a for a in hqq.assumptions)


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: QuantSpec(type=QuantType.GPTQ, bits=5), "quantization.bits"),
        (lambda: QuantSpec(type=QuantType.AWQ, bits=8), "quantization.bits"),
        (lambda: QuantSpec(type=QuantType.AWQ, group_size=256), "quantization.group_size"),
        (lambda: QuantSpec(type=QuantType.GPTQ, group_size=100), "quantization.group_size"),
        (lambda: QuantSpec(type=QuantType.HQQ, group_size=0), "quantization.group_size"),
        (lambda: QuantSpec(type=QuantType.HQQ, desc_act=True), "quantization.desc_act"),
        (lambda: QuantSpec(type=QuantType.NF4, bits=4), "quantization.bits"),
        (lambda: QuantSpec(type=QuantType.TORCHAO_FLOAT8, bits=8), "quantization.bits"),
        (lambda: QuantSpec(type=QuantType.TORCHAO_INT4), "quantization.type"),
        (lambda: QuantSpec(type=QuantType.GPTQ, double_quant=True), "quantization.double_quant"),
        (
            lambda: QuantSpec(type=QuantType.HQQ, compute_dtype=DType.BF16),
            "quantization.compute_dtype",
        ),
        (
            lambda: _spec(
                QuantSpec(type=QuantType.GPTQ),
                True,
                lora=LoraSpec(r=16, target_modules=ALL_LINEAR, use_dora=True),
            ),
            "lora.use_dora",
        ),
        (
            lambda: _spec(
                QuantSpec(type=QuantType.AWQ),
                True,
                lora=LoraSpec(r=16, target_modules=ALL_LINEAR, use_dora=True),
            ),
            "lora.use_dora",
        ),
        (
            lambda: _spec(QuantSpec(type=QuantType.HQQ), True, parallel=ParallelSpec(gpus=2)),
            "parallel.gpus",
        ),
        (lambda: _spec(QuantSpec(type=QuantType.HQQ), True, autocast=True), "autocast"),
        (
            lambda: _spec(QuantSpec(type=QuantType.HQQ), True, torch_compile=True),
            "torch_compile",
        ),
        (
            lambda: TrainingSpec(
                method=Method.FULL,
                batch_size=1,
                seq_len=8,
                quantization=QuantSpec(type=QuantType.GPTQ),
            ),
            "quantization",
        ),
        (
            lambda: TrainingSpec(
                method=Method.QLORA,
                batch_size=1,
                seq_len=8,
                dtype=DType.BF16,
                quantization=QuantSpec(type=QuantType.AWQ),
            ),
            "dtype",
        ),
    ],
)
def test_what_is_not_modelled_is_refused_naming_the_field(build: object, field: str) -> None:
    with pytest.raises(InvalidSpecError) as caught:
        build()  # type: ignore[operator]
    assert caught.value.field == field


def test_a_group_size_the_model_cannot_take_is_refused_at_estimate() -> None:
    """HQQ groups a weight's elements: Llama-3.2-1B's 2048 x 512 k_proj has no group of 3."""
    spec = _spec(QuantSpec(type=QuantType.HQQ, group_size=3), True)
    with pytest.raises(InvalidSpecError) as caught:
        estimate(LLAMA_1B, spec)
    assert caught.value.field == "quantization.group_size"
