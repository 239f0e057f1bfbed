"""What a GPTQ, AWQ, HQQ or torchao base, Liger Kernel's patches and LoRA-FA are modelled with:
the combinations the estimate refuses, each naming the field and why.

TrainingSpec's own check calls these (`spec.py`); they read the spec through `Job`, so this
module does not import it back.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Protocol

from service.core.errors import InvalidSpecError


class _Gpus(Protocol):
    @property
    def gpus(self) -> int: ...


class _Lora(Protocol):
    @property
    def use_dora(self) -> bool: ...
    @property
    def modules_to_save(self) -> tuple[str, ...]: ...


class _Quant(Protocol):
    @property
    def type(self) -> StrEnum: ...


class Job(Protocol):
    """What the checks read of a TrainingSpec."""

    @property
    def method(self) -> StrEnum: ...
    @property
    def framework(self) -> StrEnum: ...
    @property
    def objective(self) -> StrEnum: ...
    @property
    def dtype(self) -> StrEnum: ...
    @property
    def loss(self) -> StrEnum | None: ...
    @property
    def lora(self) -> _Lora | None: ...
    @property
    def quantization(self) -> _Quant | None: ...
    @property
    def parallel(self) -> _Gpus: ...
    @property
    def autocast(self) -> bool: ...
    @property
    def gradient_checkpointing(self) -> bool: ...
    @property
    def packing(self) -> bool: ...
    @property
    def torch_compile(self) -> bool: ...
    @property
    def liger_kernel(self) -> bool: ...
    @property
    def optim(self) -> StrEnum: ...
    @property
    def vision(self) -> Any: ...


# PEFT's own refusals of DoRA on a quantized base (peft/tuners/lora/gptq.py GPTQLoraLinear,
# peft/tuners/lora/awq.py AwqLoraLinear: "does not support DoRA yet").
_DORA_REFUSED_BY_PEFT = {
    "gptq": "PEFT refuses it (peft/tuners/lora/gptq.py GPTQLoraLinear: 'does not support DoRA "
    "yet')",
    "awq": "PEFT refuses it (peft/tuners/lora/awq.py AwqLoraLinear: 'does not support DoRA yet')",
}


def check_packed_base(job: Job, kind: str) -> None:
    """A GPTQ, AWQ, HQQ or torchao base (quant_formats.py): PEFT's LoRA through HF on one GPU,
    SFT, without autocast; what PEFT itself refuses is refused with its reason."""
    if job.method.value != "qlora":
        raise InvalidSpecError(
            "method", f"a {kind} base is modelled for PEFT's LoRA (method 'qlora') only"
        )
    if job.framework.value != "hf":
        raise InvalidSpecError("framework", f"a {kind} base is modelled as HF + PEFT's")
    if job.lora is not None and job.lora.use_dora:
        why = _DORA_REFUSED_BY_PEFT.get(kind, "not modelled")
        raise InvalidSpecError("lora.use_dora", f"DoRA on a {kind} base: {why}")
    refusals = (
        ("parallel.gpus", job.parallel.gpus != 1, "on one GPU"),
        ("autocast", job.autocast, "without autocast"),
        ("objective", job.objective.value != "sft", "with objective 'sft'"),
        ("packing", job.packing, "without packing"),
        ("vision", job.vision is not None, "for text models"),
    )
    for name, refused, how in refusals:
        if refused:
            raise InvalidSpecError(name, f"a {kind} base is modelled {how}")
    if job.torch_compile:
        # transformers 5.24 trainer_utils.py validate_quantization_for_training: "You cannot
        # fine-tune quantized model with `torch.compile()`"
        raise InvalidSpecError(
            "torch_compile", "the Trainer refuses torch.compile on a quantized model"
        )
    if kind in ("gptq", "awq") and job.dtype.value != "fp16":
        why = (
            "transformers' AWQ quantizer loads the model in float16 on CUDA "
            "(quantizers/quantizer_awq.py update_dtype)"
            if kind == "awq"
            else "gptqmodel keeps its scales in float16 (PackableQuantLinear buffers), and a "
            "cast of the dequantized weight to another dtype is not modelled"
        )
        raise InvalidSpecError("dtype", f"a {kind} base is modelled in fp16: {why}")


def check_liger_job(job: Job) -> None:
    """Liger's patches are modelled as HF Trainer applies them (its SFT step, one GPU, LoRA,
    QLoRA or full fine-tuning, no autocast, bitsandbytes' 4-bit bases), with their fused linear
    cross-entropy."""
    if not job.liger_kernel:
        return
    if job.loss is not None and job.loss.value != "fused":
        raise InvalidSpecError(
            "loss",
            "liger_kernel replaces the loss with Liger's fused linear cross-entropy: "
            "leave loss unset or 'fused'",
        )
    quant = job.quantization
    lora = job.lora
    refusals = (
        ("framework", job.framework.value != "hf", "as HF Trainer applies it"),
        ("objective", job.objective.value != "sft", "with objective 'sft'"),
        (
            "method",
            job.method.value not in ("lora", "qlora", "full"),
            "with methods 'lora', 'qlora' and 'full'",
        ),
        ("autocast", job.autocast, "without autocast"),
        (
            "quantization.type",
            quant is not None and quant.type.value not in ("nf4", "fp4"),
            "on bitsandbytes' 4-bit bases (nf4, fp4)",
        ),
        (
            "lora.modules_to_save",
            lora is not None and bool(lora.modules_to_save),
            "without modules_to_save",
        ),
        ("parallel.gpus", job.parallel.gpus != 1, "on one GPU"),
        ("packing", job.packing, "without packing"),
        ("torch_compile", job.torch_compile, "without torch_compile"),
    )
    for name, refused, how in refusals:
        if refused:
            raise InvalidSpecError(name, f"liger_kernel is modelled {how}")


# The optimizers LoRA-FA's own (an AdamW on each lora_B) stands for.
_LORA_FA_OPTIMIZERS = ("adamw_torch", "adamw_torch_fused")


def check_lora_fa(job: Job) -> None:
    """LoRA-FA trains with PEFT's LoraFAOptimizer, an AdamW on each lora_B whose gradient
    is projected through (A A^T)^-1 (peft/optimizers/lorafa.py create_lorafa_optimizer)."""
    if job.optim.value not in _LORA_FA_OPTIMIZERS:
        raise InvalidSpecError(
            "optim", "LoRA-FA trains with PEFT's LoraFAOptimizer (AdamW on B): use adamw_torch"
        )
    if job.lora is not None and job.lora.use_dora:
        raise InvalidSpecError(
            "lora.use_dora",
            "LoRA-FA's optimizer pairs each lora_A with its lora_B; DoRA's magnitude breaks "
            "the pairing (peft/optimizers/lorafa.py LoraFAOptimizer.step)",
        )
    if job.lora is not None and job.lora.modules_to_save:
        raise InvalidSpecError("lora.modules_to_save", "not modelled with LoRA-FA's optimizer")
    if job.framework.value != "hf":
        raise InvalidSpecError("framework", "LoRA-FA is modelled as PEFT's (framework 'hf')")
    if job.autocast:
        raise InvalidSpecError("autocast", "LoRA-FA under mixed precision is not modelled")
    if job.parallel.gpus != 1:
        raise InvalidSpecError("parallel.gpus", "LoRA-FA is modelled on one GPU")


def check_adapter_method(job: Job) -> None:
    """LitGPT's adapters: its finetune/adapter*.py on one GPU, no autocast, any base."""
    method = job.method.value
    if job.framework.value != "litgpt":
        raise InvalidSpecError(
            "method", f"method {method!r} is modelled as LitGPT's (framework 'litgpt')"
        )
    if job.parallel.gpus != 1:
        raise InvalidSpecError("parallel.gpus", f"method {method!r} is modelled on one GPU")
    if job.autocast:
        raise InvalidSpecError("autocast", f"method {method!r} is modelled without autocast")
    if job.gradient_checkpointing:
        # finetune/adapter.py and adapter_v2.py at the resource tables' commit do not
        # checkpoint
        raise InvalidSpecError(
            "gradient_checkpointing", f"method {method!r} is modelled without checkpointing"
        )
    if job.quantization is not None and job.quantization.type.value == "int8":
        raise InvalidSpecError(
            "quantization.type", f"an LLM.int8 base is not modelled for method {method!r}"
        )
