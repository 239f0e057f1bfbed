"""The fewest GPUs of each type that hold a multi-GPU job, per parallel strategy.

The job keeps its per-GPU micro-batch and sequence; only `parallel.gpus` (and the strategy)
change. GPU counts are taken from a ladder: 1 up to one node's GPUs, then whole nodes, up to a
maximum. The requirement (the per-rank safe bound) is a black box of the spec, memoised for
one check, so every GPU type of a strategy shares its evaluations.

Search: the per-rank requirement of a strategy that shards the model falls as GPUs are added,
but it is not assumed to: one GPU is tried first (no collective buffers at all, so it can be
lower than two: DDP's reducer buckets), then the ladder's top; between a top that fits and a
count that does not, the answer is found by bisection over the ladder, starting from the
tightest bracket the evaluations already made give. An answer is final only when it fits and
the ladder's previous count, evaluated for real, does not. Under a strategy that keeps full
parameters on every GPU (DDP, ZeRO-1 and ZeRO-2 for LoRA) the requirement stops falling after
two GPUs; when it is hardly lower at the top than on two GPUs, the answer says so, and the
search of a GPU that does not fit ends after those three evaluations.

Not found: a count that fits below one that does not, with a higher count that does not fit
again in between (a requirement that rises and falls again along the ladder); no estimate in
this service behaves so.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from service.core.errors import InvalidSpecError
from service.core.fit import (
    GpuOffer,
    Requirement,
    RequirementFn,
    _Requirements,
    part_threshold,
    usable_bytes,
)
from service.core.limits import MAX_GPUS
from service.core.spec import DEFAULT_GPUS_PER_NODE, Strategy, TrainingSpec
from service.core.units import GIB

# Without a maximum in the request: eight 8-GPU nodes, the size of a typical reserved cluster
# slice. MAX_PLACEMENT_GPUS bounds what a request may ask (the spec's own limit on gpus).
DEFAULT_MAX_GPUS = 64
MAX_PLACEMENT_GPUS = MAX_GPUS


class Outcome(StrEnum):
    FITS = "fits"
    DOES_NOT_FIT = "does_not_fit"  # not within max_gpus
    NOT_POSSIBLE = "not_possible"  # the job cannot run under this strategy


@dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    """One GPU type under one strategy: the fewest GPUs that hold the job, or why none."""

    offer_index: int
    strategy: Strategy
    outcome: Outcome
    usable_bytes: int
    count: int | None = None  # fewest GPUs that fit
    nodes: int | None = None
    spec: TrainingSpec | None = None  # the job on `count` GPUs
    requirement: Requirement | None = None  # per rank, at `count`
    cost_per_hour: float | None = None  # price_per_hour * count
    previous_count: int | None = None  # the ladder's count below `count`; it does not fit
    previous_requirement: Requirement | None = None
    top_requirement: Requirement | None = None  # at max_gpus' rung, when none fits
    stops_falling: bool = False  # the requirement is hardly lower at the top than on two GPUs
    reason: str | None = None  # why none fits, in words


@dataclass(frozen=True, slots=True, kw_only=True)
class PlacementCheck:
    placements: tuple[Placement, ...]  # per offer in order, per strategy in the order given
    strategies: tuple[Strategy, ...]
    counts: tuple[int, ...]  # the ladder of GPU counts tried
    gpus_per_node: int
    cheapest: int | None  # index into placements: the lowest priced cost that fits
    fewest: int | None  # index into placements: the fewest GPUs that fit
    evaluations: int  # requirement evaluations made


def gpu_counts(max_gpus: int, gpus_per_node: int) -> tuple[int, ...]:
    """The GPU counts a job may span: 1 up to one node, then whole nodes, up to `max_gpus`."""
    if not 1 <= max_gpus <= MAX_PLACEMENT_GPUS:
        raise InvalidSpecError("max_gpus", f"must be in [1, {MAX_PLACEMENT_GPUS}]")
    if gpus_per_node < 1:
        raise InvalidSpecError("gpus_per_node", "must be at least 1")
    within = list(range(1, min(gpus_per_node, max_gpus) + 1))
    nodes = [n * gpus_per_node for n in range(2, max_gpus // gpus_per_node + 1)]
    return (*within, *nodes)


class _Ladder:
    """The job under one strategy along the GPU counts, evaluated lazily."""

    __slots__ = ("counts", "error", "gpus_per_node", "job", "requirement", "strategy", "values")

    def __init__(
        self,
        job: TrainingSpec,
        strategy: Strategy,
        counts: tuple[int, ...],
        gpus_per_node: int,
        requirement: Callable[[TrainingSpec], Requirement],
    ) -> None:
        self.job = job
        self.strategy = strategy
        self.counts = counts
        self.gpus_per_node = gpus_per_node
        self.requirement = requirement
        self.values: dict[int, Requirement | None] = {}  # ladder index -> requirement
        self.error: InvalidSpecError | None = None  # why the job cannot run under `strategy`
        try:
            self.values[0] = requirement(self.spec_at(0))
        except InvalidSpecError as exc:
            self.error = exc

    def spec_at(self, i: int) -> TrainingSpec:
        """The job on the i-th count; the job itself when nothing changes (so that the
        caller's requirement can answer it from the job's own estimate)."""
        own = self.job.parallel
        # The job's node size unchanged when it is the one asked for (None means the default).
        per_node = (
            own.gpus_per_node
            if self.gpus_per_node == (own.gpus_per_node or DEFAULT_GPUS_PER_NODE)
            else self.gpus_per_node
        )
        parallel = replace(own, gpus=self.counts[i], strategy=self.strategy, gpus_per_node=per_node)
        return self.job if parallel == own else replace(self.job, parallel=parallel)

    def at(self, i: int) -> Requirement | None:
        """The requirement on the i-th count; None when the spec is invalid on that count."""
        if i not in self.values:
            try:
                self.values[i] = self.requirement(self.spec_at(i))
            except InvalidSpecError:
                self.values[i] = None
        return self.values[i]

    def fits(self, i: int, capacity: int) -> bool:
        need = self.at(i)
        return need is not None and need.device_bytes_upper <= capacity

    def fewest(self, capacity: int) -> tuple[int | None, int | None]:
        """The ladder index of the fewest GPUs that fit `capacity` and the index below it
        (None: one GPU fits); (None, None) when none fits."""
        last = len(self.counts) - 1
        if self.fits(0, capacity):
            return 0, None
        # The tightest bracket the evaluations so far give: the lowest evaluated index that
        # fits, and the highest below it that does not.
        fitting = [i for i in self.values if self.fits(i, capacity)]
        hi = min(fitting) if fitting else None
        if hi is None:
            if last == 0 or not self.fits(last, capacity):
                return None, None
            hi = last
        lo = max(i for i in self.values if i < hi and not self.fits(i, capacity))
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.fits(mid, capacity):
                hi = mid
            else:
                lo = mid
        return hi, lo

    def stops_falling(self) -> bool:
        """Whether the requirement at the top of the ladder is lower than on two GPUs by no more
        than the estimate's own spread (`part_threshold`: what a change must save to be worth
        suggesting)."""
        if len(self.counts) < 3:
            return False
        two, top = self.at(1), self.at(len(self.counts) - 1)
        if two is None or top is None:
            return False
        drop = two.device_bytes_upper - top.device_bytes_upper
        return drop <= part_threshold(two.device_bytes_upper)


def place(
    job: TrainingSpec,
    offers: Sequence[GpuOffer],
    requirement: RequirementFn,
    *,
    strategies: Sequence[Strategy] | None = None,
    max_gpus: int = DEFAULT_MAX_GPUS,
    gpus_per_node: int | None = None,
) -> PlacementCheck:
    """Per GPU type and strategy, the fewest GPUs on which `job` fits (its per-rank safe bound
    within the GPU's usable memory), with the cheapest and the fewest-GPU placement overall.

    `strategies` defaults to the job's own; `gpus_per_node` to the job's, else
    DEFAULT_GPUS_PER_NODE. An offer's `count` is not used: the count is what is solved.
    Raises InvalidSpecError for a bad maximum or node size, a strategy listed twice, and when
    the job is possible under none of the strategies (the first one's reason).
    """
    chosen = tuple(strategies) if strategies is not None else (job.parallel.strategy,)
    if not chosen:
        raise InvalidSpecError("strategies", "must name at least one strategy")
    if len(set(chosen)) < len(chosen):
        raise InvalidSpecError("strategies", "a strategy is listed twice")
    per_node = gpus_per_node or job.parallel.gpus_per_node or DEFAULT_GPUS_PER_NODE
    counts = gpu_counts(max_gpus, per_node)
    memo = _Requirements(requirement)
    ladders = [_Ladder(job, s, counts, per_node, memo) for s in chosen]
    errors = [ladder.error for ladder in ladders if ladder.error is not None]
    if len(errors) == len(ladders):
        names = ", ".join(chosen)
        raise InvalidSpecError(
            "strategies", f"the job is possible under none of {names}: {errors[0].reason}"
        )
    placements: list[Placement] = []
    for index, offer in enumerate(offers):
        capacity = usable_bytes(offer.memory_bytes)
        placements.extend(_placement(index, offer, capacity, ladder) for ladder in ladders)
    return PlacementCheck(
        placements=tuple(placements),
        strategies=chosen,
        counts=counts,
        gpus_per_node=per_node,
        cheapest=_cheapest(placements),
        fewest=_fewest(placements),
        evaluations=memo.evaluations,
    )


def _placement(index: int, offer: GpuOffer, capacity: int, ladder: _Ladder) -> Placement:
    if ladder.error is not None:
        return Placement(
            offer_index=index,
            strategy=ladder.strategy,
            usable_bytes=capacity,
            outcome=Outcome.NOT_POSSIBLE,
            reason=f"not possible: {ladder.error.reason}",
        )
    found, below = ladder.fewest(capacity)
    counts = ladder.counts
    if found is None:
        top = ladder.at(len(counts) - 1)
        flat = ladder.stops_falling()
        need = "" if top is None else f" ({top.device_bytes_upper / GIB:.1f} GiB per GPU)"
        reason = f"does not fit within {counts[-1]} GPUs{need}"
        two = ladder.at(1) if flat else None
        if two is not None:
            reason += (
                f"; more GPUs do not lower the per-GPU requirement under {ladder.strategy}: "
                f"{two.device_bytes_upper / GIB:.1f} GiB on {counts[1]} GPUs"
            )
        return Placement(
            offer_index=index,
            strategy=ladder.strategy,
            usable_bytes=capacity,
            outcome=Outcome.DOES_NOT_FIT,
            top_requirement=top,
            stops_falling=flat,
            reason=reason,
        )
    count = counts[found]
    return Placement(
        offer_index=index,
        strategy=ladder.strategy,
        usable_bytes=capacity,
        outcome=Outcome.FITS,
        count=count,
        nodes=-(-count // ladder.gpus_per_node),
        spec=ladder.spec_at(found),
        requirement=ladder.at(found),
        cost_per_hour=None if offer.price_per_hour is None else offer.price_per_hour * count,
        previous_count=None if below is None else counts[below],
        previous_requirement=None if below is None else ladder.at(below),
    )


def _cheapest(placements: Sequence[Placement]) -> int | None:
    priced = [
        (p.cost_per_hour, p.count or 0, i)
        for i, p in enumerate(placements)
        if p.cost_per_hour is not None
    ]
    return min(priced)[2] if priced else None


def _fewest(placements: Sequence[Placement]) -> int | None:
    inf = float("inf")
    fitting = [
        (p.count, inf if p.cost_per_hour is None else p.cost_per_hour, i)
        for i, p in enumerate(placements)
        if p.count is not None
    ]
    return min(fitting)[2] if fitting else None
