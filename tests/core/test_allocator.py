"""The caching-allocator model against its rules, each case computed by hand from
c10/cuda/CUDACachingAllocator.cpp, and invariants over generated malloc/free sequences."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.core.allocator import (
    MIN_LARGE_ALLOC,
    SMALL_SIZE,
    AllocatorConfig,
    CachingAllocator,
    OutOfMemoryError,
    round_size,
    segment_size,
)
from service.core.errors import InvalidSpecError
from service.core.units import MIB

KIB = 1024

# -- sizes ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("nbytes", "rounded"),
    [(0, 512), (1, 512), (512, 512), (513, 1024), (1000, 1024), (MIB + 1, MIB + 512)],
)
def test_every_request_is_rounded_to_512_bytes(nbytes: int, rounded: int) -> None:
    assert round_size(nbytes) == rounded


@pytest.mark.parametrize(
    ("divisions", "nbytes", "rounded"),
    [
        (4, 5 * MIB + 1, 6 * MIB),  # between 4 and 8 MiB in steps of 1 MiB
        (4, 12 * MIB + 1, 14 * MIB),  # between 8 and 16 MiB in steps of 2 MiB
        (4, 8 * MIB, 8 * MIB),  # a power of two stays
        (8, 1_000_000, MIB),  # 512 KiB + 7 * 64 KiB = 983,040 < 1,000,000 <= 1 MiB
        (4, 1200, 1536),  # not above 512 * divisions: plain 512 B rounding
        (2, 3 * MIB, 3 * MIB),  # already on a division (2 MiB + 1 MiB)
    ],
)
def test_roundup_power2_divisions(divisions: int, nbytes: int, rounded: int) -> None:
    config = AllocatorConfig(roundup_power2_divisions=divisions)
    assert round_size(nbytes, config) == rounded


@pytest.mark.parametrize(
    ("size", "segment"),
    [
        (512, 2 * MIB),
        (SMALL_SIZE, 2 * MIB),
        (SMALL_SIZE + 512, 20 * MIB),
        (MIN_LARGE_ALLOC - 512, 20 * MIB),
        (MIN_LARGE_ALLOC, 10 * MIB),
        (MIN_LARGE_ALLOC + 512, 12 * MIB),
        (101 * MIB, 102 * MIB),
    ],
)
def test_segment_sizes(size: int, segment: int) -> None:
    assert segment_size(size) == segment


# -- the small pool -------------------------------------------------------------------------


def test_small_requests_share_one_2_mib_segment() -> None:
    allocator = CachingAllocator()
    allocator.malloc(1)
    allocator.malloc(1000)
    assert (allocator.allocated, allocator.reserved, allocator.segments) == (1536, 2 * MIB, 1)


def test_two_1_mib_requests_fill_a_small_segment_and_a_third_needs_another() -> None:
    allocator = CachingAllocator()
    allocator.malloc(MIB)
    allocator.malloc(MIB)  # the split remainder, 1 MiB, serves it
    assert (allocator.reserved, allocator.segments) == (2 * MIB, 1)
    allocator.malloc(MIB)
    assert (allocator.allocated, allocator.reserved, allocator.segments) == (3 * MIB, 4 * MIB, 2)


# -- the large pool -------------------------------------------------------------------------


def test_a_request_just_over_1_mib_splits_a_20_mib_segment() -> None:
    allocator = CachingAllocator()
    allocator.malloc(MIB + 1)  # 1 MiB + 512 B from a 20 MiB segment
    assert (allocator.allocated, allocator.reserved, allocator.segments) == (
        MIB + 512,
        20 * MIB,
        1,
    )
    allocator.malloc(5 * MIB)  # the 19 MiB - 512 B remainder serves it
    assert (allocator.allocated, allocator.reserved, allocator.segments) == (
        6 * MIB + 512,
        20 * MIB,
        1,
    )


def test_two_12_mib_requests_take_a_segment_each_and_a_freed_one_is_reused() -> None:
    allocator = CachingAllocator()
    first = allocator.malloc(12 * MIB)
    allocator.malloc(12 * MIB)
    assert (allocator.allocated, allocator.reserved, allocator.segments) == (
        24 * MIB,
        24 * MIB,
        2,
    )
    allocator.free(first)
    allocator.malloc(12 * MIB)
    assert (allocator.reserved, allocator.segments) == (24 * MIB, 2)


def test_a_large_block_is_not_split_when_at_most_1_mib_would_remain() -> None:
    allocator = CachingAllocator()
    allocator.malloc(19 * MIB)  # a 20 MiB segment; 1 MiB left over is not > 1 MiB
    assert (allocator.allocated, allocator.reserved) == (20 * MIB, 20 * MIB)

    allocator = CachingAllocator()
    allocator.malloc(19 * MIB - 512)  # 1 MiB + 512 B left over: split
    assert (allocator.allocated, allocator.reserved) == (19 * MIB - 512, 20 * MIB)


def test_a_cached_block_is_handed_out_whole_when_the_rest_would_be_small() -> None:
    allocator = CachingAllocator()
    allocator.free(allocator.malloc(12 * MIB))
    allocator.malloc(11 * MIB + 512 * KIB)  # 512 KiB would remain: the whole 12 MiB block
    assert (allocator.allocated, allocator.reserved) == (12 * MIB, 12 * MIB)


def test_best_fit_takes_the_smallest_free_block_that_fits() -> None:
    allocator = CachingAllocator()
    twelve = allocator.malloc(12 * MIB)
    fourteen = allocator.malloc(14 * MIB)
    allocator.free(fourteen)
    allocator.free(twelve)
    allocator.malloc(11 * MIB)  # the 12 MiB block, whole (1 MiB would remain)
    assert allocator.allocated == 12 * MIB
    allocator.malloc(14 * MIB)  # so the 14 MiB block is still there for this
    assert (allocator.allocated, allocator.reserved, allocator.segments) == (
        26 * MIB,
        26 * MIB,
        2,
    )


def test_a_freed_block_merges_with_both_free_neighbours() -> None:
    allocator = CachingAllocator()
    # One 20 MiB segment: a [0, 2) b [2, 4) c [4, 6), 14 MiB free after them.
    a, b, c = (allocator.malloc(2 * MIB) for _ in range(3))
    assert (allocator.reserved, allocator.segments) == (20 * MIB, 1)
    allocator.free(a)
    allocator.free(c)  # merges with the 14 MiB tail
    allocator.empty_cache()  # the segment is still split around b: nothing to release
    assert allocator.reserved == 20 * MIB
    allocator.free(b)  # merges with a (before it) and c + tail (after it): one 20 MiB block
    allocator.malloc(20 * MIB)  # served by the merged block, no new segment
    assert (allocator.allocated, allocator.reserved, allocator.segments) == (
        20 * MIB,
        20 * MIB,
        1,
    )


def test_a_fully_freed_segment_goes_back_on_empty_cache() -> None:
    allocator = CachingAllocator()
    handles = [allocator.malloc(2 * MIB) for _ in range(3)]
    for handle in reversed(handles):
        allocator.free(handle)
    allocator.empty_cache()
    assert (allocator.allocated, allocator.reserved, allocator.segments) == (0, 0, 0)
    assert allocator.peak_reserved == 20 * MIB


# -- max_split_size_mb, max_non_split_rounding_mb ---------------------------------------------


def test_an_oversize_cached_block_never_serves_a_smaller_request() -> None:
    allocator = CachingAllocator(AllocatorConfig(max_split_size_mb=64))
    allocator.free(allocator.malloc(100 * MIB))
    allocator.malloc(30 * MIB)  # below max_split_size: the 100 MiB block is not offered
    assert (allocator.reserved, allocator.segments) == (130 * MIB, 2)


def test_an_oversize_cached_block_serves_a_large_request_within_20_mib_unsplit() -> None:
    allocator = CachingAllocator(AllocatorConfig(max_split_size_mb=64))
    allocator.free(allocator.malloc(100 * MIB))
    allocator.malloc(90 * MIB)  # 100 < 90 + 20: served, and never split (90 >= 64)
    assert (allocator.allocated, allocator.reserved) == (100 * MIB, 100 * MIB)


def test_an_oversize_cached_block_beyond_the_rounding_is_not_used() -> None:
    allocator = CachingAllocator(AllocatorConfig(max_split_size_mb=64))
    allocator.free(allocator.malloc(100 * MIB))
    allocator.malloc(70 * MIB)  # 100 >= 70 + 20: refused
    assert (allocator.allocated, allocator.reserved) == (70 * MIB, 170 * MIB)


def test_max_non_split_rounding_widens_what_an_oversize_block_serves() -> None:
    config = AllocatorConfig(max_split_size_mb=64, max_non_split_rounding_mb=40)
    allocator = CachingAllocator(config)
    allocator.free(allocator.malloc(100 * MIB))
    allocator.malloc(70 * MIB)  # 100 < 70 + 40: served whole
    assert (allocator.allocated, allocator.reserved) == (100 * MIB, 100 * MIB)


def test_without_max_split_size_a_large_cached_block_is_split_for_any_request() -> None:
    allocator = CachingAllocator()
    allocator.free(allocator.malloc(100 * MIB))
    allocator.malloc(30 * MIB)
    allocator.malloc(70 * MIB)  # the 70 MiB remainder
    assert (allocator.allocated, allocator.reserved, allocator.segments) == (
        100 * MIB,
        100 * MIB,
        1,
    )


# -- expandable_segments ----------------------------------------------------------------------


def test_expandable_segments_grow_one_segment_in_20_mib_pages() -> None:
    allocator = CachingAllocator(AllocatorConfig(expandable_segments=True))
    allocator.malloc(12 * MIB)  # one 20 MiB page mapped; the 8 MiB after it stays free
    assert (allocator.allocated, allocator.reserved, allocator.segments) == (
        12 * MIB,
        20 * MIB,
        1,
    )
    allocator.malloc(12 * MIB)  # the free 8 MiB + one more page
    assert (allocator.allocated, allocator.reserved, allocator.segments) == (
        24 * MIB,
        40 * MIB,
        1,
    )
    allocator.malloc(30 * MIB)  # 16 MiB free at the end + one page
    assert (allocator.allocated, allocator.reserved, allocator.segments) == (
        54 * MIB,
        60 * MIB,
        1,
    )


def test_expandable_segments_split_large_blocks_down_to_512_bytes() -> None:
    allocator = CachingAllocator(AllocatorConfig(expandable_segments=True))
    allocator.malloc(19 * MIB + 512 * KIB)  # a remainder of 512 KiB is split off
    assert (allocator.allocated, allocator.reserved) == (19 * MIB + 512 * KIB, 20 * MIB)


def test_expandable_small_pool_maps_2_mib_pages() -> None:
    allocator = CachingAllocator(AllocatorConfig(expandable_segments=True))
    allocator.malloc(512)
    allocator.malloc(12 * MIB)
    assert (allocator.reserved, allocator.segments) == (22 * MIB, 2)


def test_expandable_segments_unmap_every_page_once_all_is_freed() -> None:
    allocator = CachingAllocator(AllocatorConfig(expandable_segments=True))
    handles = [allocator.malloc(size) for size in (12 * MIB, 512, 30 * MIB, 3 * MIB)]
    for handle in handles:
        allocator.free(handle)
    allocator.empty_cache()
    assert (allocator.allocated, allocator.reserved) == (0, 0)


def test_expandable_segments_remap_an_unmapped_gap_before_a_free_block() -> None:
    """A request spanning an unmapped gap and the free block after it maps only the gap.

    PyTorch: find_expandable_block returns the gap (its address space and the free block after
    it hold the request); try_allocate_expandable_block maps min(gap, request) = the 20 MiB gap,
    map_block merges it with the free block after it (try_merge_blocks), and the merged 40 MiB
    block is handed out: 60 MiB reserved.
    """
    allocator = CachingAllocator(AllocatorConfig(expandable_segments=True))
    a, b, c = (allocator.malloc(20 * MIB) for _ in range(3))  # [0, 20) [20, 40) [40, 60)
    allocator.free(b)
    allocator.empty_cache()  # unmaps [20, 40)
    assert allocator.reserved == 40 * MIB
    allocator.free(c)  # [40, 60) free, between the gap and the unmapped tail
    allocator.malloc(40 * MIB)
    assert (allocator.allocated, allocator.reserved) == (60 * MIB, 60 * MIB)
    allocator.free(a)
    allocator.empty_cache()  # and the model stays consistent enough to release what it can
    assert allocator.reserved == 40 * MIB


# -- capacity: free and retry, out of memory --------------------------------------------------


def test_a_cudamalloc_over_capacity_frees_the_cached_segments_and_retries() -> None:
    allocator = CachingAllocator(capacity=40 * MIB)
    allocator.free(allocator.malloc(12 * MIB))
    allocator.free(allocator.malloc(14 * MIB))  # 12 MiB cached is too small: 26 MiB reserved
    allocator.malloc(16 * MIB)  # 26 + 16 > 40: both cached segments go back, then 16 MiB
    assert (allocator.reserved, allocator.segments, allocator.alloc_retries) == (16 * MIB, 1, 1)
    assert (allocator.peak_reserved, allocator.ooms) == (26 * MIB, 0)


def test_the_retry_keeps_segments_that_are_split_around_a_live_block() -> None:
    allocator = CachingAllocator(capacity=50 * MIB)
    allocator.malloc(2 * MIB)  # a 20 MiB segment, split: 18 MiB of it free
    allocator.free(allocator.malloc(19 * MIB))  # 18 < 19: a second 20 MiB segment, cached whole
    allocator.malloc(25 * MIB)  # a 26 MiB segment; 40 + 26 > 50: the whole one goes, then 46
    assert (allocator.reserved, allocator.segments, allocator.alloc_retries) == (46 * MIB, 2, 1)


def test_out_of_memory_when_nothing_cached_can_make_room() -> None:
    allocator = CachingAllocator(capacity=40 * MIB)
    allocator.malloc(30 * MIB)
    with pytest.raises(OutOfMemoryError) as raised:
        allocator.malloc(12 * MIB)
    error = raised.value
    assert (error.requested, error.allocated, error.reserved) == (12 * MIB, 30 * MIB, 30 * MIB)
    assert (allocator.ooms, allocator.alloc_retries, allocator.reserved) == (1, 1, 30 * MIB)


def test_with_max_split_size_one_oversize_cached_block_is_freed_before_any_retry() -> None:
    allocator = CachingAllocator(AllocatorConfig(max_split_size_mb=32), capacity=300 * MIB)
    allocator.free(allocator.malloc(150 * MIB))
    allocator.free(allocator.malloc(100 * MIB))  # 150 >= 100 + 20: a new segment, 250 MiB
    allocator.malloc(60 * MIB)  # 100 and 150 >= 60 + 20: new; 310 > 300
    # release_available_cached_blocks frees the smallest oversize block of at least 60 MiB,
    # the 100 MiB one, and the cudaMalloc succeeds without a retry.
    assert (allocator.reserved, allocator.alloc_retries, allocator.segments) == (210 * MIB, 0, 2)


def test_with_max_split_size_oversize_blocks_too_small_together_lead_to_the_retry() -> None:
    allocator = CachingAllocator(AllocatorConfig(max_split_size_mb=32), capacity=200 * MIB)
    allocator.free(allocator.malloc(100 * MIB))
    allocator.malloc(120 * MIB)  # 220 > 200; 100 MiB of oversize blocks < 120: then the retry
    assert (allocator.reserved, allocator.alloc_retries, allocator.segments) == (120 * MIB, 1, 1)


# -- garbage_collection_threshold --------------------------------------------------------------


def test_garbage_collection_frees_old_cached_blocks_before_a_cudamalloc() -> None:
    # Allowed: 0.5 of 100 MiB; collection starts above 0.5 of that, 25 MiB.
    config = AllocatorConfig(garbage_collection_threshold=0.5, per_process_memory_fraction=0.5)
    allocator = CachingAllocator(config, capacity=100 * MIB)
    allocator.free(allocator.malloc(30 * MIB))
    allocator.malloc(40 * MIB)  # 30 > 25: the cached 30 MiB goes first, so 40 fits in 50
    assert (allocator.reserved, allocator.alloc_retries) == (40 * MIB, 0)

    without = CachingAllocator(AllocatorConfig(per_process_memory_fraction=0.5), capacity=100 * MIB)
    without.free(without.malloc(30 * MIB))
    without.malloc(40 * MIB)  # 30 + 40 > 50: only the retry frees it
    assert (without.reserved, without.alloc_retries) == (40 * MIB, 1)


def test_garbage_collection_frees_blocks_at_least_as_old_as_the_average() -> None:
    config = AllocatorConfig(garbage_collection_threshold=0.05, per_process_memory_fraction=1.0)
    allocator = CachingAllocator(config, capacity=1000 * MIB)  # collects above 50 MiB
    allocator.free(allocator.malloc(30 * MIB))  # cached after 1 search
    allocator.free(allocator.malloc(32 * MIB))  # cached after 2 searches; 62 MiB reserved
    # The third search: the 30 MiB block is 2 searches old, the 32 MiB one 1; the average is
    # 1.5, so only the 30 MiB block goes (30 MiB reclaimed >= 62 - 50).
    allocator.malloc(40 * MIB)
    assert allocator.reserved == 72 * MIB
    allocator.malloc(32 * MIB)  # the 32 MiB block is still cached
    assert allocator.reserved == 72 * MIB


def test_garbage_collection_needs_a_memory_fraction() -> None:
    """PyTorch collects only with `set_fraction` (torch.cuda.set_per_process_memory_fraction):
    DeviceCachingAllocator::malloc calls garbage_collect_cached_blocks under
    `set_fraction && garbage_collection_threshold() > 0`, and get_free_block counts ages
    under the same condition. A device capacity alone does not enable it."""
    allocator = CachingAllocator(
        AllocatorConfig(garbage_collection_threshold=0.25), capacity=100 * MIB
    )
    allocator.free(allocator.malloc(30 * MIB))
    allocator.malloc(40 * MIB)  # 70 MiB fit in 100: nothing is collected
    assert allocator.reserved == 70 * MIB


def test_with_expandable_segments_a_memory_fraction_checks_the_allocation_size() -> None:
    """alloc_block tests `total_allocated_memory + p.alloc_size > allowed_memory_maximum`, with
    alloc_size = get_allocation_size(12 MiB) = 12 MiB, before mapping whole 20 MiB pages; so
    20 + 12 <= 35 passes and the second page is mapped (40 MiB reserved, over the fraction)."""
    config = AllocatorConfig(expandable_segments=True, per_process_memory_fraction=0.35)
    allocator = CachingAllocator(config, capacity=100 * MIB)
    allocator.malloc(12 * MIB)
    allocator.malloc(12 * MIB)
    assert (allocator.reserved, allocator.alloc_retries, allocator.ooms) == (40 * MIB, 0, 0)


def test_a_memory_fraction_caps_the_segments_a_cudamalloc_may_add() -> None:
    allocator = CachingAllocator(
        AllocatorConfig(per_process_memory_fraction=0.5), capacity=100 * MIB
    )
    allocator.malloc(30 * MIB)
    with pytest.raises(OutOfMemoryError):
        allocator.malloc(22 * MIB)  # 30 + 22 > 50
    allocator.malloc(20 * MIB)
    assert allocator.reserved == 50 * MIB


# -- peaks --------------------------------------------------------------------------------------


def test_reset_peaks_starts_from_the_current_levels() -> None:
    allocator = CachingAllocator()
    big = allocator.malloc(100 * MIB)
    allocator.free(big)
    allocator.reset_peaks()
    assert (allocator.peak_allocated, allocator.peak_reserved) == (0, 100 * MIB)
    allocator.malloc(10 * MIB)
    assert (allocator.peak_allocated, allocator.peak_reserved) == (10 * MIB, 100 * MIB)


# -- configuration ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings_", "field"),
    [
        ({"max_split_size_mb": 19}, "allocator.max_split_size_mb"),
        ({"max_non_split_rounding_mb": 0}, "allocator.max_non_split_rounding_mb"),
        ({"roundup_power2_divisions": 3}, "allocator.roundup_power2_divisions"),
        ({"roundup_power2_divisions": -2}, "allocator.roundup_power2_divisions"),
        ({"garbage_collection_threshold": 1.0}, "allocator.garbage_collection_threshold"),
        ({"garbage_collection_threshold": -0.1}, "allocator.garbage_collection_threshold"),
        ({"per_process_memory_fraction": 1.5}, "allocator.per_process_memory_fraction"),
        ({"per_process_memory_fraction": -0.1}, "allocator.per_process_memory_fraction"),
    ],
)
def test_invalid_settings_name_their_field(settings_: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidSpecError) as raised:
        AllocatorConfig(**settings_)
    assert raised.value.field == field
    assert isinstance(raised.value, ValueError)


def test_max_split_size_mb_accepts_20() -> None:
    """torch 2.13 (AcceleratorAllocatorConfig::parseMaxSplitSize, c10/core/AllocatorConfig.cpp)
    checks `val_env >= kLargeBuffer / kMB`: 20 is allowed ("must be >= 20")."""
    assert AllocatorConfig(max_split_size_mb=20).max_split_size == 20 * MIB


def test_max_non_split_rounding_mb_below_20_is_rejected() -> None:
    """torch 2.13 (AcceleratorAllocatorConfig::parseMaxNonSplitRoundingSize) rejects values
    under kLargeBuffer / kMB: "max_non_split_rounding_mb too small, must be >= 20"."""
    with pytest.raises(InvalidSpecError) as raised:
        AllocatorConfig(max_non_split_rounding_mb=5)
    assert raised.value.field == "allocator.max_non_split_rounding_mb"


def test_defaults_are_pytorchs() -> None:
    config = AllocatorConfig()
    assert config.is_default
    assert (config.max_split_size, config.max_non_split_rounding) == (None, 20 * MIB)
    assert not AllocatorConfig(expandable_segments=True).is_default


# -- invariants over generated sequences ------------------------------------------------------

REQUEST_SIZES = st.one_of(
    st.integers(1, SMALL_SIZE),  # the small pool
    st.integers(SMALL_SIZE + 1, MIN_LARGE_ALLOC - 1),  # 20 MiB segments
    st.integers(MIN_LARGE_ALLOC, 256 * MIB),  # a segment each
)
CONFIGS = {
    "default": AllocatorConfig(),
    "max_split_64": AllocatorConfig(max_split_size_mb=64),
    "max_split_64_rounding_128": AllocatorConfig(
        max_split_size_mb=64, max_non_split_rounding_mb=128
    ),
    "roundup_4": AllocatorConfig(roundup_power2_divisions=4),
    "expandable": AllocatorConfig(expandable_segments=True),
}
# ("malloc", size) or ("free", which live handle, taken modulo their count).
OPERATIONS = st.lists(
    st.one_of(
        st.tuples(st.just("malloc"), REQUEST_SIZES),
        st.tuples(st.just("free"), st.integers(0, 1 << 16)),
    ),
    max_size=60,
)


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@settings(max_examples=100, deadline=None, derandomize=True)
@given(operations=OPERATIONS)
def test_levels_stay_consistent_without_a_capacity(
    config: AllocatorConfig, operations: list[tuple[str, int]]
) -> None:
    allocator = CachingAllocator(config)
    live: list[tuple[int, int]] = []  # (handle, bytes its block added to `allocated`)
    for kind, value in operations:
        reserved_before, allocated_before = allocator.reserved, allocator.allocated
        if kind == "malloc":
            handle = allocator.malloc(value)
            block = allocator.allocated - allocated_before
            assert block >= round_size(value, config)
            live.append((handle, block))
        elif live:
            handle, block = live.pop(value % len(live))
            allocator.free(handle)
            assert allocator.allocated == allocated_before - block
        # Nothing goes back to the driver without capacity pressure or empty_cache.
        assert allocator.reserved >= reserved_before
        assert allocator.allocated <= allocator.reserved
        assert allocator.peak_allocated <= allocator.peak_reserved
        assert allocator.reserved <= allocator.peak_reserved
        assert (allocator.alloc_retries, allocator.ooms) == (0, 0)
    for handle, _ in live:
        allocator.free(handle)
    assert allocator.allocated == 0
    allocator.empty_cache()  # every segment is whole again: all of it goes back
    assert allocator.reserved == 0


# Expandable segments map pages rather than whole segments: `segment_size` is not what a
# cudaMalloc would add there.
SEGMENT_CONFIGS = {name: config for name, config in CONFIGS.items() if name != "expandable"}


@pytest.mark.parametrize("config", SEGMENT_CONFIGS.values(), ids=SEGMENT_CONFIGS.keys())
@settings(max_examples=100, deadline=None, derandomize=True)
@given(operations=OPERATIONS)
def test_under_a_capacity_memory_is_only_released_when_a_segment_would_not_fit(
    config: AllocatorConfig, operations: list[tuple[str, int]]
) -> None:
    capacity = 512 * MIB
    allocator = CachingAllocator(config, capacity=capacity)
    live: list[int] = []
    for kind, value in operations:
        reserved_before = allocator.reserved
        if kind == "malloc":
            needed = segment_size(round_size(value, config))
            try:
                live.append(allocator.malloc(value))
            except OutOfMemoryError as error:
                # Only what is split around live blocks is left, and the segment does not fit.
                assert error.reserved + needed > capacity
                assert allocator.reserved == error.reserved
            if allocator.reserved < reserved_before:
                assert reserved_before + needed > capacity
        elif live:
            allocator.free(live.pop(value % len(live)))
            assert allocator.reserved == reserved_before
        assert allocator.allocated <= allocator.reserved <= capacity
        assert allocator.peak_allocated <= allocator.peak_reserved <= capacity
    for handle in live:
        allocator.free(handle)
    assert allocator.allocated == 0
