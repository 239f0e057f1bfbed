"""The caching allocator's own event history, recorded on an H200, replayed through the model.

Each history in tests/data/gpu/allocator/ is torch.cuda.memory._record_memory_history of one
run of tests/data/gpu/h200_set2_traced.jsonl (two real training steps; the README there says
how). Replaying its allocations and frees through CachingAllocator must give the reserved level
the GPU had: its peak, byte for byte, and the per-step figures torch reported.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from service.core.allocator import SMALL_BUFFER, SMALL_SIZE, CachingAllocator
from service.core.units import MIB

DATA = Path(__file__).resolve().parents[1] / "data" / "gpu"
HISTORIES = DATA / "allocator"
RUNS = DATA / "h200_set2_traced.jsonl"
NAMES = sorted(path.name.removesuffix(".json.gz") for path in HISTORIES.glob("*.json.gz"))

# The history starts after `torch.empty(1, device="cuda")`: one 2 MiB small segment was already
# reserved (its 512 B block freed again) and appears in no event.
PREEXISTING_RESERVED = SMALL_BUFFER
# The probe counted allocations and frees from the start of the process (memory_stats'
# allocation.all.allocated / freed), so its counts include that one tensor.
PREEXISTING_ALLOCATIONS = 1
PREEXISTING_FREES = 1


@dataclass(frozen=True, slots=True)
class History:
    name: str
    events: list[tuple[int, int, int]]  # (action, address, size)
    alloc: int
    free_requested: int
    segment_alloc: int
    segment_free: int

    def real_reserved(self) -> list[int]:
        """Reserved bytes after each event, from the segment events."""
        reserved, levels = PREEXISTING_RESERVED, []
        for action, _, size in self.events:
            if action == self.segment_alloc:
                reserved += size
            elif action == self.segment_free:
                reserved -= size
            levels.append(reserved)
        return levels

    def preexisting_segment_address(self) -> int:
        """Where the driver put the segment that existed before the history began: freed by the
        first event (peft's prepare_model_for_kbit_training calls empty_cache before anything is
        allocated), or else holding the first small block at its start (best fit: its only
        free block)."""
        for action, address, size in self.events:
            if action == self.segment_free:
                return address
            if action == self.alloc and size <= SMALL_SIZE:
                return address
        raise AssertionError(f"{self.name}: no small allocation")


@cache
def load(name: str) -> History:
    with gzip.open(HISTORIES / f"{name}.json.gz", "rt") as f:
        raw = json.load(f)
    actions = raw["actions"]
    return History(
        name=name,
        events=[(int(a), int(b), int(c)) for a, b, c in raw["events"]],
        alloc=actions["alloc"],
        free_requested=actions["free_requested"],
        segment_alloc=actions["segment_alloc"],
        segment_free=actions["segment_free"],
    )


@cache
def runs() -> dict[str, dict[str, Any]]:
    with RUNS.open() as f:
        return {record["name"]: record for record in map(json.loads, f)}


@dataclass(slots=True)
class Replay:
    allocator: CachingAllocator
    # (step, mark) -> (allocated, reserved, peak allocated, peak reserved) at the probe's marks
    marks: dict[tuple[int, str], tuple[int, int, int, int]] = field(default_factory=dict)
    reserved_mismatches: int = 0  # allocs and frees after which reserved differs from the GPU's
    largest_reserved_gap: int = 0  # the largest such difference, either way
    address_mismatches: int = 0  # blocks handed out at another address than the GPU's


def step_marks(record: dict[str, Any]) -> list[tuple[int, str, int, int]]:
    """(step, mark, allocations, frees) in the history's own counts, in order."""
    marks = []
    for step in record["steps"]:
        for mark, (allocations, frees) in step["allocator_counts"].items():
            allocations -= PREEXISTING_ALLOCATIONS
            frees -= PREEXISTING_FREES
            marks.append((int(step["step"]), mark, allocations, frees))
    return marks


def replay(history: History, *, at_driver_addresses: bool = False) -> Replay:
    """Replay `history` through the model: alloc -> malloc(size), free_requested -> free (every
    free_completed follows its free_requested at once: one stream), a run of segment_free ->
    empty_cache. At each step start the peaks are reset, as the probe did.

    `at_driver_addresses` places each new segment where the driver placed it (the model otherwise
    places them just below the previous one), and counts every block handed out elsewhere."""
    allocator = CachingAllocator()
    if at_driver_addresses:
        _place_next_segment(allocator, history.preexisting_segment_address(), SMALL_BUFFER)
    allocator.free(allocator.malloc(1))  # the pre-existing segment and its freed 512 B block
    result = Replay(allocator)
    marks = step_marks(runs()[history.name])
    allocations = frees = 0
    previous = None

    def take_marks() -> None:
        while marks and marks[0][2:] == (allocations, frees):
            step, mark, _, _ = marks.pop(0)
            result.marks[step, mark] = (
                allocator.allocated,
                allocator.reserved,
                allocator.peak_allocated,
                allocator.peak_reserved,
            )
            if mark == "start":  # torch.cuda.reset_peak_memory_stats() before each step
                allocator.reset_peaks()

    handles: dict[int, int] = {}
    take_marks()
    for (action, address, size), real_reserved in zip(
        history.events, history.real_reserved(), strict=True
    ):
        if action == history.alloc:
            handles[address] = allocator.malloc(size)
            allocations += 1
            if at_driver_addresses and _address(allocator, handles[address]) != address:
                result.address_mismatches += 1
        elif action == history.free_requested:
            allocator.free(handles.pop(address))
            frees += 1
        elif action == history.segment_alloc:
            if at_driver_addresses:
                _place_next_segment(allocator, address, size)
        elif action == history.segment_free and previous != history.segment_free:
            allocator.empty_cache()
        previous = action
        if action in (history.alloc, history.free_requested):
            # Compared after the alloc a segment_alloc serves (it comes first) and after the
            # frees; a segment_free is compared at the next of those.
            gap = abs(allocator.reserved - real_reserved)
            result.reserved_mismatches += gap != 0
            result.largest_reserved_gap = max(result.largest_reserved_gap, gap)
            take_marks()
    assert not marks, f"{history.name}: marks never reached: {marks}"
    return result


def _place_next_segment(allocator: CachingAllocator, address: int, size: int) -> None:
    # The model hands out segments downwards from a private address counter.
    allocator._next_addr = address + size


def _address(allocator: CachingAllocator, handle: int) -> int:
    return allocator._live[handle].addr


@cache
def modelled(name: str) -> Replay:
    return replay(load(name))


@cache
def at_driver_addresses(name: str) -> Replay:
    return replay(load(name), at_driver_addresses=True)


def test_every_run_has_its_history() -> None:
    assert sorted(runs()) == NAMES
    assert len(NAMES) == 6


@pytest.mark.parametrize("name", NAMES)
def test_the_reserved_peak_is_the_gpus_to_the_byte(name: str) -> None:
    history = load(name)
    assert modelled(name).allocator.peak_reserved == max(history.real_reserved())


@pytest.mark.parametrize("name", NAMES)
def test_the_reserved_peak_is_the_measured_max_reserved(name: str) -> None:
    """The run's `max_reserved` is the highest max_memory_reserved() of its steps, each reset at
    the step's start (to the reserved level then). It equals the peak over the whole history,
    building the model included, because no segment went back to the driver once the first
    block was allocated: reserved never fell, so the peak is the level at the end of step 2,
    which step 2's window sees. (Both QLoRA histories start with a segment_free: peft's
    empty_cache releasing the pre-existing segment before anything was allocated.)"""
    history, record = load(name), runs()[name]
    first_alloc = next(i for i, event in enumerate(history.events) if event[0] == history.alloc)
    assert all(action != history.segment_free for action, _, _ in history.events[first_alloc:])
    assert (record["alloc_retries"], record["ooms"]) == (0, 0)
    assert max(history.real_reserved()) == record["max_reserved"] == record["end_reserved"]
    assert modelled(name).allocator.peak_reserved == record["max_reserved"]


@pytest.mark.parametrize("name", NAMES)
def test_the_allocated_level_of_each_step_is_the_measured_one(name: str) -> None:
    replayed = modelled(name).marks
    for step in runs()[name]["steps"]:
        n = int(step["step"])
        forward_allocated, _, forward_peak, _ = replayed[n, "forward_end"]
        backward_peak = replayed[n, "backward_end"][2]
        step_peak = replayed[n, "step_end"][2]
        assert (forward_allocated, forward_peak, backward_peak, step_peak) == (
            step["forward_end"],
            step["forward_peak"],
            step["backward_peak"],
            step["max_allocated"],
        )


@pytest.mark.parametrize("name", NAMES)
def test_at_the_drivers_addresses_every_block_and_every_level_is_the_gpus(name: str) -> None:
    """Addresses only break ties between equal free blocks; given the segments the driver
    handed out, the model puts every block where the GPU's allocator did and its reserved level
    equals the GPU's after every event, so the per-step reserved figures match as well. (With
    its own addresses a tie can go the other way: see the table.)"""
    replayed = at_driver_addresses(name)
    assert (replayed.address_mismatches, replayed.reserved_mismatches) == (0, 0)
    for step in runs()[name]["steps"]:
        n = int(step["step"])
        assert replayed.marks[n, "forward_end"][3] == step["forward_reserved"]
        assert replayed.marks[n, "step_end"][3] == step["max_reserved"]


def _step_reserved_gaps(replayed: Replay, record: dict[str, Any]) -> list[int]:
    gaps = []
    for step in record["steps"]:
        n = int(step["step"])
        gaps.append(replayed.marks[n, "forward_end"][3] - step["forward_reserved"])
        gaps.append(replayed.marks[n, "step_end"][3] - step["max_reserved"])
    return gaps


def test_replay_table() -> None:
    """`pytest -s` prints the replay of every history: the reserved peak of the model, of the
    GPU's history and as the run measured it; after how many allocs and frees the model's
    reserved level (with its own segment addresses) is off the GPU's, and by at most how much;
    and per step, the model's max_memory_reserved at the end of the forward pass and of the step
    less the measured one."""
    lines = [
        f"{'run':<26}{'events':>8}{'model peak':>16}{'GPU history':>16}{'measured':>16}"
        f"{'events off':>12}{'by, MiB':>9}  steps 1 and 2: forward, step (MiB)",
    ]
    for name in NAMES:
        history, record, replayed = load(name), runs()[name], modelled(name)
        gaps = _step_reserved_gaps(replayed, record)
        lines.append(
            f"{name:<26}{len(history.events):>8,}{replayed.allocator.peak_reserved:>16,}"
            f"{max(history.real_reserved()):>16,}{record['max_reserved']:>16,}"
            f"{replayed.reserved_mismatches:>12,}{replayed.largest_reserved_gap // MIB:>9}  "
            + " ".join(f"{gap // MIB:+d}" for gap in gaps)
        )
        assert replayed.allocator.peak_reserved == record["max_reserved"]
    print("\n" + "\n".join(lines))
