"""The frozen base's quantization in a job: bitsandbytes', GPTQ, AWQ, HQQ or torchao."""

from __future__ import annotations

from pydantic import Field

from service.api.schemas.base import Boolean, In, integers
from service.core.spec import QuantSpec, QuantType
from service.core.units import DType


class QuantizationIn(In):
    """The frozen base's quantization (method 'qlora'): bitsandbytes' (BitsAndBytesConfig), or
    GPTQ, AWQ, HQQ or torchao float8 (GPTQConfig, AwqConfig, HqqConfig, TorchAoConfig)."""

    integer_fields = integers("bits", "group_size")

    type: QuantType = Field(
        default=QuantType.NF4,
        description="Quantized weight format: bitsandbytes nf4, fp4, int8; gptq, awq, hqq, "
        "torchao-float8 (torchao-int4 is refused: PEFT does not train LoRA on it).",
    )
    double_quant: Boolean = Field(
        default=False, description="bnb_4bit_use_double_quant (quantized absmax); nf4/fp4 only."
    )
    compute_dtype: DType | None = Field(
        default=None,
        description="bnb_4bit_compute_dtype; null: the model's dtype; bitsandbytes only.",
    )
    prepare_kbit: Boolean = Field(
        default=True, description="peft.prepare_model_for_kbit_training is applied."
    )
    bits: int | None = Field(
        default=None,
        ge=1,
        le=8,
        description="GPTQ bits (2, 3, 4, 8), AWQ bits (4), HQQ nbits (1-6, 8); null: 4.",
    )
    group_size: int | None = Field(
        default=None,
        ge=-1,
        le=1 << 20,
        description="GPTQ/AWQ/HQQ group size (-1: one group per input row, GPTQ/AWQ); null: "
        "the format's default (GPTQ, AWQ 128; HQQ 64).",
    )
    desc_act: Boolean = Field(
        default=False, description="GPTQ act-order (desc_act): g_idx permutes the groups."
    )

    def to_spec(self) -> QuantSpec:
        return QuantSpec(
            type=self.type,
            double_quant=self.double_quant,
            compute_dtype=self.compute_dtype,
            prepare_kbit=self.prepare_kbit,
            bits=self.bits,
            group_size=self.group_size,
            desc_act=self.desc_act,
        )
