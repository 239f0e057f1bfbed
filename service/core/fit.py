"""Whether a job fits a GPU, the largest micro-batch and sequence that fit, and what to change.

The requirement is passed in as a function of the spec (the estimator, calibrated by the
caller), so this module only decides and solves. Solving: the peak is a maximum over phases of
terms affine in the micro-batch and affine or quadratic in the sequence length, so the safe
bound is nondecreasing and piecewise smooth in each. GPUs are taken smallest first, so each
answer is bracketed by the evaluations already made for the smaller ones (shared by every GPU
of one check); the next point is proposed by inverse quadratic interpolation through the
bracket's ends and their nearest neighbour (linear extrapolation beyond the bracket), with
bisection once the proposals stall; an answer x is final when x fits and x + 1 does not, both
evaluated for real. Suggestions are worked out once per range of capacities that answers every
comparison they make alike, not once per GPU.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal, NamedTuple, TypeVar

from service.core.errors import InvalidSpecError
from service.core.fit_changes import Change, apply_change, take_back
from service.core.spec import Objective, Optim, TrainingSpec
from service.core.spec.grpo import curve_point
from service.core.spec.vision import SequenceTooShortError
from service.core.units import MIB

# CUDA hands out less than nvidia-smi's total: on the H200 of tests/data/gpu/ torch reported
# 150,109,880,320 B of nvidia-smi's 143,771 MiB, 616 MiB less (tests/data/gpu/README.md and
# h200_set3.jsonl's gpu_total). Rounded up, so that "fits" stays safe on other GPUs.
DRIVER_RESERVED_BYTES = 640 * MIB

# After this many secant steps that move the same end of the bracket, bisect: regula falsi
# converges from one side only on a convex curve (eager attention's s^2 terms).
SECANT_STALL_STEPS = 2

# Micro-batch sizes tried (largest divisor of the effective batch first) before giving up on
# keeping the effective batch exact.
MICRO_BATCH_TRIES = 3

# A part of a suggested change must lower the safe bound by at least the larger of these, or
# be needed to fit, to be offered: a smaller saving is within the estimate's own spread (the
# CUDA context alone varies by 0.3-0.6 GiB with the driver and lazy loading, and the reserved
# level is matched to 2 % on the references), so it would cost the run for nothing.
MIN_PART_BYTES = 256 * MIB
MIN_PART_SHARE = 0.01  # of the job's safe bound

# Optimizer changes (8-bit, paged) are offered only when the optimizer's state makes up at
# least this share of the job's safe bound: 8-bit AdamW saves at most three quarters of the
# state (2 of 8 B per fp32 parameter), so below 5 % the saving stays under 4 % of the peak
# while the run changes optimizer (LoRA adapters on a large base: 0.05 GiB of 17 GiB).
MIN_OPTIMIZER_SHARE = 0.05


class Requirement(NamedTuple):
    """What one GPU of a job needs at the device level, bytes. A named tuple: a fit-check
    makes one per point of its curves, dozens per request."""

    device_bytes: int  # the median estimate
    device_bytes_upper: int  # the safe bound, compared with a GPU's usable memory


T = TypeVar("T")
RequirementFn = Callable[[TrainingSpec], Requirement]
# The requirement of a spec's job at any (batch_size, seq_len): for each spec, a function f
# with f(b, s) == requirement(spec.with_shape(b, s)), made once per spec.
ShapedRequirementFn = Callable[[TrainingSpec], Callable[[int, int], Requirement]]


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuOffer:
    """A GPU type a job may run on."""

    memory_bytes: int  # total memory as the driver reports it (nvidia-smi, NVML)
    count: int | None = None  # GPUs the job spans; None keeps the spec's parallel.gpus
    price_per_hour: float | None = None  # per GPU

    def __post_init__(self) -> None:
        if self.memory_bytes <= DRIVER_RESERVED_BYTES:
            raise InvalidSpecError(
                "gpus.memory", f"must be more than the driver's {DRIVER_RESERVED_BYTES} B"
            )
        if self.count is not None and self.count < 1:
            raise InvalidSpecError("gpus.count", "must be at least 1")
        if self.price_per_hour is not None and not (
            math.isfinite(self.price_per_hour) and self.price_per_hour >= 0
        ):
            raise InvalidSpecError("gpus.price_per_hour", "must be a non-negative number")


def usable_bytes(memory_bytes: int) -> int:
    """Memory a process can fill: the driver-reported total minus what CUDA cannot hand out."""
    return max(0, memory_bytes - DRIVER_RESERVED_BYTES)


# Rank order of the changes: the enum's declaration order.
_RANK = {change: rank for rank, change in enumerate(Change)}
# Stacked on the first, the second change makes it redundant (QLoRA trains adapters too; the
# paged optimizer is 8-bit too).
_SUPERSEDES = {Change.QLORA: Change.LORA, Change.PAGED_OPTIMIZER: Change.OPTIMIZER_8BIT}
_OPTIMIZER_CHANGES = frozenset({Change.OPTIMIZER_8BIT, Change.PAGED_OPTIMIZER})


def part_threshold(required_bytes: int) -> int:
    """What one part of a change must save to be offered, for a job needing `required_bytes`
    (its safe bound) when the part is not needed to fit."""
    return max(MIN_PART_BYTES, math.ceil(required_bytes * MIN_PART_SHARE))


class Suggestion(NamedTuple):
    """Changes to the job, the spec they give and that spec's requirement (a named tuple: a
    check makes a few per GPU that does not fit)."""

    changes: tuple[Change, ...]
    spec: TrainingSpec
    requirement: Requirement
    fits: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuFit:
    """One GPU type's answer."""

    offer: GpuOffer
    count: int  # GPUs the job spans on this type
    usable_bytes: int
    requirement: Requirement
    fits: bool
    headroom_bytes: int  # usable - safe bound; negative when it does not fit
    utilisation: float  # safe bound / usable
    max_batch_size: int  # largest micro-batch at the job's seq_len that fits; 0: none
    max_seq_len: int  # longest sequence at the job's batch_size that fits; 0: none
    suggestions: tuple[Suggestion, ...]  # empty when the job fits
    cost_per_hour: float | None  # price_per_hour * count


@dataclass(frozen=True, slots=True, kw_only=True)
class FitCheck:
    gpus: tuple[GpuFit, ...]  # in the order the offers were given
    cheapest: int | None  # index of the cheapest priced GPU that fits
    evaluations: int  # requirement evaluations made (the cache's misses)


Dimension = Literal["batch_size", "seq_len"]


class _Requirements:
    """The requirement function, memoised for one check: GPUs share every evaluation."""

    __slots__ = ("_alongs", "_cache", "_fn", "_shaped", "_shapes")

    def __init__(self, fn: RequirementFn, shaped: ShapedRequirementFn | None = None) -> None:
        self._fn = fn
        self._shaped = shaped
        self._cache: dict[TrainingSpec, Requirement] = {}
        self._alongs: dict[TrainingSpec, _Along] = {}
        self._shapes: dict[TrainingSpec, Callable[[int, int], Requirement]] = {}

    def __call__(self, spec: TrainingSpec) -> Requirement:
        found = self._cache.get(spec)
        if found is None:
            # the same requirement, read from the shaped one where there is one (cheaper)
            shaped = self._shape(spec)
            found = self._fn(spec) if shaped is None else shaped(spec.batch_size, spec.seq_len)
            self._cache[spec] = found
        return found

    def along(self, spec: TrainingSpec) -> _Along:
        """`spec`'s requirement at any shape."""
        found = self._alongs.get(spec)
        if found is None:
            found = self._alongs[spec] = _Along(spec, self, self._shape(spec))
        return found

    def _shape(self, spec: TrainingSpec) -> Callable[[int, int], Requirement] | None:
        if self._shaped is None:
            return None
        found = self._shapes.get(spec)
        if found is None:
            found = self._shapes[spec] = self._shaped(spec)
        return found

    def valid(self, spec: TrainingSpec) -> Requirement | None:
        """The requirement of a changed spec, or None when the change makes it invalid (LoRA
        on a model PEFT has no default target modules for)."""
        try:
            return self(spec)
        except InvalidSpecError:
            return None

    @property
    def evaluations(self) -> int:
        return len(self._cache) + sum(along.made for along in self._alongs.values())


class _Along:
    """One spec's requirement at any (batch_size, seq_len): read from the caller's shaped
    requirement where it gave one, without a spec per point; the spec's own shape is the
    memoised requirement's. Each curve keeps its points: one evaluation per point."""

    __slots__ = ("_requirements", "_shaped", "_spec", "made")

    def __init__(
        self,
        spec: TrainingSpec,
        requirements: _Requirements,
        shaped: Callable[[int, int], Requirement] | None,
    ) -> None:
        self._spec = spec
        self._requirements = requirements
        self._shaped = shaped
        self.made = 0  # evaluations of `shaped`

    def __call__(self, batch_size: int, seq_len: int) -> Requirement:
        spec = self._spec
        if batch_size == spec.batch_size and seq_len == spec.seq_len:
            return self._requirements(spec)
        if self._shaped is None:
            return self._requirements(spec.with_shape(batch_size, seq_len))
        self.made += 1
        return self._shaped(batch_size, seq_len)


class _Capacity:
    """One GPU's usable bytes, and the capacities [lo, hi) that answer every comparison made for
    it so far the same way: a GPU whose capacity lies in that range gets the same answers from
    the same evaluations, so they are worked out once per range, not once per GPU."""

    __slots__ = ("hi", "lo", "usable")

    def __init__(self, usable: int) -> None:
        self.usable = usable
        self.lo = 0
        self.hi: int | None = None

    def holds(self, need: int) -> bool:
        """Whether `need` bytes fit, narrowing the range to the capacities that agree."""
        if need <= self.usable:
            self.lo = max(self.lo, need)
            return True
        if self.hi is None or need < self.hi:
            self.hi = need
        return False

    def covers(self, usable: int) -> bool:
        return self.lo <= usable and (self.hi is None or usable < self.hi)


class _Curve:
    """The safe bound along one dimension of a spec, evaluated lazily, points kept in order of
    x (and so of their values: the bound is nondecreasing in x)."""

    __slots__ = ("_along", "_spec", "dimension", "limit", "requirements", "values", "xs")

    def __init__(
        self, spec: TrainingSpec, dimension: Dimension, limit: int, requirements: _Requirements
    ) -> None:
        self._spec = spec
        self._along = requirements.along(spec)
        self.dimension = dimension
        self.limit = limit
        self.requirements = requirements
        self.xs: list[int] = []
        self.values: list[int] = []
        own = getattr(spec, dimension)
        if own <= limit:
            self.at(own)
        # A second point gives the first secant a slope.
        self.at(max(1, min(limit, own // 2 if own > 1 else 2)))

    def at(self, x: int) -> int:
        i = bisect_left(self.xs, x)
        if i < len(self.xs) and self.xs[i] == x:
            return self.values[i]
        # below the objective's smallest micro-batch (KTO's KL batch: 2) the bound is the
        # smallest's, so a batch that cannot run is never the largest that fits
        job = self._spec
        if job.objective is Objective.GRPO:  # the generation batch divisible
            value = self.requirements(curve_point(job, self.dimension, x)).device_bytes_upper
        elif self.dimension != "batch_size":
            value = self._seq_point(x)
        elif x < job.min_batch_size:  # (memoised by its spec: every such x shares it)
            smallest = job.with_shape(job.min_batch_size, job.seq_len)
            value = self.requirements(smallest).device_bytes_upper
        else:
            value = self._along(x, job.seq_len).device_bytes_upper
        self.xs.insert(i, x)
        self.values.insert(i, value)
        return value

    def _seq_point(self, x: int) -> int:
        """The bound at seq_len x; shorter than the images' tokens, a sequence that cannot run
        takes the bound of the shortest that can, so it is never the longest that fits."""
        job = self._spec
        try:
            return self._along(job.batch_size, x).device_bytes_upper
        except SequenceTooShortError as short:  # (memoised by its spec)
            shortest = job.with_shape(job.batch_size, short.minimum)
            return self.requirements(shortest).device_bytes_upper

    def largest_fitting(self, capacity: _Capacity) -> int:
        """The largest x in [0, limit] whose safe bound fits `capacity` (0: none does); the
        bounds at x and x + 1 that decide it narrow `capacity`'s range."""
        x = self._solve(capacity.usable)
        if x > 0:
            capacity.holds(self._value(x))
        if x < self.limit:
            capacity.holds(self._value(x + 1))
        return x

    def _solve(self, capacity: int) -> int:
        i = bisect_right(self.values, capacity)
        lo = self.xs[i - 1] if i else 0
        hi = self.xs[i] if i < len(self.xs) else None
        same_side = 0
        last_side = ""
        while True:
            if hi is not None and hi <= lo + 1:
                return lo
            if hi is None and lo >= self.limit:
                return self.limit
            x = self._propose(lo, hi, capacity, bisect=same_side >= SECANT_STALL_STEPS)
            side = "lo" if self.at(x) <= capacity else "hi"
            if side == "lo":
                lo = x
            else:
                hi = x
            same_side = same_side + 1 if side == last_side and hi is not None else 0
            last_side = side

    def _value(self, x: int) -> int:
        return self.values[bisect_left(self.xs, x)]

    def _propose(self, lo: int, hi: int | None, capacity: int, *, bisect: bool) -> int:
        top = self.limit if hi is None else hi - 1
        if hi is not None and bisect:
            return (lo + hi) // 2
        if hi is not None and lo > 0:
            x = self._interpolate(lo, hi, capacity)
        elif hi is not None:
            x = self._extrapolate_down(hi, capacity)
        else:
            x = self._extrapolate_up(lo, capacity)
        return min(max(x, lo + 1), top)

    def _interpolate(self, lo: int, hi: int, capacity: int) -> int:
        """Where the bound crosses `capacity` inside (lo, hi): through lo, hi and the nearest
        point beyond them (the s^2 terms and the reserved level's slope make the bound curve
        gently), or the secant without a third point."""
        i = bisect_left(self.xs, lo)
        g_lo, g_hi = self.values[i], self.values[i + 1]
        secant = lo + (capacity - g_lo) * (hi - lo) // (g_hi - g_lo)
        below = i - 1 if i > 0 else None
        above = i + 2 if i + 2 < len(self.xs) else None
        if below is None or (above is not None and self.xs[above] - hi < lo - self.xs[below]):
            third = above
        else:
            third = below
        if third is None:
            return secant
        return self._through((i, i + 1, third), capacity, secant)

    def _extrapolate_up(self, lo: int, capacity: int) -> int:
        i = bisect_left(self.xs, lo)
        if i == 0:
            return 2 * lo
        a, g_a, g_lo = self.xs[i - 1], self.values[i - 1], self.values[i]
        rise = g_lo - g_a
        if rise <= 0:
            return 2 * lo
        return lo + (capacity - g_lo) * (lo - a) // rise

    def _extrapolate_down(self, hi: int, capacity: int) -> int:
        i = bisect_left(self.xs, hi)
        if i + 1 >= len(self.xs):
            return hi // 2
        b, g_b, g_hi = self.xs[i + 1], self.values[i + 1], self.values[i]
        rise = g_b - g_hi
        if rise <= 0:
            return hi // 2
        return hi - -(-(g_hi - capacity) * (b - hi) // rise)

    def _through(self, indices: tuple[int, int, int], capacity: int, fallback: int) -> int:
        """Where the bound reaches `capacity` by inverse quadratic interpolation (Lagrange's
        form of x as a function of the bound) through three evaluated points; `fallback`
        when two of them share a value."""
        i, j, k = indices
        g_i, g_j, g_k = self.values[i], self.values[j], self.values[k]
        if g_i in (g_j, g_k) or g_j == g_k:
            return fallback
        c = capacity
        x = (
            float(self.xs[i]) * ((c - g_j) / (g_i - g_j)) * ((c - g_k) / (g_i - g_k))
            + float(self.xs[j]) * ((c - g_i) / (g_j - g_i)) * ((c - g_k) / (g_j - g_k))
            + float(self.xs[k]) * ((c - g_i) / (g_k - g_i)) * ((c - g_j) / (g_k - g_j))
        )
        return math.floor(x) if math.isfinite(x) else fallback


class _Solver:
    """Curves and suggestions for one check, sharing one memoised requirement function."""

    def __init__(
        self,
        requirements: _Requirements,
        *,
        max_batch_size: int,
        max_seq_len: int,
        narrower_target_modules: tuple[str, ...] | None,
    ) -> None:
        self.requirements = requirements
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.narrower_target_modules = narrower_target_modules
        self._curves: dict[tuple[TrainingSpec, Dimension], _Curve] = {}
        # Spec changes do not depend on the GPU: made once per check, not once per GPU.
        self._changed: dict[tuple[Change, TrainingSpec], TrainingSpec | None] = {}
        self._lowering_memo: dict[TrainingSpec, list[tuple[Change, TrainingSpec, Requirement]]] = {}
        self._shares: dict[TrainingSpec, float] = {}
        self._micro: dict[tuple[TrainingSpec, int], TrainingSpec] = {}
        self._smaller: dict[tuple[TrainingSpec, _Capacity], TrainingSpec | None] = {}
        self._taken_back: dict[tuple[Change, TrainingSpec, TrainingSpec], TrainingSpec | None] = {}

    def curve(self, spec: TrainingSpec, dimension: Dimension) -> _Curve:
        key = (spec, dimension)
        found = self._curves.get(key)
        if found is None:
            limit = self.max_batch_size if dimension == "batch_size" else self.max_seq_len
            found = self._curves[key] = _Curve(spec, dimension, limit, self.requirements)
        return found

    def max_batch(self, spec: TrainingSpec, capacity: _Capacity) -> int:
        return self.curve(spec, "batch_size").largest_fitting(capacity)

    def max_seq(self, spec: TrainingSpec, capacity: _Capacity) -> int:
        return self.curve(spec, "seq_len").largest_fitting(capacity)

    def apply(self, change: Change, spec: TrainingSpec, capacity: _Capacity) -> TrainingSpec | None:
        """`spec` with `change` made, or None when the change does not apply to it."""
        if change is Change.SMALLER_MICRO_BATCH:
            return self._smaller_micro_batch(spec, capacity)
        return self._spec_change(change, spec)

    def _spec_change(self, change: Change, spec: TrainingSpec) -> TrainingSpec | None:
        """A change that does not depend on the GPU, made once per check."""
        key = (change, spec)
        if key not in self._changed:
            try:
                changed = apply_change(change, spec, self.narrower_target_modules)
            except InvalidSpecError:
                # a change the job's method does not take (LoRA-FA's optimizer is its own,
                # VeRA/LoHa/LoKr options do not go with QLoRA, checkpointing under LitGPT's
                # adapters)
                changed = None
            self._changed[key] = changed
        return self._changed[key]

    def _smaller_micro_batch(self, spec: TrainingSpec, capacity: _Capacity) -> TrainingSpec | None:
        """The largest micro-batch that divides the effective batch and fits, accumulating
        the rest; without one that fits, the last one tried (once per spec and capacity: the
        suggestions and the stacked change both ask)."""
        key = (spec, capacity)
        if key not in self._smaller:
            self._smaller[key] = self._find_smaller_micro_batch(spec, capacity)
        return self._smaller[key]

    def _find_smaller_micro_batch(
        self, spec: TrainingSpec, capacity: _Capacity
    ) -> TrainingSpec | None:
        largest = min(self.max_batch(spec, capacity), spec.batch_size - 1)
        smallest = spec.min_batch_size
        if largest < smallest:
            return None
        effective = spec.batch_size * spec.gradient_accumulation_steps
        divisors = [d for d in range(largest, smallest - 1, -1) if effective % d == 0]
        divisors = divisors[:MICRO_BATCH_TRIES]
        candidate: TrainingSpec | None = None
        for micro in divisors:
            candidate = self._micro.get((spec, micro))
            if candidate is None:
                candidate = self._micro[spec, micro] = spec.changed(
                    batch_size=micro, gradient_accumulation_steps=effective // micro
                )
            need = self.requirements.valid(candidate)
            if need is not None and capacity.holds(need.device_bytes_upper):
                break
        return candidate

    def suggestions(self, spec: TrainingSpec, capacity: _Capacity) -> tuple[Suggestion, ...]:
        """Single changes that fit or save more than `part_threshold`, those that fit first;
        when none fits, first the changes stacked in rank order up to the first combination
        that fits, less every part the combination fits without (or, when nothing fits, every
        part that saves less than the threshold)."""
        current = self.requirements(spec).device_bytes_upper
        threshold = part_threshold(current)
        singles = [
            self._suggestion((change,), changed, need, capacity)
            for change, changed, need in self._lowering(spec)
        ]
        smaller = self._smaller_micro_batch(spec, capacity)
        need = None if smaller is None else self.requirements.valid(smaller)
        if smaller is not None and need is not None and need.device_bytes_upper < current:
            singles.append(self._suggestion((Change.SMALLER_MICRO_BATCH,), smaller, need, capacity))
        singles = [
            s for s in singles if s.fits or current - s.requirement.device_bytes_upper > threshold
        ]
        singles.sort(
            key=lambda s: (not s.fits, _RANK[s.changes[0]], s.requirement.device_bytes_upper)
        )
        if singles and singles[0].fits:
            return tuple(singles)
        stacked = self._stacked(spec, capacity)
        if stacked is not None:
            stacked = self._pruned(stacked, spec, capacity, threshold)
        if stacked is None or len(stacked.changes) < 2:
            return tuple(singles)
        return (stacked, *singles)

    def _lowering(self, spec: TrainingSpec) -> list[tuple[Change, TrainingSpec, Requirement]]:
        """The changes that do not depend on the GPU and lower `spec`'s safe bound, each with
        its spec and requirement (found once per spec, shared by every GPU)."""
        found = self._lowering_memo.get(spec)
        if found is None:
            current = self.requirements(spec).device_bytes_upper
            found = []
            for change in Change:
                if change is Change.SMALLER_MICRO_BATCH:
                    continue
                # (the change first: the optimizer's share is asked of one that applies)
                changed = self._spec_change(change, spec)
                if changed is None or not self._worth_trying(change, spec):
                    continue
                need = self.requirements.valid(changed)
                if need is not None and need.device_bytes_upper < current:
                    found.append((change, changed, need))
            self._lowering_memo[spec] = found
        return found

    def _worth_trying(self, change: Change, spec: TrainingSpec) -> bool:
        """False for an optimizer change when the optimizer's share of `spec`'s safe bound is
        under MIN_OPTIMIZER_SHARE."""
        if change not in _OPTIMIZER_CHANGES:
            return True
        share = self._shares.get(spec)
        if share is None:
            share = self._shares[spec] = self._optimizer_share(spec)
        return share >= MIN_OPTIMIZER_SHARE

    def _optimizer_share(self, spec: TrainingSpec) -> float:
        """The share of `spec`'s safe bound that its optimizer accounts for: what the bound
        drops by with a stateless optimizer (HF's "sgd", momentum 0). 1.0 when that cannot be
        estimated, so optimizer changes stay on offer."""
        current = self.requirements(spec).device_bytes_upper
        try:
            probe = spec.changed(optim=Optim.SGD)
        except InvalidSpecError:
            return 0.0  # the method trains with its own optimizer (LoRA-FA): none to change
        stateless = self.requirements.valid(probe)
        if stateless is None or current <= 0:
            return 1.0
        return max(0, current - stateless.device_bytes_upper) / current

    def _stacked(self, spec: TrainingSpec, capacity: _Capacity) -> Suggestion | None:
        """Changes applied on top of each other in rank order, each kept only when it lowers
        the stacked requirement, until the job fits."""
        changes: list[Change] = []
        best: Suggestion | None = None
        current = self.requirements(spec).device_bytes_upper
        job = spec  # the optimizer's share is the job's, not that of the changes stacked so far
        for change in Change:
            changed = self.apply(change, spec, capacity)
            if changed is None or not self._worth_trying(change, job):
                continue
            need = self.requirements.valid(changed)
            if need is None or need.device_bytes_upper >= current:
                continue
            spec, current = changed, need.device_bytes_upper
            superseded = _SUPERSEDES.get(change)
            if superseded in changes:
                changes.remove(superseded)
            changes.append(change)
            best = self._suggestion(tuple(changes), spec, need, capacity)
            if best.fits:
                break
        return best

    def _pruned(
        self, stacked: Suggestion, job: TrainingSpec, capacity: _Capacity, threshold: int
    ) -> Suggestion:
        """`stacked` less the parts it can do without: a part goes when the change without it
        still fits (or neither fits) and needs at most `threshold` more. The most disruptive
        parts are tried first; the loop ends when every part is needed."""
        current = stacked
        dropped = True
        while dropped and len(current.changes) > 1:
            dropped = False
            for change in sorted(current.changes, key=_RANK.__getitem__, reverse=True):
                key = (change, current.spec, job)
                if key not in self._taken_back:
                    self._taken_back[key] = take_back(change, current.spec, job)
                spec = self._taken_back[key]
                need = None if spec is None else self.requirements.valid(spec)
                if spec is None or need is None:
                    continue
                rise = need.device_bytes_upper - current.requirement.device_bytes_upper
                fits = capacity.holds(need.device_bytes_upper)
                if rise <= threshold and (fits or not current.fits):
                    parts = tuple(c for c in current.changes if c is not change)
                    current = self._suggestion(parts, spec, need, capacity)
                    dropped = True
                    break
        return current

    @staticmethod
    def _suggestion(
        changes: tuple[Change, ...], spec: TrainingSpec, need: Requirement, capacity: _Capacity
    ) -> Suggestion:
        return Suggestion(
            changes=changes,
            spec=spec,
            requirement=need,
            fits=capacity.holds(need.device_bytes_upper),
        )


def check_fit(
    spec: TrainingSpec,
    offers: Sequence[GpuOffer],
    requirement: RequirementFn,
    *,
    max_batch_size: int,
    max_seq_len: int,
    narrower_target_modules: tuple[str, ...] | None = None,
    shaped: ShapedRequirementFn | None = None,
) -> FitCheck:
    """Decide, per GPU type, whether `spec` fits, how far it can grow and what makes it fit.

    `max_batch_size` and `max_seq_len` bound the solved answers (an answer equal to the bound
    means "at least"); `narrower_target_modules` is what "fewer target modules" changes to
    (PEFT's default for the model), None to not suggest it. `shaped`, when given, is the same
    requirement as `requirement`, read along the max-batch and max-seq curves without a spec
    per point.
    """
    requirements = _Requirements(requirement, shaped)
    solver = _Solver(
        requirements,
        max_batch_size=max_batch_size,
        max_seq_len=max_seq_len,
        narrower_target_modules=narrower_target_modules,
    )
    # Smaller GPUs first: their answers bracket the larger ones' from below.
    order = sorted(range(len(offers)), key=lambda i: offers[i].memory_bytes)
    jobs: dict[int, _Job] = {}
    answers: dict[int, GpuFit] = {}
    for index in order:
        offer = offers[index]
        count = spec.parallel.gpus if offer.count is None else offer.count
        job = jobs.get(count)
        if job is None:
            job = jobs[count] = _Job(spec, count, solver)
        answers[index] = job.fit(offer)
    fits = tuple(answers[i] for i in range(len(offers)))
    priced = [
        (fit.cost_per_hour, i)
        for i, fit in enumerate(fits)
        if fit.fits and fit.cost_per_hour is not None
    ]
    cheapest = min(priced)[1] if priced else None
    return FitCheck(gpus=fits, cheapest=cheapest, evaluations=requirements.evaluations)


class _Job:
    """The job on one GPU count: its requirement, and the answers and suggestions already
    worked out, each with the range of capacities it holds for."""

    __slots__ = ("answered", "count", "need", "solver", "spec", "suggested")

    def __init__(self, spec: TrainingSpec, count: int, solver: _Solver) -> None:
        self.count = count
        self.spec = (
            spec
            if count == spec.parallel.gpus
            else spec.changed(parallel=replace(spec.parallel, gpus=count))
        )
        self.solver = solver
        self.need = solver.requirements(self.spec)
        self.answered: list[tuple[_Capacity, tuple[bool, int, int]]] = []
        self.suggested: list[tuple[_Capacity, tuple[Suggestion, ...]]] = []

    def fit(self, offer: GpuOffer) -> GpuFit:
        usable = usable_bytes(offer.memory_bytes)
        upper = self.need.device_bytes_upper
        fits, max_batch, max_seq = self._answer(usable)
        return GpuFit(
            offer=offer,
            count=self.count,
            usable_bytes=usable,
            requirement=self.need,
            fits=fits,
            headroom_bytes=usable - upper,
            utilisation=upper / usable,
            max_batch_size=max_batch,
            max_seq_len=max_seq,
            suggestions=() if fits else self._suggestions(usable),
            cost_per_hour=(
                None if offer.price_per_hour is None else offer.price_per_hour * self.count
            ),
        )

    def _answer(self, usable: int) -> tuple[bool, int, int]:
        """Whether the job fits `usable` bytes, and its largest batch and sequence there:
        worked out once per range of capacities that answers every comparison they make
        alike."""
        found_before = _covering(self.answered, usable)
        if found_before is not None:
            return found_before
        capacity = _Capacity(usable)
        found = (
            capacity.holds(self.need.device_bytes_upper),
            self.solver.max_batch(self.spec, capacity),
            self.solver.max_seq(self.spec, capacity),
        )
        self.answered.append((capacity, found))
        return found

    def _suggestions(self, usable: int) -> tuple[Suggestion, ...]:
        found_before = _covering(self.suggested, usable)
        if found_before is not None:
            return found_before
        capacity = _Capacity(usable)
        found = self.solver.suggestions(self.spec, capacity)
        self.suggested.append((capacity, found))
        return found


def _covering(windows: Sequence[tuple[_Capacity, T]], usable: int) -> T | None:
    """What the range that holds `usable` found, or None (it is then worked out anew). GPUs
    come smallest first, so the latest range is the only one that can hold a capacity as
    large as its own: the ranges are disjoint intervals, each holding the capacity it was
    made for (an earlier one that held a larger capacity would hold the latest's too, which
    then would not have been made)."""
    if windows:
        window, found = windows[-1]
        if window.covers(usable):
            return found
    return None
