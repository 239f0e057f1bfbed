"""The levels above the allocated one: reserved (the caching allocator), device (NVML), and the
safe bound a scheduler places jobs by.

- reserved: the step's allocation schedule replayed through the caching allocator model
  (`service.core.reserved`), exact at batch sizes and sequence lengths that are powers of two,
  interpolated between the two surrounding ones otherwise.
- device: reserved plus what the process holds outside the allocator, from a table by GPU
  architecture and CUDA version (`service.core.device`), plus paged optimizer state.
- safe bound: the device level plus `SAFE_Z` standard deviations of the estimate's stated
  uncertainty, each level's own (`Uncertainty`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from service.core.device import DeviceRow
from service.core.result import Overhead

# One-sided 95 % normal quantile: the safe bound is exceeded in at most 5 % of runs whose
# errors follow the stated uncertainty (Phi^-1(0.95) = 1.6449, e.g. NIST/SEMATECH e-Handbook
# of Statistical Methods, table 1.3.6.7.1).
SAFE_Z = 1.6449


@dataclass(frozen=True, slots=True, kw_only=True)
class Uncertainty:
    """Relative standard deviations of an estimate's levels, each over the level below it."""

    allocated: float  # of the allocated level
    reserved: float  # of reserved - allocated (the allocator's share)
    loading_bytes: int = 0  # of reserved, from how the weights were loaded (bytes)
    # of reserved - allocated as a share of allocated, where no schedule models that gap
    reserved_unmodelled: float = 0.0
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class AboveAllocated:
    reserved: int
    device: int
    device_upper: int
    upper_margin: float
    overheads: dict[Overhead, int]
    assumptions: tuple[str, ...]


def levels(
    *,
    allocated: int,
    reserved: int,
    paged_state: int,
    gpus: int,
    row: DeviceRow,
    uncertainty: Uncertainty,
    reserved_note: str = "",
) -> AboveAllocated:
    """Device level and safe bound over an allocated peak and its reserved level; the
    `reserved_note` says how the reserved level was found, where it needs saying."""
    math_ = LevelMath(paged_state=paged_state, gpus=gpus, row=row, uncertainty=uncertainty)
    return math_.above(allocated, reserved, reserved_note)


class LevelMath:
    """`levels`' arithmetic for one device row, uncertainty, paged optimizer state and GPU
    count, worked out once: the reserved level, device level and safe bound over any allocated
    peak and reserved level (what a fit-check's curves evaluate dozens of times)."""

    __slots__ = (
        "_allocated",
        "_loading",
        "_outside",
        "_paged",
        "_reserved",
        "_row",
        "_unmodelled",
        "row",
        "uncertainty",
    )

    def __init__(
        self, *, paged_state: int, gpus: int, row: DeviceRow, uncertainty: Uncertainty
    ) -> None:
        self.row = row
        self.uncertainty = uncertainty
        paged = row.paged_bytes(paged_state)
        self._outside = row.outside_bytes + paged + (row.nccl_bytes if gpus > 1 else 0)
        self._allocated = uncertainty.allocated
        self._reserved = uncertainty.reserved
        self._unmodelled = uncertainty.reserved_unmodelled
        # the sum's terms that do not depend on the levels, kept in its order
        self._loading = uncertainty.loading_bytes**2
        self._row = row.uncertainty_bytes**2
        self._paged = (row.paged_uncertainty * paged) ** 2

    def numbers(self, allocated: int, reserved: int) -> tuple[int, int, int]:
        """The reserved level, the device level and the safe bound."""
        reserved = max(reserved, allocated)
        device = reserved + self._outside
        sigma = math.sqrt(
            (self._allocated * allocated) ** 2
            + (self._reserved * (reserved - allocated)) ** 2
            + self._loading
            + (self._unmodelled * allocated) ** 2
            + self._row
            + self._paged
        )
        return reserved, device, device + math.ceil(SAFE_Z * sigma)

    def above(self, allocated: int, reserved: int, reserved_note: str = "") -> AboveAllocated:
        """`levels`' answer: the levels, the overheads and the notes."""
        reserved, device, upper = self.numbers(allocated, reserved)
        row = self.row
        notes = _notes(row, self.uncertainty)
        return AboveAllocated(
            reserved=reserved,
            device=device,
            device_upper=upper,
            upper_margin=upper / device - 1 if device else 0.0,
            overheads={
                Overhead.ALLOCATOR: reserved - allocated,
                Overhead.CUDA_CONTEXT: row.context_bytes,
                Overhead.OUTSIDE_ALLOCATOR: device - reserved - row.context_bytes,
            },
            assumptions=(reserved_note, *notes) if reserved_note else notes,
        )


@lru_cache(maxsize=256)
def _notes(row: DeviceRow, uncertainty: Uncertainty) -> tuple[str, ...]:
    loading = (
        f"weights' loading {uncertainty.loading_bytes / 2**20:.0f} MiB, "
        if uncertainty.loading_bytes
        else ""
    )
    allocator = (
        f"allocator {uncertainty.reserved_unmodelled:.1%} of allocated (not modelled)"
        if uncertainty.reserved_unmodelled
        else f"allocator {uncertainty.reserved:.0%} of reserved - allocated"
    )
    return (
        row.note,
        f"safe bound: device level + {SAFE_Z:.3g} standard deviations of the stated "
        f"uncertainty (allocated {uncertainty.allocated:.1%}, {allocator}, {loading}"
        f"device row {row.uncertainty_bytes / 2**20:.0f} MiB)",
        *uncertainty.notes,
    )
