"""Objective 'orpo' (TRL's ORPOTrainer): what the spec takes and refuses, and how the estimate
is built from the SFT step on the doubled batch with the whole logits (the figures against the
traces are in tests/core/test_references.py, `-k orpo`)."""

from __future__ import annotations

import pytest

from service.catalog.models import default_catalog
from service.core.codec import spec_from_dict, spec_to_dict
from service.core.errors import InvalidSpecError
from service.core.estimator import ADDED_GRADIENTS, estimate, orpo_policy_spec, orpo_shape
from service.core.result import Component, Phase
from service.core.spec import (
    Framework,
    LoraSpec,
    LossImpl,
    Method,
    Objective,
    ParallelSpec,
    QuantSpec,
    Strategy,
    TrainingSpec,
    objective_from,
)
from service.core.spec.orpo import OrpoSpec
from service.core.units import DType

CATALOG = default_catalog()
QWEN_05B = CATALOG.resolve("Qwen/Qwen2.5-0.5B").arch


def _orpo(method: Method = Method.LORA, **kwargs: object) -> TrainingSpec:
    values: dict[str, object] = {"batch_size": 2, "seq_len": 512, **kwargs}
    return TrainingSpec(method=method, objective=Objective.ORPO, **values)  # type: ignore[arg-type]


def test_orpo_is_a_modelled_objective() -> None:
    assert objective_from("orpo") is Objective.ORPO
    assert _orpo().orpo_settings == OrpoSpec(disable_dropout=True)  # ORPOConfig's default


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"method": Method.IA3}, "method"),
        ({"framework": Framework.LITGPT}, "framework"),
        # DDP is modelled, the sharding strategies not
        ({"parallel": ParallelSpec(gpus=2, strategy=Strategy.ZERO3)}, "parallel.gpus"),
        ({"autocast": True, "dtype": DType.FP16}, "autocast"),
        ({"loss": LossImpl.FUSED}, "loss"),
        ({"method": Method.QLORA, "autocast": True, "quantization": QuantSpec()}, "autocast"),
    ],
)
def test_what_orpo_does_not_model_names_the_field(kwargs: dict[str, object], field: str) -> None:
    values: dict[str, object] = {"method": Method.LORA, **kwargs}
    with pytest.raises(InvalidSpecError) as caught:
        _orpo(**values)
    assert caught.value.field == field


def test_orpo_settings_need_the_objective() -> None:
    with pytest.raises(InvalidSpecError) as caught:
        TrainingSpec(batch_size=1, seq_len=16, orpo=OrpoSpec())
    assert caught.value.field == "orpo"


def test_the_codec_round_trips_orpo_settings() -> None:
    spec = _orpo(orpo=OrpoSpec(disable_dropout=False))
    data = spec_to_dict(spec)
    assert data["objective"] == "orpo" and data["orpo"] == {"disable_dropout": False}
    assert spec_from_dict(data) == spec
    assert "orpo" not in spec_to_dict(_orpo())


def test_the_policy_runs_the_doubled_batch_without_dropout_unless_kept() -> None:
    dropout = LoraSpec(lora_dropout=0.1)
    policy = orpo_policy_spec(_orpo(lora=dropout))
    assert policy.batch_size == 4 and policy.objective is Objective.SFT
    assert policy.lora is not None and policy.lora.lora_dropout == 0.0
    kept = orpo_policy_spec(_orpo(lora=dropout, orpo=OrpoSpec(disable_dropout=False)))
    assert kept.lora is not None and kept.lora.lora_dropout == 0.1
    assert estimate(
        QWEN_05B, _orpo(lora=dropout, orpo=OrpoSpec(disable_dropout=False))
    ).allocated_bytes > (estimate(QWEN_05B, _orpo(lora=dropout)).allocated_bytes)


def test_the_peak_holds_three_logits_sized_gradients_at_the_start_of_backward() -> None:
    spec = _orpo()
    est = estimate(QWEN_05B, spec)
    d = orpo_shape(QWEN_05B, spec)
    assert d.logits == 2 * 2 * 512 * QWEN_05B.vocab_size * 2  # bf16 logits of 4 rows
    assert est.peak_phase is Phase.BACKWARD_START
    assert est.components[Component.LOGITS_LOSS] == ADDED_GRADIENTS * d.logits
    assert not est.components.get(Component.REFERENCE_MODEL)  # ORPO has no reference
    assert any("ORPOTrainer" in note for note in est.assumptions)


def test_mixed_precision_keeps_fp32_logits() -> None:
    """accelerate converts the forward's outputs to fp32 (convert_outputs_to_fp32)."""
    d = orpo_shape(QWEN_05B, _orpo(autocast=True))
    assert d.element == 4
    plain, mixed = estimate(QWEN_05B, _orpo()), estimate(QWEN_05B, _orpo(autocast=True))
    assert mixed.allocated_bytes > plain.allocated_bytes


def test_orpo_on_an_encoder_is_refused() -> None:
    bert = CATALOG.resolve("google-bert/bert-base-uncased").arch
    with pytest.raises(InvalidSpecError) as caught:
        estimate(bert, _orpo(Method.FULL))
    assert caught.value.field == "objective"
