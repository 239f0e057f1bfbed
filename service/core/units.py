"""Byte units and element sizes; the only place they are defined."""

from __future__ import annotations

from enum import StrEnum

KIB = 1024
MIB = 1024**2
GIB = 1024**3


class DType(StrEnum):
    """Element types named as HF configs and PyTorch name them."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"


# Bytes per element of each dtype (IEEE 754 binary32 / bfloat16 / binary16).
DTYPE_BYTES: dict[DType, int] = {DType.FP32: 4, DType.BF16: 2, DType.FP16: 2}
FP32_BYTES = 4
HALF_BYTES = 2
# HF Trainer's mixed precision computes in bf16 or fp16 (TrainingArguments bf16/fp16).
AUTOCAST_BYTES = HALF_BYTES
INT64_BYTES = 8  # token ids and labels are torch.long
BOOL_BYTES = 1  # torch.bool dropout masks
UINT8_BYTES = 1
INT8_BYTES = 1  # torch.int8, LLM.int8's quantized weights
INT32_BYTES = 4  # torch.int32, LLM.int8's integer matmul output
