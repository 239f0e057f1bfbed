"""ORPO's settings in a job request (objective 'orpo'), by TRL ORPOConfig's names and defaults
(service/core/spec/orpo.py, where each field is declared)."""

from __future__ import annotations

from service.api.schemas.declared import DeclaredIn, declared_model
from service.core.spec.orpo import OrpoSpec

OrpoIn = declared_model(
    "OrpoIn",
    OrpoSpec,
    doc="""TRL ORPOConfig's settings that change memory (objective 'orpo' only); its max_length is
    the job's seq_len.""",
    base=DeclaredIn,
)
