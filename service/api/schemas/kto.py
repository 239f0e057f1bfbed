"""KTO's settings in a job request (objective 'kto'), by TRL KTOConfig's names and defaults
(service/core/spec_kto.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from service.api.schemas.base import Boolean, In
from service.core.spec_kto import KtoLossType, KtoSpec


class KtoIn(In):
    """TRL KTOConfig's settings that change memory (objective 'kto' only)."""

    precompute_ref_log_probs: Boolean = Field(
        default=False,
        description="KTOConfig.precompute_ref_log_probs: the reference's log-probs (and its KL "
        "log-probs) computed before training, so no reference forward in the step and, for "
        "full fine-tuning, no reference copy of the model.",
    )
    loss_type: Literal["kto", "apo_zero_unpaired"] = Field(
        default=KtoLossType.KTO.value,
        description="KTOConfig.loss_type: 'kto' runs the KL batch (each prompt with the "
        "completion of the example before it) through the policy and the reference under "
        "no_grad, and needs batch_size of at least 2; 'apo_zero_unpaired' runs no KL batch.",
    )

    def to_spec(self) -> KtoSpec:
        return KtoSpec(
            precompute_ref_log_probs=self.precompute_ref_log_probs,
            loss_type=KtoLossType(self.loss_type),
        )
