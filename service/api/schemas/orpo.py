"""ORPO's settings in a job request (objective 'orpo'), by TRL ORPOConfig's names and defaults
(service/core/spec_orpo.py)."""

from __future__ import annotations

from pydantic import Field

from service.api.schemas.base import Boolean, In
from service.core.spec_orpo import OrpoSpec


class OrpoIn(In):
    """TRL ORPOConfig's settings that change memory (objective 'orpo' only); its max_length is
    the job's seq_len."""

    disable_dropout: Boolean = Field(
        default=True,
        description="ORPOConfig.disable_dropout: every dropout's p set to 0, LoRA's included; "
        "false keeps LoRA's dropout and the masks it saves.",
    )

    def to_spec(self) -> OrpoSpec:
        return OrpoSpec(disable_dropout=self.disable_dropout)
