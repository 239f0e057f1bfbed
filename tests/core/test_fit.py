"""The fit solver: answers equal brute force, evaluations are shared, suggestions are honest."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.catalog.gpus import default_gpu_catalog
from service.catalog.models import default_catalog
from service.core.arch import ModelArch
from service.core.errors import InvalidSpecError
from service.core.estimator import default_target_modules, estimate, peak_levels, shape_levels
from service.core.fit import (
    DRIVER_RESERVED_BYTES,
    MIN_OPTIMIZER_SHARE,
    MIN_PART_BYTES,
    GpuOffer,
    Requirement,
    check_fit,
    part_threshold,
    usable_bytes,
)
from service.core.fit_changes import Change
from service.core.spec import (
    LORA_METHODS,
    Framework,
    LoraSpec,
    Method,
    Objective,
    Optim,
    ParallelSpec,
    Strategy,
    TrainingSpec,
)
from service.core.spec.delta import VeraSpec
from service.core.spec.prompt import PromptTuningSpec
from service.core.units import GIB, MIB

BASE = TrainingSpec(batch_size=4, seq_len=64)
BATCH_LIMIT = 64
SEQ_LIMIT = 300


def _req(bytes_of: Callable[[int, int], int]) -> Callable[[TrainingSpec], Requirement]:
    def requirement(spec: TrainingSpec) -> Requirement:
        need = bytes_of(spec.batch_size, spec.seq_len)
        return Requirement(device_bytes=need, device_bytes_upper=need)

    return requirement


def _brute(bytes_of: Callable[[int], int], capacity: int, limit: int) -> int:
    fitting = [x for x in range(1, limit + 1) if bytes_of(x) <= capacity]
    return max(fitting, default=0)


def _offer(usable: int) -> GpuOffer:
    return GpuOffer(memory_bytes=usable + DRIVER_RESERVED_BYTES)


def _check(
    bytes_of: Callable[[int, int], int], usables: list[int]
) -> tuple[list[tuple[int, int]], int]:
    report = check_fit(
        BASE,
        [_offer(u) for u in usables],
        _req(bytes_of),
        max_batch_size=BATCH_LIMIT,
        max_seq_len=SEQ_LIMIT,
    )
    return [(g.max_batch_size, g.max_seq_len) for g in report.gpus], report.evaluations


def test_usable_memory_is_the_total_less_the_drivers_share() -> None:
    assert DRIVER_RESERVED_BYTES == 640 * MIB
    assert usable_bytes(80 * GIB) == 80 * GIB - 640 * MIB
    assert usable_bytes(100) == 0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"memory_bytes": 512 * MIB}, "gpus.memory"),
        ({"memory_bytes": 8 * GIB, "count": 0}, "gpus.count"),
        ({"memory_bytes": 8 * GIB, "price_per_hour": -1.0}, "gpus.price_per_hour"),
        ({"memory_bytes": 8 * GIB, "price_per_hour": float("nan")}, "gpus.price_per_hour"),
    ],
)
def test_offer_validates_itself(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidSpecError) as raised:
        GpuOffer(**kwargs)  # type: ignore[arg-type]  # the kwargs are the point
    assert raised.value.field == field


# Shapes the estimator's peak takes: a max over phases of terms affine in batch and affine or
# quadratic in sequence, rounded to allocator blocks and scaled by a margin.
SHAPES: dict[str, Callable[[int, int], int]] = {
    "affine": lambda b, s: 1000 + 37 * b * s,
    "max of affine phases": lambda b, s: max(5000 + 10 * b * s, 200 + 55 * b * s, 9000),
    "quadratic in seq": lambda b, s: 2000 + 9 * b * s + 3 * b * s * s,
    "rounded stairs": lambda b, s: int(1.1 * (-(-(800 + 41 * b * s) // 256) * 256)),
    "plateaus": lambda b, s: 3000 + 500 * ((b * s) // 40),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_answers_equal_brute_force(shape: str) -> None:
    bytes_of = SHAPES[shape]
    usables = list(range(500, 400_000, 7919))
    answers, _ = _check(bytes_of, usables)
    for usable, (max_batch, max_seq) in zip(usables, answers, strict=True):
        assert max_batch == _brute(lambda b: bytes_of(b, BASE.seq_len), usable, BATCH_LIMIT)
        assert max_seq == _brute(lambda s: bytes_of(BASE.batch_size, s), usable, SEQ_LIMIT)


@settings(max_examples=60, deadline=None)
@given(
    fixed=st.integers(0, 10**6),
    per_token=st.integers(1, 10**4),
    per_square=st.integers(0, 50),
    usables=st.lists(st.integers(1, 10**8), min_size=1, max_size=12),
)
def test_answers_equal_brute_force_for_any_coefficients(
    fixed: int, per_token: int, per_square: int, usables: list[int]
) -> None:
    def bytes_of(b: int, s: int) -> int:
        return fixed + per_token * b * s + per_square * b * s * s

    answers, _ = _check(bytes_of, usables)
    for usable, (max_batch, max_seq) in zip(usables, answers, strict=True):
        assert max_batch == _brute(lambda b: bytes_of(b, BASE.seq_len), usable, BATCH_LIMIT)
        assert max_seq == _brute(lambda s: bytes_of(BASE.batch_size, s), usable, SEQ_LIMIT)


def test_evaluations_are_shared_across_gpus() -> None:
    calls: list[TrainingSpec] = []

    def bytes_of(b: int, s: int) -> int:
        return 1000 + 37 * b * s

    def requirement(spec: TrainingSpec) -> Requirement:
        calls.append(spec)
        return _req(bytes_of)(spec)

    same = [_offer(100_000)] * 20
    report = check_fit(BASE, same, requirement, max_batch_size=BATCH_LIMIT, max_seq_len=SEQ_LIMIT)
    assert len(calls) == len(set(calls)) == report.evaluations
    # Solved, not scanned: a handful of points per dimension for twenty identical GPUs.
    assert report.evaluations <= 8


def test_solver_uses_few_evaluations_per_gpu() -> None:
    usables = list(range(10_000, 1_000_000, 33_000))
    _, evaluations = _check(SHAPES["max of affine phases"], usables)
    assert evaluations <= 4 + 3 * 2 * len(usables)


def test_nothing_fits_gives_zero() -> None:
    answers, _ = _check(lambda b, s: 10**9, [1000])
    assert answers == [(0, 0)]


def test_answers_stop_at_the_limits() -> None:
    answers, _ = _check(lambda b, s: 1, [10**9])
    assert answers == [(BATCH_LIMIT, SEQ_LIMIT)]


# ---------------------------------------------------------------------------------------------
# With the real estimator


QWEN_05B = default_catalog().resolve("Qwen/Qwen2.5-0.5B").arch
QWEN_7B = default_catalog().resolve("Qwen/Qwen2.5-7B").arch
QWEN_14B = default_catalog().resolve("Qwen/Qwen2.5-14B").arch
OFFERS = [GpuOffer(memory_bytes=gpu.memory_bytes) for gpu in default_gpu_catalog().gpus()]


def _requirement(arch: ModelArch) -> Callable[[TrainingSpec], Requirement]:
    def requirement(spec: TrainingSpec) -> Requirement:
        est = estimate(arch, spec)
        return Requirement(device_bytes=est.device_bytes, device_bytes_upper=est.device_bytes_upper)

    return requirement


@pytest.mark.parametrize(
    "spec",
    [
        TrainingSpec(batch_size=4, seq_len=2048, lora=LoraSpec(r=16, target_modules="all-linear")),
        TrainingSpec(method=Method.QLORA, batch_size=2, seq_len=4096, gradient_checkpointing=True),
        TrainingSpec(method=Method.FULL, batch_size=1, seq_len=1024),
    ],
    ids=["lora", "qlora", "full"],
)
def test_real_estimator_answers_are_exact_on_every_catalog_gpu(spec: TrainingSpec) -> None:
    requirement = _requirement(QWEN_7B)
    limit = QWEN_7B.max_position_embeddings
    report = check_fit(
        spec,
        OFFERS,
        requirement,
        max_batch_size=4096,
        max_seq_len=limit,
        narrower_target_modules=default_target_modules(QWEN_7B),
    )
    for fit in report.gpus:
        usable = fit.usable_bytes

        def at_batch(b: int) -> int:
            return requirement(replace(spec, batch_size=b)).device_bytes_upper

        def at_seq(s: int) -> int:
            return requirement(replace(spec, seq_len=s)).device_bytes_upper

        b, s = fit.max_batch_size, fit.max_seq_len
        assert b == 0 or at_batch(b) <= usable
        assert at_batch(b + 1) > usable
        assert s == 0 or at_seq(s) <= usable
        assert s == limit or at_seq(s + 1) > usable
        assert fit.fits == (requirement(spec).device_bytes_upper <= usable)
        assert fit.headroom_bytes == usable - fit.requirement.device_bytes_upper


def test_suggestions_are_honest_and_ranked() -> None:
    spec = TrainingSpec(
        batch_size=4, seq_len=2048, lora=LoraSpec(r=16, target_modules="all-linear")
    )
    requirement = _requirement(QWEN_7B)
    report = check_fit(
        spec,
        OFFERS,
        requirement,
        max_batch_size=4096,
        max_seq_len=QWEN_7B.max_position_embeddings,
        narrower_target_modules=default_target_modules(QWEN_7B),
    )
    current = requirement(spec).device_bytes_upper
    rank = list(Change)
    for fit in report.gpus:
        if fit.fits:
            assert fit.suggestions == ()
            continue
        assert fit.suggestions
        for suggestion in fit.suggestions:
            need = requirement(suggestion.spec)
            assert suggestion.requirement == need
            assert need.device_bytes_upper < current
            assert suggestion.fits == (need.device_bytes_upper <= fit.usable_bytes)
            if Change.SMALLER_MICRO_BATCH in suggestion.changes:
                effective = suggestion.spec.batch_size * suggestion.spec.gradient_accumulation_steps
                assert effective == spec.batch_size * spec.gradient_accumulation_steps
        singles = [s for s in fit.suggestions if len(s.changes) == 1]
        keys = [(not s.fits, rank.index(s.changes[0])) for s in singles]
        assert keys == sorted(keys)


def test_stacked_changes_when_no_single_change_fits() -> None:
    spec = TrainingSpec(
        batch_size=4, seq_len=2048, lora=LoraSpec(r=16, target_modules="all-linear")
    )
    l4 = next(g for g in default_gpu_catalog().gpus() if g.name == "L4")
    report = check_fit(
        spec,
        [GpuOffer(memory_bytes=l4.memory_bytes)],
        _requirement(QWEN_7B),
        max_batch_size=4096,
        max_seq_len=QWEN_7B.max_position_embeddings,
        narrower_target_modules=default_target_modules(QWEN_7B),
    )
    fit = report.gpus[0]
    assert not fit.fits
    first = fit.suggestions[0]
    assert len(first.changes) > 1 and first.fits
    assert [rank for rank in first.changes] == sorted(first.changes, key=list(Change).index)


def test_a_change_the_model_cannot_take_is_skipped() -> None:
    def requirement(spec: TrainingSpec) -> Requirement:
        if spec.method is not Method.FULL:
            raise InvalidSpecError("lora.target_modules", "no PEFT default for this model")
        return Requirement(device_bytes=10 * GIB, device_bytes_upper=10 * GIB)

    full = TrainingSpec(method=Method.FULL, batch_size=1, seq_len=8)
    report = check_fit(
        full, [GpuOffer(memory_bytes=8 * GIB)], requirement, max_batch_size=8, max_seq_len=8
    )
    changes = {c for s in report.gpus[0].suggestions for c in s.changes}
    assert Change.LORA not in changes and Change.QLORA not in changes


LORA_FA_JOB = TrainingSpec(method=Method.LORA_FA, batch_size=1, seq_len=8)
VERA_JOB = TrainingSpec(method=Method.VERA, batch_size=1, seq_len=8, vera=VeraSpec())


@pytest.mark.parametrize(
    ("job", "refused"),
    [
        (LORA_FA_JOB, {Change.OPTIMIZER_8BIT, Change.PAGED_OPTIMIZER}),
        (VERA_JOB, {Change.QLORA}),
    ],
)
def test_a_change_the_method_cannot_take_is_skipped(
    job: TrainingSpec, refused: set[Change]
) -> None:
    def requirement(spec: TrainingSpec) -> Requirement:
        # every change but checkpointing (and the ones refused) saves nothing here
        need = (6 if spec.gradient_checkpointing else 10) * GIB
        if spec.method is Method.QLORA or spec.optim is not job.optim:
            need = 4 * GIB
        return Requirement(device_bytes=need, device_bytes_upper=need)

    report = check_fit(
        job, [GpuOffer(memory_bytes=8 * GIB)], requirement, max_batch_size=8, max_seq_len=8
    )
    changes = {c for s in report.gpus[0].suggestions for c in s.changes}
    assert not changes & refused
    assert Change.GRADIENT_CHECKPOINTING in changes


def test_count_shards_the_job_and_prices_pick_the_cheapest() -> None:
    spec = TrainingSpec(
        method=Method.FULL,
        batch_size=1,
        seq_len=1024,
        optim=Optim.ADAMW_TORCH_FUSED,
        parallel=ParallelSpec(strategy=Strategy.ZERO3),
    )
    h100 = 81559 * MIB
    offers = [
        GpuOffer(memory_bytes=h100, count=1, price_per_hour=2.0),
        GpuOffer(memory_bytes=h100, count=8, price_per_hour=2.5),
        GpuOffer(memory_bytes=h100, count=4, price_per_hour=2.0),
        GpuOffer(memory_bytes=h100, count=8),
    ]
    report = check_fit(spec, offers, _requirement(QWEN_7B), max_batch_size=4096, max_seq_len=32768)
    one, eight, four, unpriced = report.gpus
    assert eight.requirement.device_bytes_upper < one.requirement.device_bytes_upper
    assert not one.fits and eight.fits and four.fits and unpriced.fits
    assert eight.cost_per_hour == 20.0 and four.cost_per_hour == 8.0
    assert unpriced.cost_per_hour is None
    assert report.cheapest == 2


def test_no_cheapest_without_prices() -> None:
    spec = TrainingSpec(batch_size=1, seq_len=128)
    report = check_fit(
        spec, OFFERS[:3], _requirement(QWEN_05B), max_batch_size=64, max_seq_len=1024
    )
    assert report.cheapest is None


# ---------------------------------------------------------------------------------------------
# Suggestions are minimal


LLAMA_8B = default_catalog().resolve("meta-llama/Llama-3.1-8B").arch
RTX_4090 = next(g for g in default_gpu_catalog().gpus() if g.name == "RTX4090")


def _taken_back(change: Change, spec: TrainingSpec, job: TrainingSpec) -> TrainingSpec:
    """`spec` with the fields `change` sets back at the job's values."""
    match change:
        case Change.FUSED_LOSS:
            return replace(spec, loss=job.loss)
        case Change.PRECOMPUTE_REF_LOG_PROBS:
            return replace(spec, dpo=job.dpo)
        case Change.OPTIMIZER_8BIT | Change.PAGED_OPTIMIZER:
            return replace(spec, optim=job.optim)
        case Change.GRADIENT_CHECKPOINTING:
            return replace(spec, gradient_checkpointing=job.gradient_checkpointing)
        case Change.SMALLER_MICRO_BATCH:
            return replace(
                spec,
                batch_size=job.batch_size,
                gradient_accumulation_steps=job.gradient_accumulation_steps,
            )
        case Change.FEWER_TARGET_MODULES:
            assert spec.lora is not None and job.lora is not None
            return replace(spec, lora=replace(spec.lora, target_modules=job.lora.target_modules))
        case Change.LORA | Change.QLORA:
            lora = None if job.method is Method.FULL else spec.lora
            return replace(spec, method=job.method, quantization=job.quantization, lora=lora)


def _optimizer_share(arch: ModelArch, spec: TrainingSpec) -> float:
    need = estimate(arch, spec).device_bytes_upper
    stateless = estimate(arch, replace(spec, optim=Optim.SGD)).device_bytes_upper
    return (need - stateless) / need


def _assert_minimal(arch: ModelArch, job: TrainingSpec, offers: list[GpuOffer]) -> None:
    requirement = _requirement(arch)
    report = check_fit(
        job,
        offers,
        requirement,
        max_batch_size=4096,
        max_seq_len=arch.max_position_embeddings,
        narrower_target_modules=default_target_modules(arch),
    )
    threshold = part_threshold(requirement(job).device_bytes_upper)
    assert threshold >= MIN_PART_BYTES
    optimizer_matters = _optimizer_share(arch, job) >= MIN_OPTIMIZER_SHARE
    for fit in report.gpus:
        for suggestion in fit.suggestions:
            need = suggestion.requirement.device_bytes_upper
            assert requirement(suggestion.spec).device_bytes_upper == need
            if not optimizer_matters:
                assert not {Change.OPTIMIZER_8BIT, Change.PAGED_OPTIMIZER} & set(
                    suggestion.changes
                ), suggestion.changes
            for part in suggestion.changes:
                if len(suggestion.changes) == 1:
                    # Without its one part a suggestion is the job, which does not fit.
                    without = requirement(job).device_bytes_upper
                    assert without > fit.usable_bytes
                    assert suggestion.fits or without - need > threshold
                    continue
                without = requirement(_taken_back(part, suggestion.spec, job)).device_bytes_upper
                no_longer_fits = suggestion.fits and without > fit.usable_bytes
                assert no_longer_fits or without - need > threshold, (part, suggestion.changes)


# Each example fit-checks a new job on up to three GPUs and estimates every suggestion with
# each part taken back: seconds per example, so the suite keeps to a few.
@settings(max_examples=12, deadline=None)
@given(
    model=st.sampled_from([QWEN_05B, QWEN_7B, LLAMA_8B]),
    method=st.sampled_from([Method.FULL, Method.LORA, Method.QLORA]),
    batch_size=st.sampled_from([1, 2, 4, 8]),
    seq_len=st.sampled_from([512, 1024, 2048, 4096]),
    optim=st.sampled_from([Optim.ADAMW_TORCH_FUSED, Optim.ADAMW_TORCH, Optim.ADAMW_BNB_8BIT]),
    checkpointing=st.booleans(),
    all_linear=st.booleans(),
    shares=st.lists(st.floats(0.2, 0.99), min_size=1, max_size=3),
)
def test_every_part_of_a_suggestion_is_needed_or_saves_more_than_the_threshold(
    model: ModelArch,
    method: Method,
    batch_size: int,
    seq_len: int,
    optim: Optim,
    checkpointing: bool,
    all_linear: bool,
    shares: list[float],
) -> None:
    lora = (
        LoraSpec(r=16, target_modules="all-linear" if all_linear else None)
        if method in LORA_METHODS
        else None
    )
    job = TrainingSpec(
        method=method,
        batch_size=batch_size,
        seq_len=seq_len,
        optim=optim,
        gradient_checkpointing=checkpointing,
        lora=lora,
        prompt_tuning=PromptTuningSpec(num_virtual_tokens=100)
        if method is Method.PROMPT_TUNING
        else None,
    )
    need = estimate(model, job).device_bytes_upper
    # GPUs a share of the job's need: the job fits none of them, so each gets suggestions.
    offers = [GpuOffer(memory_bytes=DRIVER_RESERVED_BYTES + int(need * s) + 1) for s in shares]
    _assert_minimal(model, job, offers)


def test_llama_8b_qlora_on_an_rtx_4090_gets_no_part_that_changes_nothing() -> None:
    job = TrainingSpec(method=Method.QLORA, batch_size=4, seq_len=2048)
    offer = GpuOffer(memory_bytes=RTX_4090.memory_bytes)
    _assert_minimal(LLAMA_8B, job, [offer])
    report = check_fit(
        job,
        [offer],
        _requirement(LLAMA_8B),
        max_batch_size=4096,
        max_seq_len=LLAMA_8B.max_position_embeddings,
        narrower_target_modules=default_target_modules(LLAMA_8B),
    )
    fit = report.gpus[0]
    assert not fit.fits and fit.suggestions
    # LoRA adapters' AdamW state is a sliver of the peak: no optimizer change is offered.
    assert _optimizer_share(LLAMA_8B, job) < MIN_OPTIMIZER_SHARE
    offered = {change for s in fit.suggestions for change in s.changes}
    assert not offered & {Change.OPTIMIZER_8BIT, Change.PAGED_OPTIMIZER}


@pytest.mark.parametrize(
    "spec",
    [
        TrainingSpec(batch_size=4, seq_len=2048, lora=LoraSpec(r=16, target_modules="all-linear")),
        TrainingSpec(method=Method.QLORA, batch_size=2, seq_len=4096, gradient_checkpointing=True),
        TrainingSpec(method=Method.FULL, batch_size=1, seq_len=1024),
    ],
    ids=["lora", "qlora", "full"],
)
def test_every_gpu_gets_the_answer_it_gets_alone(spec: TrainingSpec) -> None:
    # Suggestions worked out for one GPU are handed to every GPU whose capacity answers the
    # same comparisons: each must equal what that GPU gets when checked on its own.
    requirement = _requirement(QWEN_7B)
    kwargs = {
        "max_batch_size": 4096,
        "max_seq_len": QWEN_7B.max_position_embeddings,
        "narrower_target_modules": default_target_modules(QWEN_7B),
    }
    together = check_fit(spec, OFFERS, requirement, **kwargs)  # type: ignore[arg-type]
    shared = sum(1 for fit in together.gpus if fit.suggestions)
    assert shared > 1
    for offer, fit in zip(OFFERS, together.gpus, strict=True):
        alone = check_fit(spec, [offer], requirement, **kwargs).gpus[0]  # type: ignore[arg-type]
        assert fit == alone


def test_litgpt_adapters_get_no_checkpointing_or_qlora_suggestion() -> None:
    """LitGPT's adapter scripts do not checkpoint, and a switch to QLoRA changes the method:
    neither is offered; what is offered keeps the method."""
    arch = default_catalog().resolve("meta-llama/Llama-2-7b-hf").arch
    job = TrainingSpec(
        method=Method.LLAMA_ADAPTER_V2, batch_size=8, seq_len=2048, framework=Framework.LITGPT
    )
    report = check_fit(
        job,
        [GpuOffer(memory_bytes=RTX_4090.memory_bytes)],
        _requirement(arch),
        max_batch_size=4096,
        max_seq_len=arch.max_position_embeddings,
        narrower_target_modules=None,
    )
    fit = report.gpus[0]
    assert not fit.fits and fit.suggestions
    offered = {change for s in fit.suggestions for change in s.changes}
    assert not offered & {Change.GRADIENT_CHECKPOINTING, Change.QLORA}
    assert all(s.spec.method is Method.LLAMA_ADAPTER_V2 for s in fit.suggestions)


def _levels_requirement(arch: ModelArch) -> Callable[[TrainingSpec], Requirement]:
    def requirement(spec: TrainingSpec) -> Requirement:
        levels = peak_levels(arch, spec)
        return Requirement(
            device_bytes=levels.device_bytes, device_bytes_upper=levels.device_bytes_upper
        )

    return requirement


def _shaped(arch: ModelArch) -> Callable[[TrainingSpec], Callable[[int, int], Requirement]]:
    def shaped(spec: TrainingSpec) -> Callable[[int, int], Requirement]:
        levels_at = shape_levels(arch, spec)

        def at(batch_size: int, seq_len: int) -> Requirement:
            levels = levels_at(batch_size, seq_len)
            return Requirement(
                device_bytes=levels.device_bytes, device_bytes_upper=levels.device_bytes_upper
            )

        return at

    return shaped


@pytest.mark.parametrize(
    "spec",
    [
        TrainingSpec(batch_size=4, seq_len=2048, lora=LoraSpec(r=16, target_modules="all-linear")),
        TrainingSpec(method=Method.QLORA, batch_size=2, seq_len=4096, gradient_checkpointing=True),
        TrainingSpec(method=Method.FULL, batch_size=1, seq_len=1024),
        TrainingSpec(batch_size=2, seq_len=1024, objective=Objective.DPO),
    ],
    ids=["lora", "qlora", "full", "dpo"],
)
def test_a_shaped_requirement_gives_the_same_check(spec: TrainingSpec) -> None:
    # The curves read the job's compiled step from (b, s) instead of a spec per point: every
    # answer, suggestion and count of evaluations is the same as with a spec per point.
    kwargs = {
        "max_batch_size": 4096,
        "max_seq_len": QWEN_7B.max_position_embeddings,
        "narrower_target_modules": default_target_modules(QWEN_7B),
    }
    requirement = _levels_requirement(QWEN_7B)
    by_spec = check_fit(spec, OFFERS, requirement, **kwargs)  # type: ignore[arg-type]
    for _ in range(2):  # the second check reads the pieces the first one's shapes recorded
        by_shape = check_fit(
            spec,
            OFFERS,
            requirement,
            shaped=_shaped(QWEN_7B),
            **kwargs,  # type: ignore[arg-type]
        )
        assert by_shape == by_spec
