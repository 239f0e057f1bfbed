"""Long work refused (core/cold.py): under `refusing_cold_work()`, an estimate or fit-check
that would run a step or replay the allocator raises `ColdWorkRefused` before doing either;
a warm one is answered as it is anywhere else."""

from __future__ import annotations

import pytest

from service.catalog.models import default_catalog
from service.core.cold import ColdWorkRefused, refusing_cold_work
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
