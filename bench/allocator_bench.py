"""How fast the caching-allocator model runs: malloc/free pairs, and one recorded GPU history
replayed end to end (tests/data/gpu/allocator/)."""

from __future__ import annotations

import gzip
import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from service.core.allocator import CachingAllocator

T = TypeVar("T")

HISTORY = (
    Path(__file__).resolve().parents[1] / "tests/data/gpu/allocator/l8-lora-b4s2048-gc.json.gz"
)
PAIRS = 20_000
LIVE = 256  # blocks held at once in the malloc/free sequence
REPEATS = 3  # best of


def _load(path: Path) -> dict[str, Any]:
    with gzip.open(path, "rt") as f:
        data: dict[str, Any] = json.load(f)
    return data


def _mixed_sequence(sizes: list[int], pairs: int, seed: int = 0) -> list[tuple[int, int]]:
    """(size, index of the live block to free after it) for `pairs` mallocs, sizes drawn from a
    recorded training step, so the small, 1-10 MiB and large pools are used as a step uses them."""
    rng = random.Random(seed)
    return [(rng.choice(sizes), rng.randrange(LIVE)) for _ in range(pairs)]


def time_pairs(sequence: list[tuple[int, int]]) -> float:
    """Seconds for one malloc and one free per entry, `LIVE` blocks held throughout."""
    allocator = CachingAllocator()
    live = [allocator.malloc(size) for size, _ in sequence[:LIVE]]
    started = time.perf_counter()
    for size, victim in sequence:
        allocator.free(live[victim])
        live[victim] = allocator.malloc(size)
    return time.perf_counter() - started


def replay(history: dict[str, Any]) -> CachingAllocator:
    """The history's allocs and frees through the model (the pre-existing 2 MiB segment first)."""
    actions = history["actions"]
    alloc, free, segment_free = (
        actions["alloc"],
        actions["free_requested"],
        actions["segment_free"],
    )
    allocator = CachingAllocator()
    allocator.free(allocator.malloc(1))
    handles: dict[int, int] = {}
    previous = None
    for action, address, size in history["events"]:
        if action == alloc:
            handles[address] = allocator.malloc(size)
        elif action == free:
            allocator.free(handles.pop(address))
        elif action == segment_free and previous != segment_free:
            allocator.empty_cache()
        previous = action
    return allocator


def _best(function: Callable[[], T]) -> tuple[float, T]:
    """The fastest of `REPEATS` calls, in seconds, and what the last call returned."""
    best = float("inf")
    for _ in range(REPEATS):
        started = time.perf_counter()
        result = function()
        best = min(best, time.perf_counter() - started)
    return best, result


def run() -> dict[str, Any]:
    """Microseconds per malloc/free pair and per replayed malloc or free."""
    load_s, history = _best(lambda: _load(HISTORY))
    actions, events = history["actions"], history["events"]
    sizes = [size for action, _, size in events if action == actions["alloc"]]
    sequence = _mixed_sequence(sizes, PAIRS)
    pair_s = min(time_pairs(sequence) for _ in range(REPEATS)) / PAIRS
    replay_s, allocator = _best(lambda: replay(history))
    operations = sum(
        1 for action, _, _ in events if action in (actions["alloc"], actions["free_requested"])
    )
    return {
        "malloc + free pair": f"{pair_s * 1e6:.2f} µs ({PAIRS:,} pairs, {LIVE} blocks live, "
        f"sizes drawn from {HISTORY.name})",
        "history replay": f"{replay_s / operations * 1e6:.2f} µs per malloc or free; "
        f"{replay_s * 1e3:.0f} ms for {HISTORY.name} ({len(events):,} events), "
        f"{load_s * 1e3:.0f} ms to load it",
        "replayed reserved peak": f"{allocator.peak_reserved:,} B",
    }


if __name__ == "__main__":
    for key, value in run().items():
        print(f"{key:<28}{value}")
