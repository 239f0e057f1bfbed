"""torchtune's training options that reshape the step: the optimizer run inside backward and
activations offloaded to host memory, and what each is modelled with.

Both are torchtune recipe switches (recipes/full_finetune_single_device.py: `optimizer_in_bwd`,
`enable_activation_offloading`); neither is an HF Trainer option, so both need framework
'torchtune'. TRL's SFTConfig has an `activation_offloading` of its own, a port that keeps a
storage saved twice on the GPU (trl/models/activation_offloading.py), which is not modelled.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Protocol

from service.core.errors import InvalidSpecError


class _Gpus(Protocol):
    @property
    def gpus(self) -> int: ...


class TrainingJob(Protocol):
    """What the checks read of a TrainingSpec (which calls them: no import back)."""

    @property
    def optimizer_in_backward(self) -> bool: ...
    @property
    def activation_offloading(self) -> bool: ...
    @property
    def gradient_checkpointing(self) -> bool: ...
    @property
    def gradient_accumulation_steps(self) -> int: ...
    @property
    def max_grad_norm(self) -> float: ...
    @property
    def autocast(self) -> bool: ...
    @property
    def framework(self) -> StrEnum: ...
    @property
    def method(self) -> StrEnum: ...
    @property
    def optim(self) -> StrEnum: ...
    @property
    def objective(self) -> StrEnum: ...
    @property
    def parallel(self) -> _Gpus: ...


# The optimizers modelled inside backward: torchtune builds one per parameter
# (full_finetune_single_device.py _setup_optimizer), so a fused AdamW's step touches one
# parameter at a time and allocates nothing beyond its state.
IN_BACKWARD_OPTIMS = ("adamw_torch_fused",)


def check_training_features(spec: TrainingJob) -> None:
    """Refuse what torchtune's recipes refuse with `optimizer_in_bwd` or
    `enable_activation_offloading`, and what the estimate does not model with them."""
    if spec.optimizer_in_backward:
        _check_in_backward(spec)
    if spec.activation_offloading:
        _check_offloading(spec)


def _check_in_backward(spec: TrainingJob) -> None:
    field = "optimizer_in_backward"
    if spec.framework.value != "torchtune":
        raise InvalidSpecError(
            field,
            "the optimizer step inside backward is torchtune's optimizer_in_bwd (framework "
            "'torchtune'); HF Trainer has no such option",
        )
    if spec.gradient_accumulation_steps > 1:
        # full_finetune_single_device.py __init__: "Gradient accumulation is not supported
        # with optimizer in bwd"
        raise InvalidSpecError(
            field, "needs gradient_accumulation_steps 1 (torchtune refuses accumulation with it)"
        )
    if spec.max_grad_norm > 0:
        # same place: "Gradient clipping is not supported with optimizer in bwd"
        raise InvalidSpecError(
            field, "needs max_grad_norm 0 (torchtune refuses gradient clipping with it)"
        )
    if spec.parallel.gpus != 1:
        raise InvalidSpecError(
            field,
            "is modelled on one GPU: torchtune's single-device recipe; its distributed "
            "recipes refuse it with expert parallelism and step on sharded gradients otherwise",
        )
    if spec.method.value != "full":
        raise InvalidSpecError(
            field, "is torchtune's full fine-tuning option (its LoRA recipes have none)"
        )
    if spec.optim.value not in IN_BACKWARD_OPTIMS:
        raise InvalidSpecError(
            field,
            f"is modelled with optim {', '.join(IN_BACKWARD_OPTIMS)}, not {spec.optim.value!r}",
        )
    if spec.objective.value != "sft":
        raise InvalidSpecError(field, "is modelled for supervised fine-tuning only")


def _check_offloading(spec: TrainingJob) -> None:
    field = "activation_offloading"
    if spec.framework.value != "torchtune":
        raise InvalidSpecError(
            field,
            "is torchtune's enable_activation_offloading (framework 'torchtune'); TRL's port "
            "keeps a storage saved twice on the GPU and is not modelled",
        )
    if not spec.gradient_checkpointing:
        # full_finetune_single_device.py and lora_finetune_single_device.py __init__:
        # "enable_activation_offloading should only be True when
        # enable_activation_checkpointing is True"
        raise InvalidSpecError(
            field, "needs gradient_checkpointing (torchtune's recipes refuse it without)"
        )
    if spec.parallel.gpus != 1:
        raise InvalidSpecError(field, "is modelled on one GPU")
    if spec.method.value not in ("full", "lora"):
        raise InvalidSpecError(field, "is modelled with methods 'full' and 'lora'")
    if spec.objective.value != "sft":
        raise InvalidSpecError(field, "is modelled for supervised fine-tuning only")
    if spec.autocast:
        raise InvalidSpecError(field, "is modelled without autocast (torchtune's bf16 recipes)")
