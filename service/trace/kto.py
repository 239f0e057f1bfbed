"""TRL's KTO step (trl 1.16.0, trl/trainer/kto_trainer.py `_compute_loss`) on the tracer's
fake tensors, with the kernels a GPU runs.

Per micro-batch of `batch_size` unpaired examples, in TRL's order: the KL batch (each prompt
with the completion of the example before it) through the policy under `torch.no_grad()`
(`_compute_kl_logps`, checkpointing left on), the policy's forward with gradients, then the
reference under `torch.no_grad()` and TRL's `disable_gradient_checkpointing`: the KL batch
again, then the completions (the policy with its adapters disabled for PEFT, TRL's frozen copy
for full fine-tuning). Every forward runs TRL's fused LM head (`add_fused_lm_head`) as DPO's
tracer runs it on a CUDA device (service/trace/preference.py: compact positions, Triton folds
writing in place). Loss type "apo_zero_unpaired" runs no KL batch; precomputed reference
log-probs run no reference forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from service.core.result import Component, Phase
from service.core.spec import Method, TrainingSpec
from service.core.spec.kto import KtoLossType
from service.trace import preference
from service.trace.preference import (
    IGNORE_INDEX,
)

# KTOConfig.beta, desirable_weight and undesirable_weight defaults
# (trl/trainer/kto_config.py); the values do not change memory.
KTO_BETA = 0.1
DESIRABLE_WEIGHT = 1.0
UNDESIRABLE_WEIGHT = 1.0
# The per-token fields KTOTrainer asks the policy's fused head for (kto_trainer.py __init__:
# `outputs=("log_probs", "entropy", "mean_logits")`); a full reference copy's head computes
# log-probabilities alone (`add_fused_lm_head(self.ref_model)`).
POLICY_OUTPUTS = ("log_probs", "entropy", "mean_logits")


def note(spec: TrainingSpec) -> str:
    """What a KTO trace ran, with the installed TRL's version."""
    from importlib.metadata import version

    settings = spec.kto_settings
    kl = "with the KL batch" if settings.calculate_kl else "no KL batch"
    return (
        f"KTO: trl {version('trl')} KTOTrainer's step (loss {settings.loss_type.value!r}, {kl}), "
        "its fused LM head as a CUDA device runs it (compact positions, Triton folds, fp32-out "
        "GEMMs); the batch unpadded, half desirable"
    )


def compact_rows(spec: TrainingSpec) -> int:
    """Positions TRL's fused head scores on a GPU in one forward: every label after the shift
    (the whole sequence as completion) over the batch's rows."""
    return spec.batch_size * (spec.seq_len - 1)


def mask_shape(spec: TrainingSpec) -> tuple[int, int]:
    """The fused head's label mask, the same for the completions and the KL batch."""
    return (spec.batch_size, spec.seq_len - 1)


def prepare(model: torch.nn.Module) -> None:
    """What KTOTrainer.__init__ does to the policy, as DPOTrainer's: dropout off
    (KTOConfig.disable_dropout), the fused LM head on the base model."""
    preference.prepare_policy(model, POLICY_OUTPUTS)


def needs_reference_copy(spec: TrainingSpec) -> bool:
    """Full fine-tuning loads a frozen reference model unless the log-probs are precomputed
    (KTOTrainer.__init__: a PEFT model is its own reference with the adapters disabled)."""
    return spec.method is Method.FULL and not spec.kto_settings.precompute_ref_log_probs


def build_reference(spec: TrainingSpec, config: Any) -> torch.nn.Module:
    """KTOTrainer's reference for full fine-tuning, built as DPOTrainer's is (the model in the
    policy's dtype, frozen, dropout off, the fused head computing log-probs alone)."""
    return preference.build_reference(spec, config)


def run_kto_steps(run: preference.TrainerRun, ref_model: torch.nn.Module | None) -> None:
    """`steps` optimizer steps of KTOTrainer: per micro-batch `_compute_loss` (the KL batch,
    the policy forward, the reference forwards, the loss), backward, then HF Trainer's
    clipping, optimizer step and zero_grad as in service/trace/runner.py."""
    model, tracker, spec = run.model, run.tracker, run.spec
    rows, seq = spec.batch_size, spec.seq_len
    settings = spec.kto_settings
    chosen = (rows + 1) // 2  # the first half of the batch desirable
    with tracker.labelling(Component.INPUTS):
        # DataCollatorForUnpairedPreference's batch (kto_trainer.py): int64 ids and masks, the
        # KL sequences under the KL_ keys, the labels, the precomputed log-probs
        kl, precompute = settings.calculate_kl, settings.precompute_ref_log_probs
        batch = _Batch(
            input_ids=torch.zeros(rows, seq, dtype=torch.long),
            attention_mask=torch.ones(rows, seq, dtype=torch.long),
            completion_mask=torch.ones(rows, seq, dtype=torch.long),
            kl_input_ids=torch.zeros(rows, seq, dtype=torch.long) if kl else None,
            kl_attention_mask=torch.ones(rows, seq, dtype=torch.long) if kl else None,
            kl_completion_mask=torch.ones(rows, seq, dtype=torch.long) if kl else None,
            label=torch.zeros(rows, dtype=torch.bool),
            ref_logps=torch.zeros(rows) if precompute else None,
            ref_kl_logps=torch.zeros(rows) if precompute and kl else None,
            chosen=chosen,
        )

    micro_batch = preference.reference_micro_batch(run, _compute_loss, ref_model, batch, spec)
    with preference.fused_head_steering(run, model, ref_model) as head:
        preference.trainer_steps(run, micro_batch, head)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Batch:
    """The collator's tensors for one micro-batch; `chosen` rows are desirable."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor
    kl_input_ids: torch.Tensor | None
    kl_attention_mask: torch.Tensor | None
    kl_completion_mask: torch.Tensor | None
    label: torch.Tensor
    ref_logps: torch.Tensor | None
    ref_kl_logps: torch.Tensor | None
    chosen: int


def _kl_logps(model: torch.nn.Module, batch: _Batch) -> torch.Tensor | None:
    """KTOTrainer._compute_kl_logps: the KL batch's summed log-probs under no_grad."""
    if batch.kl_input_ids is None or batch.kl_completion_mask is None:
        return None
    kl_labels = batch.kl_input_ids.masked_fill(batch.kl_completion_mask == 0, IGNORE_INDEX)
    with torch.no_grad():
        per_token = model(
            input_ids=batch.kl_input_ids, labels=kl_labels, fused_lm_head=True, use_cache=False
        ).log_probs
    return per_token[:, -(kl_labels.size(1) - 1) :].sum(-1)


def _compute_loss(
    model: torch.nn.Module,
    ref_model: torch.nn.Module | None,
    batch: _Batch,
    spec: TrainingSpec,
    call: preference.LossCall,
) -> torch.Tensor:
    """KTOTrainer._compute_loss's tensors, in its order. Its metrics are left out: their host
    scalars (`.item()`, which fake tensors cannot give) and the per-token copies they gather
    (the mean logits and completion mask by label, batch x (seq - 1) elements each), made after
    the reference forward and let go when `_compute_loss` returns, before backward."""
    tracker, step = call.tracker, call.step
    rows = batch.input_ids.size(0)
    tracker.component = Component.ACTIVATIONS
    kl_logps = _kl_logps(model, batch)
    tracker.component = Component.ACTIVATIONS
    completion_labels = batch.input_ids.masked_fill(batch.completion_mask == 0, IGNORE_INDEX)
    outputs = model(
        input_ids=batch.input_ids, labels=completion_labels, fused_lm_head=True, use_cache=False
    )
    seq_len = batch.input_ids.size(1) - 1
    per_token_logps = outputs.log_probs[:, -seq_len:]
    completion_logps = per_token_logps.sum(-1)
    # torch.nonzero(bool_labels) and its complement: int64 indices, the first half chosen
    chosen_idx = torch.arange(batch.chosen, dtype=torch.long)
    rejected_idx = torch.arange(batch.chosen, rows, dtype=torch.long)
    chosen_logps = completion_logps.index_select(0, chosen_idx)
    rejected_logps = completion_logps.index_select(0, rejected_idx)
    tracker.mark(step, Phase.FORWARD_END)

    if batch.ref_logps is not None:
        ref_chosen_logps = batch.ref_logps.index_select(0, chosen_idx)
        ref_rejected_logps = batch.ref_logps.index_select(0, rejected_idx)
        ref_kl_logps = batch.ref_kl_logps
    else:
        tracker.begin_phase(step, Phase.REFERENCE_FORWARD)
        with call.reference(model, ref_model) as forward:
            tracker.component = Component.ACTIVATIONS
            ref_kl_logps = _kl_logps(forward, batch)
            tracker.component = Component.ACTIVATIONS
            ref_outputs = forward(
                input_ids=batch.input_ids,
                labels=completion_labels,
                fused_lm_head=True,
                use_cache=False,
            )
        ref_per_token_logps = ref_outputs.log_probs[:, -seq_len:]
        ref_completion_logps = ref_per_token_logps.sum(-1)
        ref_chosen_logps = ref_completion_logps.index_select(0, chosen_idx)
        ref_rejected_logps = ref_completion_logps.index_select(0, rejected_idx)
        del ref_outputs, ref_per_token_logps, ref_completion_logps

    tracker.component = Component.LOGITS_LOSS
    if kl_logps is not None and ref_kl_logps is not None:
        kl = (kl_logps - ref_kl_logps).mean().detach().clamp(min=0)
    else:
        kl = torch.zeros(1)
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    if spec.kto_settings.loss_type is KtoLossType.KTO:
        # Eqn (7) of the KTO paper, as kto_trainer.py writes it
        chosen_losses = 1 - F.sigmoid(KTO_BETA * (chosen_logratios - kl))
        rejected_losses = 1 - F.sigmoid(KTO_BETA * (kl - rejected_logratios))
    else:
        chosen_losses = 1 - F.sigmoid(KTO_BETA * chosen_logratios)
        rejected_losses = F.sigmoid(KTO_BETA * rejected_logratios)
    losses = torch.cat((DESIRABLE_WEIGHT * chosen_losses, UNDESIRABLE_WEIGHT * rejected_losses), 0)
    loss: torch.Tensor = losses.nanmean()
    return loss
