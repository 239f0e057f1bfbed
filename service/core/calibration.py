"""Robust calibration factors (measured / estimated) from peaks that training nodes measured.

Every ratio is one run's measured peak over the estimate for the same spec, at one level. A
run's voter is the credential it was uploaded with (its API key), not the node id its body
names: a body can name any node, a key is what an operator issued. Per group (model, method,
level; split by GPU or environment only where the data show it matters):

1. one vote per voter: the median of the voter's completed runs (a key that uploads a
   thousand rows, under however many node ids, still casts one vote);
2. votes far from the median of votes (modified z-score on the MAD, in log space, because the
   errors are multiplicative) are rejected;
3. the factor is the median of the remaining votes, once at least `MIN_NODES` voters vote,
   moved toward 1 by `SHIFT_Z` standard errors of that median (a soft threshold) and
   clamped to [`FACTOR_MIN`, `FACTOR_MAX`]: a factor shifts an estimate only by what lies beyond
   the uncertainty of its votes, so votes that disagree as much as they differ from 1 leave
   the estimate as it was, while many votes that agree tightly shift it almost fully;
4. the upper multiplier is the widest of: a one-sided upper prediction bound on the log ratio
   of one more voter's run (Student's t for the number of votes, on the votes' robust spread
   floored at `MIN_LOG_SPREAD`), so that a few agreeing voters never prove a zero spread; the
   largest ratio of a run that supports the factor; and, where OOM runs lie above that (they
   are lower bounds of what their jobs needed), the smallest that leaves at most 5 % of the
   runs and those OOM runs above `factor * upper_multiplier`. The bound is taken over the
   larger of the median and the shifted factor, so moving a factor toward 1 never lowers the
   safe bound, and kept within [`UPPER_MULTIPLIER_MIN`, `UPPER_MULTIPLIER_MAX`] of it, a
   clamp that never takes it below a run that supports it.

The runs that support a factor are the completed runs of its kept voters, less those more
than `OUTLIER_Z` spreads (floored at `MIN_LOG_SPREAD`) above the kept votes' median: a run
that far above every vote (another job, a shared GPU, a made-up peak) is as little evidence
of the group as a vote that far, which is rejected.

Each level is fitted on its own ratios. A model without enough voters falls back to the global
factor of its method and level, which models vote on as voters vote on a model's factor: one
vote per model, at least `MIN_MODELS` of them and `MIN_NODES` voters behind them; a factor
learned from one model is that model's alone. Without either, no factor applies.

What voters can do to a safe bound (the calibrated device level times the device factor's
`upper_multiplier`, `Calibrator.levels`; tests/core/test_calibration_votes.py checks each over
`fit_table`):

- Fewer than `MIN_NODES` voters move nothing. A model's factor and a global one both need the
  votes of `MIN_NODES` distinct voters, so runs uploaded with fewer keys, under however many
  node ids, form no factor: every level and safe bound stays the estimator's, for the models
  they name and every other one, and no safe bound comes below its uncalibrated device level.
  Beside other voters, such keys vote as any voter does: once each, rejected when far off.
- Down: with `MIN_NODES` voters or more a safe bound may come below the uncalibrated device
  level (to `FACTOR_MIN * UPPER_MULTIPLIER_MIN` of it at the least), but never below a run
  that supports it: a factor's `upper_ratio` is at least the ratio of each such run, so the
  job of each, calibrated with the factor, gets a safe bound at or above the device peak it
  measured.
- Up: a safe bound rises only through a factor of `MIN_NODES` voters or more. The device
  factor's `upper_ratio` is at most `max(UPPER_MULTIPLIER_CEILING, L)`, L the largest ratio of
  a run that supports it: the statistics' margin reaches `UPPER_MULTIPLIER_CEILING` at the
  most, and beyond it only peaks the kept voters measured, within `OUTLIER_Z` spreads of their
  votes' median, lift it. The safe bound is the calibrated device level times
  `upper_multiplier` (`upper_ratio / ratio`): at most `upper_ratio` times the device
  estimate, unless the (calibrated) reserved or allocated level lies above the device level
  the factor gives, and lifts the bound with it.
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

from service.core.measured import ImplausibleMeasurementError as ImplausibleMeasurementError
from service.core.measured import Level as Level
from service.core.measured import Measured as Measured
from service.core.measured import Outcome as Outcome
from service.core.measured import check_measured as check_measured
from service.core.measured import estimated_at as estimated_at
from service.core.result import Levels
from service.core.student_t import student_t_quantile

# A vote needs this many distinct voters: with three votes the median survives one bad voter
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
# The prediction bound's one-sided level, and the share of runs that OOM runs above the bound
# may make up (the 95 % coverage); no completed run that supports a factor may.
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


class Scope(StrEnum):
    """Where a factor comes from, most specific first."""

    MODEL_GPU = "model_gpu"
    MODEL_ENVIRONMENT = "model_environment"
    MODEL = "model"
    GLOBAL = "global"


@dataclass(frozen=True, slots=True, kw_only=True)
class Sample:
    """One run's measured / estimated ratio at one level, from one voter (the key that
    uploaded it)."""

    voter: str
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
    nodes: int  # voters (upload keys) whose vote counted
    models: int  # models whose vote counted: 1 for a model's own factor
    rejected_nodes: tuple[str, ...]  # voters whose vote was too far from the others
    runs: int  # completed runs of the voters kept
    oom_runs: int  # OOM runs above the bound the completed runs gave: they raised it
    # Robust standard deviation of the kept votes, log space (may be 0; the global factor's:
    # the wider of its models' and its voters' votes).
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
    """How many of `runs` runs may lie above the safe bound (OOM runs only: every completed
    run that supports a factor lies at or under it)."""
    return math.floor(UPPER_EXCEEDANCE * runs)


def voter_votes(samples: Iterable[Sample]) -> dict[str, float]:
    """Each voter's vote: the median of its completed runs' log ratios."""
    by_voter: dict[str, list[float]] = defaultdict(list)
    for sample in samples:
        if sample.outcome is Outcome.COMPLETED:
            by_voter[sample.voter].append(math.log(sample.ratio))
    return {voter: _median(logs) for voter, logs in by_voter.items()}


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


# A (model, voter) pair: a voter's vote on a model's factor, and the runs behind it.
Pair = tuple[str, str]


@dataclass(frozen=True, slots=True, kw_only=True)
class Selection:
    """The runs of a group that set its safe bound: those of `models`, except the runs of
    the `dropped` (model, voter) pairs (voters rejected as far from the others)."""

    models: frozenset[str]
    dropped: frozenset[Pair]

    def supports(self, model: str, voter: str) -> bool:
        """Whether the runs of `voter` on `model` support the factor."""
        return model in self.models and (model, voter) not in self.dropped


@dataclass(frozen=True, slots=True, kw_only=True)
class Window:
    """The runs an order statistic is taken among: the completed runs up to `at_most` (all
    of them when None) and the OOM runs above `oom_above` (none when None)."""

    oom_above: float | None = None
    at_most: float | None = None


COMPLETED = Window()  # every completed run, no OOM run


@dataclass(frozen=True, slots=True, kw_only=True)
class Support:
    """The votes behind a factor and the runs that support it (`selection`)."""

    log_center: float  # the median of the kept votes, log space, before any shift
    log_spread: float  # their robust spread (the global factor's: models' or pairs')
    votes: int  # the votes the median and its prediction bound count (models, for global)
    selection: Selection
    nodes: int  # voters kept
    models: int  # models kept
    rejected: frozenset[str]  # voters left out


def _factor(support: Support, runs: Runs) -> Factor:
    """A factor from its votes' median and spread and the runs that support it."""
    log_center, log_spread, selection = support.log_center, support.log_spread, support.selection
    raw_ratio = math.exp(log_center)
    median = _clamp(raw_ratio, FACTOR_MIN, FACTOR_MAX)
    shifted = shifted_log_ratio(log_center, log_spread, support.votes)
    # The shift is the median's (a median beyond a clamp shifts from where it lies); clamping
    # after it keeps the factor between 1 and the clamped median.
    unclamped = raw_ratio if shifted == log_center else math.exp(shifted)
    ratio = _clamp(unclamped, FACTOR_MIN, FACTOR_MAX)
    # The bound is taken over the larger of the median and the shifted factor: a factor moved
    # down toward 1 keeps the bound its median gives, one moved up raises it.
    reference = max(median, ratio)
    margin = math.exp(upper_prediction_log_margin(log_spread, support.votes))
    # The prediction bound holds over the votes' median and over the (clamped) factor alike,
    # and no run that supports the factor (none far above the votes) may lie above the bound.
    completed = runs.completed(selection)
    reach = OUTLIER_Z * max(log_spread, MIN_LOG_SPREAD)
    largest = runs.largest(selection, 0, Window(at_most=math.exp(log_center + reach)))
    upper = max(raw_ratio * margin, reference * margin, largest)
    # OOM runs needed more than they measured; one above the bound is a run the bound let
    # through, so it joins the population, of which at most UPPER_EXCEEDANCE may lie above.
    pushing = runs.oom_above(selection, upper)
    if pushing:
        upper = max(
            upper,
            runs.largest(selection, _allowed_above(completed + pushing), Window(oom_above=upper)),
        )
    # The margin over the reference is clamped, but no clamp takes the bound below a run that
    # supports it: the job of each keeps a safe bound at or above the peak it measured.
    clamped = reference * _clamp(upper / reference, UPPER_MULTIPLIER_MIN, UPPER_MULTIPLIER_MAX)
    bound = max(clamped, largest)
    upper_multiplier = bound / ratio
    while ratio * upper_multiplier < bound:  # one ulp, where the division rounded down
        upper_multiplier = math.nextafter(upper_multiplier, math.inf)
    return Factor(
        ratio=ratio,
        upper_multiplier=upper_multiplier,
        nodes=support.nodes,
        models=support.models,
        rejected_nodes=tuple(sorted(support.rejected)),
        runs=completed,
        oom_runs=pushing,
        log_spread=log_spread,
        clamped=ratio != unclamped or bound < upper,
    )


class Runs(Protocol):
    """A group's runs as its fit reads them: each voter's vote per model, and the few order
    statistics the safe bound needs. `SampleRuns` holds them in memory; a store can answer
    the same questions with queries, without reading every run."""

    def votes(self) -> Mapping[Pair, float]:
        """Each (model, voter)'s vote: the median of the log ratios of its completed runs."""
        ...

    def completed(self, selection: Selection) -> int:
        """How many completed runs `selection` holds."""
        ...

    def oom_above(self, selection: Selection, bound: float) -> int:
        """How many OOM runs of `selection` have a ratio above `bound`."""
        ...

    def largest(self, selection: Selection, rank: int, window: Window = COMPLETED) -> float:
        """The ratio that `rank` others lie above (0: the largest) among the runs of
        `selection` that `window` takes."""
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
                (model, voter): vote
                for model, samples in by_model.items()
                for voter, vote in voter_votes(samples).items()
            }
        return self._votes

    def _ratios(self, selection: Selection, outcome: Outcome) -> list[float]:
        return [
            sample.ratio
            for model, sample in self._runs
            if sample.outcome is outcome and selection.supports(model, sample.voter)
        ]

    def completed(self, selection: Selection) -> int:
        return len(self._ratios(selection, Outcome.COMPLETED))

    def oom_above(self, selection: Selection, bound: float) -> int:
        return sum(1 for ratio in self._ratios(selection, Outcome.OOM) if ratio > bound)

    def largest(self, selection: Selection, rank: int, window: Window = COMPLETED) -> float:
        ratios = self._ratios(selection, Outcome.COMPLETED)
        at_most, oom_above = window.at_most, window.oom_above
        if at_most is not None:
            ratios = [r for r in ratios if r <= at_most]
        if oom_above is not None:
            ratios += [r for r in self._ratios(selection, Outcome.OOM) if r > oom_above]
        return sorted(ratios, reverse=True)[rank]


def fit_factor(samples: Iterable[Sample]) -> Factor | None:
    """The group's factor, or None when fewer than MIN_NODES voters vote after rejection."""
    runs = SampleRuns.of_model(samples)
    support = model_support(runs, "")
    return None if support is None else _factor(support, runs)


def model_support(runs: Runs, model: str) -> Support | None:
    """What stands behind a model's group factor: its voters' votes, those far from the
    others rejected, or None when fewer than MIN_NODES voters are left."""
    votes = {voter: vote for (_model, voter), vote in runs.votes().items()}
    consensus = _consensus(votes, MIN_NODES)
    if consensus is None:
        return None
    kept, rejected = consensus.kept, consensus.rejected
    return Support(
        log_center=consensus.log_center,
        log_spread=robust_spread(list(kept.values()), consensus.log_center),
        votes=len(kept),
        # The kept voters' completed runs, and the OOM runs of every voter not rejected.
        selection=Selection(
            models=frozenset({model}), dropped=frozenset((model, voter) for voter in rejected)
        ),
        nodes=len(kept),
        models=1,
        rejected=rejected,
    )


def _fit_model_runs(runs: Runs, model: str) -> tuple[Factor, float] | None:
    """A model's group factor and the log median of its kept votes (before any shift)."""
    support = model_support(runs, model)
    return None if support is None else (_factor(support, runs), support.log_center)


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
    models agree and MIN_NODES voters stand behind them (`global_support`)."""
    support = global_support(runs)
    return None if support is None else _factor(support, runs)


def global_support(runs: Runs) -> Support | None:
    """What stands behind the factor of one method and level across models, or None unless
    at least MIN_MODELS models agree and MIN_NODES voters stand behind them.

    Models vote as voters do on a model's factor: once each, with the median of their voters'
    votes, and a model far from the others is rejected. Among the kept models, a voter whose
    vote is far from their median is left out too, so that its runs set no bound. The safe
    bound's prediction counts models (a new model is what the global factor is for), on the
    wider of the models' and the voters' spreads.
    """
    votes_of: dict[str, dict[str, float]] = defaultdict(dict)
    for (model, voter), vote in runs.votes().items():
        votes_of[model][voter] = vote
    model_votes = {model: _median(list(votes.values())) for model, votes in votes_of.items()}
    consensus = _consensus(model_votes, MIN_MODELS)
    if consensus is None:
        return None
    center = consensus.log_center
    pairs = {
        (model, voter): vote for model in consensus.kept for voter, vote in votes_of[model].items()
    }
    pair_spread = robust_spread(list(pairs.values()), center)
    reach = OUTLIER_Z * max(pair_spread, MIN_LOG_SPREAD)
    kept = {pair for pair, vote in pairs.items() if abs(vote - center) <= reach}
    voters = {voter for _model, voter in kept}
    if len(voters) < MIN_NODES:
        return None
    dropped = {(model, voter) for model, votes in votes_of.items() for voter in votes} - kept
    return Support(
        log_center=center,
        log_spread=max(robust_spread(list(consensus.kept.values()), center), pair_spread),
        votes=len(consensus.kept),
        # The kept models' runs, less those of their voters left out.
        selection=Selection(
            models=frozenset(consensus.kept),
            dropped=frozenset(pair for pair in dropped if pair[0] in consensus.kept),
        ),
        nodes=len(voters),
        models=len(consensus.kept),
        rejected=frozenset(voter for _model, voter in dropped),
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
