"""Robust calibration factors (measured / estimated) from peaks that training nodes measured.

Every ratio is one run's measured peak over the estimate for the same spec, at one level. Per
group (model, method, level; split by GPU or environment only where the data show it matters):

1. one vote per node: the median of the node's completed runs (a node that uploads a thousand
   rows still casts one vote);
2. votes far from the median of votes (modified z-score on the MAD, in log space, because the
   errors are multiplicative) are rejected;
3. the factor is the median of the remaining votes, once at least `MIN_NODES` nodes vote,
   moved toward 1 by `SHIFT_Z` standard errors of that median (a soft threshold) and
   clamped to [`FACTOR_MIN`, `FACTOR_MAX`]: a factor shifts an estimate only by what lies beyond
   the uncertainty of its votes, so votes that disagree as much as they differ from 1 leave
   the estimate as it was, while many votes that agree tightly shift it almost fully;
4. the upper multiplier is the widest of: a one-sided upper prediction bound on the log ratio
   of one more node's run (Student's t for the number of votes, on the votes' robust spread
   floored at `MIN_LOG_SPREAD`), so that a few agreeing nodes never prove a zero spread; and
   the smallest multiplier that leaves at most 5 % of the voting nodes' runs above
   `factor * upper_multiplier` (OOM runs are lower bounds: they can only raise it). The
   bound is taken over the larger of the median and the shifted factor, so moving a factor
   toward 1 never lowers the safe bound (over a factor moved down, the multiplier can reach
   `UPPER_MULTIPLIER_CEILING`).

Each level is fitted on its own ratios. A model without enough nodes falls back to the global
factor of its method and level, which models vote on as nodes vote on a model's factor: one
vote per model, at least `MIN_MODELS` of them; a factor learned from one model is that
model's alone. Without either, no factor applies.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from statistics import NormalDist
from types import MappingProxyType
from typing import Protocol

from service.core.errors import EstimatorError
from service.core.result import Levels
from service.core.student_t import student_t_quantile

# A vote needs this many distinct nodes: with three votes the median survives one bad node
# (the median's breakdown point is floor((n - 1) / 2) votes).
MIN_NODES = 3
# A factor applies across models (the global scope) only when this many models agree, each
# voting once, for the same reason: the median of three model votes survives one model whose
# ratio is its own (an architecture the estimator misses something of).
MIN_MODELS = 3
# Calibration lowers an estimate by at most 20 %: an underestimate places a job that OOMs,
# and a larger gap means the estimator misses something that a factor must not hide.
FACTOR_MIN = 0.8
# Calibration raises an estimate by at most 50 %: an overestimate only wastes memory, so the
# bound is looser, but beyond it the estimator is wrong for the group, not imprecise.
FACTOR_MAX = 1.5
# At most this share of runs may exceed the upper bound (the 95 % coverage).
UPPER_EXCEEDANCE = 0.05
# Modified z-score threshold for rejecting a vote (Iglewicz & Hoaglin 1993, "How to Detect
# and Handle Outliers": |0.6745 (x - median) / MAD| > 3.5).
OUTLIER_Z = 3.5
# 1 / Phi^-1(3/4): MAD times this estimates a normal distribution's standard deviation.
MAD_TO_SIGMA = 1.4826
# Floor of the log-space spread (about 5 %): with few nodes the MAD can be zero (two equal
# votes), and nodes on other driver, CUDA and torch builds legitimately differ by a few
# percent, so votes within about ±19 % (OUTLIER_Z floors) of the median are never rejected,
# and the safe bound never assumes a smaller spread than this.
MIN_LOG_SPREAD = 0.05
# The safe bound sits at least this far above the calibrated median: the one-sided 95 %
# normal quantile (Phi^-1(0.95) = 1.645) times the spread floor, the margin that prediction
# bound reaches with unboundedly many agreeing nodes (t -> normal, the median known), 8.6 %.
UPPER_MULTIPLIER_MIN = math.exp(NormalDist().inv_cdf(1 - UPPER_EXCEEDANCE) * MIN_LOG_SPREAD)
# ... and never more than 50 % above the larger of the median and the factor: a spread wider
# than that means the group mixes different jobs, and widening the bound further would make
# every placement wasteful.
UPPER_MULTIPLIER_MAX = 1.5
# Over a factor shifted down toward 1 (never below 1) from a median of at most FACTOR_MAX,
# the bound the median gives is at most this many times the factor.
UPPER_MULTIPLIER_CEILING = UPPER_MULTIPLIER_MAX * FACTOR_MAX
# Spread assumed when a group has no factor yet, for flagging uploads as outliers: with
# OUTLIER_Z it flags ratios outside about [0.70, 1.42], i.e. far from the estimate.
PRIOR_LOG_SPREAD = 0.10
# Asymptotic standard error of a median is sqrt(pi / 2) sigma / sqrt(n) (normal data):
# the sample median's asymptotic variance is 1 / (4 n f(m)^2), f(m) = 1 / (sigma sqrt(2 pi))
# the normal density at its median (Serfling, "Approximation Theorems of Mathematical
# Statistics" (1980), 2.3: asymptotic normality of sample quantiles), so 1.2533 sigma/sqrt(n).
MEDIAN_SE = math.sqrt(math.pi / 2)
# A factor shifts an estimate by the part of log(median) beyond this many standard errors of
# the median (soft thresholding, Donoho & Johnstone, "Ideal spatial adaptation by wavelet
# shrinkage", Biometrika 81 (1994)): the two-sided 95 % normal quantile, Phi^-1(0.975) =
# 1.96, so a median that a two-sided test at 5 % cannot tell from 1 shifts nothing. The
# error is taken on the votes' own spread (not floored: the floor is the safe bound's, and
# identical votes are the strongest evidence a median can have).
SHIFT_Z = NormalDist().inv_cdf(0.975)
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

    ratio: float  # the votes' median moved toward 1 (`shifted_log_ratio`), then clamped
    upper_multiplier: float
    nodes: int  # nodes whose vote counted
    models: int  # models whose vote counted: 1 for a model's own factor
    rejected_nodes: tuple[str, ...]  # nodes whose vote was too far from the others
    runs: int  # completed runs of the voting nodes
    oom_runs: int  # OOM runs above the bound the completed runs gave: they raised it
    # Robust standard deviation of the kept votes, log space (may be 0; the global factor's:
    # the wider of its models' and its nodes' votes).
    log_spread: float
    clamped: bool  # the (shifted) factor or the upper multiplier hit a clamp

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


def _allowed_above(runs: int) -> int:
    """How many of `runs` runs may lie above the safe bound."""
    return math.floor(UPPER_EXCEEDANCE * runs)


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


def upper_prediction_log_margin(log_spread: float, votes: int) -> float:
    """How far above the median of `votes` votes (log space) the one-sided upper prediction
    bound of one more vote lies at 1 - UPPER_EXCEEDANCE: t(votes - 1) * s * sqrt(1 + (pi/2) /
    votes), s the votes' spread floored at MIN_LOG_SPREAD.

    Hahn & Meeker, "Statistical Intervals" (1991), 4.4: a normal sample's mean plus
    t(1 - alpha; n - 1) s sqrt(1 + 1/n) bounds one future observation; the factor is a median,
    whose variance is pi/2 times the mean's (MEDIAN_SE). Few votes give a wide margin (t and
    the median's own error), which narrows toward UPPER_MULTIPLIER_MIN as agreeing votes
    accumulate; identical votes never prove a zero spread.
    """
    if votes < 2:
        raise ValueError(f"a prediction bound needs at least two votes, got {votes}")
    spread = max(log_spread, MIN_LOG_SPREAD)
    t = student_t_quantile(1 - UPPER_EXCEEDANCE, votes - 1)
    return t * spread * math.sqrt(1 + MEDIAN_SE**2 / votes)


def median_standard_error(log_spread: float, votes: int) -> float:
    """The standard error of the median of `votes` votes whose spread is `log_spread`."""
    if votes < 1:
        raise ValueError(f"a median needs at least one vote, got {votes}")
    return MEDIAN_SE * log_spread / math.sqrt(votes)


def shifted_log_ratio(log_median: float, log_spread: float, votes: int) -> float:
    """The part of a median log ratio beyond SHIFT_Z standard errors of it, toward 0 (a soft
    threshold): what the votes show beyond their own uncertainty."""
    threshold = SHIFT_Z * median_standard_error(log_spread, votes)
    return math.copysign(max(abs(log_median) - threshold, 0.0), log_median)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Consensus:
    log_center: float  # median of the kept votes
    kept: dict[str, float]  # voter -> log vote
    rejected: frozenset[str]  # voters too far from the others


def _consensus(votes: Mapping[str, float], minimum: int) -> _Consensus | None:
    """The median of the votes left after rejecting those far from the median (modified
    z-score on the MAD), or None when fewer than `minimum` voters are left."""
    if len(votes) < minimum:
        return None
    values = list(votes.values())
    center = _median(values)
    spread = max(robust_spread(values, center), MIN_LOG_SPREAD)
    kept = {
        voter: vote for voter, vote in votes.items() if abs(vote - center) <= OUTLIER_Z * spread
    }
    if len(kept) < minimum:
        return None
    return _Consensus(
        log_center=_median(list(kept.values())),
        kept=kept,
        rejected=frozenset(votes.keys() - kept.keys()),
    )


def _factor(
    *,
    log_center: float,
    log_spread: float,
    voters: int,
    runs: Runs,
    selection: Selection,
    nodes: int,
    models: int,
    rejected_nodes: Iterable[str],
) -> Factor:
    """A factor from its votes' median and spread and the `selection` of `runs` behind them."""
    raw_ratio = math.exp(log_center)
    median = _clamp(raw_ratio, FACTOR_MIN, FACTOR_MAX)
    shifted = shifted_log_ratio(log_center, log_spread, voters)
    # The shift is the median's (a median beyond a clamp shifts from where it lies); clamping
    # after it keeps the factor between 1 and the clamped median.
    unclamped = raw_ratio if shifted == log_center else math.exp(shifted)
    ratio = _clamp(unclamped, FACTOR_MIN, FACTOR_MAX)
    # The bound is taken over the larger of the median and the shifted factor: a factor moved
    # down toward 1 keeps the bound its median gives, one moved up raises it.
    reference = max(median, ratio)
    margin = math.exp(upper_prediction_log_margin(log_spread, voters))
    # The prediction bound holds over the votes' median and over the (clamped) factor alike,
    # and at most UPPER_EXCEEDANCE of the runs may lie above the bound.
    completed = runs.completed(selection)
    upper = max(
        raw_ratio * margin,
        reference * margin,
        runs.largest(selection, _allowed_above(completed)),
    )
    # OOM runs needed more than they measured; one above the bound is a run the bound let
    # through, so it joins the population (and can only raise the quantile).
    pushing = runs.oom_above(selection, upper)
    if pushing:
        upper = max(
            upper,
            runs.largest(selection, _allowed_above(completed + pushing), oom_above=upper),
        )
    raw_multiplier = upper / reference
    over_reference = _clamp(raw_multiplier, UPPER_MULTIPLIER_MIN, UPPER_MULTIPLIER_MAX)
    return Factor(
        ratio=ratio,
        upper_multiplier=over_reference * (reference / ratio),
        nodes=nodes,
        models=models,
        rejected_nodes=tuple(sorted(rejected_nodes)),
        runs=completed,
        oom_runs=pushing,
        log_spread=log_spread,
        clamped=ratio != unclamped or raw_multiplier > UPPER_MULTIPLIER_MAX,
    )


# A (model, node) pair: a node's vote on a model's factor, and the runs behind it.
Pair = tuple[str, str]


@dataclass(frozen=True, slots=True, kw_only=True)
class Selection:
    """The runs of a group that set its safe bound: those of `models`, except the runs of
    the `dropped` (model, node) pairs (voters rejected as far from the others)."""

    models: frozenset[str]
    dropped: frozenset[Pair]


class Runs(Protocol):
    """A group's runs as its fit reads them: each node's vote per model, and the few order
    statistics the safe bound needs. `SampleRuns` holds them in memory; a store can answer
    the same questions with queries, without reading every run."""

    def votes(self) -> Mapping[Pair, float]:
        """Each (model, node)'s vote: the median of the log ratios of its completed runs."""
        ...

    def completed(self, selection: Selection) -> int:
        """How many completed runs `selection` holds."""
        ...

    def oom_above(self, selection: Selection, bound: float) -> int:
        """How many OOM runs of `selection` have a ratio above `bound`."""
        ...

    def largest(self, selection: Selection, rank: int, *, oom_above: float | None = None) -> float:
        """The ratio that `rank` others lie above (0: the largest) among the completed runs
        of `selection` and, if `oom_above` is given, its OOM runs above `oom_above`."""
        ...


class SampleRuns:
    """Runs held in memory: the definition the other `Runs` must agree with."""

    def __init__(self, runs: Iterable[tuple[str, Sample]]) -> None:
        self._runs = list(runs)
        self._votes: dict[Pair, float] | None = None

    @classmethod
    def of_model(cls, samples: Iterable[Sample], model: str = "") -> SampleRuns:
        return cls((model, sample) for sample in samples)

    def votes(self) -> Mapping[Pair, float]:
        if self._votes is None:
            by_model: dict[str, list[Sample]] = defaultdict(list)
            for model, sample in self._runs:
                by_model[model].append(sample)
            self._votes = {
                (model, node): vote
                for model, samples in by_model.items()
                for node, vote in node_votes(samples).items()
            }
        return self._votes

    def _ratios(self, selection: Selection, outcome: Outcome) -> list[float]:
        return [
            sample.ratio
            for model, sample in self._runs
            if sample.outcome is outcome
            and model in selection.models
            and (model, sample.node_id) not in selection.dropped
        ]

    def completed(self, selection: Selection) -> int:
        return len(self._ratios(selection, Outcome.COMPLETED))

    def oom_above(self, selection: Selection, bound: float) -> int:
        return sum(1 for ratio in self._ratios(selection, Outcome.OOM) if ratio > bound)

    def largest(self, selection: Selection, rank: int, *, oom_above: float | None = None) -> float:
        ratios = self._ratios(selection, Outcome.COMPLETED)
        if oom_above is not None:
            ratios += [r for r in self._ratios(selection, Outcome.OOM) if r > oom_above]
        return sorted(ratios, reverse=True)[rank]


def fit_factor(samples: Iterable[Sample]) -> Factor | None:
    """The group's factor, or None when fewer than MIN_NODES nodes vote after rejection."""
    fitted = _fit_model_runs(SampleRuns.of_model(samples), "")
    return None if fitted is None else fitted[0]


def _fit_model_runs(runs: Runs, model: str) -> tuple[Factor, float] | None:
    """A model's group factor (its nodes vote) and the log median of its kept votes (before
    any shift)."""
    votes = {node: vote for (_model, node), vote in runs.votes().items()}
    consensus = _consensus(votes, MIN_NODES)
    if consensus is None:
        return None
    kept, rejected = consensus.kept, consensus.rejected
    factor = _factor(
        log_center=consensus.log_center,
        log_spread=robust_spread(list(kept.values()), consensus.log_center),
        voters=len(kept),
        runs=runs,
        # The kept nodes' completed runs, and the OOM runs of every node not rejected.
        selection=Selection(
            models=frozenset({model}), dropped=frozenset((model, node) for node in rejected)
        ),
        nodes=len(kept),
        models=1,
        rejected_nodes=rejected,
    )
    return factor, consensus.log_center


@dataclass(frozen=True, slots=True, kw_only=True)
class Observation:
    """A sample with the group it belongs to."""

    model: str
    method: str
    level: Level
    gpu: str
    environment: str
    sample: Sample


def fit_global_factor(observations: Iterable[Observation]) -> Factor | None:
    """The factor of one method and level across models (see `fit_global_runs`)."""
    return fit_global_runs(SampleRuns((obs.model, obs.sample) for obs in observations))


def fit_global_runs(runs: Runs) -> Factor | None:
    """The factor of one method and level across models, or None unless at least MIN_MODELS
    models agree and MIN_NODES nodes stand behind them.

    Models vote as nodes do on a model's factor: once each, with the median of their nodes'
    votes, and a model far from the others is rejected. Among the kept models, a node whose
    vote is far from their median is left out too, so that its runs set no bound. The safe
    bound's prediction counts models (a new model is what the global factor is for), on the
    wider of the models' and the nodes' spreads.
    """
    votes_of: dict[str, dict[str, float]] = defaultdict(dict)
    for (model, node), vote in runs.votes().items():
        votes_of[model][node] = vote
    model_votes = {model: _median(list(votes.values())) for model, votes in votes_of.items()}
    consensus = _consensus(model_votes, MIN_MODELS)
    if consensus is None:
        return None
    center = consensus.log_center
    pairs = {
        (model, node): vote for model in consensus.kept for node, vote in votes_of[model].items()
    }
    pair_spread = robust_spread(list(pairs.values()), center)
    reach = OUTLIER_Z * max(pair_spread, MIN_LOG_SPREAD)
    kept = {pair for pair, vote in pairs.items() if abs(vote - center) <= reach}
    nodes = {node for _model, node in kept}
    if len(nodes) < MIN_NODES:
        return None
    dropped = {(model, node) for model, votes in votes_of.items() for node in votes} - kept
    return _factor(
        log_center=center,
        log_spread=max(robust_spread(list(consensus.kept.values()), center), pair_spread),
        voters=len(consensus.kept),
        runs=runs,
        # The kept models' runs, less those of their nodes left out.
        selection=Selection(
            models=frozenset(consensus.kept),
            dropped=frozenset(pair for pair in dropped if pair[0] in consensus.kept),
        ),
        nodes=len(nodes),
        models=len(consensus.kept),
        rejected_nodes={node for _model, node in dropped},
    )


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


def _differs(sub: Factor, sub_log_median: float, parent_log_median: float) -> bool:
    """Whether a subgroup's votes differ from its model's by more than chance would (their
    medians are compared: a shift toward 1 says how sure each is of differing from 1)."""
    effect = abs(sub_log_median - parent_log_median)
    standard_error = median_standard_error(sub.log_spread, sub.nodes)
    return effect > max(SPLIT_MIN_EFFECT, SPLIT_Z * standard_error)


# Calibrators a factor table remembers (catalog models x GPUs x methods stay far below it).
CALIBRATOR_MEMO_ENTRIES = 16_384


@dataclass(frozen=True, slots=True)
class FactorTable:
    """Every group's factor; `lookup` picks the most specific one that applies."""

    factors: Mapping[GroupKey, Factor]
    # Every job of a model, method and GPU is calibrated alike: each calibrator is found once
    # per table (a table never changes; a refit makes a new one). Uploads name GPUs
    # freely, so the memo is emptied when it holds CALIBRATOR_MEMO_ENTRIES.
    _calibrators: dict[tuple[str, str, str | None], Calibrator] = field(
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

    def calibrator(self, *, model: str, method: str, gpu: str | None = None) -> Calibrator:
        """The factors that apply, level by level, to one model, method and GPU.

        An estimate names no environment, so the environment's factors (which flag uploads'
        ratios as outliers) never apply to it."""
        key = (model, method, gpu)
        found = self._calibrators.get(key)
        if found is None:
            if len(self._calibrators) >= CALIBRATOR_MEMO_ENTRIES:
                self._calibrators.clear()
            applied = {}
            for level in Level:
                factor = self.lookup(model=model, method=method, level=level, gpu=gpu)
                if factor is not None:
                    applied[level] = factor
            found = self._calibrators[key] = Calibrator(MappingProxyType(applied))
        return found


EMPTY_TABLE = FactorTable({})


def fit_table(observations: Iterable[Observation]) -> FactorTable:
    """Fit every group, each level on its own: per model, the splits that matter, and global
    per (method, level) where several models agree."""
    by_global: dict[tuple[str, Level], list[Observation]] = defaultdict(list)
    by_model: dict[tuple[str, str, Level], list[Observation]] = defaultdict(list)
    for obs in observations:
        by_global[(obs.method, obs.level)].append(obs)
        by_model[(obs.model, obs.method, obs.level)].append(obs)

    factors: dict[GroupKey, Factor] = {}
    for (method, level), group in by_global.items():
        factor = fit_global_factor(group)
        if factor is not None:
            factors[GroupKey(scope=Scope.GLOBAL, method=method, level=level)] = factor
    for (model, method, level), group in by_model.items():
        variants: dict[tuple[Scope, str], list[Sample]] = defaultdict(list)
        for obs in group:
            variants[(Scope.MODEL_GPU, obs.gpu)].append(obs.sample)
            variants[(Scope.MODEL_ENVIRONMENT, obs.environment)].append(obs.sample)
        factors.update(
            fit_model_factors(
                model=model,
                method=method,
                level=level,
                runs=SampleRuns.of_model((obs.sample for obs in group), model),
                variants={
                    variant: SampleRuns.of_model(samples, model)
                    for variant, samples in variants.items()
                },
            )
        )
    return FactorTable(factors)


def fit_model_factors(
    *,
    model: str,
    method: str,
    level: Level,
    runs: Runs,
    variants: Mapping[tuple[Scope, str], Runs],
) -> dict[GroupKey, Factor]:
    """One model's factors at one method and level: its own, and those of the GPUs (or
    environments) whose runs differ from it. `variants` holds the runs of each GPU and each
    environment the model's runs name (`Scope.MODEL_GPU` or `Scope.MODEL_ENVIRONMENT`)."""
    fitted = _fit_model_runs(runs, model)
    if fitted is None:
        return {}
    parent, parent_log_median = fitted
    factors = {GroupKey(scope=Scope.MODEL, method=method, level=level, model=model): parent}
    split_scopes = Counter(scope for scope, _ in variants)
    for (scope, variant), variant_runs in variants.items():
        if split_scopes[scope] < 2:
            continue  # one GPU (or environment) only: the model's factor is its factor
        fitted_sub = _fit_model_runs(variant_runs, model)
        if fitted_sub is not None and _differs(*fitted_sub, parent_log_median):
            key = GroupKey(scope=scope, method=method, level=level, model=model, variant=variant)
            factors[key] = fitted_sub[0]
    return factors


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
class CalibratedLevels:
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

    def apply(self, estimate: Levels) -> CalibratedLevels:
        """Each level's factor applied, keeping allocated <= reserved <= device."""
        allocated, reserved, device, upper = self.levels(estimate)
        return CalibratedLevels(
            allocated_bytes=allocated,
            reserved_bytes=reserved,
            device_bytes=device,
            device_bytes_upper=upper,
            applied=self.applied,
        )

    def levels(self, estimate: Levels) -> tuple[int, int, int, int]:
        """`apply`'s allocated, reserved and device levels and safe bound, alone."""
        applied = self.applied
        if applied:
            device_factor = applied.get(Level.DEVICE)
            allocated = _scaled(estimate.allocated_bytes, applied.get(Level.ALLOCATED))
            reserved = _scaled(estimate.reserved_bytes, applied.get(Level.RESERVED))
            device = _scaled(estimate.device_bytes, device_factor)
        else:  # (the same, without a factor to look up)
            device_factor = None
            allocated = estimate.allocated_bytes
            reserved = estimate.reserved_bytes
            device = estimate.device_bytes
        reserved = max(reserved, allocated)
        device = max(device, reserved)
        if device_factor is not None:
            upper = math.ceil(device * device_factor.factor.upper_multiplier)
        elif estimate.device_bytes > 0:
            # No device factor: keep the prior's margin over whatever the device level became.
            upper = -(-estimate.device_bytes_upper * device // estimate.device_bytes)
        else:
            upper = estimate.device_bytes_upper
        return allocated, reserved, device, max(upper, device)


def _scaled(value: int, found: AppliedFactor | None) -> int:
    return value if found is None else math.ceil(value * found.factor.ratio)


def calibrate(
    estimate: Levels,
    table: FactorTable,
    *,
    model: str,
    method: str,
    gpu: str | None = None,
) -> CalibratedLevels:
    """Apply each level's factor to an estimate, keeping allocated <= reserved <= device."""
    calibrator = table.calibrator(model=model, method=method, gpu=gpu)
    return calibrator.apply(estimate)
