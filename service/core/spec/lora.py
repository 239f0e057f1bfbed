"""LoRA's options (PEFT LoraConfig) and the frozen base's quantization (BitsAndBytesConfig,
GPTQConfig, AwqConfig, HqqConfig, TorchAoConfig), each field declared once (fields.py)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import service.core.quant_formats as quant_formats
from service.core.errors import InvalidSpecError
from service.core.fields import job_field
from service.core.limits import MAX_LORA_ALPHA, MAX_LORA_R
from service.core.units import DType

ALL_LINEAR = "all-linear"
# What `modules_to_save` can name: the input embedding and the LM head, by their module names in
# transformers' decoder models (modeling_llama.py LlamaModel.embed_tokens,
# LlamaForCausalLM.lm_head). PEFT trains a full copy of each (ModulesToSaveWrapper).
SAVABLE_MODULES = ("embed_tokens", "lm_head")


class QuantType(StrEnum):
    """The frozen base's weight format: bitsandbytes' (nf4, fp4, int8) or another library's
    (service/core/quant_formats.py): GPTQ and AWQ through gptqmodel, HQQ, torchao."""

    NF4 = "nf4"
    FP4 = "fp4"
    INT8 = "int8"
    GPTQ = quant_formats.GPTQ
    AWQ = quant_formats.AWQ
    HQQ = quant_formats.HQQ
    TORCHAO_INT4 = quant_formats.TORCHAO_INT4
    TORCHAO_FLOAT8 = quant_formats.TORCHAO_FLOAT8

    @property
    def packed(self) -> bool:
        """A format beside bitsandbytes' (GPTQ, AWQ, HQQ, torchao)."""
        return self.value in quant_formats.PACKED_TYPES


@dataclass(frozen=True, slots=True, kw_only=True)
class LoraSpec:
    """PEFT LoraConfig; defaults are PEFT's (peft/tuners/lora/config.py)."""

    r: int = job_field(8, doc="LoRA rank.", mirrors="LoraConfig.r", ge=1, le=MAX_LORA_R)
    lora_alpha: int = job_field(
        8,
        doc="LoRA scaling numerator (no memory).",
        mirrors="LoraConfig.lora_alpha",
        ge=1,
        le=MAX_LORA_ALPHA,
    )
    # None: the framework's default (PEFT 0.0; LitGPT's finetune scripts 0.05).
    lora_dropout: float | None = job_field(
        None,
        doc="Dropout on the adapter input; null: the framework's (PEFT 0.0, LitGPT 0.05).",
        mirrors="LoraConfig.lora_dropout",
        ge=0.0,
        lt=1.0,
    )
    # None: PEFT's per-architecture default (q_proj, v_proj for Llama-family models).
    target_modules: tuple[str, ...] | str | None = job_field(
        None,
        doc="Adapted modules, or 'all-linear'; null: PEFT's default for the model.",
        mirrors="LoraConfig.target_modules",
    )
    modules_to_save: tuple[str, ...] = job_field(
        (),
        doc="Modules trained in full beside the adapters: the embedding, the LM head.",
        mirrors="LoraConfig.modules_to_save",
        min_length=0,
        choices=SAVABLE_MODULES,
    )
    # None: the framework's default; PEFT's autocast_adapter_dtype=True makes fp32 adapters.
    adapter_dtype: DType | None = job_field(
        None, doc="Adapter weights' dtype; null: the framework's (fp32 for HF + PEFT)."
    )
    # DoRA (peft/tuners/lora/dora.py DoraLinearLayer): a trainable magnitude per output feature
    # of each adapted linear, and a forward that keeps more for backward.
    use_dora: bool = job_field(
        False,
        doc="DoRA (PEFT use_dora): a magnitude vector per adapted linear, more saved for backward.",
        mirrors="LoraConfig.use_dora",
    )
    # rsLoRA: scaling lora_alpha / sqrt(r) instead of lora_alpha / r; no tensor changes size.
    use_rslora: bool = job_field(
        False,
        doc="rsLoRA (PEFT use_rslora): scaling lora_alpha/sqrt(r); no memory change.",
        mirrors="LoraConfig.use_rslora",
    )

    def __post_init__(self) -> None:
        if self.r < 1:
            raise InvalidSpecError("lora.r", "must be at least 1")
        if self.lora_dropout is not None and not 0.0 <= self.lora_dropout < 1.0:
            raise InvalidSpecError("lora.lora_dropout", "must be in [0, 1)")
        if isinstance(self.target_modules, str) and self.target_modules != ALL_LINEAR:
            raise InvalidSpecError(
                "lora.target_modules", f"must be a list of module names or {ALL_LINEAR!r}"
            )
        if isinstance(self.target_modules, tuple) and not self.target_modules:
            raise InvalidSpecError("lora.target_modules", "must not be empty")
        unknown = [name for name in self.modules_to_save if name not in SAVABLE_MODULES]
        if unknown:
            raise InvalidSpecError(
                "lora.modules_to_save",
                f"{', '.join(map(repr, unknown))}: only the embedding and the LM head can be "
                f"trained in full beside the adapters ({', '.join(SAVABLE_MODULES)})",
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class QuantSpec:
    """The frozen base's quantization: bitsandbytes' (BitsAndBytesConfig), or GPTQ, AWQ, HQQ
    or torchao (GPTQConfig, AwqConfig, HqqConfig, TorchAoConfig; quant_formats.py)."""

    type: QuantType = job_field(
        QuantType.NF4,
        doc="Quantized weight format: bitsandbytes nf4, fp4, int8; gptq, awq, hqq, "
        "torchao-float8 (torchao-int4 is refused: PEFT does not train LoRA on it).",
    )
    double_quant: bool = job_field(
        False,
        doc="bnb_4bit_use_double_quant (quantized absmax); nf4/fp4 only.",
        mirrors="BitsAndBytesConfig.bnb_4bit_use_double_quant",
    )
    # None: the model's dtype (the QLoRA recipe); BitsAndBytesConfig's own default is fp32.
    compute_dtype: DType | None = job_field(
        None,
        doc="bnb_4bit_compute_dtype; null: the model's dtype; bitsandbytes only.",
        mirrors="BitsAndBytesConfig.bnb_4bit_compute_dtype",
    )
    prepare_kbit: bool = job_field(
        True,
        doc="peft.prepare_model_for_kbit_training is applied.",
        mirrors="peft.prepare_model_for_kbit_training",
    )
    # GPTQ/AWQ `bits`, HQQ `nbits`; None: the format's default (quant_formats.DEFAULT_BITS);
    # quant_formats.check_quant_options names the values each format takes
    bits: int | None = job_field(
        None,
        doc="GPTQ bits (2, 3, 4, 8), AWQ bits (4), HQQ nbits (1-6, 8); null: 4.",
        mirrors="GPTQConfig.bits",
        ge=1,
        le=8,
        omit="none",
    )
    # GPTQ/AWQ/HQQ `group_size` (-1: one group per input row for GPTQ/AWQ); None: the default
    group_size: int | None = job_field(
        None,
        doc="GPTQ/AWQ/HQQ group size (-1: one group per input row, GPTQ/AWQ); null: the "
        "format's default (GPTQ, AWQ 128; HQQ 64).",
        mirrors="GPTQConfig.group_size",
        ge=-1,
        le=1 << 20,
        omit="none",
    )
    # GPTQConfig.desc_act (act-order: g_idx permutes the groups; the stored tensors are alike)
    desc_act: bool = job_field(
        False,
        doc="GPTQ act-order (desc_act): g_idx permutes the groups.",
        mirrors="GPTQConfig.desc_act",
        omit="off",
    )

    def __post_init__(self) -> None:
        quant_formats.check_quant_options(
            self.type.value, self.bits, self.group_size, self.desc_act
        )
        if self.type.packed and self.double_quant:
            raise InvalidSpecError("quantization.double_quant", "only for bitsandbytes' nf4/fp4")
        if self.type.packed and self.compute_dtype is not None:
            raise InvalidSpecError(
                "quantization.compute_dtype",
                f"only for bitsandbytes; {self.type.value} computes in the model's dtype",
            )

    @property
    def resolved_bits(self) -> int:
        """The width of a GPTQ, AWQ or HQQ weight (the format's default when not given)."""
        return self.bits or quant_formats.DEFAULT_BITS.get(self.type.value, 0)

    @property
    def resolved_group_size(self) -> int:
        """The group size of a GPTQ, AWQ or HQQ weight (the format's default when not given)."""
        return self.group_size or quant_formats.DEFAULT_GROUP_SIZE.get(self.type.value, 0)
