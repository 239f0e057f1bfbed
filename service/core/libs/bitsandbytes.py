"""bitsandbytes: its 4-bit storage, its 8-bit optimizers' states and its CUDA dispatch for the
4-bit matmul, shared by the estimator, the allocator schedule and the tracer.

On CUDA, `bitsandbytes::gemm_4bit` either runs its fused kernel (the output is the only new
tensor) or falls back to rebuilding the absmax, dequantizing the whole weight and calling
F.linear (bitsandbytes/backends/cuda/ops.py, _gemm_4bit_use_custom_cuda and
_dequant_linear_fallback). The backward always dequantizes (autograd/_functions.py
MatMul4Bit.backward).
"""

from __future__ import annotations

from service.core.units import FP32_BYTES, UINT8_BYTES

# 4-bit storage (bitsandbytes/functional.py quantize_4bit, blocksize=64): two 4-bit values per
# uint8, one fp32 absmax per block of 64 values and the 16-entry fp32 NF4/FP4 code
# (quant_state.code). Double quant stores the absmax as uint8 with one fp32 absmax per 256 of
# them plus a 256-entry fp32 code and an fp32 offset (quantize_blockwise, blocksize=256).
NF4_VALUES_PER_BYTE = 2
NF4_BLOCK = 64
NF4_CODE_ENTRIES = 16
NESTED_BLOCK = 256
NESTED_CODE_ENTRIES = 256

# 8-bit optimizers (bitsandbytes/optim/optimizer.py Optimizer2State, blockwise=True): uint8
# state per element with one fp32 absmax per 256-element block; parameters with fewer than
# min_8bit_size = 4096 elements keep fp32 states.
OPTIM_8BIT_BLOCK = 256
OPTIM_MIN_8BIT_SIZE = 4096

# Above this many rows gemm_4bit dequantizes (backends/cuda/ops.py, _gemm_4bit_custom_max_m).
GEMM_4BIT_CUSTOM_MAX_M = 1536
# ...and for weights of at least this many elements, already above this many rows
# (same file, _gemm_4bit_use_custom_cuda: "custom wins up to M=512").
GEMM_4BIT_LARGE_WEIGHT = 4 * 1024 * 1024
GEMM_4BIT_LARGE_WEIGHT_MAX_M = 512
# At or below this many rows the fused kernel is always used (same file,
# _GEMM_4BIT_CUSTOM_FLOOR_M).
GEMM_4BIT_CUSTOM_FLOOR_M = 4


def uses_dequant_fallback(rows: int, out_features: int, in_features: int) -> bool:
    """Whether gemm_4bit dequantizes the weight for an input of `rows` rows.

    The full heuristic also weighs the GPU's SM count for small weights between the floor
    and 512 rows; the branches modelled here are the ones training inputs reach.
    """
    if rows > GEMM_4BIT_CUSTOM_MAX_M:
        return True
    if rows <= GEMM_4BIT_CUSTOM_FLOOR_M:
        return False
    return out_features * in_features >= GEMM_4BIT_LARGE_WEIGHT and rows > (
        GEMM_4BIT_LARGE_WEIGHT_MAX_M
    )


def nf4_absmax_bytes(elements: int) -> int:
    """The fp32 absmax of a 4-bit weight of `elements` values (one per block): what
    dequantize_4bit rebuilds from the nested uint8 one under double quant."""
    return -(-elements // NF4_BLOCK) * FP32_BYTES


def optim_8bit_states(elements: int) -> tuple[int, ...]:
    """An 8-bit optimizer's two states for a parameter of `elements` elements, bytes in
    creation order: state1, state2 and their absmax; two fp32 states under the minimum size."""
    if elements < OPTIM_MIN_8BIT_SIZE:
        return elements * FP32_BYTES, elements * FP32_BYTES
    absmax = -(-elements // OPTIM_8BIT_BLOCK) * FP32_BYTES
    return elements * UINT8_BYTES, elements * UINT8_BYTES, absmax, absmax


def nf4_storage(elements: int, double_quant: bool) -> tuple[int, ...]:
    """The tensors a 4-bit weight of `elements` values is stored in, bytes in the order
    quantize_4bit makes them: the packed values, then with double quant the uint8 absmax, the
    code, the offset, the nested absmax and its code; without, the fp32 absmax and the code."""
    blocks = -(-elements // NF4_BLOCK)
    packed = elements // NF4_VALUES_PER_BYTE
    if double_quant:
        nested = -(-blocks // NESTED_BLOCK)
        return (
            packed,
            blocks * UINT8_BYTES,
            NF4_CODE_ENTRIES * FP32_BYTES,
            FP32_BYTES,
            nested * FP32_BYTES,
            NESTED_CODE_ENTRIES * FP32_BYTES,
        )
    return packed, blocks * FP32_BYTES, NF4_CODE_ENTRIES * FP32_BYTES
