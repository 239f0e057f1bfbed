"""The frozen base's quantization in a job: bitsandbytes', GPTQ, AWQ, HQQ or torchao
(service/core/spec/lora.py QuantSpec, where each field is declared)."""

from __future__ import annotations

from service.api.schemas.declared import DeclaredIn, declared_model
from service.core.spec import QuantSpec

QuantizationIn = declared_model(
    "QuantizationIn",
    QuantSpec,
    doc="""The frozen base's quantization (method 'qlora'): bitsandbytes' (BitsAndBytesConfig), or
    GPTQ, AWQ, HQQ or torchao float8 (GPTQConfig, AwqConfig, HqqConfig, TorchAoConfig).""",
    base=DeclaredIn,
)
