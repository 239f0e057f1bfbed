"""PyTorch's CUDA caching allocator: its block sizes and rounding (c10/cuda/
CUDACachingAllocator.cpp, torch 2.x), read by the allocator model (`service.core.allocator`),
the estimator's block rounding and the reserved level's replay."""

from __future__ import annotations

from service.core.units import MIB

# c10/cuda/CUDACachingAllocator.cpp
MIN_BLOCK = 512  # kMinBlockSize: every size is rounded to a multiple of it
SMALL_SIZE = 1 * MIB  # kSmallSize: the largest request served by the small pool
SMALL_BUFFER = 2 * MIB  # kSmallBuffer: a small-pool segment
MIN_LARGE_ALLOC = 10 * MIB  # kMinLargeAlloc: requests under it share kLargeBuffer segments
LARGE_BUFFER = 20 * MIB  # kLargeBuffer: large-pool segment for 1-10 MiB requests
ROUND_LARGE = 2 * MIB  # kRoundLarge: larger segments are rounded to it
# c10/cuda/CUDAAllocatorConfig.h: max_non_split_rounding_size defaults to kLargeBuffer.
DEFAULT_NON_SPLIT_ROUNDING = LARGE_BUFFER
# The smallest max_split_size_mb / max_non_split_rounding_mb accepted: kLargeBuffer in MiB.
MIN_SPLIT_SETTING_MB = LARGE_BUFFER // MIB


def block_bytes(nbytes: int) -> int:
    """The bytes a tensor of `nbytes` takes once rounded to kMinBlockSize."""
    return -(-nbytes // MIN_BLOCK) * MIN_BLOCK
