"""Long work refused (core/cold.py): under `refusing_cold_work()`, an estimate or fit-check
that would run a step or replay the allocator raises `ColdWorkRefused` before doing either;
a warm one is answered as it is anywhere else. Under `allowing_cold_work()`, the pieces of
long work that would start past the allowance's time are refused alike, nothing of them kept."""

from __future__ import annotations

import pytest

from service.catalog.models import default_catalog
from service.core.cold import (
    ColdWorkAllowance,
    ColdWorkOverBudget,
    ColdWorkRefused,
    allowing_cold_work,
    refusing_cold_work,
)
from service.core.estimator import estimate, forget_compiled_steps, peak_levels, shape_levels
from service.core.reserved import clear_replay_caches
from service.core.spec import ALL_LINEAR, LoraSpec, Method, Objective, TrainingSpec
from tests.core.test_pieces import _qlora

ARCH = default_catalog().resolve("Qwen/Qwen2.5-7B").arch


@pytest.fixture(autouse=True)
def _cold() -> None:
    clear_replay_caches()
    forget_compiled_steps()


def test_a_new_job_is_refused_until_it_is_compiled() -> None:
    spec = _qlora(3, 1500)
    with pytest.raises(ColdWorkRefused), refusing_cold_work():
        estimate(ARCH, spec)
    # the refused attempt did none of the work: it is refused again
    with pytest.raises(ColdWorkRefused), refusing_cold_work():
        peak_levels(ARCH, spec)
    answered = estimate(ARCH, spec)
    # a job asked about at one shape runs its step at each (RECORD_AFTER_RUNS)
    with pytest.raises(ColdWorkRefused), refusing_cold_work():
        estimate(ARCH, spec)
    estimate(ARCH, _qlora(3, 1600))  # its second shape: the step's piece recorded
    with refusing_cold_work():
        assert estimate(ARCH, spec) == answered


def test_a_compiled_job_is_warm_at_shapes_its_replays_bracket() -> None:
    for s in (1500, 1600):  # the second shape records the job's piece
        estimate(ARCH, _qlora(3, s))
    levels_at = shape_levels(ARCH, _qlora(3, 1500))
    with refusing_cold_work():
        # shapes between the powers of two replayed: read from the piece and the replays
        warm = [
            (b, s, estimate(ARCH, _qlora(b, s)), levels_at(b, s)) for b, s in ((3, 1700), (4, 2000))
        ]
        # a shape outside them needs a replay of its own
        with pytest.raises(ColdWorkRefused):
            levels_at(3, 4000)
    for b, s, answered, levels in warm:
        assert answered == estimate(ARCH, _qlora(b, s))
        assert levels == peak_levels(ARCH, _qlora(b, s))


@pytest.mark.parametrize(
    ("model", "spec"),
    [
        (
            "Qwen/Qwen2.5-7B",
            TrainingSpec(
                method=Method.LORA,
                objective=Objective.DPO,
                batch_size=2,
                seq_len=512,
                lora=LoraSpec(r=16, target_modules=ALL_LINEAR),
            ),
        ),
        ("bert-large-uncased", TrainingSpec(method=Method.FULL, batch_size=4, seq_len=512)),
        ("google/t5-v1_1-small", TrainingSpec(method=Method.FULL, batch_size=4, seq_len=512)),
    ],
    ids=["dpo", "encoder", "encoder-decoder"],
)
def test_a_step_that_runs_for_every_estimate_is_always_refused(
    model: str, spec: TrainingSpec
) -> None:
    """A preference job, an encoder's and an encoder-decoder's run their steps for each
    estimate (none is compiled): never on the refusing side, even once their replays are
    kept."""
    arch = default_catalog().resolve(model).arch
    answered = estimate(arch, spec)
    for estimated in (estimate, peak_levels):
        with pytest.raises(ColdWorkRefused), refusing_cold_work():
            estimated(arch, spec)
    assert estimate(arch, spec) == answered


def test_refusing_ends_with_its_block() -> None:
    with pytest.raises(ColdWorkRefused), refusing_cold_work():
        estimate(ARCH, _qlora(2, 700))
    estimate(ARCH, _qlora(2, 700))  # outside the block: the work is done


class _Clock:
    """A clock that reads `start` once, then `later` (the allowance's first piece sets its
    deadline from the first reading; every later check reads the second)."""

    def __init__(self, start: float, later: float) -> None:
        self.readings = [start]
        self.later = later

    def __call__(self) -> float:
        return self.readings.pop() if self.readings else self.later


def test_past_its_time_the_next_piece_is_refused_and_nothing_of_it_is_kept() -> None:
    spec = _qlora(3, 1500)
    allowance = ColdWorkAllowance(1.0, clock=_Clock(0.0, 2.0))
    with pytest.raises(ColdWorkOverBudget) as refused, allowing_cold_work(allowance):
        estimate(ARCH, spec)
    # the step ran (the first piece always does); the replay after it was not started
    assert (allowance.pieces, allowance.refused) == (1, 1)
    assert "replay" in refused.value.what and refused.value.seconds == 1.0
    with pytest.raises(ColdWorkRefused), refusing_cold_work():
        peak_levels(ARCH, spec)  # no replay half kept: still cold
    answered = estimate(ARCH, spec)
    clear_replay_caches()
    forget_compiled_steps()
    assert estimate(ARCH, spec) == answered


def test_a_step_recorded_after_its_run_is_not_stopped_halfway() -> None:
    """The job's second shape runs the step and records it: one piece, which an allowance
    spent right after it starts does not cut (the job's piece is kept, not given up)."""
    estimate(ARCH, _qlora(3, 1500))
    allowance = ColdWorkAllowance(1.0, clock=_Clock(0.0, 2.0))
    with allowing_cold_work(allowance):
        second = estimate(ARCH, _qlora(3, 1600))  # its replays are the first shape's
    assert (allowance.pieces, allowance.refused) == (1, 0)
    with refusing_cold_work():  # recorded: a third shape between them is warm
        third = estimate(ARCH, _qlora(3, 1700))
    assert second == estimate(ARCH, _qlora(3, 1600))
    assert third == estimate(ARCH, _qlora(3, 1700))


def test_admission_comes_once_before_the_first_piece_and_may_refuse_it() -> None:
    class Full(Exception):
        pass

    def refuse() -> None:
        raise Full

    with pytest.raises(Full), allowing_cold_work(ColdWorkAllowance(60.0, admit=refuse)):
        estimate(ARCH, _qlora(2, 900))
    with pytest.raises(ColdWorkRefused), refusing_cold_work():
        estimate(ARCH, _qlora(2, 900))  # nothing was done
    admitted: list[None] = []
    allowance = ColdWorkAllowance(60.0, admit=lambda: admitted.append(None))
    with allowing_cold_work(allowance):
        estimate(ARCH, _qlora(2, 900))
        estimate(ARCH, _qlora(5, 3000))
    assert len(admitted) == 1 and allowance.pieces > 2 and allowance.refused == 0
    with allowing_cold_work(allowance := ColdWorkAllowance(60.0, admit=refuse)):
        estimate(ARCH, _qlora(2, 900))  # warm: neither admitted nor counted
    assert allowance.pieces == 0
