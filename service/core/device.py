"""What a training process holds on its GPU besides its tensors: library workspaces taken from
the caching allocator, and what lies outside the allocator (CUDA context, loaded kernels,
managed memory).

Workspaces count at the allocated level (they are caching-allocator blocks); the rest is the
difference between the device level a node's NVML reads and the reserved level.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from service.core.units import KIB, MIB

# The GPU a reference trace stands for: the references and the measured runs are Hopper's
# (H100/H200).
REFERENCE_COMPUTE_CAPABILITY = "9.0"
# cuBLAS: each (handle, stream) gets its own workspace from the caching allocator the first
# time a handle runs a GEMM (aten/src/ATen/cuda/CublasHandlePool.cpp getNewWorkspace). Its
# size is CUBLAS_WORKSPACE_CONFIG's, by default ":4096:8" on compute capability 9.0 and
# ":4096:2:16:8" elsewhere (parseChosenWorkspaceSize).
CUBLAS_WORKSPACE_SM90 = 4096 * KIB * 8
CUBLAS_WORKSPACE_OTHER = 4096 * KIB * 2 + 16 * KIB * 8
# cuBLASLt (addmm with a bias epilogue): CUBLASLT_WORKSPACE_SIZE, 1024 KiB by default
# (parseCUDABlasLtWorkspaceSize). Measured on an H200 with torch 2.11: a bf16 matmul first
# took 32 MiB, a linear layer with a bias 1 MiB more, the first backward GEMM (the autograd
# engine's thread, its own handle) another 32 MiB (tests/data/gpu/h200_environment.json).
CUBLASLT_WORKSPACE = 1024 * KIB


def cublas_workspace(compute_capability: str | None) -> int:
    """One cuBLAS handle's workspace on a GPU of `compute_capability` ("9.0"); Hopper's when
    unknown (the GPU the references and measured runs were made on)."""
    if compute_capability is None or compute_capability == "9.0":
        return CUBLAS_WORKSPACE_SM90
    return CUBLAS_WORKSPACE_OTHER


# The process's memory outside the caching allocator, measured on an H200 (compute capability
# 9.0, driver 580.159.04, CUDA 13.0, torch 2.11): NVML's used memory at the end of step 2 minus
# max_memory_reserved, the same in every one of 43 runs of tests/data/gpu/ but for which kernel
# libraries the step loaded: 800,653,312 B when half-precision SDPA ran (cuDNN's attention
# kernels loaded), 16 MiB less when it did not (fp32 math / mem-efficient, eager).
H200_OUTSIDE_FUSED_ATTENTION = 800_653_312
H200_OUTSIDE = 783_876_096
# ...of which the CUDA context: NVML used after torch.cuda.init() and one tiny tensor
# (tests/data/gpu/h200_environment.json context_used, 551,092,224 B) less that tensor's 2 MiB
# small-pool segment, which the reserved level counts.
H200_CONTEXT = 551_092_224 - 2 * MIB
# Without lazy module loading (torch before 1.13, `Stack.eager_module_loading`) CUDA loads
# every kernel module of the process's libraries (libtorch_cuda, cuBLAS, cuDNN) when it creates
# the context. transformers' "Efficient Training on a Single GPU" page measured it on its Tesla
# V100 box: NVML used 1343 MiB after torch.ones((1, 1)).to("cuda") ("the kernels alone take up
# 1.3GB"; quoted in tests/data/published_peaks.csv, rows hfdocs-bert-*), less that tensor's
# 2 MiB small-pool segment, which the reserved level counts. The kernel libraries a lazy context
# loads at their first call (the H200's outside-minus-context) are already in it.
EAGER_CONTEXT = 1343 * MIB - 2 * MIB
# Paged optimizers keep their state in CUDA managed memory, outside the allocator; NVML showed
# 128 MiB more with bitsandbytes' PagedAdamW8bit than with AdamW for a Qwen2.5-7B LoRA r16
# (78.4 MiB of 8-bit state by the estimator's count): managed memory on the device per byte of
# paged state (tests/data/gpu/ *-paged8 runs).
H200_PAGED_FACTOR = 128 / 78.37
# A GPU or CUDA version nobody measured: the row is the H200's, with a standard deviation of a
# third of its 0.75 GiB outside the allocator. A stated prior, not a measurement: the context
# and kernel libraries differ by architecture, driver and CUDA version, and `vramcast probe`
# on that GPU measures them.
UNMEASURED_UNCERTAINTY = 256 * MIB
# A measured row's spread: the 16 MiB the attention libraries move it by.
MEASURED_UNCERTAINTY = 16 * MIB
# NCCL buffers per rank for multi-GPU runs: NCCL_BUFFSIZE 4 MiB per channel and peer (NCCL
# documentation, environment variables); a prior for a single-node ring/tree.
NCCL_PRIOR = 512 * MIB


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceRow:
    """What a process holds outside the caching allocator on one kind of GPU and stack."""

    context_bytes: int
    outside_bytes: int  # context and loaded kernel libraries
    uncertainty_bytes: int  # one standard deviation of outside_bytes
    paged_factor: float  # device bytes per byte of paged optimizer state
    paged_uncertainty: float  # relative standard deviation of the paged bytes
    nccl_bytes: int
    note: str

    def paged_bytes(self, paged_state: int) -> int:
        return math.ceil(paged_state * self.paged_factor)


@lru_cache(maxsize=256)
def device_row(
    compute_capability: str | None, *, fused_attention: bool, eager_loading: bool = False
) -> DeviceRow:
    """The row for a GPU of `compute_capability` (None: not given) running a step whose
    attention is (`fused_attention`) or is not a half-precision fused kernel, on a torch that
    loads CUDA's kernel modules eagerly (`eager_loading`) or lazily."""
    if eager_loading:
        return _eager_row(compute_capability)
    outside = H200_OUTSIDE_FUSED_ATTENTION if fused_attention else H200_OUTSIDE
    measured = compute_capability == "9.0"
    if measured:
        note = (
            "device adds what an H200 (Hopper, CUDA 13, torch 2.11) held outside the allocator "
            f"in every measured run: {outside / MIB:.1f} MiB, the CUDA context included"
        )
    else:
        which = (
            f"compute capability {compute_capability} was not measured"
            if compute_capability
            else "the request names no GPU"
        )
        note = (
            f"device adds the {outside / MIB:.1f} MiB an H200 (CUDA 13) held outside the "
            f"allocator; {which}, so its uncertainty is {UNMEASURED_UNCERTAINTY / MIB:.0f} MiB"
        )
    return DeviceRow(
        context_bytes=H200_CONTEXT,
        outside_bytes=outside,
        uncertainty_bytes=MEASURED_UNCERTAINTY if measured else UNMEASURED_UNCERTAINTY,
        paged_factor=H200_PAGED_FACTOR,
        paged_uncertainty=0.25,
        nccl_bytes=NCCL_PRIOR,
        note=note,
    )


def _eager_row(compute_capability: str | None) -> DeviceRow:
    """Outside the allocator without lazy module loading: the eager context, every kernel
    library loaded with it; measured on one V100 box only, so a row's uncertainty is that of an
    unmeasured GPU."""
    gpu = f"compute capability {compute_capability}" if compute_capability else "a GPU not named"
    return DeviceRow(
        context_bytes=EAGER_CONTEXT,
        outside_bytes=EAGER_CONTEXT,
        uncertainty_bytes=UNMEASURED_UNCERTAINTY,
        paged_factor=H200_PAGED_FACTOR,
        paged_uncertainty=0.25,
        nccl_bytes=NCCL_PRIOR,
        note=(
            f"device adds an eager-loading CUDA context of {EAGER_CONTEXT / MIB:.0f} MiB (torch "
            "before 1.13 loads every kernel module with it; measured on a V100 by transformers' "
            f"single-GPU training page) for {gpu}, with an uncertainty of "
            f"{UNMEASURED_UNCERTAINTY / MIB:.0f} MiB"
        ),
    )
