"""torchtune's optimizer in backward and activation offloading: what the spec refuses with
them, and how they change the estimate (the reference traces hold the figures:
tests/data/traces/*__torchtune__*)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from service.catalog.models import default_catalog
from service.core.errors import InvalidSpecError
from service.core.estimator import estimate
from service.core.result import Component
from service.core.spec import Framework, LossImpl, Method, Optim, ParallelSpec, TrainingSpec

QWEN = "Qwen/Qwen2.5-0.5B"
TUNE: dict[str, Any] = {"framework": Framework.TORCHTUNE, "loss": LossImpl.HF}
IN_BWD: dict[str, Any] = {**TUNE, "optimizer_in_backward": True, "max_grad_norm": 0.0}
OFFLOAD: dict[str, Any] = {**TUNE, "activation_offloading": True, "gradient_checkpointing": True}


def _arch(model: str = QWEN) -> Any:
    return default_catalog().resolve(model).arch


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"framework": Framework.HF}, "HF Trainer has no such option"),
        ({"gradient_accumulation_steps": 2}, "gradient_accumulation_steps 1"),
        ({"max_grad_norm": 1.0}, "max_grad_norm 0"),
        ({"parallel": ParallelSpec(gpus=2)}, "one GPU"),
        ({"method": Method.LORA}, "full fine-tuning option"),
        ({"optim": Optim.ADAMW_TORCH}, "adamw_torch_fused"),
    ],
)
def test_optimizer_in_backward_refusals_name_the_field(
    changes: dict[str, Any], reason: str
) -> None:
    fields = {"method": Method.FULL, "batch_size": 1, "seq_len": 512, **IN_BWD, **changes}
    with pytest.raises(InvalidSpecError, match=reason) as caught:
        TrainingSpec(**fields)
    assert caught.value.field == "optimizer_in_backward"


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"framework": Framework.HF}, "framework 'torchtune'"),
        ({"gradient_checkpointing": False}, "needs gradient_checkpointing"),
        ({"method": Method.QLORA}, "methods 'full' and 'lora'"),
        ({"autocast": True}, "without autocast"),
    ],
)
def test_activation_offloading_refusals_name_the_field(
    changes: dict[str, Any], reason: str
) -> None:
    fields = {"method": Method.LORA, "batch_size": 1, "seq_len": 512, **OFFLOAD, **changes}
    with pytest.raises(InvalidSpecError, match=reason) as caught:
        TrainingSpec(**fields)
    assert caught.value.field == "activation_offloading"


def test_optimizer_in_backward_frees_the_gradients_of_a_short_sequence() -> None:
    # At 256 tokens the full step's peak is its gradients; inside backward they never add up.
    arch = _arch("meta-llama/Llama-3.2-1B")
    spec = TrainingSpec(method=Method.FULL, batch_size=1, seq_len=256, **IN_BWD)
    stepped = estimate(arch, replace(spec, optimizer_in_backward=False))
    inside = estimate(arch, spec)
    assert inside.allocated_bytes < stepped.allocated_bytes
    assert inside.components[Component.GRADIENTS] < 2**20  # the final norm weight's, held
    assert (
        inside.components[Component.OPTIMIZER_STATE]
        == (stepped.components[Component.OPTIMIZER_STATE])
    )


def test_offloading_keeps_three_checkpoints_and_reports_the_pinned_host_memory() -> None:
    arch = _arch()
    spec = TrainingSpec(method=Method.LORA, batch_size=2, seq_len=1024, **OFFLOAD)
    kept = estimate(arch, replace(spec, activation_offloading=False))
    offloaded = estimate(arch, spec)
    checkpoint = 2 * 1024 * arch.hidden_size * 2
    saved = kept.components[Component.ACTIVATIONS] - offloaded.components[Component.ACTIVATIONS]
    assert saved == (arch.num_hidden_layers - 3) * checkpoint
    assert kept.host_pinned_bytes == 0
    # every layer's 3.5 MiB input in a 4 MiB pinned block (the power of two above it), and
    # the final norm's fp32 input twice and its inverse RMS twice
    assert checkpoint == 3670016
    norm = 2 * 8 * 2**20 + 2 * 8192
    assert offloaded.host_pinned_bytes == arch.num_hidden_layers * 4 * 2**20 + norm
