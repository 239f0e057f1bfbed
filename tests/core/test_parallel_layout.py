"""Per-rank layouts the multi-GPU traces cannot check: gradient accumulation under FSDP, FSDP's
own mixed precision, offloading's host memory, and the PEFT model FSDP2 gathers whole."""

from __future__ import annotations

from dataclasses import replace

from service.catalog.models import default_catalog
from service.core.estimator import estimate
from service.core.result import Component, Phase
from service.core.spec import (
    LoraSpec,
    Method,
    Offload,
    ParallelSpec,
    Strategy,
    TrainingSpec,
)
from service.core.units import DType

QWEN_05B = default_catalog().resolve("Qwen/Qwen2.5-0.5B").arch
FULL = TrainingSpec(
    method=Method.FULL,
    batch_size=1,
    seq_len=512,
    gradient_checkpointing=True,
    parallel=ParallelSpec(gpus=4, strategy=Strategy.FSDP2),
)
PARAM_BYTES = QWEN_05B.total_params * 2  # bf16


def _phase(spec: TrainingSpec, step: int, phase: Phase) -> dict[Component, int]:
    est = estimate(QWEN_05B, spec)
    (found,) = [p for p in est.phases if (p.step, p.phase) == (step, phase)]
    return found.components


def test_accumulated_gradients_are_held_unsharded_under_fsdp() -> None:
    """accelerate's no_sync keeps them whole between micro-batches; DDP holds them whole
    anyway, so its forward holds the same gradients with or without sharding."""
    accumulating = replace(FULL, gradient_accumulation_steps=4)
    held = _phase(accumulating, 2, Phase.FORWARD_END)[Component.GRADIENTS]
    assert held >= PARAM_BYTES  # every gradient, whole
    sharded_after_step = _phase(accumulating, 1, Phase.OPTIMIZER_STEP)[Component.GRADIENTS]
    assert sharded_after_step < PARAM_BYTES // 3  # the optimizer sees its shard only
    one_micro_batch = _phase(FULL, 2, Phase.FORWARD_END)
    assert Component.GRADIENTS not in one_micro_batch


def test_fsdp_mixed_precision_gathers_a_full_precision_model_in_half() -> None:
    fp32 = replace(FULL, dtype=DType.FP32)
    mixed = replace(fp32, autocast=True)
    gathered_fp32 = _phase(fp32, 2, Phase.FORWARD_END)[Component.COMMUNICATION]
    gathered_mixed = _phase(mixed, 2, Phase.FORWARD_END)[Component.COMMUNICATION]
    assert gathered_mixed * 2 == gathered_fp32
    assert any("modelled" in note for note in estimate(QWEN_05B, mixed).assumptions)


def test_offloading_reports_host_memory_per_gpu_and_per_node() -> None:
    offloaded = replace(
        FULL,
        parallel=ParallelSpec(
            gpus=16, gpus_per_node=8, strategy=Strategy.FSDP2, offload=Offload.OPTIMIZER_AND_PARAMS
        ),
    )
    est = estimate(QWEN_05B, offloaded)
    # the shards of parameters, gradients and AdamW's two moments live on the host
    assert est.host_bytes >= 4 * PARAM_BYTES // 16
    assert est.components.get(Component.OPTIMIZER_STATE, 0) == 0
    (note,) = [n for n in est.assumptions if n.startswith("host memory")]
    assert "per node of 8 GPUs" in note


def test_a_peft_model_under_fsdp2_is_gathered_whole() -> None:
    lora = replace(FULL, method=Method.LORA, lora=LoraSpec(r=16, target_modules="all-linear"))
    per_layer_fsdp1 = replace(lora, parallel=replace(lora.parallel, strategy=Strategy.FSDP))
    whole = estimate(QWEN_05B, lora)
    assert whole.components[Component.COMMUNICATION] >= PARAM_BYTES
    assert any("whole model is gathered" in note for note in whole.assumptions)
    assert estimate(QWEN_05B, per_layer_fsdp1).allocated_bytes < whole.allocated_bytes
