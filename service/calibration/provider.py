"""The seam through which measured peaks correct estimates: a provider of calibrated peaks.

Every estimate and fit-check asks the app's one `FactorProvider` for its peaks.
`CachedFactors` applies the factors that a replica's `FactorCache` holds, never waiting on a
load; the estimate says which factors applied and whether they are fresh, stale or none.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Protocol

from service.calibration.factors import FactorCache, FactorState
from service.core.calibration import AppliedFactor, Level, Scope
from service.core.result import Levels

# A job's calibrated levels: allocated, reserved, device and the safe bound, bytes.
LevelsFn = Callable[[Levels], tuple[int, int, int, int]]
SCOPE_NONE = "none"
# How the calibration notes name a factor's scope.
SCOPE_WORDS = {
    Scope.MODEL_GPU.value: "model+GPU",
    Scope.MODEL_ENVIRONMENT.value: "model+environment",
    Scope.MODEL.value: "model",
    Scope.GLOBAL.value: "cross-model",
}
_STALE_WORDS = "the store is unreachable: these are the last factors loaded"
_CALIBRATED_BOUND = "the device factor's spread, widened for few nodes"
_NONE_APPLIED = {
    FactorState.FRESH: "calibration: none applied (no factor for this model and method yet): "
    "the estimator's own numbers and safe-bound margin",
    FactorState.STALE: "calibration: none applied (the store is unreachable, and the last "
    "factors loaded have none for this job): the estimator's own numbers and safe-bound margin",
    FactorState.NONE: "calibration: none applied (the calibration store could not be read): "
    "the estimator's own numbers and safe-bound margin",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class AppliedCalibration:
    """Which factors corrected the estimate. `scope` to `samples` describe the device level's
    (the safe bound's level) factor, if any; `levels` lists every level's."""

    applied: bool
    scope: str  # "none", or the calibration scope the device factor came from
    factor: float | None  # measured / estimated, multiplied into the estimate
    upper_multiplier: float | None  # the calibrated spread above the factor
    nodes: int  # voters (upload keys: one per training node) whose measurements voted
    samples: int  # measured runs behind the factor
    levels: tuple[AppliedFactor, ...] = ()  # every level's factor, in Level order
    # The factor table used: fresh, stale (the store is unreachable: the last one loaded) or
    # none (nothing could be loaded).
    state: FactorState = FactorState.NONE
    # The identity of the factor table used (`factors.table_identity`): equal on replicas that
    # applied the same table; None: none was ever loaded.
    table_id: str | None = None

    def upper_margin(self, estimated: float) -> float:
        """The safe bound's margin over the device level: the device factor's, when one
        applied, else the estimator's own (`estimated`)."""
        return estimated if self.upper_multiplier is None else self.upper_multiplier - 1

    def note(self, upper_margin: float) -> str:
        """What calibration did to the estimate, in one line: per level, the factor, where it
        came from, the runs and nodes behind it, and the safe bound's margin; or that none
        applied, and why.

        Calibration is the one place that says so: the core knows no factors.
        """
        if not (self.applied or self.levels):
            return _NONE_APPLIED[self.state]
        found = {applied.key.level: applied for applied in self.levels}
        parts = []
        for level in Level:
            applied = found.get(level)
            if level is Level.DEVICE and self.factor is not None:
                models = applied.factor.models if applied is not None else 1
                parts.append(
                    _level_words(level, self.scope, self.factor, models, self.samples, self.nodes)
                )
            elif applied is not None:
                factor = applied.factor
                parts.append(
                    _level_words(
                        level,
                        applied.key.scope.value,
                        factor.ratio,
                        factor.models,
                        factor.runs,
                        factor.nodes,
                    )
                )
            else:
                parts.append(f"{level} none (the estimator's own)")
        bound = "the estimator's own" if self.upper_multiplier is None else _CALIBRATED_BOUND
        stale = "" if self.state is FactorState.FRESH else f"; {_STALE_WORDS}"
        return (
            f"calibration applied: {'; '.join(parts)}; safe bound +{upper_margin:.1%} over the "
            f"device level ({bound}){stale}"
        )


def _level_words(
    level: Level, scope: str, factor: float, models: int, samples: int, nodes: int
) -> str:
    voters = f"{models} models, " if models > 1 else ""
    return (
        f"{level} x{factor:.3f} from the {SCOPE_WORDS.get(scope, scope)} factor "
        f"({voters}{samples} runs on {nodes} nodes)"
    )


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

    def calibrated(self, *, model: str, method: str, gpu: str | None) -> LevelsFn:
        """`peaks`' four numbers (allocated, reserved, device, safe bound) for any estimate of
        this model, method and GPU, without their description: what a fit-check reads at
        dozens of shapes. A provider that subclasses this protocol may keep this reading of
        its `peaks`."""

        def levels(estimate: Levels) -> tuple[int, int, int, int]:
            p = self.peaks(estimate, model=model, method=method, gpu=gpu)
            return p.allocated_bytes, p.reserved_bytes, p.device_bytes, p.device_bytes_upper

        return levels


class CachedFactors:
    """The store's factors, as this replica's cache holds them (never waiting on a load)."""

    def __init__(self, cache: FactorCache) -> None:
        self.cache = cache

    def calibrated(self, *, model: str, method: str, gpu: str | None) -> LevelsFn:
        # the factors in force now, looked up once
        return self.cache.peek().table.calibrator(model=model, method=method, gpu=gpu).levels

    def generation(self) -> object:
        # A snapshot is replaced, never changed, when the factors or their state change.
        return self.cache.peek()

    def peaks(
        self, estimate: Levels, *, model: str, method: str, gpu: str | None
    ) -> CalibratedPeaks:
        snapshot = self.cache.peek()
        calibrator = snapshot.table.calibrator(model=model, method=method, gpu=gpu)
        allocated, reserved, device, upper = calibrator.levels(estimate)
        return CalibratedPeaks(
            allocated_bytes=allocated,
            reserved_bytes=reserved,
            device_bytes=device,
            device_bytes_upper=upper,
            calibration=applied_calibration(
                calibrator.applied, snapshot.state, table_id=snapshot.table_id
            ),
        )


# What an uncalibrated estimate says of itself, per state and identity of the factor table:
# one object per table, so that answers share it (a replica loads a few tables a minute at
# most; forgotten whole when full).
_MAX_UNCALIBRATED = 64
_uncalibrated: dict[tuple[FactorState, str | None], AppliedCalibration] = {}


def _uncalibrated_in(state: FactorState, table_id: str | None) -> AppliedCalibration:
    found = _uncalibrated.get((state, table_id))
    if found is None:
        if len(_uncalibrated) >= _MAX_UNCALIBRATED:
            _uncalibrated.clear()
        found = _uncalibrated[(state, table_id)] = replace(
            NOT_APPLIED, state=state, table_id=table_id
        )
    return found


def applied_calibration(
    applied: Mapping[Level, AppliedFactor], state: FactorState, *, table_id: str | None = None
) -> AppliedCalibration:
    if not applied:
        return _uncalibrated_in(state, table_id)
    levels = tuple(applied.values())
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
            table_id=table_id,
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
        table_id=table_id,
    )
