"""KTO's step (TRL 1.16.0 KTOTrainer): the SFT step on the batch's unpaired examples, its
logits replaced by TRL's fused chunked log-prob head, with the no-grad forwards around it.

KTOTrainer._compute_loss runs, per micro-batch: the KL batch (each prompt with the completion
of the example before it) through the policy under no_grad (`_compute_kl_logps`), the policy's
forward, then under no_grad with checkpointing off the reference on the KL batch and on the
completions. The KL forward through the policy comes first, with nothing of the policy's
forward alive, so it is smaller than the reference forwards after it; the two reference
forwards hold the same tensors. So the step is DPO's fused-head step
(estimator/preference.py `fused_head_phases`) on `batch_size` rows instead of 2 x batch_size,
with a policy head that returns no is_top1 (kto_trainer.py __init__:
`outputs=("log_probs", "entropy", "mean_logits")`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from service.core.arch import ModelArch
from service.core.estimator.ledger import _blk
from service.core.estimator.preference import (
    TILE_TOKENS,
    TILE_VOCAB,
    DpoShape,
    fused_head_phases,
    head_dtypes,
    reference_notes,
)
from service.core.estimator.step import _Step, _step
from service.core.result import Phase
from service.core.spec import LossImpl, Method, Objective, TrainingSpec
from service.core.units import FP32_BYTES, INT64_BYTES

# The KL batch's tensors in the collator's batch, int64 (batch, seq) each: KL_input_ids,
# KL_attention_mask, KL_completion_mask (kto_trainer.py DataCollatorForUnpairedPreference).
KL_BATCH_TENSORS = 3


def kto_shape(spec: TrainingSpec) -> DpoShape:
    """The batch's rows, the positions TRL's fused head scores (every label after the shift:
    the whole sequence as completion), and the head's dtypes (`preference.head_dtypes`)."""
    rows = spec.batch_size
    return DpoShape(rows, rows * (spec.seq_len - 1), *head_dtypes(spec))


def kto_policy_spec(spec: TrainingSpec) -> TrainingSpec:
    """The SFT step whose layers KTO's policy runs: the batch's rows, no logits, and no
    dropout (KTOConfig.disable_dropout, True by default: trl/trainer/utils.py
    disable_dropout_in_model sets every nn.Dropout's p to 0, LoRA's included)."""
    lora = spec.lora
    if lora is not None and lora.lora_dropout:
        lora = replace(lora, lora_dropout=0.0)
    return replace(spec, objective=Objective.SFT, kto=None, loss=LossImpl.FUSED, lora=lora)


def kto_inputs(spec: TrainingSpec) -> int:
    """What the collator's batch holds beyond the SFT step's inputs: the KL batch's tensors,
    and the precomputed log-probs (fp32 per example: ref_logps, and ref_KL_logps with the KL
    batch)."""
    settings = spec.kto_settings
    kl = KL_BATCH_TENSORS * _blk(spec.batch_size * spec.seq_len * INT64_BYTES)
    precomputed = (1 + settings.calculate_kl) * _blk(spec.batch_size * FP32_BYTES)
    return (kl if settings.calculate_kl else 0) + (
        precomputed if settings.precompute_ref_log_probs else 0
    )


def reference_copy(spec: TrainingSpec) -> bool:
    """Whether KTOTrainer loads a frozen reference model: full fine-tuning without precomputed
    log-probs (a PEFT policy is its own reference with the adapters disabled)."""
    return spec.method is Method.FULL and not spec.kto_settings.precompute_ref_log_probs


class KtoStep(NamedTuple):
    """KTO's phases as (step, phase, parts) with the SFT step they extend."""

    step: _Step
    phases: tuple[tuple[int, Phase, tuple[int, ...]], ...]
    assumptions: tuple[str, ...]


def kto_step(arch: ModelArch, spec: TrainingSpec, compute_capability: str | None) -> KtoStep:
    d = kto_shape(spec)
    st = _step(arch, kto_policy_spec(spec), compute_capability)
    st = st._replace(fixed=st.fixed._replace(inputs=st.fixed.inputs + kto_inputs(spec)))
    settings = spec.kto_settings
    precompute = settings.precompute_ref_log_probs
    reference = st.fixed.trainable_params if reference_copy(spec) else 0
    rows = fused_head_phases(
        arch, spec, d, st, reference_forward=not precompute, reference=reference, top1=False
    )
    kl = (
        "the KL batch (each prompt with the completion of the example before it) through the "
        "policy and the reference under no_grad"
        if settings.calculate_kl
        else "no KL batch"
    )
    notes = [
        f"KTO (TRL 1.16.0 KTOTrainer, loss {settings.loss_type.value!r}): {spec.batch_size} "
        f"unpaired examples of {spec.seq_len} tokens, unpadded; {kl}",
        "the fused LM head scores every position but the first (the whole sequence as "
        f"completion): {d.scored} positions per forward, in tiles of {TILE_TOKENS} x "
        f"{TILE_VOCAB} logits",
    ]
    notes += reference_notes(spec, precompute, "KTOConfig")
    return KtoStep(st, rows, tuple(notes))
