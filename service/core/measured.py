"""What a training node measured: the peak levels, a run's outcome, and the checks that refuse
peaks no real run can produce. Calibration (`service.core.calibration`) compares them with
the estimate of the same job."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from service.core.errors import EstimatorError
from service.core.result import Levels


class Level(StrEnum):
    """The three peak levels a node can measure (see the architecture notes)."""

    ALLOCATED = "allocated"
    RESERVED = "reserved"
    DEVICE = "device"


class Outcome(StrEnum):
    COMPLETED = "completed"
    OOM = "oom"  # the run died; its measured peak is a lower bound of what it needed


class ImplausibleMeasurementError(ValueError, EstimatorError):
    """Measured peaks that cannot be true; `field` names the offending value."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


@dataclass(frozen=True, slots=True, kw_only=True)
class Measured:
    """Peaks one run measured, bytes; a level the node did not measure is None."""

    allocated_bytes: int | None = None
    reserved_bytes: int | None = None
    device_bytes: int | None = None

    def at(self, level: Level) -> int | None:
        return {
            Level.ALLOCATED: self.allocated_bytes,
            Level.RESERVED: self.reserved_bytes,
            Level.DEVICE: self.device_bytes,
        }[level]

    def levels(self) -> dict[Level, int]:
        return {level: value for level in Level if (value := self.at(level)) is not None}


def check_measured(measured: Measured, *, gpu_memory_total_bytes: int) -> None:
    """Raise ImplausibleMeasurementError for peaks no real run can produce."""
    if gpu_memory_total_bytes <= 0:
        raise ImplausibleMeasurementError("gpu.memory_total_bytes", "must be positive")
    levels = measured.levels()
    if not levels:
        raise ImplausibleMeasurementError("measured", "at least one level must be measured")
    for level, value in levels.items():
        field = f"measured.{level}_bytes"
        if value <= 0:
            raise ImplausibleMeasurementError(field, f"a peak must be positive, got {value}")
        if value > gpu_memory_total_bytes:
            raise ImplausibleMeasurementError(
                field,
                f"{value} bytes is above the GPU's total memory ({gpu_memory_total_bytes})",
            )
    allocated, reserved = measured.allocated_bytes, measured.reserved_bytes
    if allocated is not None and reserved is not None and allocated > reserved:
        raise ImplausibleMeasurementError(
            "measured.allocated_bytes",
            f"allocated ({allocated}) cannot exceed reserved ({reserved}): "
            "the caching allocator reserves every allocated byte",
        )


def estimated_at(estimate: Levels, level: Level) -> int:
    if level is Level.ALLOCATED:
        return estimate.allocated_bytes
    if level is Level.RESERVED:
        return estimate.reserved_bytes
    return estimate.device_bytes
