"""Quantized bases beyond bitsandbytes: GPTQ, AWQ, HQQ and torchao, as PEFT trains LoRA on them.

What each format stores per linear, what its training forward and backward allocate, and what
its options may be. Read from the libraries' sources (not installed beside the tracer, their
kernels need CUDA; none of these formats is traced):

- GPTQ: transformers 5.24 quantizer_gptq.py (optimum + gptqmodel >= 1.4.3); gptqmodel 7.3.4
  (github ModelCloud/GPTQModel f4c327a) nn_modules/qlinear/__init__.py PackableQuantLinear
  (buffers, dequantize_weight) and nn_modules/qlinear/torch.py TorchLinear. PEFT's training
  kernels are those with SUPPORTS_TRAINING (backend "auto_trainable", utils/importer.py
  select_quant_linear); on CUDA that is TritonV2Linear, whose forward in training mode is
  TorchLinear's (tritonv2.py forward: `if self.training: return super().forward(x)`).
- AWQ: transformers 5.24 quantizer_awq.py + integrations/awq.py (gptqmodel's kernels);
  gptqmodel 7.3.4 nn_modules/qlinear/gemm_awq.py AwqGEMMLinear / AwqGemmFn (the CUDA kernel
  with SUPPORTS_TRAINING and the highest auto priority for the GEMM format).
- HQQ: transformers 5.24 quantizer_hqq.py / HqqConfig; hqq 0.2.8.post1 (github mobiusml/hqq
  e0b1d00) core/quantize.py HQQLinear (default backend PYTORCH = forward_pytorch_backprop,
  HQQMatmulNoCacheMul), Quantizer.quantize / dequantize, core/bitpack.py.
- torchao: transformers 5.24 quantizer_torchao.py; torchao 0.19.0 (github pytorch/ao 36027d8)
  quantization/quant_api.py Float8WeightOnlyConfig, quantize_/workflows/float8/
  float8_tensor.py Float8Tensor (F.linear implemented at the torch-function level:
  `torch.matmul(input, weight.dequantize())`), quant_primitives.py _dequantize_affine_float8.
"""

from __future__ import annotations

from service.core.errors import InvalidSpecError

# The quantization.type values of these formats (service/core/spec/__init__.py QuantType).
GPTQ = "gptq"
AWQ = "awq"
HQQ = "hqq"
TORCHAO_INT4 = "torchao-int4"
TORCHAO_FLOAT8 = "torchao-float8"
PACKED_TYPES = frozenset({GPTQ, AWQ, HQQ, TORCHAO_INT4, TORCHAO_FLOAT8})

# transformers 5.24 utils/quantization_config.py GPTQConfig.post_init: bits in [2, 3, 4, 8].
GPTQ_BITS = (2, 3, 4, 8)
# gptqmodel 7.3.4 TorchLinear.SUPPORTS_GROUP_SIZE (-1: one group over the whole input).
GPTQ_GROUP_SIZES = (-1, 16, 32, 64, 128, 256, 512, 1024)
# gptqmodel 7.3.4 AwqGEMMLinear.SUPPORTS_BITS and SUPPORTS_GROUP_SIZE.
AWQ_BITS = (4,)
AWQ_GROUP_SIZES = (-1, 16, 32, 64, 128)
# hqq 0.2.8 Quantizer.SUPPORTED_BITS without 1.58 (not an integer width) and bit_to_packing:
# 8, 6 and 5 bits are stored one per uint8, 4 bits two, 2 bits four, 1 bit eight, 3 bits ten
# per int32.
HQQ_BITS = (1, 2, 3, 4, 5, 6, 8)
# Defaults: GPTQConfig(group_size=128), AwqConfig(bits=4, group_size=128),
# HqqConfig(nbits=4, group_size=64) (transformers 5.24 quantization_config.py).
DEFAULT_BITS = {GPTQ: 4, AWQ: 4, HQQ: 4}
DEFAULT_GROUP_SIZE = {GPTQ: 128, AWQ: 128, HQQ: 64}

INT32_BYTES = 4
UINT8_BYTES = 1
FP16_BYTES = 2  # gptqmodel registers scales (and a bias) as torch.float16
FP32_BYTES = 4
FP8_BYTES = 1  # torch.float8_e4m3fn, Float8WeightOnlyConfig's weight_dtype
# gptqmodel's packing word: pack_dtype torch.int32 (hf_select_quant_linear_v2 default).
PACK_BITS = 32
# hqq core/bitpack.py pack_3bit_32: ten 3-bit values per int32, rows padded to a multiple of 10.
HQQ_3BIT_PER_WORD = 10
# AwqGemmFn.forward: `x.shape[0] * x.shape[1] > 1024` dequantizes the whole weight and calls
# matmul; below it the fused GEMM kernel writes only the output.
AWQ_FULL_DEQUANT_ROWS = 1024
# hqq Quantizer.dequantize: the unpacked weight (core/bitpack.py unpack_* into the compute
# dtype), `W_r - zero` and `(...) * scale` are alive together before the first two go.
HQQ_DEQUANT_COPIES = 3
# torchao _dequantize_affine_float8: `tensor.to(float32)`, `* scale` (fp32) and
# `.to(output_dtype)` are alive together.
FLOAT8_DEQUANT_FP32_COPIES = 2


def _choices(values: tuple[int, ...]) -> str:
    return ", ".join(str(v) for v in values)


def check_quant_options(
    qtype: str, bits: int | None, group_size: int | None, desc_act: bool
) -> None:
    """The options a format takes, or an error naming the field and why."""
    if qtype not in PACKED_TYPES:
        for name, given in (("bits", bits), ("group_size", group_size)):
            if given is not None:
                raise InvalidSpecError(
                    f"quantization.{name}", f"only for types gptq, awq and hqq, not {qtype!r}"
                )
        if desc_act:
            raise InvalidSpecError("quantization.desc_act", f"only for type gptq, not {qtype!r}")
        return
    if qtype == TORCHAO_INT4:
        raise InvalidSpecError(
            "quantization.type",
            "torchao int4 weight-only bases cannot be trained with LoRA: transformers 5.24's "
            "TorchAoHfQuantizer.is_trainable holds only for 8-bit configs (the Trainer refuses "
            "the rest, trainer_utils.py validate_quantization_for_training), and PEFT 0.21's "
            "TorchaoLoraLinear refuses Int4Tensor weights ('only supports int8 weights for now', "
            "peft/tuners/lora/torchao.py _check_dtype_supported); modelled: torchao-float8",
        )
    if desc_act and qtype != GPTQ:
        raise InvalidSpecError("quantization.desc_act", f"only for type gptq, not {qtype!r}")
    if qtype == TORCHAO_FLOAT8:
        for name, given in (("bits", bits), ("group_size", group_size)):
            if given is not None:
                raise InvalidSpecError(
                    f"quantization.{name}",
                    "torchao-float8 is Float8WeightOnlyConfig's per-row float8_e4m3fn weight; "
                    "it takes no bits or group_size",
                )
        return
    allowed_bits = {GPTQ: GPTQ_BITS, AWQ: AWQ_BITS, HQQ: HQQ_BITS}[qtype]
    if bits is not None and bits not in allowed_bits:
        raise InvalidSpecError(
            "quantization.bits", f"{qtype} takes {_choices(allowed_bits)} bits, not {bits}"
        )
    if group_size is None:
        return
    if qtype == HQQ:
        if group_size < 1:
            raise InvalidSpecError("quantization.group_size", "hqq's group_size must be at least 1")
        return
    sizes = GPTQ_GROUP_SIZES if qtype == GPTQ else AWQ_GROUP_SIZES
    if group_size not in sizes:
        raise InvalidSpecError(
            "quantization.group_size",
            f"{qtype}'s training kernel takes group sizes {_choices(sizes)}, not {group_size}",
        )


def _groups(in_features: int, group_size: int) -> int:
    """Groups along the input: one when group_size is -1 (gptqmodel sets it to in_features)."""
    return 1 if group_size == -1 else -(-in_features // group_size)


def check_shape(qtype: str, bits: int, group_size: int, in_features: int, out_features: int) -> str:
    """Why a linear of this shape cannot take the format ('' when it can)."""
    if qtype == AWQ:
        per_word = PACK_BITS // bits
        if out_features % per_word:
            return f"AWQ packs {per_word} outputs per int32: out_features {out_features}"
        if group_size != -1 and in_features % group_size:
            return f"AWQ groups the input by {group_size}: in_features {in_features}"
    if qtype == HQQ and (in_features * out_features) % group_size:
        return f"HQQ groups the weight's {in_features * out_features} elements by {group_size}"
    return ""


def packed_tensors(
    qtype: str, bits: int, group_size: int, in_features: int, out_features: int, dtype_bytes: int
) -> tuple[tuple[str, int], ...]:
    """Each stored tensor of one quantized linear and its bytes (bias not included);
    `dtype_bytes`: the model's dtype, HQQ's compute dtype."""
    k, n = in_features, out_features
    if qtype == GPTQ:
        # PackableQuantLinear.__init__ (register_buffers): qweight int32
        # [ceil(in * bits / 32), out], qzeros int32 [ceil(in / group), ceil(out * bits / 32)],
        # scales fp16 [ceil(in / group), out], g_idx int32 [in] (kept with or without desc_act).
        g = _groups(k, group_size)
        return (
            ("qweight", -(-k * bits // PACK_BITS) * n * INT32_BYTES),
            ("qzeros", g * -(-n * bits // PACK_BITS) * INT32_BYTES),
            ("scales", g * n * FP16_BYTES),
            ("g_idx", k * INT32_BYTES),
        )
    if qtype == AWQ:
        # AWQuantLinear.__init__: qweight int32 [in, out / (32 / bits)], qzeros int32
        # [in / group, out / (32 / bits)], scales fp16 [in / group, out].
        g = 1 if group_size == -1 else k // group_size
        per_word = PACK_BITS // bits
        return (
            ("qweight", k * (n // per_word) * INT32_BYTES),
            ("qzeros", g * (n // per_word) * INT32_BYTES),
            ("scales", g * n * FP16_BYTES),
        )
    if qtype == HQQ:
        # Quantizer.quantize, axis=1 (HqqConfig's default): the weight reshaped to
        # [numel / group, group], packed along the first dimension (core/bitpack.py), with a
        # scale and a zero per group in the compute dtype (the model's; no quant_scale or
        # quant_zero in HqqConfig).
        rows = k * n // group_size
        if bits == 3:
            w_q = -(-rows // HQQ_3BIT_PER_WORD) * group_size * INT32_BYTES
        elif bits in (1, 2, 4):
            w_q = rows // (8 // bits) * group_size * UINT8_BYTES
        else:
            w_q = rows * group_size * UINT8_BYTES
        return (("W_q", w_q), ("scale", rows * dtype_bytes), ("zero", rows * dtype_bytes))
    if qtype == TORCHAO_FLOAT8:
        # Float8Tensor: qdata float8_e4m3fn [out, in], scale fp32 [out, 1] (PerRow granularity,
        # Float8WeightOnlyConfig's default).
        return (("qdata", k * n * FP8_BYTES), ("scale", n * FP32_BYTES))
    raise InvalidSpecError("quantization.type", f"{qtype!r} has no packed layout")


def packed_bytes(
    qtype: str, bits: int, group_size: int, in_features: int, out_features: int, dtype_bytes: int
) -> tuple[int, ...]:
    """The bytes of each of one quantized linear's stored tensors (`packed_tensors`)."""
    tensors = packed_tensors(qtype, bits, group_size, in_features, out_features, dtype_bytes)
    return tuple(nbytes for _, nbytes in tensors)


def saves_dequantized_weight(qtype: str) -> bool:
    """The kernel dequantizes the weight with ordinary tensor ops and calls matmul, which
    saves the dequantized weight for the input's gradient: GPTQ's TorchLinear._forward_eager
    (`torch.matmul(x, weights)`), torchao Float8Tensor's linear (`torch.matmul(input,
    weight.dequantize())`)."""
    return qtype in (GPTQ, TORCHAO_FLOAT8)


def saves_input(qtype: str) -> bool:
    """The kernel is a custom autograd.Function that saves its input (not the weight):
    AwqGemmFn.forward (`ctx.save_for_backward(x, qweight, qzeros, scales, bias)`),
    HQQMatmulNoCacheMul.setup_context (`ctx.save_for_backward(x, bias)`)."""
    return qtype in (AWQ, HQQ)


def dequant_transient(
    qtype: str, in_features: int, out_features: int, dtype_bytes: int, batch: int, tokens: int
) -> int:
    """The largest transient one linear's matmul allocates beyond its output and what it saves
    (forward or backward, whichever is larger), for a weight of in x out elements."""
    n = in_features * out_features
    if qtype == GPTQ:
        # TorchLinear.post_init compiles dequantize_weight (optimize(): torch.compile,
        # inductor), so the unpacking fuses into one kernel writing the dequantized weight,
        # which matmul saves (counted as saved); backward reuses it: no dequantization.
        return 0
    if qtype == AWQ:
        # AwqGemmFn.backward: awq_dequantize_weights (fp16 [in, out]) then
        # `weights.transpose(0, 1).unsqueeze(0).repeat(batch_size, 1, 1)` for bmm: the weight
        # and `batch` copies of it. Forward above AWQ_FULL_DEQUANT_ROWS: one dequantized copy.
        backward = n * FP16_BYTES * (1 + batch)
        forward = n * FP16_BYTES if tokens > AWQ_FULL_DEQUANT_ROWS else 0
        return max(backward, forward)
    if qtype == HQQ:
        # HQQLinear.matmul -> dequantize, forward and again in backward.
        return HQQ_DEQUANT_COPIES * n * dtype_bytes
    if qtype == TORCHAO_FLOAT8:
        # _dequantize_affine_float8 in forward: two fp32 copies beside the output, which
        # matmul saves (counted as saved); backward reuses it.
        return FLOAT8_DEQUANT_FP32_COPIES * n * FP32_BYTES
    return 0


def format_note(qtype: str, bits: int, group_size: int) -> str:
    """The assumption an answer states for a base in this format."""
    if qtype == GPTQ:
        return (
            f"GPTQ base ({bits}-bit, group {group_size}) modelled from gptqmodel 7.3.4's "
            "TorchLinear (the training path of backend 'auto_trainable'): each linear's "
            "dequantized weight is saved for backward by matmul; not traced"
        )
    if qtype == AWQ:
        return (
            f"AWQ base ({bits}-bit GEMM, group {group_size}) modelled from gptqmodel 7.3.4's "
            "AwqGEMMLinear/AwqGemmFn: each linear saves its input; backward dequantizes the "
            "weight and repeats it per sequence of the batch; not traced"
        )
    if qtype == HQQ:
        return (
            f"HQQ base ({bits}-bit, group {group_size}, axis 1) modelled from hqq 0.2.8's "
            "HQQLinear (backend PYTORCH, HQQMatmulNoCacheMul): each linear saves its input and "
            "dequantizes its weight in forward and again in backward; not traced"
        )
    return (
        "torchao float8 weight-only base modelled from torchao 0.19's Float8Tensor (per-row "
        "scales): each linear's dequantized weight is saved for backward by matmul; not traced"
    )
