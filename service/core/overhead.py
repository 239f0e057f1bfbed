"""Memory above the allocated level: the caching allocator (reserved) and the device.

These are priors. Shapes decide the allocated level; what the allocator keeps cached, the CUDA
context and libraries outside the allocator depend on the GPU, driver and stack, and are what
calibration against measured peaks refines (`service.core.calibration`).
"""

from __future__ import annotations

from dataclasses import dataclass

from service.core.result import Overhead
from service.core.units import MIB

# CUDACachingAllocator (c10/cuda/CUDACachingAllocator.cpp): requests above kMinLargeAlloc =
# 10 MiB are rounded up to kRoundLarge = 2 MiB; smaller ones share 2 MiB / 20 MiB segments.
ROUND_LARGE = 2 * MIB

# Fragmentation of the caching allocator's reserved pool, as a share of the step's largest
# transient working set (activations, logits, recompute, temporaries). No published figure
# exists for LLM fine-tuning (design/memory-model.md section 1): a prior that calibration
# replaces.
FRAGMENTATION_PRIOR = 0.08

# CUDA context with lazy module loading (CUDA_MODULE_LOADING=LAZY, the default since
# CUDA 11.7 / torch 1.13): 0.3-0.6 GiB (design/memory-model.md section 1); the upper end.
CUDA_CONTEXT = 600 * MIB

# cuBLAS workspace: CUBLAS_WORKSPACE_CONFIG default ":4096:8" = 8 x 4 MiB on Hopper
# (torch/csrc/cuda/CUDABlas / cuBLAS docs); less on older GPUs.
CUBLAS_WORKSPACE = 32 * MIB

# NCCL buffers per rank for multi-GPU runs: NCCL_BUFFSIZE 4 MiB per channel and peer
# (NCCL docs, environment variables); a prior for a single-node ring/tree.
NCCL_PRIOR = 512 * MIB

# The safe bound's margin over the device-level estimate until calibration measures the
# spread of measured/estimated ratios (design/architecture.md, "device_bytes_upper").
UPPER_MARGIN_PRIOR = 0.10


_PRIOR_NOTES = (
    f"reserved = allocated + a {FRAGMENTATION_PRIOR:.0%} fragmentation prior on transient "
    "tensors (no calibration applied)",
    f"device adds a {CUDA_CONTEXT // MIB} MiB CUDA context and {CUBLAS_WORKSPACE // MIB} MiB "
    "cuBLAS workspace",
)
_PAGED_NOTE = ("paged optimizer state counted at the device level (managed memory)",)


@dataclass(frozen=True, slots=True)
class AboveAllocated:
    reserved: int
    device: int
    device_upper: int
    upper_margin: float
    overheads: dict[Overhead, int]
    assumptions: tuple[str, ...]


def above_allocated(
    *, phases: list[tuple[int, int]], paged_state: int, gpus: int
) -> AboveAllocated:
    """Reserved and device levels over a step's phases, each (allocated, transient bytes).

    The caching allocator keeps what it once reserved, so its slack follows the step's largest
    transient working set (activations, logits) even when the allocated peak is elsewhere.
    """
    allocated = max(a for a, _t in phases)
    churn = max(t for _a, t in phases)
    reserved, device, upper = levels_above(allocated, churn, paged_state=paged_state, gpus=gpus)
    allocator = reserved - allocated
    outside = _outside_allocator(paged_state, gpus)
    notes = _PRIOR_NOTES + (_PAGED_NOTE if paged_state else ())
    return AboveAllocated(
        reserved=reserved,
        device=device,
        device_upper=upper,
        upper_margin=UPPER_MARGIN_PRIOR,
        overheads={
            Overhead.ALLOCATOR: allocator,
            Overhead.CUDA_CONTEXT: CUDA_CONTEXT,
            Overhead.OUTSIDE_ALLOCATOR: outside,
        },
        assumptions=notes,
    )


def levels_above(
    allocated: int, churn: int, *, paged_state: int, gpus: int
) -> tuple[int, int, int]:
    """Reserved, device and the device level's safe bound over an allocated peak, given the
    step's largest transient working set (`churn`)."""
    reserved = _round_up(allocated + int(churn * FRAGMENTATION_PRIOR), ROUND_LARGE)
    device = reserved + CUDA_CONTEXT + _outside_allocator(paged_state, gpus)
    return reserved, device, int(device * (1 + UPPER_MARGIN_PRIOR))


def _outside_allocator(paged_state: int, gpus: int) -> int:
    return CUBLAS_WORKSPACE + paged_state + (NCCL_PRIOR if gpus > 1 else 0)


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit
