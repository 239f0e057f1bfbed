"""Objective 'dpo' (TRL's DPOTrainer): what the spec takes and refuses, and how the estimate
is built from the SFT step on the doubled batch (the figures against the traces are in
tests/core/test_references.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from service.catalog.models import default_catalog
from service.core.codec import spec_from_dict, spec_to_dict
from service.core.errors import InvalidSpecError
from service.core.estimator import TILE_TOKENS, TILE_VOCAB, dpo_shape, estimate, policy_spec
from service.core.result import Component, Phase
from service.core.spec import (
    DpoSpec,
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
QWEN_7B = CATALOG.resolve("Qwen/Qwen2.5-7B").arch


def _dpo(method: Method = Method.LORA, **kwargs: object) -> TrainingSpec:
    return TrainingSpec(
        method=method,
        batch_size=2,
        seq_len=512,
        objective=Objective.DPO,
        **kwargs,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    ("name", "words"),
    [("cpo", "not modelled"), ("rloo", "not modelled"), ("x", "unknown")],
)
def test_an_objective_not_modelled_names_the_field_and_why(name: str, words: str) -> None:
    with pytest.raises(InvalidSpecError, match=words) as caught:
        objective_from(name)
    assert caught.value.field == "objective"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"method": Method.IA3}, "method"),
        ({"parallel": ParallelSpec(gpus=2, strategy=Strategy.ZERO2)}, "parallel.gpus"),
        ({"autocast": True, "dtype": DType.FP16}, "autocast"),
        ({"loss": LossImpl.FUSED}, "loss"),
    ],
)
def test_dpo_refuses_what_is_not_modelled(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidSpecError) as caught:
        _dpo(**kwargs)  # type: ignore[arg-type]
    assert caught.value.field == field


def test_dpo_settings_need_the_dpo_objective() -> None:
    with pytest.raises(InvalidSpecError) as caught:
        TrainingSpec(batch_size=1, seq_len=128, dpo=DpoSpec())
    assert caught.value.field == "dpo"
    with pytest.raises(InvalidSpecError) as caught:
        DpoSpec(max_completion_length=0)
    assert caught.value.field == "dpo.max_completion_length"


def test_the_codec_writes_the_objective_only_when_it_is_not_sft() -> None:
    sft = TrainingSpec(batch_size=1, seq_len=128)
    assert "objective" not in spec_to_dict(sft) and "dpo" not in spec_to_dict(sft)
    dpo = _dpo(dpo=DpoSpec(precompute_ref_log_probs=True, max_completion_length=64))
    data = spec_to_dict(dpo)
    assert data["objective"] == "dpo"
    assert data["dpo"] == {"precompute_ref_log_probs": True, "max_completion_length": 64}
    assert spec_from_dict(data) == dpo


def test_the_policy_runs_the_doubled_batch_without_logits() -> None:
    spec = _dpo(gradient_checkpointing=True)
    policy = policy_spec(spec)
    assert policy.batch_size == 2 * spec.batch_size and policy.objective is Objective.SFT
    sft = estimate(QWEN_7B, policy)
    est = estimate(QWEN_7B, spec)
    # at the start of backward (the forward's phase peaks inside the fused head, the final
    # norm's output beside the saved tensors)
    forward = {(p.step, p.phase): p for p in est.phases}[(2, Phase.BACKWARD_START)]
    sft_forward = {(p.step, p.phase): p for p in sft.phases}[(2, Phase.BACKWARD_START)]
    # the layers' saved tensors are the SFT step's on 2 x batch_size rows
    assert (
        forward.components[Component.ACTIVATIONS] == sft_forward.components[Component.ACTIVATIONS]
    )
    assert any("4 sequences of 512 tokens" in a for a in est.assumptions)


def test_the_fused_head_scores_only_the_completion() -> None:
    whole = dpo_shape(QWEN_7B, _dpo())
    assert whole.scored == 4 * 511  # every position but the first of 2 x 2 sequences
    part = dpo_shape(QWEN_7B, _dpo(dpo=DpoSpec(max_completion_length=100)))
    assert part.scored == 4 * 100
    lora = estimate(QWEN_7B, _dpo())
    shorter = estimate(QWEN_7B, _dpo(dpo=DpoSpec(max_completion_length=100)))
    assert shorter.allocated_bytes < lora.allocated_bytes
    assert TILE_TOKENS == 4096 and TILE_VOCAB == 32768  # trl 1.16.0's tile


def test_full_fine_tuning_holds_a_reference_copy_unless_precomputed() -> None:
    full = estimate(QWEN_05B, _dpo(Method.FULL))
    weights = full.components[Component.TRAINABLE_PARAMS]
    assert full.components[Component.REFERENCE_MODEL] == weights
    phases = {p.phase for p in full.phases}
    assert Phase.REFERENCE_FORWARD in phases
    pre = estimate(QWEN_05B, _dpo(Method.FULL, dpo=DpoSpec(precompute_ref_log_probs=True)))
    assert Component.REFERENCE_MODEL not in pre.components
    assert Phase.REFERENCE_FORWARD not in {p.phase for p in pre.phases}
    assert pre.allocated_bytes < full.allocated_bytes
    lora = estimate(QWEN_05B, _dpo())
    assert Component.REFERENCE_MODEL not in lora.components
    assert any("adapters disabled" in a for a in lora.assumptions)


@pytest.mark.parametrize("model", ["google-bert/bert-base-uncased", "google/t5-v1_1-small"])
def test_dpo_on_an_encoder_is_refused(model: str) -> None:
    arch = CATALOG.resolve(model).arch
    with pytest.raises(InvalidSpecError) as caught:
        estimate(arch, _dpo(Method.FULL))
    assert caught.value.field == "objective"


def test_sft_answers_do_not_change_with_the_new_field() -> None:
    spec = TrainingSpec(method=Method.LORA, batch_size=2, seq_len=512)
    assert estimate(QWEN_7B, spec) == estimate(QWEN_7B, replace(spec, objective=Objective.SFT))
