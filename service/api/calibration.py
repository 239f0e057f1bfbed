"""The seam through which measured peaks correct estimates: a provider of calibrated peaks.

Every estimate and fit-check asks the app's one `FactorProvider` (the `FactorProviderDep`
dependency) for its peaks. `CachedFactors` applies the factors that a replica's
`FactorCache` holds: requests only read that cache, never the database, and `keep_fresh`
reloads it in a worker thread. When the store is down, estimates carry the last factors
loaded (`stale`) or none (`none`), and say which.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Protocol

from service.calibration_service import FactorCache, FactorState
from service.core.calibration import AppliedFactor, Level
from service.core.result import Levels

SCOPE_NONE = "none"
# How often a replica checks whether its factors are due for a reload (their TTL passed, or
# an upload invalidated them): factors are at most the cache's TTL plus this old.
REFRESH_TICK_S = 1.0

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class LevelFactor:
    """The factor that corrected one peak level."""

    level: Level
    scope: str  # the calibration scope the factor came from (model_gpu, model, global, ...)
    factor: float  # measured / estimated, multiplied into the estimate
    nodes: int  # training nodes whose measurements voted
    samples: int  # measured runs behind the factor


@dataclass(frozen=True, slots=True, kw_only=True)
class AppliedCalibration:
    """Which factors corrected the estimate. `scope` to `samples` describe the device level's
    (the safe bound's level) factor, if any; `levels` lists every level's."""

    applied: bool
    scope: str  # "none", or the calibration scope the device factor came from
    factor: float | None  # measured / estimated, multiplied into the estimate
    upper_multiplier: float | None  # the calibrated spread above the factor
    nodes: int  # training nodes whose measurements voted
    samples: int  # measured runs behind the factor
    levels: tuple[LevelFactor, ...] = ()
    # The factor table used: fresh, stale (the store is unreachable: the last one loaded) or
    # none (nothing could be loaded).
    state: FactorState = FactorState.NONE


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
        self, estimate: Levels, *, model: str, method: str, gpu: str | None
    ) -> CalibratedPeaks: ...

    def generation(self) -> object:
        """An object that stays the same (`is`) exactly while `peaks` answers as it does
        now: answers computed under another generation are stale."""
        ...


class CachedFactors:
    """The store's factors, as this replica's cache holds them (never waiting on a load)."""

    def __init__(self, cache: FactorCache) -> None:
        self.cache = cache

    def generation(self) -> object:
        # A snapshot is replaced, never changed, when the factors or their state change.
        return self.cache.peek()

    def peaks(
        self, estimate: Levels, *, model: str, method: str, gpu: str | None
    ) -> CalibratedPeaks:
        snapshot = self.cache.peek()
        calibrator = snapshot.table.calibrator(model=model, method=method, gpu=gpu)
        calibrated = calibrator.apply(estimate)
        return CalibratedPeaks(
            allocated_bytes=calibrated.allocated_bytes,
            reserved_bytes=calibrated.reserved_bytes,
            device_bytes=calibrated.device_bytes,
            device_bytes_upper=calibrated.device_bytes_upper,
            calibration=applied_calibration(calibrated.applied, snapshot.state),
        )


# What an uncalibrated estimate says of itself, per state of the factor table.
_UNCALIBRATED = {state: replace(NOT_APPLIED, state=state) for state in FactorState}


def applied_calibration(
    applied: Mapping[Level, AppliedFactor], state: FactorState
) -> AppliedCalibration:
    if not applied:
        return _UNCALIBRATED[state]
    levels = tuple(
        LevelFactor(
            level=level,
            scope=found.key.scope.value,
            factor=found.factor.ratio,
            nodes=found.factor.nodes,
            samples=found.factor.runs,
        )
        for level, found in applied.items()
    )
    device = applied.get(Level.DEVICE)
    if device is None:
        return AppliedCalibration(
            applied=bool(levels),
            scope=SCOPE_NONE,
            factor=None,
            upper_multiplier=None,
            nodes=0,
            samples=0,
            levels=levels,
            state=state,
        )
    return AppliedCalibration(
        applied=True,
        scope=device.key.scope.value,
        factor=device.factor.ratio,
        upper_multiplier=device.factor.upper_multiplier,
        nodes=device.factor.nodes,
        samples=device.factor.runs,
        levels=levels,
        state=state,
    )


async def keep_fresh(cache: FactorCache, tick_s: float = REFRESH_TICK_S) -> None:
    """Reload `cache` in a worker thread whenever it is due; runs until cancelled."""
    while True:
        await asyncio.sleep(tick_s)
        try:
            await asyncio.to_thread(cache.get)
        except Exception:
            # The cache turns database errors into a stale state; anything else is a bug,
            # and the next tick tries again.
            logger.exception("reloading the calibration factors failed")
