"""What an estimate says: the peak at three levels, its breakdown, and where it happens."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple, Protocol


class Component(StrEnum):
    """Allocated-level memory by role; the reference tracer labels storages with these too."""

    FROZEN_WEIGHTS = "frozen_weights"  # base weights that take no gradient (incl. 4-bit + consts)
    TRAINABLE_PARAMS = "trainable_params"  # adapters, modules_to_save, or every weight (full FT)
    GRADIENTS = "gradients"
    OPTIMIZER_STATE = "optimizer_state"
    OPTIMIZER_TEMPORARIES = "optimizer_temporaries"  # foreach AdamW's scratch during step()
    ACTIVATIONS = "activations"  # tensors saved for backward (checkpoints when checkpointing)
    RECOMPUTE = "recompute"  # one layer's activations recomputed during backward
    LOGITS_LOSS = "logits_loss"  # logits, their fp32 copies, log-probs and their gradients
    BACKWARD_TEMPORARIES = "backward_temporaries"  # grads in flight, 4-bit dequant transients
    INPUTS = "inputs"  # token ids, labels, masks
    WORKSPACES = "workspaces"  # cuBLAS/cuBLASLt workspaces, taken from the caching allocator
    # Several GPUs: parameters gathered from other ranks (FSDP, ZeRO-3) and the collectives'
    # buffers (DDP's gradient buckets, FSDP's reduce-scatter input, ZeRO's reduce buckets).
    COMMUNICATION = "communication"
    # DPO and KTO full fine-tuning: the frozen reference copy of the model TRL's DPOTrainer
    # and KTOTrainer load beside the policy (trl/trainer/dpo_trainer.py, kto_trainer.py
    # __init__), held all run.
    REFERENCE_MODEL = "reference_model"
    # GRPO: the KV cache of model.generate's completions (transformers DynamicCache, one key
    # and one value tensor per layer, grown a token at a time: trl/trainer/grpo_trainer.py
    # `_generate_single_turn`), alive during the generation phase alone.
    GENERATION_KV_CACHE = "generation_kv_cache"


class Overhead(StrEnum):
    """Memory above the allocated level."""

    ALLOCATOR = "allocator"  # reserved - allocated: caching-allocator rounding, fragmentation
    CUDA_CONTEXT = "cuda_context"
    OUTSIDE_ALLOCATOR = "outside_allocator"  # NCCL, paged optimizer state, cuBLAS workspace


class Phase(StrEnum):
    # GRPO: model.generate's completions under no_grad, before the step's forward
    GENERATION = "generation"
    FORWARD_END = "forward_end"  # the loss computed, every saved activation alive
    # DPO, KTO: the reference model's forwards under no_grad, after the policy's (TRL's
    # DPOTrainer._compute_loss, KTOTrainer._compute_loss), every policy activation alive
    REFERENCE_FORWARD = "reference_forward"
    BACKWARD_START = "backward_start"  # the loss gradient: fp32 log-prob gradient is born
    BACKWARD = "backward"  # inside the layers' backward (recompute, gradients in flight)
    OPTIMIZER_STEP = "optimizer_step"


PHASE_WORDS: dict[Phase, str] = {
    Phase.GENERATION: "while generating the completions (GRPO's model.generate)",
    Phase.FORWARD_END: "at the end of the forward pass, with the loss computed",
    Phase.REFERENCE_FORWARD: "during the reference model's forward pass (DPO, KTO)",
    Phase.BACKWARD_START: "at the start of the backward pass (the loss gradient)",
    Phase.BACKWARD: "inside the backward pass",
    Phase.OPTIMIZER_STEP: "during the optimizer step",
}


# The order in which a phase's parts are kept (PhasePeak.parts).
COMPONENT_ORDER = (
    Component.FROZEN_WEIGHTS,
    Component.TRAINABLE_PARAMS,
    Component.INPUTS,
    Component.WORKSPACES,
    Component.OPTIMIZER_STATE,
    Component.GRADIENTS,
    Component.ACTIVATIONS,
    Component.RECOMPUTE,
    Component.LOGITS_LOSS,
    Component.BACKWARD_TEMPORARIES,
    Component.OPTIMIZER_TEMPORARIES,
    Component.COMMUNICATION,
    Component.REFERENCE_MODEL,
    Component.GENERATION_KV_CACHE,
)


class PhasePeak(NamedTuple):
    """The allocated level at one phase of one step. A named tuple: an estimate builds seven
    of them on every call, and a tuple is the cheapest immutable record to build."""

    step: int  # 1: no optimizer state yet; 2: the steady state
    phase: Phase
    allocated_bytes: int
    parts: tuple[int, ...]  # bytes per component, in COMPONENT_ORDER

    @property
    def components(self) -> dict[Component, int]:
        """The non-zero parts by component; they sum to allocated_bytes."""
        return {c: v for c, v in zip(COMPONENT_ORDER, self.parts, strict=True) if v}


class PeakLevels(NamedTuple):
    """A peak's four levels without its breakdown, bytes (`estimator.peak_levels`)."""

    allocated_bytes: int
    reserved_bytes: int
    device_bytes: int
    device_bytes_upper: int


class Levels(Protocol):
    """What has a peak's levels: an `Estimate`, `PeakLevels`."""

    @property
    def allocated_bytes(self) -> int: ...
    @property
    def reserved_bytes(self) -> int: ...
    @property
    def device_bytes(self) -> int: ...
    @property
    def device_bytes_upper(self) -> int: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamCounts:
    total: int
    trainable: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Estimate:
    """Peak memory of one GPU of the job, bytes at each level."""

    allocated_bytes: int
    reserved_bytes: int
    device_bytes: int
    device_bytes_upper: int  # the safe bound a scheduler compares with a GPU's memory
    components: dict[Component, int]  # at the peak; sums to allocated_bytes
    overheads: dict[Overhead, int]  # reserved and device = allocated + these
    peak_step: int
    peak_phase: Phase
    phases: tuple[PhasePeak, ...]
    params: ParamCounts
    upper_margin: float  # device_bytes_upper / device_bytes - 1, the prior's stated margin
    assumptions: tuple[str, ...]
    warnings: tuple[str, ...]
    estimator_version: str
    host_bytes: int = 0  # host memory per rank for offloaded states
    host_pinned_bytes: int = 0  # pinned host memory per rank for offloaded activations


def estimate_to_dict(est: Estimate) -> dict[str, object]:
    """A JSON-ready view of an estimate, bytes throughout (the CLI's --json)."""
    return {
        "peak": {
            "allocated_bytes": est.allocated_bytes,
            "reserved_bytes": est.reserved_bytes,
            "device_bytes": est.device_bytes,
            "device_bytes_upper": est.device_bytes_upper,
            "step": est.peak_step,
            "phase": est.peak_phase.value,
        },
        "components": {c.value: v for c, v in est.components.items()},
        "overheads": {o.value: v for o, v in est.overheads.items()},
        "phases": [
            {
                "step": ph.step,
                "phase": ph.phase.value,
                "allocated_bytes": ph.allocated_bytes,
                "components": {c.value: v for c, v in ph.components.items()},
            }
            for ph in est.phases
        ],
        "params": {"total": est.params.total, "trainable": est.params.trainable},
        "host_bytes": est.host_bytes,
        "host_pinned_bytes": est.host_pinned_bytes,
        "upper_margin": est.upper_margin,
        "assumptions": list(est.assumptions),
        "warnings": list(est.warnings),
        "estimator_version": est.estimator_version,
    }
