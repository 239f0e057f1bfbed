"""The changes a fit-check suggests to a job that does not fit, and what each does to its spec.

`fit.py` decides which to offer and stacks them; this module only says what a change is, in
words, and makes (or takes back) its spec.
"""

from __future__ import annotations

from dataclasses import replace
from enum import StrEnum

from service.core.errors import InvalidSpecError
from service.core.spec import TrainingSpec
from service.core.spec.choices import (
    ADAPTER_METHODS,
    METHOD_OPTIONS,
    LossImpl,
    Method,
    Objective,
    Optim,
)
from service.core.spec.grpo import fewer_generations, shorter_completions
from service.core.spec.lora import ALL_LINEAR, QuantSpec, QuantType
from service.core.spec.parallel import SHARDING_STRATEGIES


class Change(StrEnum):
    """Changes that lower a job's peak, least disruptive to the training run first."""

    FUSED_LOSS = "fused_loss"  # same loss, logits never materialised (Liger, CCE)
    # DPO, KTO: the reference's log-probs computed once before training (a pass over the data)
    PRECOMPUTE_REF_LOG_PROBS = "precompute_ref_log_probs"
    OPTIMIZER_8BIT = "optimizer_8bit"  # bitsandbytes 8-bit AdamW (Dettmers et al. 2022)
    PAGED_OPTIMIZER = "paged_optimizer"  # 8-bit AdamW state in pageable managed memory
    GRADIENT_CHECKPOINTING = "gradient_checkpointing"  # about 20-30 % slower steps
    SMALLER_MICRO_BATCH = "smaller_micro_batch"  # same effective batch, more accumulation
    FEWER_GENERATIONS = "fewer_generations"  # GRPO: smaller groups, the prompts per step kept
    SHORTER_COMPLETIONS = "shorter_completions"  # GRPO: max_completion_length halved
    FEWER_TARGET_MODULES = "fewer_target_modules"  # fewer adapters: fewer trainable params
    LORA = "lora"  # a different training method than full fine-tuning
    QLORA = "qlora"  # 4-bit base weights: slower and slightly lossy


CHANGE_WORDS: dict[Change, str] = {
    Change.FUSED_LOSS: "use a fused linear cross-entropy loss (Liger, Cut Cross-Entropy)",
    Change.PRECOMPUTE_REF_LOG_PROBS: (
        "precompute the reference model's log-probs (precompute_ref_log_probs of DPOConfig "
        "or KTOConfig)"
    ),
    Change.OPTIMIZER_8BIT: "use bitsandbytes 8-bit AdamW",
    Change.PAGED_OPTIMIZER: "use bitsandbytes paged 8-bit AdamW",
    Change.GRADIENT_CHECKPOINTING: "turn on gradient checkpointing",
    Change.SMALLER_MICRO_BATCH: (
        "use a smaller micro-batch with gradient accumulation (same effective batch)"
    ),
    Change.FEWER_GENERATIONS: "sample fewer generations per prompt (GRPOConfig.num_generations)",
    Change.SHORTER_COMPLETIONS: "generate shorter completions (GRPOConfig.max_completion_length)",
    Change.FEWER_TARGET_MODULES: "adapt fewer modules (PEFT's default target modules)",
    Change.LORA: "train LoRA adapters instead of every weight",
    Change.QLORA: "quantize the base weights to NF4 (QLoRA, double quantization)",
}


def apply_change(
    change: Change, spec: TrainingSpec, narrower: tuple[str, ...] | None
) -> TrainingSpec | None:
    """A spec-only change (everything but the micro-batch), or None when it does not apply."""
    match change:
        case Change.FUSED_LOSS:
            # TRL's DPO head materialises no logits already; a reward model has none
            if spec.objective is not Objective.SFT:
                return None
            return None if spec.loss is LossImpl.FUSED else spec.changed(loss=LossImpl.FUSED)
        case Change.PRECOMPUTE_REF_LOG_PROBS:
            if spec.objective is Objective.KTO:
                kto = spec.kto_settings
                if kto.precompute_ref_log_probs:
                    return None
                return spec.changed(kto=replace(kto, precompute_ref_log_probs=True))
            settings = spec.dpo_settings
            if spec.objective is not Objective.DPO or settings.precompute_ref_log_probs:
                return None
            return spec.changed(dpo=replace(settings, precompute_ref_log_probs=True))
        case Change.FEWER_GENERATIONS | Change.SHORTER_COMPLETIONS:
            if spec.objective is not Objective.GRPO:
                return None
            if change is Change.FEWER_GENERATIONS:
                return fewer_generations(spec)
            return shorter_completions(spec)
        case Change.OPTIMIZER_8BIT:
            eight_bit = {
                Optim.ADAMW_TORCH: Optim.ADAMW_BNB_8BIT,
                Optim.ADAMW_TORCH_FUSED: Optim.ADAMW_BNB_8BIT,
                Optim.PAGED_ADAMW_32BIT: Optim.PAGED_ADAMW_8BIT,
            }.get(spec.optim)
            return None if eight_bit is None else spec.changed(optim=eight_bit)
        case Change.PAGED_OPTIMIZER:
            if spec.optim not in (Optim.ADAMW_TORCH, Optim.ADAMW_TORCH_FUSED, Optim.ADAMW_BNB_8BIT):
                return None
            return spec.changed(optim=Optim.PAGED_ADAMW_8BIT)
        case Change.GRADIENT_CHECKPOINTING:
            return (
                None if spec.gradient_checkpointing else spec.changed(gradient_checkpointing=True)
            )
        case Change.FEWER_TARGET_MODULES:
            return _fewer_targets(spec, narrower)
        case Change.LORA:
            return spec.changed(method=Method.LORA) if spec.method is Method.FULL else None
        case Change.QLORA:
            # A sharded 4-bit base is refused (TrainingSpec): not offered under FSDP or ZeRO-3;
            # nor to PEFT's methods besides LoRA or LitGPT's adapters, which would change method
            # and options.
            if (
                spec.method in (Method.QLORA, *METHOD_OPTIONS, *ADAPTER_METHODS)
                or spec.parallel.strategy in SHARDING_STRATEGIES
            ):
                return None
            quant = QuantSpec(type=QuantType.NF4, double_quant=True)
            return spec.changed(method=Method.QLORA, quantization=quant)
        case Change.SMALLER_MICRO_BATCH:
            return None


def take_back(change: Change, spec: TrainingSpec, job: TrainingSpec) -> TrainingSpec | None:
    """`spec`, a changed `job`, with `change` taken back: the fields it set get `job`'s values
    again, every other change stays. None when the rest does not make a valid spec."""
    try:
        match change:
            case Change.FUSED_LOSS:
                return spec.changed(loss=job.loss)
            case Change.FEWER_GENERATIONS | Change.SHORTER_COMPLETIONS:
                return spec.changed(batch_size=job.batch_size, seq_len=job.seq_len, grpo=job.grpo)
            case Change.PRECOMPUTE_REF_LOG_PROBS:
                return spec.changed(dpo=job.dpo, kto=job.kto)
            case Change.OPTIMIZER_8BIT | Change.PAGED_OPTIMIZER:
                return spec.changed(optim=job.optim)
            case Change.GRADIENT_CHECKPOINTING:
                return spec.changed(gradient_checkpointing=job.gradient_checkpointing)
            case Change.SMALLER_MICRO_BATCH:
                return spec.changed(
                    batch_size=job.batch_size,
                    gradient_accumulation_steps=job.gradient_accumulation_steps,
                )
            case Change.FEWER_TARGET_MODULES:
                if spec.lora is None or job.lora is None:
                    return None
                return spec.changed(lora=replace(spec.lora, target_modules=job.lora.target_modules))
            case Change.LORA | Change.QLORA:
                lora = None if job.method is Method.FULL else spec.lora
                return spec.changed(method=job.method, quantization=job.quantization, lora=lora)
    except InvalidSpecError:
        return None


def _fewer_targets(spec: TrainingSpec, narrower: tuple[str, ...] | None) -> TrainingSpec | None:
    if narrower is None or spec.lora is None or spec.method is Method.FULL:
        return None
    current = spec.lora.target_modules
    if current is None:
        return None  # already PEFT's default
    if current != ALL_LINEAR and len(current) <= len(narrower):
        return None
    return spec.changed(lora=replace(spec.lora, target_modules=narrower))
