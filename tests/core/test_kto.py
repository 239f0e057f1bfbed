"""Objective 'kto' (TRL's KTOTrainer): what the spec takes and refuses, and how the estimate
is built from DPO's fused-head step on the batch's unpaired rows (the figures against the
traces are in tests/core/test_references.py, `-k kto`)."""

from __future__ import annotations

import pytest

from service.catalog.models import default_catalog
from service.core.codec import spec_from_dict, spec_to_dict
from service.core.errors import InvalidSpecError
from service.core.estimator import KL_BATCH_TENSORS, estimate, kto_policy_spec, kto_shape
from service.core.result import Component, Phase
from service.core.spec import (
    DpoSpec,
    Framework,
    LossImpl,
    Method,
    Objective,
    ParallelSpec,
    Strategy,
    TrainingSpec,
    objective_from,
)
from service.core.spec.kto import KtoLossType, KtoSpec
from service.core.units import DType

CATALOG = default_catalog()
QWEN_05B = CATALOG.resolve("Qwen/Qwen2.5-0.5B").arch
QWEN_7B = CATALOG.resolve("Qwen/Qwen2.5-7B").arch
APO = KtoSpec(loss_type=KtoLossType.APO_ZERO_UNPAIRED)


def _kto(method: Method = Method.LORA, **kwargs: object) -> TrainingSpec:
    values: dict[str, object] = {"batch_size": 2, "seq_len": 512, **kwargs}
    return TrainingSpec(method=method, objective=Objective.KTO, **values)  # type: ignore[arg-type]


def test_kto_is_a_modelled_objective() -> None:
    assert objective_from("kto") is Objective.KTO


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"method": Method.IA3}, "method"),
        # DDP is modelled, the sharding strategies not
        ({"parallel": ParallelSpec(gpus=2, strategy=Strategy.FSDP)}, "parallel.gpus"),
        # fp16 mixed precision (GradScaler); bf16, TRL's default, is modelled
        ({"autocast": True, "dtype": DType.FP16}, "autocast"),
        ({"loss": LossImpl.FUSED}, "loss"),
        ({"framework": Framework.LITGPT}, "framework"),
        ({"num_labels": 2}, "num_labels"),
        ({"dpo": DpoSpec()}, "dpo"),
        # KTOTrainer.__init__: the KL batch needs two examples per micro-batch
        ({"batch_size": 1}, "batch_size"),
    ],
)
def test_kto_refuses_what_is_not_modelled(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidSpecError) as caught:
        _kto(**kwargs)
    assert caught.value.field == field


def test_one_example_per_batch_runs_without_the_kl_batch() -> None:
    spec = _kto(batch_size=1, kto=APO)
    assert not spec.kto_settings.calculate_kl
    assert estimate(QWEN_05B, spec).allocated_bytes > 0


def test_kto_settings_need_the_kto_objective() -> None:
    with pytest.raises(InvalidSpecError) as caught:
        TrainingSpec(batch_size=2, seq_len=128, kto=KtoSpec())
    assert caught.value.field == "kto"


def test_the_codec_round_trips_kto_settings_and_names_a_bad_loss_type() -> None:
    spec = _kto(kto=KtoSpec(precompute_ref_log_probs=True, loss_type=KtoLossType.KTO))
    data = spec_to_dict(spec)
    assert data["objective"] == "kto"
    assert data["kto"] == {"precompute_ref_log_probs": True, "loss_type": "kto"}
    assert spec_from_dict(data) == spec
    assert "kto" not in spec_to_dict(TrainingSpec(batch_size=1, seq_len=128))
    with pytest.raises(InvalidSpecError) as caught:
        spec_from_dict({**data, "kto": {"loss_type": "sigmoid"}})
    assert caught.value.field == "kto.loss_type"


def test_the_policy_runs_the_batch_rows_not_doubled() -> None:
    spec = _kto(gradient_checkpointing=True)
    policy = kto_policy_spec(spec)
    assert policy.batch_size == spec.batch_size and policy.objective is Objective.SFT
    assert policy.kto is None and policy.loss is LossImpl.FUSED
    shape = kto_shape(spec)
    assert (shape.rows, shape.scored) == (2, 2 * 511)
    # two examples of KTO hold what one pair of DPO does: the same rows through the same head
    dpo = TrainingSpec(
        method=Method.LORA,
        batch_size=1,
        seq_len=512,
        gradient_checkpointing=True,
        objective=Objective.DPO,
    )
    kto_act = estimate(QWEN_7B, spec).phases[0].components[Component.ACTIVATIONS]
    dpo_act = estimate(QWEN_7B, dpo).phases[0].components[Component.ACTIVATIONS]
    assert kto_act == dpo_act
    assert any(
        "2 unpaired examples of 512 tokens" in a for a in estimate(QWEN_7B, spec).assumptions
    )


def test_the_kl_batch_adds_only_its_input_tensors() -> None:
    """The KL forwards run under no_grad: the policy's before its forward (nothing of it
    alive), the reference's beside the completions' (the same tensors), so the KL batch adds
    only its three int64 (batch, seq) tensors to the peak (traced: 24,576 bytes at b2 s512 on
    Qwen2.5-0.5B, LoRA and full)."""
    kl_batch = KL_BATCH_TENSORS * 2 * 512 * 8
    for method in (Method.LORA, Method.FULL, Method.QLORA):
        with_kl = estimate(QWEN_05B, _kto(method))
        without = estimate(QWEN_05B, _kto(method, kto=APO))
        assert with_kl.allocated_bytes - without.allocated_bytes == kl_batch
        assert any("the KL batch" in a for a in with_kl.assumptions)
        assert any("no KL batch" in a for a in without.assumptions)


def test_full_fine_tuning_holds_a_reference_copy_unless_precomputed() -> None:
    full = estimate(QWEN_05B, _kto(Method.FULL))
    assert full.components[Component.REFERENCE_MODEL] == full.components[Component.TRAINABLE_PARAMS]
    assert Phase.REFERENCE_FORWARD in {p.phase for p in full.phases}
    pre = estimate(QWEN_05B, _kto(Method.FULL, kto=KtoSpec(precompute_ref_log_probs=True)))
    assert Component.REFERENCE_MODEL not in pre.components
    assert Phase.REFERENCE_FORWARD not in {p.phase for p in pre.phases}
    assert pre.allocated_bytes < full.allocated_bytes
    lora = estimate(QWEN_05B, _kto())
    assert Component.REFERENCE_MODEL not in lora.components
    assert any("adapters disabled" in a for a in lora.assumptions)


def test_lora_dropout_is_turned_off() -> None:
    from service.core.spec import LoraSpec

    spec = _kto(lora=LoraSpec(lora_dropout=0.1))
    assert kto_policy_spec(spec).lora is not None
    assert kto_policy_spec(spec).lora.lora_dropout == 0.0  # type: ignore[union-attr]
    assert estimate(QWEN_05B, spec).allocated_bytes == estimate(QWEN_05B, _kto()).allocated_bytes
    assert any("disable_dropout" in a for a in estimate(QWEN_05B, spec).assumptions)


@pytest.mark.parametrize(
    "model",
    ["google-bert/bert-base-uncased", "google/t5-v1_1-small", "Qwen/Qwen1.5-MoE-A2.7B"],
)
def test_kto_on_an_encoder_or_a_mixture_of_experts_is_refused(model: str) -> None:
    arch = CATALOG.resolve(model).arch
    with pytest.raises(InvalidSpecError) as caught:
        estimate(arch, _kto(Method.FULL))
    assert caught.value.field == "objective"
    assert "'kto'" in str(caught.value)
