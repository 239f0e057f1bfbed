"""GRPO's settings in a job request (objective 'grpo'), by TRL GRPOConfig's names and defaults
(service/core/spec/grpo.py, where each field is declared)."""

from __future__ import annotations

from service.api.schemas.declared import DeclaredIn, declared_model
from service.core.spec.grpo import GrpoSpec

GrpoIn = declared_model(
    "GrpoIn",
    GrpoSpec,
    doc="""TRL GRPOConfig's settings that change memory (objective 'grpo' only). batch_size counts
    completions (per_device_train_batch_size: prompts x num_generations) and seq_len is
    max_prompt_length + max_completion_length.""",
    base=DeclaredIn,
)
