"""The step recorded on symbolic shapes (estimator/symbolic.py) and compiled per job
(estimator/pieces.py) gives the step's own numbers at every shape."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.catalog.models import default_catalog
from service.core.errors import EstimatorError
from service.core.estimator import (
    MAX_PIECES,
    Pieces,
    Trace,
    compile_record,
    decoder_step,
    estimate,
    forget_compiled_steps,
    peak_levels,
    shape_estimates,
    shape_levels,
)
from service.core.spec import ALL_LINEAR, Framework, LoraSpec, Method, QuantSpec, TrainingSpec
from tests.core.test_properties import specs

SHAPES = st.lists(st.tuples(st.integers(1, 64), st.integers(1, 16384)), min_size=2, max_size=12)


@settings(max_examples=60, deadline=None)
@given(specs(), SHAPES, st.sampled_from([None, "8.0", "9.0"]))
def test_pieces_give_the_steps_own_peak_at_every_shape(
    case: tuple[str, TrainingSpec], shapes: list[tuple[int, int]], capability: str | None
) -> None:
    model, spec = case
    arch = default_catalog().resolve(model).arch
    pieces = Pieces(decoder_step)
    for b, s in shapes:
        shaped = spec.with_shape(b, s)
        own = decoder_step(arch, shaped, capability)
        numbers = pieces.step(arch, shaped, capability, notes=False)
        assert (numbers.arch, numbers.spec, numbers.plan) == (own.arch, own.spec, own.plan)
        assert (numbers.paged_state, numbers.allocated) == (own.paged_state, own.allocated)
        assert pieces.step(arch, shaped, capability) == own


def _qlora(b: int, s: int, **changes: object) -> TrainingSpec:
    return TrainingSpec(
        method=Method.QLORA,
        batch_size=b,
        seq_len=s,
        lora=LoraSpec(r=16, target_modules=ALL_LINEAR),
        quantization=QuantSpec(double_quant=True),
        autocast=True,
        gradient_checkpointing=True,
        **changes,  # type: ignore[arg-type]
    )


def test_a_jobs_shapes_share_its_pieces() -> None:
    arch = default_catalog().resolve("Qwen/Qwen2.5-7B").arch
    pieces = Pieces(decoder_step)
    shapes = [(b, s) for b in (2, 3, 5, 8, 13) for s in (700, 1024, 3000, 4095)]
    for b, s in shapes:
        spec = _qlora(b, s)
        assert pieces.step(arch, spec, None) == decoder_step(arch, spec, None)
    # the step ran for the first shape and for each branch met after it, not for every shape
    assert pieces.runs <= MAX_PIECES
    assert pieces.runs < len(shapes) // 2


def test_a_step_that_leaves_the_integers_runs_itself() -> None:
    # torchtune's activation offloading rounds the pinned buffers to powers of two (a bit
    # length): not recordable, so every shape runs the step, and the answers stay the step's
    arch = default_catalog().resolve("Qwen/Qwen2.5-0.5B").arch
    pieces = Pieces(decoder_step)
    for s in (256, 300, 512):
        spec = TrainingSpec(
            method=Method.FULL,
            batch_size=2,
            seq_len=s,
            framework=Framework.TORCHTUNE,
            gradient_checkpointing=True,
            activation_offloading=True,
        )
        assert pieces.step(arch, spec, None) == decoder_step(arch, spec, None)
    assert pieces.runs == 3


def test_a_record_holds_only_where_its_guards_do() -> None:
    trace = Trace(3, 100)
    b, s = trace.shape()
    tokens = b * s
    blocks = -(-(tokens * 8) // 512) * 512  # the allocator's block rounding
    chosen = max(tokens * 10, blocks + 4096)  # a comparison: the larger one at b=3, s=100
    shaped = compile_record(trace, [chosen, blocks])
    assert shaped(3, 100) == (6656, 2560)
    assert shaped(3, 101) == (6656, 2560)  # the same branch: blocks + 4096 is larger
    assert shaped(64, 64) is None  # there tokens * 10 is the larger: another branch
    assert shaped(1, 1) == (4608, 512)


def test_a_shape_cannot_become_a_plain_number() -> None:
    trace = Trace(2, 8)
    b, s = trace.shape()
    for convert in (
        hash,
        int,
        float,
        round,
        lambda x: x / 2 + 1,
        lambda x: x.bit_length(),
        lambda x: {x},
        lambda x: x // b,
    ):
        with pytest.raises((TypeError, AttributeError)):
            convert(b * s)
    with pytest.raises(TypeError):
        _ = s < 2.5  # compared with a float: not recorded
    assert not trace.formatted
    assert f"{b * s / 4:.1f} GiB" == "4.0 GiB"  # text alone: formatted, it marks the record
    assert trace.formatted


def test_the_oldest_jobs_leave_past_the_pieces_kept() -> None:
    arch = default_catalog().resolve("Qwen/Qwen2.5-0.5B").arch
    pieces = Pieces(decoder_step, kept=3)
    for steps in (1, 2, 3, 4, 5):  # five jobs
        for s in (512, 600):  # each recorded at its second shape
            pieces.step(arch, _qlora(2, s, gradient_accumulation_steps=steps), None)
    assert pieces.kept == 3
    runs = pieces.runs
    pieces.step(arch, _qlora(2, 700, gradient_accumulation_steps=5), None)
    assert pieces.runs == runs  # the newest job's piece is kept
    pieces.step(arch, _qlora(2, 700, gradient_accumulation_steps=1), None)
    assert pieces.runs == runs + 1  # the oldest's is gone


@settings(max_examples=40, deadline=None)
@given(specs(), SHAPES, st.sampled_from([None, "9.0"]))
def test_shape_levels_are_the_levels_at_every_shape(
    case: tuple[str, TrainingSpec], shapes: list[tuple[int, int]], capability: str | None
) -> None:
    model, spec = case
    arch = default_catalog().resolve(model).arch
    at = shape_levels(arch, spec, compute_capability=capability)
    for b, s in [*shapes, *shapes]:  # the second time round, from the pieces recorded
        try:
            want = peak_levels(arch, spec.with_shape(b, s), compute_capability=capability)
        except EstimatorError as refused:
            with pytest.raises(type(refused)) as raised:
                at(b, s)
            assert str(raised.value) == str(refused)
            continue
        assert at(b, s) == want


def test_shape_levels_refuse_what_peak_levels_refuse() -> None:
    arch = default_catalog().resolve("Qwen/Qwen2.5-7B").arch
    at = shape_levels(arch, _qlora(2, 1024))
    for s in (1000, 1100, 1200):
        at(2, s)  # the job's pieces recorded
    for b, s in ((0, 1024), (2, 0), (-3, 5)):
        with pytest.raises(EstimatorError) as raised:
            peak_levels(arch, _qlora(2, 1024).with_shape(b, s))
        with pytest.raises(type(raised.value), match=str(raised.value)):
            at(b, s)


def _made(make: Callable[[], object]) -> object:
    """What `make()` returns, or the type and text of the EstimatorError it raises."""
    try:
        return make()
    except EstimatorError as refused:
        return (type(refused), str(refused))


@settings(max_examples=40, deadline=None)
@given(specs(), SHAPES, st.sampled_from([None, "9.0"]))
def test_estimates_from_pieces_are_the_steps_own_at_every_shape(
    case: tuple[str, TrainingSpec], shapes: list[tuple[int, int]], capability: str | None
) -> None:
    # Each shape's estimate as the step itself makes it (no piece kept: a job's first shape
    # runs the step), then the same shapes twice from the pieces the job records, read by
    # shape_estimates and by estimate itself.
    model, spec = case
    arch = default_catalog().resolve(model).arch

    def estimated(b: int, s: int) -> object:
        return _made(lambda: estimate(arch, spec.with_shape(b, s), compute_capability=capability))

    wants = {}
    for b, s in shapes:
        forget_compiled_steps()
        wants[b, s] = estimated(b, s)
    forget_compiled_steps()
    at = shape_estimates(arch, spec, compute_capability=capability)
    for b, s in [*shapes, *shapes]:
        assert _made(lambda: at(b, s)) == wants[b, s]  # noqa: B023 (called at once)
        assert estimated(b, s) == wants[b, s]


def test_shape_estimates_refuse_what_estimate_refuses() -> None:
    arch = default_catalog().resolve("Qwen/Qwen2.5-7B").arch
    spec = _qlora(2, 1024)
    at = shape_estimates(arch, spec, compute_capability="8.0")
    for s in (1000, 1100, 1200, 1300):  # the job's pieces recorded, then read
        assert at(3, s) == estimate(arch, spec.with_shape(3, s), compute_capability="8.0")
    for b, s in ((0, 1024), (2, 0), (-3, 5)):
        with pytest.raises(EstimatorError) as raised:
            estimate(arch, spec.with_shape(b, s))
        with pytest.raises(type(raised.value), match=str(raised.value)):
            at(b, s)
