"""The fewest GPUs per GPU type and strategy: the ladder of counts, the search's answers
checked against the requirement itself, and the cheapest and fewest placements."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from service.catalog.gpus import default_gpu_catalog
from service.catalog.models import default_catalog
from service.core.errors import InvalidSpecError
from service.core.estimator import peak_levels
from service.core.fit import GpuOffer, Requirement, usable_bytes
from service.core.placement import (
    DEFAULT_MAX_GPUS,
    MAX_PLACEMENT_GPUS,
    Outcome,
    Placement,
    gpu_counts,
    place,
)
from service.core.spec import Method, Offload, ParallelSpec, Strategy, TrainingSpec
from service.core.units import GIB

JOB = TrainingSpec(method=Method.FULL, batch_size=1, seq_len=4096, gradient_checkpointing=True)


def _gpu(name: str, price: float | None = None) -> GpuOffer:
    return GpuOffer(
        memory_bytes=default_gpu_catalog().resolve(name).memory_bytes, price_per_hour=price
    )


class Counted:
    """A requirement function that counts its calls."""

    def __init__(self, per_gpu: dict[Strategy, object]) -> None:
        self.per_gpu = per_gpu
        self.calls: list[TrainingSpec] = []

    def __call__(self, spec: TrainingSpec) -> Requirement:
        self.calls.append(spec)
        fn = self.per_gpu[spec.parallel.strategy]
        need = int(fn(spec.parallel.gpus))  # type: ignore[operator]
        return Requirement(device_bytes=need, device_bytes_upper=need)


def test_the_ladder_is_one_node_then_whole_nodes() -> None:
    assert gpu_counts(64, 8) == (1, 2, 3, 4, 5, 6, 7, 8, 16, 24, 32, 40, 48, 56, 64)
    assert gpu_counts(10, 4) == (1, 2, 3, 4, 8)
    assert gpu_counts(3, 8) == (1, 2, 3)
    for bad in (0, MAX_PLACEMENT_GPUS + 1):
        with pytest.raises(InvalidSpecError) as err:
            gpu_counts(bad, 8)
        assert err.value.field == "max_gpus"


def test_a_toy_requirement_gets_its_known_answer_in_few_evaluations() -> None:
    # Sharded states over n GPUs plus a fixed part: 10 GiB + 600 GiB / n. On a GPU of 80 GiB
    # usable it fits from n = 600 / 70 = 8.57, so the ladder's answer is 16 (2 nodes of 8).
    usable = 80 * GIB
    fn = Counted({Strategy.ZERO3: lambda n: 10 * GIB + 600 * GIB // n})
    offer = GpuOffer(memory_bytes=usable + (640 << 20))
    assert usable_bytes(offer.memory_bytes) == usable
    check = place(JOB, [offer], fn, strategies=[Strategy.ZERO3])
    (found,) = check.placements
    assert found.outcome is Outcome.FITS
    assert (found.count, found.nodes, found.previous_count) == (16, 2, 8)
    assert found.requirement is not None and found.requirement.device_bytes_upper <= usable
    assert found.previous_requirement is not None
    assert found.previous_requirement.device_bytes_upper > usable
    ladder = len(gpu_counts(DEFAULT_MAX_GPUS, 8))
    assert check.evaluations == len(fn.calls) < ladder // 2
    assert check.fewest == 0 and check.cheapest is None  # no price given


def test_every_gpu_size_gets_the_first_fitting_count_of_the_ladder() -> None:
    counts = gpu_counts(DEFAULT_MAX_GPUS, 8)

    def need(n: int) -> int:
        return 4 * GIB + 500 * GIB // n

    fn = Counted({Strategy.FSDP: need})
    offers = [GpuOffer(memory_bytes=gib * GIB) for gib in (16, 24, 40, 48, 80, 96, 141, 192)]
    check = place(JOB, offers, fn, strategies=[Strategy.FSDP])
    for offer, found in zip(offers, check.placements, strict=True):
        usable = usable_bytes(offer.memory_bytes)
        fitting = [n for n in counts if need(n) <= usable]
        expected = fitting[0] if fitting else None
        assert found.count == expected
    # GPU types share the requirement's evaluations: far fewer than one ladder per GPU.
    assert len(fn.calls) == check.evaluations < len(counts) * 2


def test_a_requirement_that_stops_falling_ends_the_search_and_says_so() -> None:
    # DDP: one GPU needs no reducer buckets; from two GPUs on every GPU holds everything.
    fn = Counted({Strategy.DDP: lambda n: 50 * GIB if n == 1 else 70 * GIB})
    small, large = GpuOffer(memory_bytes=40 * GIB), GpuOffer(memory_bytes=60 * GIB)
    check = place(JOB, [small, large], fn, strategies=[Strategy.DDP])
    none, one = check.placements
    assert none.outcome is Outcome.DOES_NOT_FIT and none.stops_falling
    assert none.reason is not None and "do not lower" in none.reason
    assert one.count == 1 and one.previous_count is None
    assert len(fn.calls) == 3  # one GPU, the top of the ladder, two GPUs


def test_a_slowly_falling_requirement_is_not_called_flat() -> None:
    fn = Counted({Strategy.ZERO1: lambda n: 30 * GIB + 200 * GIB // n})
    check = place(JOB, [GpuOffer(memory_bytes=24 * GIB)], fn, strategies=[Strategy.ZERO1])
    (found,) = check.placements
    assert found.outcome is Outcome.DOES_NOT_FIT and not found.stops_falling
    assert found.top_requirement is not None
    assert found.top_requirement.device_bytes_upper == 30 * GIB + 200 * GIB // 64


def test_cheapest_and_fewest_over_gpu_types_and_strategies() -> None:
    fn = Counted(
        {
            Strategy.ZERO3: lambda n: 8 * GIB + 400 * GIB // n,
            Strategy.ZERO2: lambda n: 60 * GIB + 100 * GIB // n,
        }
    )
    offers = [
        GpuOffer(memory_bytes=80 * GIB, price_per_hour=3.0),
        GpuOffer(memory_bytes=40 * GIB, price_per_hour=1.0),
        GpuOffer(memory_bytes=141 * GIB),  # no price: only in the fewest
    ]
    check = place(JOB, offers, fn, strategies=[Strategy.ZERO3, Strategy.ZERO2])
    assert [p.strategy for p in check.placements[:2]] == [Strategy.ZERO3, Strategy.ZERO2]
    priced = [p for p in check.placements if p.cost_per_hour is not None]
    for p in priced:
        assert p.count is not None
        assert p.cost_per_hour == offers[p.offer_index].price_per_hour * p.count  # type: ignore[operator]
    assert check.cheapest is not None and check.fewest is not None
    cheapest = check.placements[check.cheapest]
    assert cheapest.cost_per_hour == min(p.cost_per_hour for p in priced)  # type: ignore[type-var]
    fewest = check.placements[check.fewest]
    assert fewest.count == min(p.count for p in check.placements if p.count is not None)


def test_a_strategy_the_job_cannot_use_is_not_possible_and_none_at_all_is_an_error() -> None:
    qlora = TrainingSpec(method=Method.QLORA, batch_size=1, seq_len=1024)
    fn = Counted({s: (lambda n: 10 * GIB) for s in Strategy})
    check = place(
        qlora, [GpuOffer(memory_bytes=80 * GIB)], fn, strategies=[Strategy.ZERO3, Strategy.ZERO2]
    )
    impossible, possible = check.placements
    assert impossible.outcome is Outcome.NOT_POSSIBLE
    assert impossible.reason is not None and impossible.reason.startswith("not possible: QLoRA")
    assert possible.outcome is Outcome.FITS and possible.count == 1
    with pytest.raises(InvalidSpecError) as err:
        place(
            qlora, [GpuOffer(memory_bytes=80 * GIB)], fn, strategies=[Strategy.ZERO3, Strategy.FSDP]
        )
    assert err.value.field == "strategies"
    offloading = replace(
        JOB, parallel=ParallelSpec(strategy=Strategy.ZERO2, offload=Offload.OPTIMIZER)
    )
    (ddp,) = place(
        offloading, [GpuOffer(memory_bytes=80 * GIB)], fn, strategies=[Strategy.DDP, Strategy.ZERO2]
    ).placements[:1]
    assert ddp.outcome is Outcome.NOT_POSSIBLE and "DDP cannot offload" in (ddp.reason or "")


def test_the_job_s_own_strategy_by_default_and_a_strategy_listed_twice_is_refused() -> None:
    job = replace(JOB, parallel=ParallelSpec(gpus=8, strategy=Strategy.FSDP2, gpus_per_node=4))
    fn = Counted({Strategy.FSDP2: lambda n: 200 * GIB // n})
    check = place(job, [GpuOffer(memory_bytes=80 * GIB)], fn)
    assert check.strategies == (Strategy.FSDP2,) and check.gpus_per_node == 4
    assert check.counts[:5] == (1, 2, 3, 4, 8)
    (found,) = check.placements
    assert found.count == 3 and found.nodes == 1
    with pytest.raises(InvalidSpecError) as err:
        place(
            job, [GpuOffer(memory_bytes=80 * GIB)], fn, strategies=[Strategy.FSDP2, Strategy.FSDP2]
        )
    assert err.value.field == "strategies"


# The real estimator on a catalog model. Its multi-GPU model changes, so no count is pinned:
# every answer is checked against the estimator itself.

LLAMA_70B = "meta-llama/Llama-3.1-70B"


def _levels(spec: TrainingSpec) -> Requirement:
    arch = default_catalog().resolve(LLAMA_70B).arch
    levels = peak_levels(arch, spec)
    return Requirement(
        device_bytes=levels.device_bytes, device_bytes_upper=levels.device_bytes_upper
    )


def _assert_fewest(
    found: Placement, job: TrainingSpec, usable: int, counts: tuple[int, ...]
) -> None:
    assert found.outcome is Outcome.FITS, found.reason
    assert found.count is not None and found.spec is not None and found.requirement is not None
    # The answer is the job on that many GPUs under the strategy, per-GPU sizes unchanged.
    assert found.spec.parallel.gpus == found.count
    assert found.spec.parallel.strategy is found.strategy
    assert (found.spec.batch_size, found.spec.seq_len) == (job.batch_size, job.seq_len)
    assert _levels(found.spec).device_bytes_upper == found.requirement.device_bytes_upper
    assert found.requirement.device_bytes_upper <= usable
    position = counts.index(found.count)
    if position == 0:
        assert found.previous_count is None
        return
    below = counts[position - 1]
    assert found.previous_count == below
    spec = replace(found.spec, parallel=replace(found.spec.parallel, gpus=below))
    assert _levels(spec).device_bytes_upper > usable
    assert found.nodes == -(-found.count // 8)


@pytest.mark.parametrize("method", [Method.FULL, Method.LORA])
def test_fewest_h100s_for_llama_70b_under_zero3_or_fsdp(method: Method) -> None:
    job = replace(JOB, method=method)
    h100 = _gpu("H100-SXM", price=3.0)
    usable = usable_bytes(h100.memory_bytes)
    check = place(job, [h100], _levels, strategies=[Strategy.ZERO3, Strategy.FSDP])
    assert len(check.placements) == 2
    for found in check.placements:
        _assert_fewest(found, job, usable, check.counts)
        assert found.cost_per_hour == 3.0 * found.count  # type: ignore[operator]
        per_gpu = peak_levels(default_catalog().resolve(LLAMA_70B).arch, found.spec)  # type: ignore[arg-type]
        assert per_gpu.allocated_bytes > 0
    assert check.cheapest is not None
    costs = [p.cost_per_hour for p in check.placements if p.cost_per_hour is not None]
    assert check.placements[check.cheapest].cost_per_hour == min(costs)


def test_llama_70b_full_fine_tuning_under_ddp_does_not_fit_any_number_of_h100s() -> None:
    check = place(JOB, [_gpu("H100-SXM")], _levels, strategies=[Strategy.DDP])
    (found,) = check.placements
    assert found.outcome is Outcome.DOES_NOT_FIT and found.count is None
    assert found.top_requirement is not None
    assert found.top_requirement.device_bytes_upper > usable_bytes(_gpu("H100-SXM").memory_bytes)


def test_a_requirement_that_rises_before_it_falls_is_bracketed_and_verified() -> None:
    # One GPU holds no collective buffers (lower than two); sharding pays off from a node on.
    def need(n: int) -> int:
        if n == 1:
            return 100 * GIB
        return 120 * GIB if n <= 8 else 4 * GIB + 900 * GIB // n

    fn = Counted({Strategy.ZERO3: need})
    check = place(JOB, [GpuOffer(memory_bytes=80 * GIB)], fn, strategies=[Strategy.ZERO3])
    (found,) = check.placements
    assert (found.count, found.previous_count) == (16, 8)
    usable = found.usable_bytes
    assert need(16) <= usable < need(8)


def test_random_falling_requirements_get_the_first_fitting_count() -> None:
    rng = random.Random(20261201)
    counts = gpu_counts(DEFAULT_MAX_GPUS, 8)
    for _ in range(200):
        # Nonincreasing along the ladder, with plateaus, from one GPU on.
        steps = sorted((rng.randrange(0, 64 * GIB) for _ in counts), reverse=True)
        table = dict(zip(counts, (8 * GIB + s for s in steps), strict=True))
        fn = Counted({Strategy.FSDP: table.__getitem__})
        offers = [GpuOffer(memory_bytes=rng.randrange(9, 80) * GIB) for _ in range(4)]
        check = place(JOB, offers, fn, strategies=[Strategy.FSDP])
        for offer, found in zip(offers, check.placements, strict=True):
            usable = usable_bytes(offer.memory_bytes)
            fitting = [n for n in counts if table[n] <= usable]
            assert found.count == (fitting[0] if fitting else None)
        assert check.evaluations <= len(counts)
