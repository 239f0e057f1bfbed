"""PyTorch's CUDA caching allocator, replayed in pure Python: the reserved level by computation.

`torch.cuda.max_memory_reserved()` is what the caching allocator (DeviceCachingAllocator in
c10/cuda/CUDACachingAllocator.cpp, torch 2.x) has taken from the driver at its highest. It is a
deterministic function of the sequence of allocation sizes and frees on a stream, which this
module replays with the allocator's rules:

- every request is rounded up to 512 B (kMinBlockSize), or to a power-of-two division when
  `roundup_power2_divisions` is set (round_size);
- requests of at most 1 MiB (kSmallSize) come from the small pool, whose segments are 2 MiB
  (kSmallBuffer); requests under 10 MiB (kMinLargeAlloc) from the large pool in 20 MiB segments
  (kLargeBuffer); larger ones get a segment of their size rounded up to 2 MiB (kRoundLarge)
  (get_allocation_size);
- a request takes the smallest cached free block of its pool that fits, the lowest address
  among equal sizes (get_free_block: BlockComparatorSize); with `max_split_size` set, blocks at
  or above it serve only requests at or above it, within `max_non_split_rounding_size`;
- the block is split when what remains is at least 512 B (small pool, expandable segments) or
  more than 1 MiB (large pool; never for requests of `max_split_size` or more) (should_split);
- a freed block merges with free neighbours of its segment (free_block, try_merge_blocks);
  segments are only returned to the driver by `empty_cache` or when a cudaMalloc fails: then
  the allocator frees cached oversize blocks (with `max_split_size` set), then every unsplit
  cached segment, and retries (release_available_cached_blocks, release_cached_blocks);
- with `garbage_collection_threshold` and a memory fraction, cached unsplit blocks older than
  the average are freed before a segment is allocated once reserved passes the threshold
  (garbage_collect_cached_blocks);
- with `expandable_segments`, each pool maps pages (2 MiB small, 20 MiB large) at the end of one
  growing segment instead of making new segments (try_allocate_expandable_block).

One stream is modelled (a training step runs on the default stream). Addresses matter only where
free blocks of equal size tie; they are modelled as the CUDA driver hands them out on an H200
(CUDA 13, driver 580): each new segment just below the previous one. With that, replaying the
allocation history that torch recorded on the GPU gives its reserved peak to the byte
(tests/data/gpu/allocator/; increasing addresses miss one of those peaks by 1.2 GiB).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from service.core.errors import InvalidSpecError
from service.core.fields import job_field
from service.core.libs.torch_allocator import (
    DEFAULT_NON_SPLIT_ROUNDING,
    LARGE_BUFFER,
    MIN_BLOCK,
    MIN_LARGE_ALLOC,
    MIN_SPLIT_SETTING_MB,
    ROUND_LARGE,
    SMALL_BUFFER,
    SMALL_SIZE,
)
from service.core.limits import MAX_ALLOC_SETTING_MB, MAX_ROUNDUP_POWER2_DIVISIONS
from service.core.units import MIB

# Address space of an expandable segment: more than any step a spec can describe asks for
# (on a GPU the allocator reserves 1 1/8 of the device's memory, ExpandableSegment's
# constructor; the model has no device, so without a `capacity` a replay never runs out).
EXPANDABLE_SPACE = 1 << 100
# Where the modelled address space ends; segments are placed downwards from it (the two
# pools' expandable segments fit below it).
ADDRESS_TOP = 1 << 102


@dataclass(frozen=True, slots=True, kw_only=True)
class AllocatorConfig:
    """`PYTORCH_CUDA_ALLOC_CONF` settings, PyTorch's defaults when left as they are."""

    # None: every block may be split
    max_split_size_mb: int | None = job_field(
        None,
        doc="Blocks this large are never split.",
        ge=MIN_SPLIT_SETTING_MB,
        le=MAX_ALLOC_SETTING_MB,
    )
    # None: 20 MiB (kLargeBuffer)
    max_non_split_rounding_mb: int | None = job_field(
        None,
        doc="How much larger an unsplit block may be than a large request.",
        ge=MIN_SPLIT_SETTING_MB,
        le=MAX_ALLOC_SETTING_MB,
    )
    # 0 or 1: plain 512 B rounding
    roundup_power2_divisions: int = job_field(
        0, doc="Round sizes to power-of-two divisions.", ge=0, le=MAX_ROUNDUP_POWER2_DIVISIONS
    )
    # acts only with a memory fraction set
    garbage_collection_threshold: float = job_field(
        0.0,
        doc="Free cached blocks past this share of the allowed memory (needs a fraction).",
        ge=0.0,
        lt=1.0,
    )
    expandable_segments: bool = job_field(
        False, doc="Grow segments page by page instead of new ones."
    )
    # torch.cuda.set_per_process_memory_fraction
    per_process_memory_fraction: float | None = job_field(
        None,
        doc="torch.cuda.set_per_process_memory_fraction, if the job sets one.",
        mirrors="torch.cuda.set_per_process_memory_fraction",
        ge=0.0,
        le=1.0,
    )

    def __post_init__(self) -> None:
        # c10/core/AllocatorConfig.cpp (torch 2.13): both sizes must be >= kLargeBuffer / kMB.
        if self.max_split_size_mb is not None and self.max_split_size_mb < MIN_SPLIT_SETTING_MB:
            raise InvalidSpecError(
                "allocator.max_split_size_mb", f"must be at least {MIN_SPLIT_SETTING_MB}"
            )
        rounding = self.max_non_split_rounding_mb
        if rounding is not None and rounding < MIN_SPLIT_SETTING_MB:
            raise InvalidSpecError(
                "allocator.max_non_split_rounding_mb", f"must be at least {MIN_SPLIT_SETTING_MB}"
            )
        divisions = self.roundup_power2_divisions
        if divisions < 0 or (divisions > 1 and divisions & (divisions - 1)):
            raise InvalidSpecError(
                "allocator.roundup_power2_divisions", "must be 0 or a power of two"
            )
        if not 0.0 <= self.garbage_collection_threshold < 1.0:
            raise InvalidSpecError("allocator.garbage_collection_threshold", "must be in [0, 1)")
        fraction = self.per_process_memory_fraction
        if fraction is not None and not 0.0 <= fraction <= 1.0:
            raise InvalidSpecError("allocator.per_process_memory_fraction", "must be in [0, 1]")

    @property
    def max_split_size(self) -> int | None:
        return None if self.max_split_size_mb is None else self.max_split_size_mb * MIB

    @property
    def max_non_split_rounding(self) -> int:
        mb = self.max_non_split_rounding_mb
        return DEFAULT_NON_SPLIT_ROUNDING if mb is None else mb * MIB

    @property
    def is_default(self) -> bool:
        return self == DEFAULT_ALLOCATOR


DEFAULT_ALLOCATOR = AllocatorConfig()

# PYTORCH_CUDA_ALLOC_CONF keys this model takes (c10/cuda/CUDAAllocatorConfig.cpp), and the
# ones it accepts and ignores because they do not change the device allocator's layout.
_CONF_INTS = ("max_split_size_mb", "max_non_split_rounding_mb", "roundup_power2_divisions")
_CONF_IGNORED = (
    "release_lock_on_cudamalloc",
    "pinned_use_cuda_host_register",
    "pinned_num_register_threads",
    "pinned_use_background_threads",
    "backend",
)


def parse_alloc_conf(text: str) -> AllocatorConfig:
    """An `AllocatorConfig` from a PYTORCH_CUDA_ALLOC_CONF string ("key:value,key:value");
    InvalidSpecError names the key that is wrong."""
    return AllocatorConfig(**alloc_conf_values(text))  # type: ignore[arg-type]


def alloc_conf_values(text: str) -> dict[str, object]:
    """The settings a PYTORCH_CUDA_ALLOC_CONF string gives, by `AllocatorConfig` field, not yet
    checked against each other; InvalidSpecError names a key that is unknown or unreadable."""
    values: dict[str, object] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, raw = item.partition(":")
        key, raw = key.strip(), raw.strip()
        field = f"allocator.{key}"
        if not sep or not raw:
            raise InvalidSpecError("allocator", f"{item!r} is not key:value")
        if key in _CONF_IGNORED:
            continue
        try:
            if key in _CONF_INTS:
                values[key] = int(raw)
            elif key == "garbage_collection_threshold":
                values[key] = float(raw)
            elif key == "expandable_segments":
                if raw not in ("True", "False"):
                    raise ValueError(raw)
                values[key] = raw == "True"
            else:
                raise InvalidSpecError(field, "not a PYTORCH_CUDA_ALLOC_CONF setting")
        except ValueError as exc:
            raise InvalidSpecError(field, f"{raw!r} is not a valid value") from exc
    return values


def round_size(nbytes: int, config: AllocatorConfig = DEFAULT_ALLOCATOR) -> int:
    """The block size a request of `nbytes` takes (round_size)."""
    if nbytes < MIN_BLOCK:
        return MIN_BLOCK
    divisions = config.roundup_power2_divisions
    if divisions > 1 and nbytes > MIN_BLOCK * divisions:
        return _roundup_power2_division(nbytes, divisions)
    return -(-nbytes // MIN_BLOCK) * MIN_BLOCK


def _roundup_power2_division(size: int, divisions: int) -> int:
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    base = size & ~(step - 1)
    return size if base == size else base + step


def segment_size(size: int) -> int:
    """The cudaMalloc size for a block of `size` that no cached block serves
    (get_allocation_size)."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass(frozen=True, slots=True)
class FrozenState:
    """An allocator's state whose allocated blocks are never freed (a loaded model's)."""

    reserved: int
    allocated: int
    segments: int
    next_address: int
    free_blocks: tuple[tuple[int, int, bool], ...]  # (size, address, small pool)


class OutOfMemoryError(Exception):
    """The replay needed more device memory than `capacity` even after freeing the cache."""

    def __init__(self, requested: int, allocated: int, reserved: int) -> None:
        super().__init__(
            f"out of memory: {requested} bytes requested with {allocated} allocated and "
            f"{reserved} reserved"
        )
        self.requested = requested
        self.allocated = allocated
        self.reserved = reserved


class _Block:
    __slots__ = (
        "addr",
        "allocated",
        "expandable",
        "gc_base",
        "mapped",
        "next",
        "pool",
        "prev",
        "size",
    )

    def __init__(self, pool: _Pool, addr: int, size: int, *, expandable: bool = False) -> None:
        self.pool = pool
        self.addr = addr
        self.size = size
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.allocated = False
        self.mapped = True
        self.expandable = expandable
        self.gc_base = 0

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


class _Pool:
    """Free blocks of one pool, ordered by (size, address) as BlockComparatorSize orders them."""

    __slots__ = ("blocks", "free_calls", "keys", "small", "unmapped")

    def __init__(self, *, small: bool) -> None:
        self.small = small
        self.keys: list[tuple[int, int]] = []
        self.blocks: dict[tuple[int, int], _Block] = {}
        self.unmapped: dict[int, _Block] = {}  # unmapped blocks of expandable segments, by addr
        self.free_calls = 0  # get_free_blocks_call_count, for garbage collection ages

    def insert(self, block: _Block) -> None:
        key = (block.size, block.addr)
        bisect.insort(self.keys, key)
        self.blocks[key] = block
        block.gc_base = self.free_calls

    def remove(self, block: _Block) -> None:
        key = (block.size, block.addr)
        del self.blocks[key]
        del self.keys[bisect.bisect_left(self.keys, key)]


class CachingAllocator:
    """The allocator's state over one stream; `malloc` returns a handle that `free` takes.

    `capacity`: device bytes the allocator may take from the driver (None: unlimited); beyond
    it a cudaMalloc fails, the cache is freed and the request retried, then OutOfMemoryError.
    `device_total`: the device's total memory, which a per-process memory fraction is of
    (cudaMemGetInfo's total; `capacity` when not given).
    """

    def __init__(
        self,
        config: AllocatorConfig = DEFAULT_ALLOCATOR,
        *,
        capacity: int | None = None,
        device_total: int | None = None,
    ) -> None:
        self.config = config
        fraction = config.per_process_memory_fraction
        self.capacity = capacity
        total = device_total if device_total is not None else capacity
        # set_fraction: the allowed maximum is fraction * the device's total memory
        # (setMemoryFraction); garbage collection acts only then.
        self.allowed = int(total * fraction) if total is not None and fraction is not None else None
        self._collect = config.garbage_collection_threshold > 0 and self.allowed is not None
        self._split_max = config.max_split_size
        self._rounding = config.max_non_split_rounding
        self._small = _Pool(small=True)
        self._large = _Pool(small=False)
        self._live: dict[int, _Block] = {}
        self._next_handle = 0
        self._next_addr = ADDRESS_TOP
        self._expandable: dict[bool, int] = {}  # pool.small -> the segment's base address
        self.allocated = 0
        self.reserved = 0
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.segments = 0
        self.alloc_retries = 0
        self.ooms = 0

    # -- public operations ----------------------------------------------------------------

    def malloc(self, nbytes: int) -> int:
        size = round_size(nbytes, self.config)
        pool = self._small if size <= SMALL_SIZE else self._large
        block = self._find_free(pool, size)
        if block is None:
            block = self._new_block(pool, size)
        if self._should_split(block, size):
            block = self._split(block, size)
        block.allocated = True
        self.allocated += block.size
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        handle = self._next_handle
        self._next_handle += 1
        self._live[handle] = block
        return handle

    def free(self, handle: int) -> None:
        block = self._live.pop(handle)
        block.allocated = False
        self.allocated -= block.size
        pool = block.pool
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated and neighbour.mapped:
                self._merge(block, neighbour)
        pool.insert(block)

    def frozen_state(self) -> FrozenState:
        """This allocator's state, for an allocator in which every allocated block stays
        allocated (`resume`): its totals, where new segments go, and its free blocks."""
        blocks = tuple(
            (size, addr, pool.small)
            for pool in (self._large, self._small)
            for size, addr in pool.keys
            if not pool.blocks[(size, addr)].expandable
        )
        return FrozenState(
            reserved=self.reserved,
            allocated=self.allocated,
            segments=self.segments,
            next_address=self._next_addr,
            free_blocks=blocks,
        )

    def resume(self, state: FrozenState) -> None:
        """Start from `state` (a fresh allocator with the same config): its free blocks lie
        inside segments that also hold allocated blocks, so they are never merged together
        nor released on their own."""
        self.reserved = self.peak_reserved = state.reserved
        self.allocated = self.peak_allocated = state.allocated
        self.segments = state.segments
        self._next_addr = state.next_address
        for size, addr, small in state.free_blocks:
            pool = self._small if small else self._large
            block = _Block(pool, addr, size)
            pinned = _Block(pool, addr - MIN_BLOCK, MIN_BLOCK)
            pinned.allocated = True
            pinned.next, block.prev = block, pinned
            pool.insert(block)

    def reset_peaks(self) -> None:
        """torch.cuda.reset_peak_memory_stats()."""
        self.peak_allocated = self.allocated
        self.peak_reserved = self.reserved

    def empty_cache(self) -> None:
        """torch.cuda.empty_cache(): every unsplit cached segment goes back to the driver."""
        self._release_cached()

    # -- finding a block --------------------------------------------------------------------

    def _find_free(self, pool: _Pool, size: int) -> _Block | None:
        if self._collect:
            pool.free_calls += 1
        keys = pool.keys
        i = bisect.bisect_left(keys, (size, -1))
        if i == len(keys):
            return None
        block = pool.blocks[keys[i]]
        if block.expandable:
            # Best fit counts an expandable block's unmapped tail as room it can grow into.
            def room(b: _Block) -> int:
                tail = b.next
                return b.size + (tail.size if tail is not None and not tail.mapped else 0)

            while block.expandable and i + 1 < len(keys):
                candidate = pool.blocks[keys[i + 1]]
                if room(candidate) >= room(block):
                    break
                i += 1
                block = candidate
        split_max = self._split_max
        if split_max is not None:
            if size < split_max <= block.size:
                return None  # an oversize block never serves a smaller request
            if size >= split_max and block.size >= size + self._rounding:
                return None
        pool.remove(block)
        return block

    def _should_split(self, block: _Block, size: int) -> bool:
        remaining = block.size - size
        if block.pool.small or self.config.expandable_segments:
            return remaining >= MIN_BLOCK
        split_max = self._split_max
        return (split_max is None or size < split_max) and remaining > SMALL_SIZE

    def _split(self, block: _Block, size: int) -> _Block:
        """Hand out the first `size` bytes of free `block`; the rest stays cached."""
        head = _Block(block.pool, block.addr, size, expandable=block.expandable)
        head.prev = block.prev
        if head.prev is not None:
            head.prev.next = head
        head.next = block
        block.prev = head
        block.addr += size
        block.size -= size
        block.pool.insert(block)
        return head

    def _merge(self, block: _Block, neighbour: _Block) -> None:
        neighbour.pool.remove(neighbour)
        _join(block, neighbour)

    # -- new memory from the driver ---------------------------------------------------------

    def _new_block(self, pool: _Pool, size: int) -> _Block:
        if self._collect:
            self._garbage_collect()
        block = self._alloc_segment(pool, size)
        if block is None and self._release_oversize(pool, size):
            block = self._alloc_segment(pool, size)
        if block is None:
            self._release_cached()
            self.alloc_retries += 1
            block = self._alloc_segment(pool, size)
        if block is None:
            self.ooms += 1
            raise OutOfMemoryError(size, self.allocated, self.reserved)
        return block

    def _allowed(self, size: int) -> bool:
        """alloc_block's memory-fraction check: reserved plus the request's allocation size."""
        return self.allowed is None or self.reserved + segment_size(size) <= self.allowed

    def _fits(self, nbytes: int) -> bool:
        """Whether the driver can hand out `nbytes` more (cudaMalloc / cuMemCreate)."""
        return self.capacity is None or self.reserved + nbytes <= self.capacity

    def _grow(self, nbytes: int) -> None:
        self.reserved += nbytes
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved

    def _alloc_segment(self, pool: _Pool, size: int) -> _Block | None:
        if not self._allowed(size):
            return None
        if self.config.expandable_segments:
            return self._alloc_expandable(pool, size)
        nbytes = segment_size(size)
        if not self._fits(nbytes):
            return None
        self._next_addr -= nbytes
        block = _Block(pool, self._next_addr, nbytes)
        self.segments += 1
        self._grow(nbytes)
        return block

    def _alloc_expandable(self, pool: _Pool, size: int) -> _Block | None:
        """Map pages at the lowest unmapped address of the pool's segment that, with the free
        block before it, holds `size` (find_expandable_block, try_allocate_expandable_block)."""
        if pool.small not in self._expandable:
            # One segment per pool, its address space larger than any device.
            self._next_addr -= EXPANDABLE_SPACE
            head = _Block(pool, self._next_addr, EXPANDABLE_SPACE, expandable=True)
            head.mapped = False
            self._expandable[pool.small] = head.addr
            pool.unmapped[head.addr] = head
            self.segments += 1
        candidate = None
        for addr in sorted(pool.unmapped):
            start = pool.unmapped[addr]
            if start.prev is not None and not start.prev.allocated:
                start = start.prev
            room = 0
            b: _Block | None = start
            while room < size and b is not None and not b.allocated:
                room += b.size
                b = b.next
            if room >= size:
                candidate = start
                break
        if candidate is None:  # pragma: no cover - the address space exceeds any request
            return None
        if not candidate.mapped:
            candidate = self._map(candidate, min(candidate.size, size))
            if candidate is None:
                return None
        else:
            pool.remove(candidate)
        while candidate.size < size:
            tail = candidate.next
            if tail is None:  # pragma: no cover - the search found room
                return None
            pool.insert(candidate)
            mapped = self._map(tail, min(size - candidate.size, tail.size))
            if mapped is None:
                return None
            candidate = mapped
        return candidate

    def _map(self, block: _Block, nbytes: int) -> _Block | None:
        """map_block: back the first `nbytes` of unmapped `block` (rounded up to pages) with
        memory, merged with free mapped neighbours; the result is out of the free pool."""
        pool = block.pool
        page = SMALL_BUFFER if pool.small else LARGE_BUFFER
        need = min(-(-nbytes // page) * page, block.size)
        if not self._fits(need):
            return None
        del pool.unmapped[block.addr]
        if need < block.size:
            rest = _Block(pool, block.addr + need, block.size - need, expandable=True)
            rest.mapped = False
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = need
            pool.unmapped[rest.addr] = rest
        block.mapped = True
        self._grow(need)
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.mapped and not neighbour.allocated:
                self._merge(block, neighbour)
        return block

    def _release_oversize(self, pool: _Pool, size: int) -> bool:
        """release_available_cached_blocks: free cached blocks of max_split_size or more."""
        split_max = self._split_max
        if split_max is None:
            return False
        target = max(size, split_max)
        keys = pool.keys
        i = bisect.bisect_left(keys, (target, -1))
        while i < len(keys) and pool.blocks[keys[i]].expandable:
            i += 1
        if i < len(keys):
            self._release_block(pool.blocks[keys[i]])
            return True
        released = 0
        for key in reversed(list(keys)):
            block = pool.blocks[key]
            if released >= target or block.size < split_max:
                break
            if not block.expandable and not block.is_split():
                released += block.size
                self._release_block(block)
        return released >= target

    def _release_cached(self) -> None:
        """release_cached_blocks: every cached block that is a whole segment goes back; the
        free pages of expandable segments are unmapped."""
        for pool in (self._large, self._small):
            for key in list(pool.keys):
                block = pool.blocks[key]
                if block.expandable:
                    self._unmap(block)
                elif not block.is_split():
                    self._release_block(block)

    def _release_block(self, block: _Block) -> None:
        block.pool.remove(block)
        self.reserved -= block.size
        self.segments -= 1

    def _unmap(self, block: _Block) -> None:
        """Unmap the whole pages inside a free block of an expandable segment."""
        page = SMALL_BUFFER if block.pool.small else LARGE_BUFFER
        base = self._expandable.get(block.pool.small, 0)
        first = base + -(-(block.addr - base) // page) * page
        last = base + (block.addr + block.size - base) // page * page
        if last <= first:
            return
        pool = block.pool
        pool.remove(block)
        end = block.addr + block.size
        if first > block.addr:  # a free sliver before the unmapped pages
            before = _Block(pool, block.addr, first - block.addr, expandable=True)
            before.prev, before.next = block.prev, block
            if block.prev is not None:
                block.prev.next = before
            block.prev = before
            pool.insert(before)
        if end > last:  # and after them
            after = _Block(pool, last, end - last, expandable=True)
            after.prev, after.next = block, block.next
            if block.next is not None:
                block.next.prev = after
            block.next = after
            pool.insert(after)
        block.addr, block.size, block.mapped = first, last - first, False
        self.reserved -= block.size
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.mapped:
                del pool.unmapped[neighbour.addr]
                _join(block, neighbour)
        pool.unmapped[block.addr] = block

    def _garbage_collect(self) -> None:
        """garbage_collect_cached_blocks: past the threshold, free cached unsplit large blocks
        whose age (get_free_block calls since they were cached) is at least the average."""
        allowed = self.allowed or 0
        threshold = int(self.config.garbage_collection_threshold * allowed)
        if self.reserved <= threshold:
            return
        target = self.reserved - threshold
        pool = self._large
        freeable = [pool.blocks[k] for k in pool.keys if not pool.blocks[k].is_split()]
        ages = {id(b): pool.free_calls - b.gc_base for b in freeable}
        total_age = sum(ages.values())
        reclaimed = 0
        while reclaimed < target and freeable:
            threshold_age = total_age / len(freeable)
            kept = []
            for block in freeable:
                age = ages[id(block)]
                if age >= threshold_age:
                    reclaimed += block.size
                    total_age -= age
                    self._release_block(block)
                else:
                    kept.append(block)
            if len(kept) == len(freeable):
                break
            freeable = kept


def _join(block: _Block, neighbour: _Block) -> None:
    """Take `neighbour`, the block before or after `block` in its segment, into `block`."""
    if neighbour is block.prev:
        block.addr = neighbour.addr
        block.prev = neighbour.prev
        if block.prev is not None:
            block.prev.next = block
    else:
        block.next = neighbour.next
        if block.next is not None:
            block.next.prev = block
    block.size += neighbour.size
