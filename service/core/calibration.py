"""Robust calibration factors (measured / estimated) from peaks that training nodes measured.

Every ratio is one run's measured peak over the estimate for the same spec, at one level. Per
group (model, method, level; split by GPU or environment only where the data show it matters):

1. one vote per node: the median of the node's completed runs (a node that uploads a thousand
   rows still casts one vote);
2. votes far from the median of votes (modified z-score on the MAD, in log space, because the
   errors are multiplicative) are rejected;
3. the factor is the median of the remaining votes, once at least `MIN_NODES` nodes vote,
   clamped to [`FACTOR_MIN`, `FACTOR_MAX`];
4. the upper multiplier is the smallest that leaves at most 5 % of the voting nodes' runs
   above `factor * upper_multiplier`. OOM runs are lower bounds: they can only raise it.

A model without enough nodes falls back to the global factor (all models, same method and
level), then to none.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType

from service.core.errors import EstimatorError
from service.core.result import Levels

# A vote needs this many distinct nodes: with three votes the median survives one bad node
# (the median's breakdown point is floor((n - 1) / 2) votes).
MIN_NODES = 3
# Calibration lowers an estimate by at most 20 %: an underestimate places a job that OOMs,
# and a larger gap means the estimator misses something that a factor must not hide.
FACTOR_MIN = 0.8
# Calibration raises an estimate by at most 50 %: an overestimate only wastes memory, so the
# bound is looser, but beyond it the estimator is wrong for the group, not imprecise.
FACTOR_MAX = 1.5
# The safe bound never sits below the calibrated median, nor more than 50 % above it: a
# spread wider than that means the group mixes different jobs, and widening the bound further
# would make every placement of the group wasteful.
UPPER_MULTIPLIER_MIN = 1.0
UPPER_MULTIPLIER_MAX = 1.5
# At most this share of runs may exceed the upper bound (the 95 % coverage).
UPPER_EXCEEDANCE = 0.05
# Modified z-score threshold for rejecting a vote (Iglewicz & Hoaglin 1993, "How to Detect
# and Handle Outliers": |0.6745 (x - median) / MAD| > 3.5).
OUTLIER_Z = 3.5
# 1 / Phi^-1(3/4): MAD times this estimates a normal distribution's standard deviation.
MAD_TO_SIGMA = 1.4826
# Floor of the log-space spread (about 5 %): with few nodes the MAD can be zero (two equal
# votes), and nodes on other driver, CUDA and torch builds legitimately differ by a few
# percent, so votes within about ±19 % (OUTLIER_Z floors) of the median are never rejected.
MIN_LOG_SPREAD = 0.05
# Spread assumed when a group has no factor yet, for flagging uploads as outliers: with
# OUTLIER_Z it flags ratios outside about [0.70, 1.42], i.e. far from the estimate.
PRIOR_LOG_SPREAD = 0.10
# Asymptotic standard error of a median is sqrt(pi / 2) sigma / sqrt(n) (normal data).
MEDIAN_SE = math.sqrt(math.pi / 2)
# A GPU or environment gets its own factor when it differs from the model's by more than
# 5 % and by more than three standard errors of its median.
SPLIT_MIN_EFFECT = math.log(1.05)
SPLIT_Z = 3.0


class Level(StrEnum):
    """The three peak levels a node can measure (see the architecture notes)."""

    ALLOCATED = "allocated"
    RESERVED = "reserved"
    DEVICE = "device"


class Outcome(StrEnum):
    COMPLETED = "completed"
    OOM = "oom"  # the run died; its measured peak is a lower bound of what it needed


class Scope(StrEnum):
    """Where a factor comes from, most specific first."""

    MODEL_GPU = "model_gpu"
    MODEL_ENVIRONMENT = "model_environment"
    MODEL = "model"
    GLOBAL = "global"


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


@dataclass(frozen=True, slots=True, kw_only=True)
class Sample:
    """One run's measured / estimated ratio at one level, from one node."""

    node_id: str
    ratio: float
    outcome: Outcome = Outcome.COMPLETED

    def __post_init__(self) -> None:
        if not (math.isfinite(self.ratio) and self.ratio > 0):
            raise ValueError(f"ratio must be positive and finite, got {self.ratio}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Factor:
    """A group's factor: multiply the estimate by `ratio`, the upper bound further by
    `upper_multiplier`."""

    ratio: float
    upper_multiplier: float
    nodes: int  # nodes whose vote counted
    rejected_nodes: tuple[str, ...]  # nodes whose vote was too far from the others
    runs: int  # completed runs of the voting nodes
    oom_runs: int  # OOM runs that were considered for the upper bound
    log_spread: float  # robust standard deviation of the kept votes, log space (may be 0)
    clamped: bool  # the median or the upper multiplier hit a clamp

    @property
    def upper_ratio(self) -> float:
        return self.ratio * self.upper_multiplier


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[mid]
    return (ordered[mid - 1] + ordered[mid]) / 2


def _clamp(value: float, low: float, high: float) -> float:
    return min(max(value, low), high)


def _upper_quantile(ratios: Sequence[float]) -> float:
    """The smallest value that at most UPPER_EXCEEDANCE of `ratios` lie above."""
    ordered = sorted(ratios)
    allowed_above = math.floor(UPPER_EXCEEDANCE * len(ordered))
    return ordered[len(ordered) - 1 - allowed_above]


def node_votes(samples: Iterable[Sample]) -> dict[str, float]:
    """Each node's vote: the median of its completed runs' log ratios."""
    by_node: dict[str, list[float]] = defaultdict(list)
    for sample in samples:
        if sample.outcome is Outcome.COMPLETED:
            by_node[sample.node_id].append(math.log(sample.ratio))
    return {node: _median(logs) for node, logs in by_node.items()}


def robust_spread(log_values: Sequence[float], center: float) -> float:
    """MAD-based standard deviation of log values around `center` (may be zero)."""
    return MAD_TO_SIGMA * _median([abs(value - center) for value in log_values])


def fit_factor(samples: Iterable[Sample]) -> Factor | None:
    """The group's factor, or None when fewer than MIN_NODES nodes vote after rejection."""
    samples = list(samples)
    votes = node_votes(samples)
    if len(votes) < MIN_NODES:
        return None
    center = _median(list(votes.values()))
    spread = max(robust_spread(list(votes.values()), center), MIN_LOG_SPREAD)
    kept = {node: vote for node, vote in votes.items() if abs(vote - center) <= OUTLIER_Z * spread}
    rejected = tuple(sorted(node for node in votes if node not in kept))
    if len(kept) < MIN_NODES:
        return None
    kept_logs = list(kept.values())
    log_center = _median(kept_logs)
    raw_ratio = math.exp(log_center)
    ratio = _clamp(raw_ratio, FACTOR_MIN, FACTOR_MAX)

    completed = [s.ratio for s in samples if s.outcome is Outcome.COMPLETED and s.node_id in kept]
    upper = _upper_quantile(completed)
    # OOM runs needed more than they measured; one above the bound is a run the bound let
    # through, so it joins the population (and can only raise the quantile). Rejected
    # nodes are left out here as well.
    pushing = [
        s.ratio
        for s in samples
        if s.outcome is Outcome.OOM and s.node_id not in rejected and s.ratio > upper
    ]
    if pushing:
        upper = _upper_quantile(completed + pushing)
    raw_multiplier = upper / ratio
    multiplier = _clamp(raw_multiplier, UPPER_MULTIPLIER_MIN, UPPER_MULTIPLIER_MAX)
    return Factor(
        ratio=ratio,
        upper_multiplier=multiplier,
        nodes=len(kept),
        rejected_nodes=rejected,
        runs=len(completed),
        oom_runs=len(pushing),
        log_spread=robust_spread(kept_logs, log_center),
        clamped=ratio != raw_ratio or raw_multiplier > UPPER_MULTIPLIER_MAX,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Observation:
    """A sample with the group it belongs to."""

    model: str
    method: str
    level: Level
    gpu: str
    environment: str
    sample: Sample


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupKey:
    scope: Scope
    method: str
    level: Level
    model: str | None = None  # None for the global scope
    variant: str | None = None  # the GPU or environment of a split group


@dataclass(frozen=True, slots=True, kw_only=True)
class AppliedFactor:
    key: GroupKey
    factor: Factor


def _differs(sub: Factor, parent: Factor) -> bool:
    """Whether a subgroup's factor differs from its model's by more than chance would."""
    effect = abs(math.log(sub.ratio) - math.log(parent.ratio))
    standard_error = MEDIAN_SE * sub.log_spread / math.sqrt(sub.nodes)
    return effect > max(SPLIT_MIN_EFFECT, SPLIT_Z * standard_error)


# Calibrators a factor table remembers (catalog models x GPUs x methods stay far below it).
CALIBRATOR_MEMO_ENTRIES = 16_384


@dataclass(frozen=True, slots=True)
class FactorTable:
    """Every group's factor; `lookup` picks the most specific one that applies."""

    factors: Mapping[GroupKey, Factor]
    # Every job of a model, method and GPU is calibrated alike: each calibrator is found once
    # per table (a table never changes; a refit makes a new one). Uploads name GPUs and
    # environments freely, so the memo is emptied when it holds CALIBRATOR_MEMO_ENTRIES.
    _calibrators: dict[tuple[str, str, str | None, str | None], Calibrator] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def lookup(
        self,
        *,
        model: str,
        method: str,
        level: Level,
        gpu: str | None = None,
        environment: str | None = None,
    ) -> AppliedFactor | None:
        candidates = [
            GroupKey(scope=Scope.MODEL_GPU, method=method, level=level, model=model, variant=gpu),
            GroupKey(
                scope=Scope.MODEL_ENVIRONMENT,
                method=method,
                level=level,
                model=model,
                variant=environment,
            ),
            GroupKey(scope=Scope.MODEL, method=method, level=level, model=model),
            GroupKey(scope=Scope.GLOBAL, method=method, level=level),
        ]
        for key in candidates:
            if key.scope in (Scope.MODEL_GPU, Scope.MODEL_ENVIRONMENT) and key.variant is None:
                continue
            factor = self.factors.get(key)
            if factor is not None:
                return AppliedFactor(key=key, factor=factor)
        return None

    def calibrator(
        self, *, model: str, method: str, gpu: str | None = None, environment: str | None = None
    ) -> Calibrator:
        """The factors that apply, level by level, to one model, method, GPU, environment."""
        key = (model, method, gpu, environment)
        found = self._calibrators.get(key)
        if found is None:
            if len(self._calibrators) >= CALIBRATOR_MEMO_ENTRIES:
                self._calibrators.clear()
            applied = {}
            for level in Level:
                factor = self.lookup(
                    model=model, method=method, level=level, gpu=gpu, environment=environment
                )
                if factor is not None:
                    applied[level] = factor
            found = self._calibrators[key] = Calibrator(MappingProxyType(applied))
        return found


EMPTY_TABLE = FactorTable({})


def fit_table(observations: Iterable[Observation]) -> FactorTable:
    """Fit every group: global per (method, level), per model, and the splits that matter."""
    by_global: dict[tuple[str, Level], list[Sample]] = defaultdict(list)
    by_model: dict[tuple[str, str, Level], list[Observation]] = defaultdict(list)
    for obs in observations:
        by_global[(obs.method, obs.level)].append(obs.sample)
        by_model[(obs.model, obs.method, obs.level)].append(obs)

    factors: dict[GroupKey, Factor] = {}
    for (method, level), samples in by_global.items():
        factor = fit_factor(samples)
        if factor is not None:
            factors[GroupKey(scope=Scope.GLOBAL, method=method, level=level)] = factor
    for (model, method, level), group in by_model.items():
        parent = fit_factor(obs.sample for obs in group)
        if parent is None:
            continue
        factors[GroupKey(scope=Scope.MODEL, method=method, level=level, model=model)] = parent
        variants: dict[tuple[Scope, str], list[Sample]] = defaultdict(list)
        for obs in group:
            variants[(Scope.MODEL_GPU, obs.gpu)].append(obs.sample)
            variants[(Scope.MODEL_ENVIRONMENT, obs.environment)].append(obs.sample)
        split_scopes = Counter(scope for scope, _ in variants)
        for (scope, variant), samples in variants.items():
            if split_scopes[scope] < 2:
                continue  # one GPU (or environment) only: the model's factor is its factor
            sub = fit_factor(samples)
            if sub is not None and _differs(sub, parent):
                key = GroupKey(
                    scope=scope, method=method, level=level, model=model, variant=variant
                )
                factors[key] = sub
    return FactorTable(factors)


def flag_outlier(ratio: float, outcome: Outcome, applied: AppliedFactor | None) -> str | None:
    """Why a ratio is far from what the group expects, or None when it is not.

    OOM runs are lower bounds, so only a ratio far above the expectation is flagged for them.
    """
    if applied is None:
        center, spread, against = 0.0, PRIOR_LOG_SPREAD, "the uncalibrated estimate"
    else:
        factor = applied.factor
        center, spread = math.log(factor.ratio), max(factor.log_spread, MIN_LOG_SPREAD)
        against = f"the {applied.key.scope} factor {factor.ratio:.3f}"
    z = (math.log(ratio) - center) / spread
    if abs(z) <= OUTLIER_Z or (outcome is Outcome.OOM and z < 0):
        return None
    direction = "above" if z > 0 else "below"
    return f"measured/estimated {ratio:.3f} is {abs(z):.1f} spreads {direction} {against}"


@dataclass(frozen=True, slots=True, kw_only=True)
class CalibratedPeaks:
    """An estimate's peaks after calibration; a level without a factor keeps its estimate."""

    allocated_bytes: int
    reserved_bytes: int
    device_bytes: int
    device_bytes_upper: int
    applied: Mapping[Level, AppliedFactor]


@dataclass(frozen=True, slots=True)
class Calibrator:
    """The factor of each level that has one, for one model, method, GPU and environment."""

    applied: Mapping[Level, AppliedFactor]

    def apply(self, estimate: Levels) -> CalibratedPeaks:
        """Each level's factor applied, keeping allocated <= reserved <= device."""
        applied = self.applied
        device_factor = applied.get(Level.DEVICE)
        allocated = _scaled(estimate.allocated_bytes, applied.get(Level.ALLOCATED))
        reserved = max(_scaled(estimate.reserved_bytes, applied.get(Level.RESERVED)), allocated)
        device = max(_scaled(estimate.device_bytes, device_factor), reserved)
        if device_factor is not None:
            upper = math.ceil(device * device_factor.factor.upper_multiplier)
        elif estimate.device_bytes > 0:
            # No device factor: keep the prior's margin over whatever the device level became.
            upper = -(-estimate.device_bytes_upper * device // estimate.device_bytes)
        else:
            upper = estimate.device_bytes_upper
        return CalibratedPeaks(
            allocated_bytes=allocated,
            reserved_bytes=reserved,
            device_bytes=device,
            device_bytes_upper=max(upper, device),
            applied=applied,
        )


def _scaled(value: int, found: AppliedFactor | None) -> int:
    return value if found is None else math.ceil(value * found.factor.ratio)


def calibrate(
    estimate: Levels,
    table: FactorTable,
    *,
    model: str,
    method: str,
    gpu: str | None = None,
    environment: str | None = None,
) -> CalibratedPeaks:
    """Apply each level's factor to an estimate, keeping allocated <= reserved <= device."""
    calibrator = table.calibrator(model=model, method=method, gpu=gpu, environment=environment)
    return calibrator.apply(estimate)
