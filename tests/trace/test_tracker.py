"""The storage tracker on hand-made tensor programs whose byte counts are known."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from service.core.result import Component, Phase  # noqa: E402
from service.trace.tracker import (  # noqa: E402
    CUDA_MIN_BLOCK_BYTES,
    StorageTracker,
    allocated_size,
)

pytestmark = pytest.mark.trace


@pytest.fixture
def tracker() -> Iterator[StorageTracker]:
    gc.collect()
    gc.disable()
    tracker = StorageTracker(record_events=True)
    try:
        with tracker:
            yield tracker
    finally:
        gc.enable()
        tracker.close()


def test_rounds_each_allocation_up_to_512_bytes() -> None:
    assert CUDA_MIN_BLOCK_BYTES == 512
    assert allocated_size(0) == 0
    assert allocated_size(1) == 512
    assert allocated_size(512) == 512
    assert allocated_size(513) == 1024
    assert allocated_size(10 * 512 + 7) == 11 * 512
    assert allocated_size(3, unit=1) == 3


def test_counts_rounded_storages(tracker: StorageTracker) -> None:
    a = torch.empty(100, dtype=torch.uint8)
    b = torch.empty(513, dtype=torch.uint8)
    c = torch.empty(0)
    d = torch.empty(2, 256, dtype=torch.bfloat16)  # exactly 1024 B
    assert tracker.total == 512 + 1024 + 0 + 1024
    del a, b, c, d


def test_views_and_in_place_ops_cost_nothing(tracker: StorageTracker) -> None:
    x = torch.zeros(64, 64)  # 16 KiB
    before = tracker.total
    views = [x.view(-1), x.t(), x[::2], x[1:3], x.unsqueeze(0), x.expand(2, 64, 64)]
    x.add_(1).mul_(2)
    x[0].zero_()
    assert tracker.total == before == 16384
    del views


def test_frees_on_the_last_reference_to_the_storage(tracker: StorageTracker) -> None:
    x = torch.zeros(1000)  # 4000 B -> 4096
    view = x[10:20]
    del x
    assert tracker.total == 4096  # the view keeps the storage alive
    del view
    assert tracker.total == 0
    assert [e.delta for e in tracker.events or ()] == [4096, -4096]


def test_an_op_output_is_a_new_storage_and_temporaries_come_and_go(
    tracker: StorageTracker,
) -> None:
    x = torch.ones(256)  # 1024 B
    y = (x * 2 + 1).sum()  # x*2 (1024), +1 (1024), then x*2 freed; sum 4 B -> 512
    assert tracker.total == 1024 + 512
    assert tracker.peak().allocated_bytes == 1024 * 3
    del x, y


def test_relabelling_moves_bytes_and_the_breakdown_always_sums_to_the_total(
    tracker: StorageTracker,
) -> None:
    x = torch.zeros(512)  # 2048 B
    assert tracker.by_component[Component.ACTIVATIONS] == 2048
    tracker.label(x.view(2, 256), Component.GRADIENTS)
    assert tracker.by_component[Component.ACTIVATIONS] == 0
    assert tracker.by_component[Component.GRADIENTS] == 2048
    tracker.check_consistent()
    del x
    assert tracker.by_component[Component.GRADIENTS] == 0


def test_the_peak_breakdown_includes_roles_learnt_before_the_next_memory_event(
    tracker: StorageTracker,
) -> None:
    state = torch.zeros(1024)  # 4096 B: the new peak
    tracker.label(state, Component.OPTIMIZER_STATE)  # its role becomes known just after
    peak = tracker.peak()
    assert peak.allocated_bytes == 4096
    assert peak.components[Component.OPTIMIZER_STATE] == 4096
    assert peak.components[Component.ACTIVATIONS] == 0
    assert peak.op == "aten.zeros.default"
    del state


def test_phase_windows_record_their_own_peaks_and_marks(tracker: StorageTracker) -> None:
    tracker.begin_phase(1, Phase.FORWARD_END)
    a = torch.zeros(256)  # 1024
    b = torch.zeros(256)
    tracker.mark(1, Phase.FORWARD_END)
    del b
    tracker.begin_phase(1, Phase.BACKWARD)
    c = torch.zeros(128)  # 512: total back at 1536, below the forward peak
    tracker.end_phase()
    peaks = {(p.step, p.phase): p.snapshot.allocated_bytes for p in tracker.phase_peaks()}
    assert peaks[(1, Phase.FORWARD_END)] == 2048
    assert peaks[(1, Phase.BACKWARD)] == 1536  # the window starts at the level it inherits
    assert tracker.peak_key() == (1, Phase.FORWARD_END)
    [mark] = tracker.marks()
    assert mark.snapshot.allocated_bytes == 2048
    del a, c


def test_host_outputs_and_host_scalars_are_not_counted(tracker: StorageTracker) -> None:
    tracker.mark_host_outputs("aten.aminmax.default", (1,))
    r = torch.arange(10.0)  # 40 B -> 512
    lo, hi = torch.aminmax(r)  # min 512, max on the host
    assert tracker.total == 1024
    tracker.host_scalar_ops = True
    s = torch.tensor(3.0) * 2
    assert tracker.total == 1024
    del r, lo, hi, s


def test_a_rewrite_runs_instead_of_the_op_and_its_ops_are_counted(
    tracker: StorageTracker,
) -> None:
    def add_twice(a: torch.Tensor, b: torch.Tensor, alpha: int = 1) -> torch.Tensor:
        doubled = b * 2  # a transient the plain op would not have
        return torch.add(a, doubled)  # the replaced op itself runs as it is

    tracker.rewrite("aten.add.Tensor", add_twice)
    x = torch.ones(256)  # 1024 B
    y = x + x
    assert torch.equal(y, torch.full((256,), 3.0))
    assert tracker.total == 2048
    assert tracker.peak().allocated_bytes == 3072
    del x, y


def test_fake_tensors_are_counted_like_real_ones() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    def program() -> int:
        tracker = StorageTracker()
        with tracker:
            w = torch.zeros(300, 7, requires_grad=True)
            loss = (w.sin() * 3).sum()
            loss.backward()
            peak = tracker.peak().allocated_bytes
            del w, loss
        tracker.close()
        return peak

    real = program()
    with FakeTensorMode():
        fake = program()
    # 8400-B tensors round to 8704. The peak is in backward: w, the gradient through ·3, cos(w)
    # and their product (the grad of w), plus the 512-B loss and its 512-B seed gradient.
    assert fake == real == 4 * 8704 + 2 * 512


_OPS = st.lists(
    st.tuples(st.sampled_from(["new", "view", "inplace", "drop", "op"]), st.integers(0, 2000)),
    max_size=40,
)


@pytest.fixture(scope="module")
def _frozen_heap() -> Iterator[None]:
    """The heap the suite built so far, frozen: each example's gc.collect() then walks only
    the objects created since, not the whole suite's heap."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.mark.usefixtures("_frozen_heap")
@settings(max_examples=40, deadline=None)
@given(_OPS)
def test_the_total_is_the_rounded_size_of_the_distinct_live_storages(
    program: list[tuple[str, int]],
) -> None:
    gc.collect()
    gc.disable()
    tracker = StorageTracker()
    held: list[torch.Tensor] = []
    try:
        with tracker:
            for action, n in program:
                if action == "new":
                    held.append(torch.empty(n, dtype=torch.uint8))
                elif held and action == "view":
                    held.append(held[n % len(held)].view(-1)[: n % 7])
                elif held and action == "inplace":
                    held[n % len(held)].add_(1)
                elif held and action == "drop":
                    held.pop(n % len(held))
                elif held and action == "op":
                    held.append(held[n % len(held)] + 1)
                storages = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in held}
                assert tracker.total == sum(allocated_size(b) for b in storages.values())
                tracker.check_consistent()
    finally:
        held.clear()
        gc.enable()
        tracker.close()
