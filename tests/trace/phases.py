"""The phases a reference records for its spec, in the order the tracer writes them."""

from __future__ import annotations

from service.core.result import Phase
from service.core.spec import Objective, TrainingSpec


def expected_phases(spec: TrainingSpec) -> list[tuple[int, str]]:
    """(step, phase) of both traced steps; the reference forward is DPO's and KTO's phase,
    absent with precomputed log-probs; the generation GRPO's."""
    reference_forward = (
        spec.objective is Objective.DPO and not spec.dpo_settings.precompute_ref_log_probs
    ) or (spec.objective is Objective.KTO and not spec.kto_settings.precompute_ref_log_probs)
    return [
        (step, phase.value)
        for step in (1, 2)
        for phase in Phase
        if phase is not Phase.REFERENCE_FORWARD or reference_forward
        if phase is not Phase.GENERATION or spec.objective is Objective.GRPO
    ]
