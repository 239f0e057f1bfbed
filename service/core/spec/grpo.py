"""GRPOConfig's settings that change memory (TRL 1.16.0 trl/trainer/grpo_config.py), by its
field names and defaults, for objective 'grpo', and what is modelled of them.

The step's batch is `batch_size` completions (GRPOConfig.per_device_train_batch_size counts
completions: prompts x num_generations) of `seq_len` = max_prompt_length +
max_completion_length tokens; TRL generates once per optimizer step for the whole generation
batch (steps_per_generation defaults to gradient_accumulation_steps, generation_batch_size to
per_device_train_batch_size x steps_per_generation: GRPOConfig.__post_init__).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol, TypeVar

from service.core.errors import InvalidSpecError
from service.core.fields import job_field
from service.core.limits import MAX_BATCH_SIZE, MAX_SEQ_LEN

# GRPOConfig.__post_init__: "num_generations ... is less than the minimum required" below 2.
MIN_GENERATIONS = 2


@dataclass(frozen=True, slots=True, kw_only=True)
class GrpoSpec:
    """GRPOConfig's memory settings, its defaults where it has them."""

    # GRPOConfig.num_generations (default 8): completions sampled per prompt.
    num_generations: int = job_field(
        8,
        doc="GRPOConfig.num_generations: completions sampled per prompt; the generation batch "
        "(batch_size x gradient_accumulation_steps) must divide by it.",
        mirrors="GRPOConfig.num_generations",
        ge=1,
        unstated_le=MAX_BATCH_SIZE,
    )
    # The prompts' padded length (TRL 1.16.0 has no GRPOConfig.max_prompt_length: prompts are
    # left-padded to the longest of the generation batch, `_generate_single_turn`); None: the
    # sequence's length less max_completion_length.
    max_prompt_length: int | None = job_field(
        None,
        doc="The prompts' padded length (TRL 1.16.0 pads prompts to the longest); null: seq_len - "
        "max_completion_length.",
        ge=1,
        unstated_le=MAX_SEQ_LEN,
    )
    # GRPOConfig.max_completion_length (default 512): generate's max_new_tokens; completions
    # run to it (no EOS), the longest case.
    max_completion_length: int = job_field(
        512,
        doc="GRPOConfig.max_completion_length: model.generate's max_new_tokens; completions are "
        "taken to run to it (no EOS).",
        mirrors="GRPOConfig.max_completion_length",
        ge=1,
        unstated_le=MAX_SEQ_LEN,
    )
    # GRPOConfig.beta (default 0.0): the KL coefficient; 0.0 loads no reference model.
    beta: float = job_field(
        0.0,
        doc="GRPOConfig.beta: 0.0 (the default) loads no reference model; above 0 is a 422 (not "
        "modelled).",
        mirrors="GRPOConfig.beta",
        ge=0.0,
    )
    # GRPOConfig.num_iterations (default 1): above 1 TRL computes old_per_token_logps.
    num_iterations: int = job_field(
        1,
        doc="GRPOConfig.num_iterations: above 1 is a 422 (old_per_token_logps not modelled).",
        mirrors="GRPOConfig.num_iterations",
        ge=1,
    )
    # GRPOConfig.use_vllm (default False): generation by vLLM instead of model.generate.
    use_vllm: bool = job_field(
        False,
        doc="GRPOConfig.use_vllm: true is a 422 (vLLM's engine is not traced).",
        mirrors="GRPOConfig.use_vllm",
    )

    def prompt_length(self, seq_len: int) -> int:
        """The prompts' padded length within a `seq_len`-token sequence."""
        if self.max_prompt_length is not None:
            return self.max_prompt_length
        return seq_len - self.max_completion_length


class _Job(Protocol):
    """What of a TrainingSpec these checks read (spec.py imports this module)."""

    @property
    def autocast(self) -> bool: ...

    @property
    def grpo_settings(self) -> GrpoSpec: ...

    @property
    def batch_size(self) -> int: ...

    @property
    def seq_len(self) -> int: ...

    @property
    def gradient_accumulation_steps(self) -> int: ...


Job = TypeVar("Job", bound=_Job)


def check_grpo(spec: _Job) -> None:
    """What is modelled of GRPOTrainer: model.generate's completions, the policy's loss with
    num_iterations 1 and beta 0.0; the generation batch divisible by num_generations; the
    step's batch `batch_size` completions of `seq_len` tokens."""
    settings, batch_size, seq_len = spec.grpo_settings, spec.batch_size, spec.seq_len
    accumulation = spec.gradient_accumulation_steps
    if spec.autocast:
        raise InvalidSpecError("autocast", "objective 'grpo' under mixed precision is not modelled")
    if settings.use_vllm:
        raise InvalidSpecError(
            "grpo.use_vllm",
            "vLLM generation is not modelled (its engine's own KV-cache pool, sized by "
            "vllm_gpu_memory_utilization, is not traced); GRPO is modelled with model.generate",
        )
    if settings.num_iterations != 1:
        raise InvalidSpecError(
            "grpo.num_iterations",
            "num_iterations above 1 is not modelled (GRPOTrainer then computes "
            "old_per_token_logps over the generation batch)",
        )
    if settings.beta != 0.0:
        raise InvalidSpecError(
            "grpo.beta",
            "beta above 0.0 is not modelled (GRPOTrainer then loads a reference model and "
            "computes ref_per_token_logps); GRPOConfig's default is 0.0",
        )
    if settings.num_generations < MIN_GENERATIONS:
        raise InvalidSpecError(
            "grpo.num_generations",
            f"GRPOConfig needs at least {MIN_GENERATIONS} generations per prompt",
        )
    generation_batch = batch_size * accumulation
    if generation_batch % settings.num_generations:
        raise InvalidSpecError(
            "grpo.num_generations",
            f"the generation batch (batch_size x gradient_accumulation_steps = "
            f"{generation_batch} completions) must be divisible by num_generations "
            f"({settings.num_generations}): GRPOConfig.__post_init__",
        )
    prompt = settings.prompt_length(seq_len)
    if prompt < 1 or prompt + settings.max_completion_length != seq_len:
        raise InvalidSpecError(
            "seq_len",
            f"GRPO's sequence is max_prompt_length + max_completion_length tokens "
            f"({prompt} + {settings.max_completion_length}), not {seq_len}",
        )


def fewer_generations(spec: Job) -> Job | None:
    """The fit-check's "fewer generations per prompt": half the completions per step, the
    prompts per step kept (num_generations and batch_size halved together), or None where
    GRPOConfig's minimum of two generations stops it."""
    settings = spec.grpo_settings
    half = settings.num_generations // 2
    if half < MIN_GENERATIONS or spec.batch_size % 2:
        return None
    changed: Job = replace(  # type: ignore[type-var]
        spec, batch_size=spec.batch_size // 2, grpo=replace(settings, num_generations=half)
    )
    return changed


def shorter_completions(spec: Job) -> Job | None:
    """The fit-check's "shorter completions": max_completion_length halved, the sequence
    shortened with it (the prompts kept), or None below one token."""
    settings = spec.grpo_settings
    half = settings.max_completion_length // 2
    if half < 1:
        return None
    prompt = settings.prompt_length(spec.seq_len)
    grpo = replace(settings, max_prompt_length=prompt, max_completion_length=half)
    changed: Job = replace(spec, seq_len=prompt + half, grpo=grpo)  # type: ignore[type-var]
    return changed


def curve_point(spec: Job, dimension: str, x: int) -> Job:
    """The fit-check's job at micro-batch (or sequence length) `x`: the memory depends on the
    generation batch and the lengths alone, so num_generations becomes the generation batch
    where `x` does not divide by it, and the completion is cut to leave a prompt token."""
    settings = spec.grpo_settings
    if dimension == "batch_size":
        # below two completions per generation batch the bound is two's (GRPOConfig's minimum)
        rows = max(x * spec.gradient_accumulation_steps, MIN_GENERATIONS)
        generations = settings.num_generations if rows % settings.num_generations == 0 else rows
        batch = -(-rows // spec.gradient_accumulation_steps)
        grpo = replace(settings, num_generations=generations)
        changed: Job = replace(spec, batch_size=batch, grpo=grpo)  # type: ignore[type-var]
        return changed
    seq = max(x, 2)
    completion = min(settings.max_completion_length, seq - 1)
    grpo = replace(settings, max_prompt_length=seq - completion, max_completion_length=completion)
    changed = replace(spec, seq_len=seq, grpo=grpo)  # type: ignore[type-var]
    return changed
