"""KTO's settings in a job request (objective 'kto'), by TRL KTOConfig's names and defaults
(service/core/spec/kto.py, where each field is declared)."""

from __future__ import annotations

from service.api.schemas.declared import DeclaredIn, declared_model
from service.core.spec.kto import KtoSpec

KtoIn = declared_model(
    "KtoIn",
    KtoSpec,
    doc="TRL KTOConfig's settings that change memory (objective 'kto' only).",
    base=DeclaredIn,
)
