"""Objective 'grpo' (TRL 1.16.0 GRPOTrainer): GRPOConfig's settings, what is refused and why,
the generation phase with its KV cache apart, and the fit-check's GRPO changes."""

from __future__ import annotations

import pytest

from service.catalog.models import default_catalog
from service.core.codec import spec_from_dict, spec_to_dict
from service.core.errors import InvalidSpecError
from service.core.estimator import buffered_inputs, estimate, kv_cache_bytes
from service.core.fit import GpuOffer, Requirement, check_fit
from service.core.fit_changes import Change
from service.core.result import Component, Phase
from service.core.spec import Framework, LoraSpec, Method, Objective, TrainingSpec
from service.core.spec.grpo import GrpoSpec, fewer_generations, shorter_completions
from service.core.units import GIB

CATALOG = default_catalog()
QWEN_15B = CATALOG.resolve("Qwen/Qwen2.5-1.5B").arch
QWEN_05B = CATALOG.resolve("Qwen/Qwen2.5-0.5B").arch


def _grpo(**kwargs: object) -> TrainingSpec:
    values: dict[str, object] = {
        "method": Method.LORA,
        "batch_size": 8,
        "seq_len": 1024,
        "lora": LoraSpec(r=16, lora_alpha=32, target_modules="all-linear"),
        "objective": Objective.GRPO,
        **kwargs,
    }
    return TrainingSpec(**values)  # type: ignore[arg-type]


def test_grpoconfigs_defaults_are_the_settings_defaults() -> None:
    settings = _grpo().grpo_settings
    assert settings == GrpoSpec()
    assert (settings.num_generations, settings.max_completion_length) == (8, 512)
    assert (settings.beta, settings.num_iterations, settings.use_vllm) == (0.0, 1, False)
    assert settings.prompt_length(1024) == 512


@pytest.mark.parametrize(
    ("kwargs", "field", "words"),
    [
        ({"grpo": GrpoSpec(use_vllm=True)}, "grpo.use_vllm", "vLLM generation is not modelled"),
        ({"grpo": GrpoSpec(beta=0.04)}, "grpo.beta", "reference model"),
        ({"grpo": GrpoSpec(num_iterations=2)}, "grpo.num_iterations", "old_per_token_logps"),
        ({"batch_size": 4}, "grpo.num_generations", "must be divisible by num_generations"),
        ({"grpo": GrpoSpec(num_generations=1), "batch_size": 1}, "grpo.num_generations", "2"),
        ({"seq_len": 512}, "seq_len", "max_prompt_length \\+ max_completion_length"),
        ({"grpo": GrpoSpec(max_prompt_length=100)}, "seq_len", "100 \\+ 512"),
        ({"autocast": True}, "autocast", "mixed precision is not modelled"),
        ({"framework": Framework.TORCHTUNE}, "framework", "GRPOTrainer"),
    ],
)
def test_what_is_not_modelled_names_the_field_and_why(
    kwargs: dict[str, object], field: str, words: str
) -> None:
    with pytest.raises(InvalidSpecError, match=words) as caught:
        _grpo(**kwargs)
    assert caught.value.field == field


def test_grpo_settings_need_objective_grpo() -> None:
    with pytest.raises(InvalidSpecError) as caught:
        _grpo(objective=Objective.SFT, grpo=GrpoSpec())
    assert caught.value.field == "grpo"


def test_the_codec_round_trips_grpo_settings() -> None:
    spec = _grpo(grpo=GrpoSpec(num_generations=4, max_prompt_length=768, max_completion_length=256))
    data = spec_to_dict(spec)
    assert data["grpo"]["num_generations"] == 4
    assert spec_from_dict(data) == spec
    data["grpo"]["use_vllm"] = "yes"
    with pytest.raises(InvalidSpecError) as caught:
        spec_from_dict(data)
    assert caught.value.field == "grpo.use_vllm"


def test_the_generation_kv_cache_is_its_own_component_in_the_generation_phase() -> None:
    """Qwen2.5-1.5B LoRA, 8 generations of 512 tokens after 512-token prompts: the cache is
    28 layers x (key, value) x 8 rows x 256 (2 KV heads x 128) x tokens x 2 bytes."""
    spec = _grpo()
    est = estimate(QWEN_15B, spec, compute_capability="9.0")
    generation = {ph.step: ph for ph in est.phases if ph.phase is Phase.GENERATION}
    assert set(generation) == {1, 2}
    prompt_cache = 28 * 2 * 8 * 256 * 512 * 2
    assert kv_cache_bytes(QWEN_15B, spec, 512) == prompt_cache == 117_440_512
    assert kv_cache_bytes(QWEN_15B, spec, 1024) == 2 * prompt_cache
    # the prefill (every prompt token through a layer beside the prompt's cache) is larger
    # than the last decode step's whole cache
    assert generation[2].components[Component.GENERATION_KV_CACHE] == prompt_cache
    assert Component.GENERATION_KV_CACHE not in est.components  # the step's backward peaks
    assert est.peak_phase is Phase.BACKWARD_START
    assert generation[2].allocated_bytes < est.allocated_bytes
    assert 34 * GIB < est.allocated_bytes < 35 * GIB
    text = " ".join(est.assumptions)
    assert "GRPOTrainer" in text and "8 rows (8 per prompt) on 512-token prompts" in text
    assert "scores the 512 completion tokens of each: 4096 positions" in text


def test_a_large_generation_batch_peaks_in_the_generation_phase() -> None:
    """One completion per micro-batch over 64 accumulation steps: generate runs on all 64
    rows at once, and its whole cache at the last decode step (256 + 2048 tokens) is the
    job's peak."""
    spec = _grpo(
        batch_size=1,
        gradient_accumulation_steps=64,
        seq_len=256 + 2048,
        gradient_checkpointing=True,
        grpo=GrpoSpec(max_completion_length=2048),
    )
    est = estimate(QWEN_05B, spec, compute_capability="9.0")
    assert est.peak_phase is Phase.GENERATION and est.peak_step == 2
    cache = est.components[Component.GENERATION_KV_CACHE]
    assert cache == kv_cache_bytes(QWEN_05B, spec, 2304) == 24 * 2 * 64 * 128 * 2304 * 2


def test_the_buffered_batch_spans_the_generation_batch() -> None:
    """prompt ids and mask (int64), completion ids (int64) and mask (int32), advantages and
    num_items_in_batch, over batch_size x gradient_accumulation_steps rows."""
    one = _grpo(batch_size=4, gradient_accumulation_steps=2)
    assert buffered_inputs(one) == 2 * 8 * 512 * 8 + 8 * 512 * 8 + 8 * 512 * 4 + 512 + 512


def test_the_fit_changes_halve_generations_and_completions() -> None:
    spec = _grpo(batch_size=16, grpo=GrpoSpec(num_generations=16))
    fewer = fewer_generations(spec)
    assert fewer is not None
    assert (fewer.batch_size, fewer.grpo_settings.num_generations) == (8, 8)
    shorter = shorter_completions(spec)
    assert shorter is not None
    assert (shorter.seq_len, shorter.grpo_settings.max_completion_length) == (768, 256)
    assert shorter.grpo_settings.prompt_length(768) == 512
    assert fewer_generations(_grpo(batch_size=2, grpo=GrpoSpec(num_generations=2))) is None
    assert estimate(QWEN_15B, shorter).allocated_bytes < estimate(QWEN_15B, spec).allocated_bytes


def test_the_fit_check_suggests_fewer_generations_or_shorter_completions() -> None:
    spec = _grpo(batch_size=16, grpo=GrpoSpec(num_generations=16))

    def requirement(job: TrainingSpec) -> Requirement:
        est = estimate(QWEN_15B, job)
        return Requirement(device_bytes=est.device_bytes, device_bytes_upper=est.device_bytes_upper)

    report = check_fit(
        spec,
        [GpuOffer(memory_bytes=48 * GIB)],
        requirement,
        max_batch_size=1024,
        max_seq_len=QWEN_15B.max_position_embeddings,
    )
    (fit,) = report.gpus
    assert not fit.fits
    changes = {c for s in fit.suggestions for c in s.changes}
    assert changes & {Change.FEWER_GENERATIONS, Change.SHORTER_COMPLETIONS}, changes
    for suggestion in fit.suggestions:
        if suggestion.changes == (Change.SHORTER_COMPLETIONS,):
            assert suggestion.spec.grpo_settings.max_completion_length == 256
