"""The seam through which measured peaks correct estimates: a provider of calibrated peaks.

Every estimate and fit-check asks the app's one `FactorProvider` (the `FactorProviderDep`
dependency) for its peaks. Until the store supplies factors, `Uncalibrated` returns the
estimator's own peaks and says that no calibration applied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from service.core.result import Estimate

SCOPE_NONE = "none"


@dataclass(frozen=True, slots=True, kw_only=True)
class AppliedCalibration:
    """Which factor corrected the device level (the safe bound's level), if any."""

    applied: bool
    scope: str  # "none", or the calibration scope the factor came from (model, global, ...)
    factor: float | None  # measured / estimated, multiplied into the estimate
    upper_multiplier: float | None  # the calibrated spread above the factor
    nodes: int  # training nodes whose measurements voted
    samples: int  # measured runs behind the factor


NOT_APPLIED = AppliedCalibration(
    applied=False, scope=SCOPE_NONE, factor=None, upper_multiplier=None, nodes=0, samples=0
)


@dataclass(frozen=True, slots=True, kw_only=True)
class CalibratedPeaks:
    """An estimate's three peak levels and safe bound after calibration, bytes."""

    allocated_bytes: int
    reserved_bytes: int
    device_bytes: int
    device_bytes_upper: int
    calibration: AppliedCalibration


class FactorProvider(Protocol):
    """Turns an estimate into calibrated peaks for one model, method and (optional) GPU."""

    def peaks(
        self, estimate: Estimate, *, model: str, method: str, gpu: str | None
    ) -> CalibratedPeaks: ...


class Uncalibrated:
    """No measurements yet: the estimator's peaks, with its stated prior margin."""

    def peaks(
        self, estimate: Estimate, *, model: str, method: str, gpu: str | None
    ) -> CalibratedPeaks:
        return CalibratedPeaks(
            allocated_bytes=estimate.allocated_bytes,
            reserved_bytes=estimate.reserved_bytes,
            device_bytes=estimate.device_bytes,
            device_bytes_upper=estimate.device_bytes_upper,
            calibration=NOT_APPLIED,
        )
