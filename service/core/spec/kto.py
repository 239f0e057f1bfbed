"""KTOConfig's settings that change memory (TRL 1.16.0 trl/trainer/kto_config.py), by its
field names and defaults, for objective 'kto'."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from service.core.fields import job_field


class KtoLossType(StrEnum):
    """KTOConfig.loss_type's choices."""

    KTO = "kto"  # Eqn (7) of the KTO paper, with the KL term (the default)
    APO_ZERO_UNPAIRED = "apo_zero_unpaired"  # APO-zero's unpaired form: no KL term


# KTOTrainer.__init__: `calculate_kl = args.loss_type not in ["apo_zero_unpaired"]`.
KL_FREE_LOSS_TYPES = (KtoLossType.APO_ZERO_UNPAIRED,)
# KTOTrainer.__init__ refuses `per_device_train_batch_size <= 1` with the KL batch: its
# completions are the batch's own rotated by one.
KL_MIN_BATCH_SIZE = 2


@dataclass(frozen=True, slots=True, kw_only=True)
class KtoSpec:
    """KTOConfig's memory settings; the batch is `batch_size` unpaired (prompt, completion,
    label) examples of `seq_len` tokens (KTOConfig.max_length, default 1024)."""

    # KTOConfig.precompute_ref_log_probs (default False): the reference's log-probabilities
    # (and its KL log-probabilities) are computed before training, so the step runs no
    # reference forward and full fine-tuning loads no reference copy (KTOTrainer.__init__).
    precompute_ref_log_probs: bool = job_field(
        False,
        doc="KTOConfig.precompute_ref_log_probs: the reference's log-probs (and its KL log-probs) "
        "computed before training, so no reference forward in the step and, for full fine-tuning, "
        "no reference copy of the model.",
        mirrors="KTOConfig.precompute_ref_log_probs",
    )
    # KTOConfig.loss_type (default "kto"): every loss type but "apo_zero_unpaired" runs the
    # KL batch, the completions rotated by one within the batch, through the policy and the
    # reference under no_grad (KTOTrainer._compute_kl_logps).
    loss_type: KtoLossType = job_field(
        KtoLossType.KTO,
        doc="KTOConfig.loss_type: 'kto' runs the KL batch (each prompt with the completion of the "
        "example before it) through the policy and the reference under no_grad, and needs "
        "batch_size of at least 2; 'apo_zero_unpaired' runs no KL batch.",
        mirrors="KTOConfig.loss_type",
        inline=True,
    )

    @property
    def calculate_kl(self) -> bool:
        """Whether the step runs the KL batch (KTOTrainer.calculate_KL)."""
        return self.loss_type not in KL_FREE_LOSS_TYPES

    @property
    def min_batch_size(self) -> int:
        """The smallest micro-batch KTOTrainer runs with these settings."""
        return KL_MIN_BATCH_SIZE if self.calculate_kl else 1
