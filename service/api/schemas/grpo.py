"""GRPO's settings in a job request (objective 'grpo'), by TRL GRPOConfig's names and defaults
(service/core/spec_grpo.py)."""

from __future__ import annotations

from pydantic import Field

from service.api.schemas.base import Boolean, In, Number, integers
from service.core.spec_grpo import GrpoSpec

_DEFAULTS = GrpoSpec()


class GrpoIn(In):
    """TRL GRPOConfig's settings that change memory (objective 'grpo' only). batch_size counts
    completions (per_device_train_batch_size: prompts x num_generations) and seq_len is
    max_prompt_length + max_completion_length."""

    integer_fields = integers(
        "num_generations", "max_prompt_length", "max_completion_length", "num_iterations"
    )

    num_generations: int = Field(
        default=_DEFAULTS.num_generations,
        ge=1,
        description="GRPOConfig.num_generations: completions sampled per prompt; the "
        "generation batch (batch_size x gradient_accumulation_steps) must divide by it.",
    )
    max_prompt_length: int | None = Field(
        default=None,
        ge=1,
        description="The prompts' padded length (TRL 1.16.0 pads prompts to the longest); "
        "null: seq_len - max_completion_length.",
    )
    max_completion_length: int = Field(
        default=_DEFAULTS.max_completion_length,
        ge=1,
        description="GRPOConfig.max_completion_length: model.generate's max_new_tokens; "
        "completions are taken to run to it (no EOS).",
    )
    beta: Number = Field(
        default=_DEFAULTS.beta,
        ge=0.0,
        description="GRPOConfig.beta: 0.0 (the default) loads no reference model; above 0 is "
        "a 422 (not modelled).",
    )
    num_iterations: int = Field(
        default=_DEFAULTS.num_iterations,
        ge=1,
        description="GRPOConfig.num_iterations: above 1 is a 422 (old_per_token_logps not "
        "modelled).",
    )
    use_vllm: Boolean = Field(
        default=False,
        description="GRPOConfig.use_vllm: true is a 422 (vLLM's engine is not traced).",
    )

    def to_spec(self) -> GrpoSpec:
        return GrpoSpec(
            num_generations=self.num_generations,
            max_prompt_length=self.max_prompt_length,
            max_completion_length=self.max_completion_length,
            beta=float(self.beta),
            num_iterations=self.num_iterations,
            use_vllm=self.use_vllm,
        )
