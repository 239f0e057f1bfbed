"""The two-step runner: fake equals real on a tiny model, options it refuses, the CLI."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from service.core.result import Component, Phase
from service.core.spec import (
    Framework,
    FsdpSharding,
    LoraSpec,
    LossImpl,
    Method,
    Optim,
    ParallelSpec,
    QuantSpec,
    Strategy,
    TrainingSpec,
    resolve,
)
from service.core.stack import preset
from service.trace.runner import trace
from service.trace.traceable import NotTraceableError, check_traceable
from service.trace.validate import TINY_CONFIGS

pytestmark = pytest.mark.trace

TINY = TINY_CONFIGS["tiny-qwen2"]
LORA = LoraSpec(r=8, lora_alpha=16, target_modules="all-linear")


@pytest.mark.parametrize(
    "spec",
    [
        TrainingSpec(
            method=Method.LORA, batch_size=2, seq_len=32, lora=LORA, gradient_checkpointing=True
        ),
        TrainingSpec(
            method=Method.QLORA,
            batch_size=2,
            seq_len=32,
            lora=LORA,
            quantization=QuantSpec(double_quant=True),
        ),
        TrainingSpec(
            method=Method.LORA,
            batch_size=2,
            seq_len=32,
            lora=LORA,
            gradient_checkpointing=True,
            autocast=True,
        ),
        TrainingSpec(
            method=Method.QLORA,
            batch_size=2,
            seq_len=32,
            lora=LORA,
            quantization=QuantSpec(double_quant=True),
            gradient_checkpointing=True,
            autocast=True,
        ),
    ],
    ids=["lora-ckpt", "qlora", "lora-ckpt-autocast", "qlora-ckpt-autocast"],
)
def test_the_fake_trace_equals_a_real_cpu_run(spec: TrainingSpec) -> None:
    _fake_equals_real(spec)


@pytest.mark.parametrize(
    "spec",
    [
        TrainingSpec(
            method=Method.FULL,
            batch_size=2,
            seq_len=32,
            framework=Framework.TORCHTUNE,
            loss=LossImpl.HF,
            optimizer_in_backward=True,
            max_grad_norm=0.0,
        ),
        TrainingSpec(
            method=Method.LORA,
            batch_size=2,
            seq_len=32,
            lora=LORA,
            framework=Framework.TORCHTUNE,
            loss=LossImpl.HF,
            gradient_checkpointing=True,
            activation_offloading=True,
        ),
    ],
    ids=["full-optimizer-in-backward", "lora-ckpt-offloading"],
)
def test_torchtune_options_trace_the_same_fake_and_real(spec: TrainingSpec) -> None:
    """torchtune's hooks (service/trace/train_features.py) count the same on fake tensors as
    on real ones: the device level and the pinned host copies."""
    fake, real = _fake_equals_real(spec)
    assert fake.host_pinned_bytes == real.host_pinned_bytes
    assert (fake.host_pinned_bytes > 0) is spec.activation_offloading


def _fake_equals_real(spec: TrainingSpec) -> tuple[Any, Any]:
    fake = trace(spec, TINY, "tiny", cpu_kernels=True, record_events=True)
    real = trace(spec, TINY, "tiny", real=True, cpu_kernels=True, record_events=True)
    assert fake.peak == real.peak
    assert fake.phases == real.phases
    assert fake.events == real.events
    assert len(fake.events) > 1000
    assert sum(fake.peak.components.values()) == fake.peak.allocated_bytes
    for entry in fake.phases:
        assert sum(entry.snapshot.components.values()) == entry.snapshot.allocated_bytes
    return fake, real


def test_a_trace_labels_every_role_and_sees_both_steps() -> None:
    spec = TrainingSpec(
        method=Method.LORA, batch_size=2, seq_len=32, lora=LORA, gradient_checkpointing=True
    )
    result = trace(spec, TINY, "tiny")
    phases = {(p.step, p.phase): p.snapshot for p in result.phases}
    # every phase but DPO's reference forward and GRPO's generation
    assert set(phases) == {
        (s, p)
        for s in (1, 2)
        for p in Phase
        if p not in (Phase.REFERENCE_FORWARD, Phase.GENERATION)
    }
    # No optimizer state before the first step; all of it in the steady state.
    assert phases[(1, Phase.FORWARD_END)].components[Component.OPTIMIZER_STATE] == 0
    state = phases[(2, Phase.FORWARD_END)].components[Component.OPTIMIZER_STATE]
    trainable = phases[(2, Phase.FORWARD_END)].components[Component.TRAINABLE_PARAMS]
    # Fused AdamW: exp_avg and exp_avg_sq like the fp32 adapters, and a 0-dim step counter on
    # the device for each of the 28 adapter tensors (2 layers x 7 modules x A, B).
    assert state == 2 * trainable + 28 * 512
    assert phases[(1, Phase.BACKWARD)].components[Component.RECOMPUTE] > 0
    assert phases[(1, Phase.OPTIMIZER_STEP)].components[Component.GRADIENTS] == trainable
    assert result.peak_step == 2
    assert result.params_trainable > 0


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"parallel": ParallelSpec(gpus=2, strategy=Strategy.ZERO2)}, "zero2 is not traced"),
        (
            {
                "parallel": ParallelSpec(
                    gpus=2, strategy=Strategy.FSDP, sharding_strategy=FsdpSharding.HYBRID_SHARD
                )
            },
            "HYBRID_SHARD is not traced",
        ),
        ({"loss": LossImpl.FUSED}, "loss"),
        ({"optim": Optim.PAGED_ADAMW_8BIT}, "managed memory"),
        # (a transformers 4 stack with a newer torch is traced, its MoE through the stand-in
        # block of service/trace/linear_experts.py; torch 1.x behaviours are not emulated)
        ({"stack": preset("hf-4.16")}, "runs the installed stack"),
    ],
)
def test_options_the_tracer_cannot_reproduce_are_refused(
    changes: dict[str, object], words: str
) -> None:
    spec = TrainingSpec(method=Method.LORA, batch_size=1, seq_len=16, **changes)  # type: ignore[arg-type]
    with pytest.raises(NotTraceableError, match=words):
        check_traceable(resolve(spec))


def test_the_trace_command_prints_reference_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from service.cli.main import main

    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    out = tmp_path / "out"
    argv = ["trace", "--config", str(config), "-b", "1", "-s", "16", "--json", "--out", str(out)]
    assert main(argv) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["peak"]["allocated_bytes"] % 512 == 0
    assert sum(document["peak"]["components"].values()) == document["peak"]["allocated_bytes"]
    assert [p.name for p in out.iterdir()] == [f"{document['name']}.json"]


def test_the_trace_command_refuses_what_it_cannot_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from service.cli.main import main

    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    argv = ["trace", "--config", str(config), "-b", "1", "-s", "16"]
    assert main([*argv, "--optim", "paged_adamw_8bit"]) == 2
    assert "managed memory" in capsys.readouterr().err


def test_a_dpo_trace_runs_the_reference_forward_on_a_frozen_copy() -> None:
    """TRL's DPO step on the tiny model: the reference forward is its own phase, and full
    fine-tuning holds the reference copy (the policy's weights and buffers again)."""
    from service.core.spec import DpoSpec, Objective

    full = TrainingSpec(method=Method.FULL, batch_size=1, seq_len=32, objective=Objective.DPO)
    result = trace(full, TINY, "tiny")
    phases = {(p.step, p.phase): p.snapshot for p in result.phases}
    assert (2, Phase.REFERENCE_FORWARD) in phases
    weights = phases[(2, Phase.FORWARD_END)].components
    policy = weights[Component.TRAINABLE_PARAMS] + weights[Component.FROZEN_WEIGHTS]
    assert weights[Component.REFERENCE_MODEL] == policy > 0
    pre = replace(full, dpo=DpoSpec(precompute_ref_log_probs=True))
    result = trace(pre, TINY, "tiny")
    assert Phase.REFERENCE_FORWARD not in {p.phase for p in result.phases}
    assert not result.peak.components.get(Component.REFERENCE_MODEL)


def test_a_kto_trace_runs_the_kl_batch_and_the_reference_forward() -> None:
    """TRL's KTO step on the tiny model: the reference forward is its own phase, full
    fine-tuning holds the reference copy, and the KL batch's three (rows, seq) int64 tensors
    are in the collator's batch only with a loss type that estimates the KL term."""
    from service.core.spec import Objective
    from service.core.spec.kto import KtoLossType, KtoSpec

    full = TrainingSpec(method=Method.FULL, batch_size=2, seq_len=32, objective=Objective.KTO)
    result = trace(full, TINY, "tiny")
    phases = {(p.step, p.phase): p.snapshot for p in result.phases}
    assert (2, Phase.REFERENCE_FORWARD) in phases
    weights = phases[(2, Phase.FORWARD_END)].components
    policy = weights[Component.TRAINABLE_PARAMS] + weights[Component.FROZEN_WEIGHTS]
    assert weights[Component.REFERENCE_MODEL] == policy > 0
    assert any("KTOTrainer" in note for note in result.assumptions)
    apo = replace(full, kto=KtoSpec(loss_type=KtoLossType.APO_ZERO_UNPAIRED))
    without = {(p.step, p.phase): p.snapshot for p in trace(apo, TINY, "tiny").phases}
    inputs = Component.INPUTS
    kl_batch = 3 * 2 * 32 * 8  # KL_input_ids, KL_attention_mask, KL_completion_mask
    key = (2, Phase.FORWARD_END)
    assert phases[key].components[inputs] - without[key].components[inputs] == kl_batch
    pre = replace(full, kto=KtoSpec(precompute_ref_log_probs=True))
    result = trace(pre, TINY, "tiny")
    assert Phase.REFERENCE_FORWARD not in {p.phase for p in result.phases}
    assert not result.peak.components.get(Component.REFERENCE_MODEL)


def test_a_grpo_trace_runs_generate_with_its_kv_cache_then_the_step() -> None:
    """TRL's GRPO step on the tiny model: model.generate is its own phase, its DynamicCache
    labelled generation_kv_cache (a key and a value per layer over the prompt and every
    sampled token), freed before the step's forward."""
    from service.core.spec import Objective
    from service.core.spec.grpo import GrpoSpec

    settings = GrpoSpec(num_generations=2, max_prompt_length=8, max_completion_length=4)
    spec = TrainingSpec(
        method=Method.LORA,
        batch_size=2,
        seq_len=12,
        lora=LORA,
        objective=Objective.GRPO,
        grpo=settings,
    )
    result = trace(spec, TINY, "tiny")
    phases = {(p.step, p.phase): p.snapshot for p in result.phases}
    assert [p.phase for p in result.phases if p.step == 2][:2] == [
        Phase.GENERATION,
        Phase.FORWARD_END,
    ]
    cache = phases[(2, Phase.GENERATION)].components[Component.GENERATION_KV_CACHE]
    layers, kv = TINY["num_hidden_layers"], TINY["num_key_value_heads"]
    head = TINY["hidden_size"] // TINY["num_attention_heads"]
    # the peak at the prefill's MLP: per layer a key and a value of 2 rows x 2 KV heads x 8
    # prompt tokens x 16 x 2 bytes (1024 bytes, two 512-byte blocks)
    assert cache == layers * 2 * (2 * kv * 8 * head * 2) == 4096
    assert not phases[(2, Phase.FORWARD_END)].components.get(Component.GENERATION_KV_CACHE)
    assert any("GRPOTrainer" in note for note in result.assumptions)


def test_an_orpo_trace_keeps_the_logits_and_adds_their_gradients() -> None:
    """TRL's ORPO step on the tiny model: no reference model or reference forward, the peak at
    the start of backward where the kernel's and the NLL's logits gradients are added, and the
    collator's batch (chosen and rejected ids, masks and labels, the prompt's ids and mask)."""
    from service.core.spec import Objective
    from service.trace import orpo

    spec = TrainingSpec(method=Method.FULL, batch_size=2, seq_len=32, objective=Objective.ORPO)
    result = trace(spec, TINY, "tiny")
    assert Phase.REFERENCE_FORWARD not in {p.phase for p in result.phases}
    assert not result.peak.components.get(Component.REFERENCE_MODEL)
    assert any("ORPOTrainer" in note for note in result.assumptions)
    phases = {(p.step, p.phase): p.snapshot for p in result.phases}
    start = phases[(2, Phase.BACKWARD_START)]
    assert start.op == "aten.add.Tensor"
    logits = 2 * 2 * 32 * TINY["vocab_size"] * 2  # bf16 [chosen; rejected] logits
    assert start.components[Component.LOGITS_LOSS] >= 3 * logits
    prompt = 32 // orpo.PROMPT_DIVISOR
    batch = 6 * 2 * 32 * 8 + 2 * 2 * prompt * 8
    assert phases[(2, Phase.FORWARD_END)].components[Component.INPUTS] >= batch


def test_a_reward_trace_runs_one_forward_through_the_score_head() -> None:
    """TRL's reward step on the tiny model: a one-label sequence classifier (no LM head), the
    [chosen; rejected] rows in one forward, PEFT's SEQ_CLS copy of the score trained beside
    LoRA's adapters, no reference phase."""
    from service.core.spec import Objective

    spec = TrainingSpec(
        method=Method.LORA, batch_size=2, seq_len=32, lora=LORA, objective=Objective.REWARD
    )
    result = trace(spec, TINY, "tiny")
    assert Phase.REFERENCE_FORWARD not in {p.phase for p in result.phases}
    sft = trace(replace(spec, objective=Objective.SFT), TINY, "tiny")
    # the score's trainable copy (hidden x 1) is the only trainable tensor SFT's LoRA lacks
    assert result.params_trainable == sft.params_trainable + TINY["hidden_size"]
    key = (2, Phase.FORWARD_END)
    forward = {(p.step, p.phase): p.snapshot for p in result.phases}[key]
    sft_forward = {(p.step, p.phase): p.snapshot for p in sft.phases}[key]
    # on twice the rows, still less than SFT's vocabulary-wide logits and loss
    logits = Component.LOGITS_LOSS
    assert forward.components[logits] < sft_forward.components[logits]
    assert any("RewardTrainer" in note for note in result.assumptions)
