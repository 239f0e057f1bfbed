"""Objective 'reward' (TRL's RewardTrainer): what the spec takes and refuses, and how the
estimate is built from the SFT step on the doubled batch with the score head (the figures
against the traces are in tests/core/test_references.py)."""

from __future__ import annotations

import pytest

from service.catalog.models import default_catalog
from service.core.codec import spec_from_dict, spec_to_dict
from service.core.errors import InvalidSpecError
from service.core.estimator import estimate, reward_arch, reward_spec
from service.core.result import Component, Phase
from service.core.spec import (
    DpoSpec,
    Framework,
    LoraSpec,
    LossImpl,
    Method,
    Objective,
    ParallelSpec,
    Strategy,
    TrainingSpec,
    objective_from,
)
from service.core.units import DType

CATALOG = default_catalog()
QWEN_05B = CATALOG.resolve("Qwen/Qwen2.5-0.5B").arch
LLAMA_8B = CATALOG.resolve("meta-llama/Llama-3.1-8B").arch


def _reward(method: Method = Method.LORA, **kwargs: object) -> TrainingSpec:
    return TrainingSpec(
        method=method,
        batch_size=2,
        seq_len=512,
        objective=Objective.REWARD,
        **kwargs,  # type: ignore[arg-type]
    )


def test_reward_is_an_objective() -> None:
    assert objective_from("reward") is Objective.REWARD


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"method": Method.IA3}, "method"),
        ({"framework": Framework.LITGPT}, "framework"),
        ({"parallel": ParallelSpec(gpus=2, strategy=Strategy.ZERO2)}, "parallel.gpus"),
        ({"autocast": True, "dtype": DType.FP16}, "autocast"),
        ({"loss": LossImpl.FUSED}, "loss"),
        ({"num_labels": 2}, "num_labels"),
        ({"target_length": 32}, "target_length"),
        ({"dpo": DpoSpec()}, "dpo"),
    ],
)
def test_reward_refuses_what_is_not_modelled(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidSpecError) as caught:
        _reward(**kwargs)  # type: ignore[arg-type]
    assert caught.value.field == field
    assert "reward" in caught.value.reason or field == "dpo"


@pytest.mark.parametrize(
    "model", ["google-bert/bert-base-uncased", "google/t5-v1_1-small", "Qwen/Qwen1.5-MoE-A2.7B"]
)
def test_reward_on_an_encoder_or_a_mixture_of_experts_is_refused(model: str) -> None:
    arch = CATALOG.resolve(model).arch
    with pytest.raises(InvalidSpecError) as caught:
        estimate(arch, _reward(Method.FULL))
    assert caught.value.field == "objective"


def test_the_codec_round_trips_a_reward_spec() -> None:
    spec = _reward()
    data = spec_to_dict(spec)
    assert data["objective"] == "reward" and "dpo" not in data
    assert spec_from_dict(data) == spec


def test_the_reward_model_runs_the_doubled_batch_without_logits() -> None:
    spec = _reward(gradient_checkpointing=True)
    run = reward_spec(spec)
    assert run.batch_size == 4 and run.objective is Objective.SFT and run.loss is LossImpl.FUSED
    est = estimate(LLAMA_8B, spec)
    assert not est.components.get(Component.LOGITS_LOSS)
    assert any("4 sequences of 512 tokens" in a for a in est.assumptions)
    assert any("score head" in a for a in est.assumptions)
    # far below the SFT step on the same rows, whose 128k-wide logits dominate
    sft = estimate(LLAMA_8B, TrainingSpec(method=Method.LORA, batch_size=4, seq_len=512))
    assert est.allocated_bytes < sft.allocated_bytes


def test_the_score_head_replaces_the_lm_head() -> None:
    # Llama-3.1-8B's LM head is its own matrix: the reward model holds none of it
    assert not LLAMA_8B.tie_word_embeddings
    model = reward_arch(LLAMA_8B)
    assert model.lm_head_params == LLAMA_8B.hidden_size
    assert model.total_params == LLAMA_8B.total_params - LLAMA_8B.lm_head_params + 4096
    full = estimate(LLAMA_8B, _reward(Method.FULL))
    sft = estimate(LLAMA_8B, TrainingSpec(method=Method.FULL, batch_size=2, seq_len=512))
    head = LLAMA_8B.vocab_size * LLAMA_8B.hidden_size * 2  # bf16
    assert full.params.total == sft.params.total - LLAMA_8B.lm_head_params + 4096
    assert (
        sft.components[Component.TRAINABLE_PARAMS] - full.components[Component.TRAINABLE_PARAMS]
        == head - 8192  # the score's (4096 bf16 values) in its place
    )


def test_lora_trains_the_score_head_whole() -> None:
    lora = estimate(QWEN_05B, _reward())
    plain = estimate(QWEN_05B, TrainingSpec(method=Method.LORA, batch_size=4, seq_len=512))
    # PEFT's SEQ_CLS copy of the score (896 bf16 values, one 2048-byte block) is trainable
    assert lora.params.trainable == plain.params.trainable + QWEN_05B.hidden_size
    assert any("score head trains whole" in a for a in lora.assumptions)


def test_lora_dropout_is_off() -> None:
    dropped = _reward(lora=LoraSpec(r=16, lora_alpha=32, lora_dropout=0.1))
    assert dropped.lora is not None and dropped.lora.lora_dropout == 0.1
    run_lora = reward_spec(dropped).lora
    assert run_lora is not None and run_lora.lora_dropout == 0.0
    assert (
        estimate(QWEN_05B, dropped).allocated_bytes
        == estimate(QWEN_05B, _reward(lora=LoraSpec(r=16, lora_alpha=32))).allocated_bytes
    )


def test_the_phases_are_the_sft_steps() -> None:
    est = estimate(QWEN_05B, _reward(Method.FULL))
    assert Phase.REFERENCE_FORWARD not in {p.phase for p in est.phases}
    assert Component.REFERENCE_MODEL not in est.components
