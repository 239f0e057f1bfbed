"""Jobs at the edges of what a spec takes: AdaLoRA under every loss, and jobs whose allocated
peak is beyond any GPU, answered without replaying the allocator."""

from __future__ import annotations

import time

import pytest

from service.catalog.models import default_catalog
from service.core.allocator import AllocatorConfig, CachingAllocator
from service.core.estimator import decoder_step, estimate, peak_levels, shape_levels
from service.core.limits import MAX_BATCH_SIZE, MAX_SEQ_LEN
from service.core.reserved import REPLAY_CEILING, reserved_gap
from service.core.spec import LossImpl, Method, TrainingSpec
from service.core.units import GIB
from tests.core.test_estimator import ARCH
from tests.core.test_peft_adalora import _spec as adalora_spec

# An estimate that skips the replay reads the step's compiled pieces or runs the step once:
# far under this (a replay of a 7B decoder's step alone takes tens of milliseconds).
ABSURD_ANSWER_S = 2.0


@pytest.mark.parametrize("loss", list(LossImpl))
@pytest.mark.parametrize("checkpointing", [False, True])
def test_adalora_adds_its_penalty_under_every_loss(loss: LossImpl, checkpointing: bool) -> None:
    """AdaLoraModel.forward adds its orthogonality penalty to the model's loss whichever way
    the loss is computed: the replay records the penalty's forward for its backward."""
    spec = adalora_spec(Method.ADALORA, loss=loss, gradient_checkpointing=checkpointing)
    est = estimate(ARCH, spec)
    assert est.reserved_bytes >= est.allocated_bytes > 0


def test_the_fit_checks_adalora_job_with_a_fused_loss() -> None:
    """The shape a fit-check's suggestion reached: Qwen2.5-14B AdaLoRA with a fused loss."""
    arch = default_catalog().resolve("Qwen/Qwen2.5-14B").arch
    spec = TrainingSpec(method=Method.ADALORA, batch_size=10, seq_len=16, loss=LossImpl.FUSED)
    levels = peak_levels(arch, spec)
    assert levels.reserved_bytes >= levels.allocated_bytes


def test_an_unlimited_allocator_never_runs_out_of_address_space() -> None:
    """Without a capacity, expandable segments take any request (the address space is
    larger than any step a spec describes)."""
    allocator = CachingAllocator(AllocatorConfig(expandable_segments=True))
    handles = [allocator.malloc(1 << 70) for _ in range(4)]
    assert allocator.reserved >= 4 << 70
    for handle in handles:
        allocator.free(handle)


@pytest.mark.parametrize("expandable", [False, True])
def test_a_job_beyond_any_gpu_is_answered_without_a_replay(expandable: bool) -> None:
    arch = default_catalog().resolve("tiiuae/falcon-7b").arch
    spec = TrainingSpec(
        method=Method.LORA,
        batch_size=15,
        seq_len=951_817,
        allocator=AllocatorConfig(expandable_segments=expandable),
    )
    started = time.perf_counter()
    est = estimate(arch, spec)
    assert time.perf_counter() - started < ABSURD_ANSWER_S
    assert est.allocated_bytes > REPLAY_CEILING
    assert est.reserved_bytes == est.allocated_bytes
    assert est.device_bytes_upper > est.device_bytes > est.reserved_bytes
    [note] = [a for a in est.assumptions if a.startswith("reserved: not replayed")]
    assert f"{REPLAY_CEILING / GIB:,.0f} GiB" in note
    # a fit-check's curve reads the same levels at the same shape
    at = shape_levels(arch, spec)(spec.batch_size, spec.seq_len)
    assert at.reserved_bytes == at.allocated_bytes == est.allocated_bytes


def test_the_ceiling_is_where_the_replay_stops() -> None:
    arch = default_catalog().resolve("Qwen/Qwen2.5-0.5B").arch
    spec = TrainingSpec(method=Method.LORA, batch_size=2, seq_len=512)
    est = estimate(arch, spec)
    plan = decoder_step(arch, spec, None).plan.reserved
    replayed = reserved_gap(plan, 2, 512, allocated=est.allocated_bytes)
    assert replayed[0] == est.reserved_bytes - est.allocated_bytes > 0
    assert reserved_gap(plan, 2, 512, allocated=REPLAY_CEILING) == replayed
    gap, note = reserved_gap(plan, 2, 512, allocated=REPLAY_CEILING + 1)
    assert gap == 0 and note.startswith("reserved: not replayed")


@pytest.mark.parametrize("model", ["Qwen/Qwen2.5-0.5B", "tiiuae/falcon-7b", "google/t5-v1_1-small"])
def test_the_largest_shape_is_answered(model: str) -> None:
    arch = default_catalog().resolve(model).arch
    for expandable in (False, True):
        spec = TrainingSpec(
            method=Method.LORA,
            batch_size=MAX_BATCH_SIZE,
            seq_len=MAX_SEQ_LEN,
            allocator=AllocatorConfig(expandable_segments=expandable),
        )
        est = estimate(arch, spec)
        assert est.reserved_bytes == est.allocated_bytes > REPLAY_CEILING
