"""bitsandbytes' CUDA dispatch for the 4-bit matmul, shared by the tracer and the schedule.

On CUDA, `bitsandbytes::gemm_4bit` either runs its fused kernel (the output is the only new
tensor) or falls back to rebuilding the absmax, dequantizing the whole weight and calling
F.linear (bitsandbytes/backends/cuda/ops.py, _gemm_4bit_use_custom_cuda and
_dequant_linear_fallback). The backward always dequantizes (autograd/_functions.py
MatMul4Bit.backward).
"""

from __future__ import annotations

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
