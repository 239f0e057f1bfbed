"""DPOConfig's settings that change memory (TRL 1.16.0 trl/trainer/dpo_config.py), by its
field names and defaults, for objective 'dpo'."""

from __future__ import annotations

from dataclasses import dataclass

from service.core.errors import InvalidSpecError
from service.core.fields import job_field
from service.core.limits import MAX_SEQ_LEN


@dataclass(frozen=True, slots=True, kw_only=True)
class DpoSpec:
    """DPOConfig's settings that change memory (TRL 1.16.0 trl/trainer/dpo_config.py)."""

    # DPOConfig.precompute_ref_log_probs (default False): the reference's log-probabilities
    # are computed before training, so the step runs no reference forward and full
    # fine-tuning keeps no reference copy (DPOTrainer.__init__).
    precompute_ref_log_probs: bool = job_field(
        False,
        doc="DPOConfig.precompute_ref_log_probs: the reference's log-probs computed before "
        "training, so no reference forward in the step and, for full fine-tuning, no reference "
        "copy of the model.",
        mirrors="DPOConfig.precompute_ref_log_probs",
    )
    # Completion tokens of each sequence (older DPOConfig's max_completion_length): only
    # their positions go through the fused LM head on a GPU. None: every position but the
    # first (the whole padded sequence is completion), the largest it can be.
    max_completion_length: int | None = job_field(
        None,
        doc="Completion tokens of each sequence (older DPOConfig's name): only they go through "
        "TRL's fused LM head. null: the whole sequence is completion (the largest).",
        mirrors="DPOConfig.max_completion_length",
        ge=1,
        le=MAX_SEQ_LEN,
    )

    def __post_init__(self) -> None:
        if self.max_completion_length is not None and self.max_completion_length < 1:
            raise InvalidSpecError("dpo.max_completion_length", "must be at least 1")
