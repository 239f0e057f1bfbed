"""DPOConfig's settings that change memory (TRL 1.16.0 trl/trainer/dpo_config.py), by its
field names and defaults, for objective 'dpo'."""

from __future__ import annotations

from dataclasses import dataclass

from service.core.errors import InvalidSpecError


@dataclass(frozen=True, slots=True, kw_only=True)
class DpoSpec:
    """DPOConfig's settings that change memory (TRL 1.16.0 trl/trainer/dpo_config.py)."""

    # DPOConfig.precompute_ref_log_probs (default False): the reference's log-probabilities
    # are computed before training, so the step runs no reference forward and full
    # fine-tuning keeps no reference copy (DPOTrainer.__init__).
    precompute_ref_log_probs: bool = False
    # Completion tokens of each sequence (older DPOConfig's max_completion_length): only
    # their positions go through the fused LM head on a GPU. None: every position but the
    # first (the whole padded sequence is completion), the largest it can be.
    max_completion_length: int | None = None

    def __post_init__(self) -> None:
        if self.max_completion_length is not None and self.max_completion_length < 1:
            raise InvalidSpecError("dpo.max_completion_length", "must be at least 1")
