"""Storage-level memory tracker: what the CUDA caching allocator's `allocated` counter would read.

Every op output's untyped storage is counted once, by identity (views and in-place ops cost
nothing), rounded up the way the caching allocator rounds a request, and released through a weakref
finalizer when the storage dies. Each storage carries a `Component` label that can change when its
role becomes known; the per-component totals always sum to the live total.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from service.core.allocator import CachingAllocator
from service.core.libs.torch_allocator import MIN_BLOCK as CUDA_MIN_BLOCK_BYTES
from service.core.result import Component, Phase

# The ops that run a cuBLAS GEMM on CUDA (aten/src/ATen/native/cuda/Blas.cpp).
ADDMM_OP = "aten.addmm.default"
BLAS_OPS = frozenset(
    {
        "aten.mm.default",
        ADDMM_OP,
        "aten.bmm.default",
        "aten.baddbmm.default",
        "aten.addbmm.default",
        "aten._addmm_activation.default",
    }
)


def allocated_size(nbytes: int, unit: int = CUDA_MIN_BLOCK_BYTES) -> int:
    """Bytes `torch.cuda.memory_allocated` counts for a request of `nbytes` (unit 512)."""
    if nbytes <= 0:
        return 0
    return -(-nbytes // unit) * unit


def _inner_tensors(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """The tensors holding `tensor`'s memory: itself, or for a wrapper subclass (a DTensor: its
    local shard) the tensors it flattens to; the wrapper has no memory of its own."""
    if not is_traceable_wrapper_subclass(tensor):
        yield tensor
        return
    names, _ = tensor.__tensor_flatten__()
    for name in names:
        inner = getattr(tensor, name)
        if isinstance(inner, torch.Tensor):
            yield from _inner_tensors(inner)


def pinned_size(nbytes: int) -> int:
    """Bytes the pinned-memory caching allocator takes for a request: the next power of two
    (aten/src/ATen/core/CachingHostAllocator.h allocate, PowerOf2Ceil of the size)."""
    if nbytes <= 0:
        return 0
    return 1 << (nbytes - 1).bit_length()


def _empty_breakdown() -> dict[Component, int]:
    return dict.fromkeys(Component, 0)


@dataclass(frozen=True, slots=True, kw_only=True)
class Snapshot:
    """The live total and its breakdown at one instant, and the op that made it."""

    allocated_bytes: int
    components: dict[Component, int]
    op: str

    def to_json(self) -> dict[str, Any]:
        return {
            "allocated_bytes": self.allocated_bytes,
            "op": self.op,
            "components": {c.value: n for c, n in self.components.items()},
        }


@dataclass(slots=True)
class _Block:
    size: int
    component: Component
    finalizer: weakref.finalize
    handle: int = -1  # the block's handle in the allocator replay, if any


@dataclass(slots=True)
class _PeakSlot:
    """A running maximum whose breakdown is copied lazily, at the next memory event.

    Relabels that happen between the peak's allocation and the next allocation or free describe
    the same instant (the roles became known then), so they belong in the peak's breakdown.
    """

    total: int = -1
    op: str = ""
    components: dict[Component, int] = field(default_factory=_empty_breakdown)
    pending: bool = False

    def snapshot(self) -> Snapshot:
        return Snapshot(allocated_bytes=self.total, components=dict(self.components), op=self.op)


@dataclass(frozen=True, slots=True, kw_only=True)
class PhaseSnapshot:
    step: int
    phase: Phase
    snapshot: Snapshot


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryEvent:
    """One change of the live total: an op's allocation (+) or a storage's free (-)."""

    op: str
    delta: int


class OpMode(TorchDispatchMode):
    """A dispatch mode whose `dispatch` takes each op with its positional and keyword
    arguments (an empty dict for none); the types torch passes are not read."""

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return self.dispatch(func, args, kwargs or {})

    def dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The op's result: `func` run on `args` and `kwargs`, or what stands for it."""
        raise NotImplementedError


class StorageTracker(OpMode):
    """Counts live storages of every op output while active; see the module docstring.

    The caller steers labelling: `component` is the label new allocations get, `label()` changes
    a storage's label, `begin_phase()` opens a (step, phase) window whose peak is recorded, and
    `host_scalar_ops` makes 0-dim outputs free (they live in host memory on a GPU run).
    """

    def __init__(
        self,
        *,
        record_events: bool = False,
        unit: int = CUDA_MIN_BLOCK_BYTES,
        allocator: CachingAllocator | None = None,
    ) -> None:
        super().__init__()
        self.unit = unit  # 1 counts requested bytes, as a CPU allocator's statistics do
        # Every storage's allocation and free replayed through the caching allocator's model:
        # the reserved level a GPU would reach on the same sequence.
        self.allocator = allocator
        # cuBLAS: the handle GEMMs run on now ("forward": the Python thread; "backward": the
        # autograd engine's device thread), and the workspace sizes each handle takes once.
        self.blas_handle: str | None = None
        self.blas_workspace = 0
        self.blaslt_workspace = 0
        self._persistent: dict[str, int] = {}
        self._phase_reserved: dict[tuple[int, Phase], int] = {}
        self.component = Component.ACTIVATIONS
        self.host_scalar_ops = False
        self.total = 0
        self.by_component = _empty_breakdown()
        self.events: list[MemoryEvent] | None = [] if record_events else None
        self._blocks: dict[int, _Block] = {}
        self._peak = _PeakSlot()
        self._phase_key: tuple[int, Phase] | None = None
        self._phase_peaks: dict[tuple[int, Phase], _PeakSlot] = {}
        self._marks: list[PhaseSnapshot] = []
        self._host_outputs: dict[str, tuple[int, ...]] = {}
        self._rewrites: dict[str, Callable[..., Any]] = {}
        self._rewriting: set[str] = set()
        # Pinned host copies (activation offloading): counted apart from the device total.
        self._off_device = False
        self._host_blocks: dict[int, tuple[int, weakref.finalize]] = {}
        self.host_total = 0
        self.host_peak = 0

    # -- the dispatch hook -------------------------------------------------------------------

    def dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._off_device:  # a host copy's ops: host memory, counted by `host_pinned`
            return func(*args, **kwargs)
        name = str(func)
        rewrite = self._rewrites.get(name)
        if rewrite is not None and name not in self._rewriting:
            self._rewriting.add(name)  # the rewrite may call the op it replaces
            try:
                with self:  # the rewrite's own ops are dispatched (and counted) one by one
                    replaced = rewrite(*args, **kwargs)
            finally:
                self._rewriting.discard(name)
            if replaced is not None:
                return replaced
        out = func(*args, **kwargs)
        if name in BLAS_OPS and self.blas_handle is not None:
            self._blas_workspaces(name, args)
        host = self._host_outputs.get(name, ())
        for index, leaf in enumerate(tree_leaves(out)):
            if not isinstance(leaf, torch.Tensor) or index in host:
                continue
            if self.host_scalar_ops and leaf.dim() == 0:
                continue
            for inner in _inner_tensors(leaf):
                self._record(inner, self.component, name)
        return out

    def _blas_workspaces(self, name: str, args: tuple[Any, ...]) -> None:
        """The workspaces a GEMM's handle takes the first time it runs (after its output):
        cuBLAS's for every GEMM, cuBLASLt's for an addmm with a 1-D bias (the epilogue path,
        aten/src/ATen/native/cuda/Blas.cpp addmm_out_cuda_impl)."""
        handle = self.blas_handle
        self.persistent(f"{handle}.cublas", self.blas_workspace, "cublas workspace")
        bias = args[0] if args else None
        if name == ADDMM_OP and isinstance(bias, torch.Tensor) and bias.dim() == 1:
            self.persistent(f"{handle}.cublaslt", self.blaslt_workspace, "cublaslt workspace")

    def persistent(self, key: str, nbytes: int, op: str) -> None:
        """Allocate `nbytes` once under `key`, held until the process ends (a library's
        workspace), as `Component.WORKSPACES`."""
        if key in self._persistent or nbytes <= 0:
            return
        self._persistent[key] = allocated_size(nbytes, self.unit)
        if self.allocator is not None:
            self.allocator.malloc(nbytes)
        self._change(Component.WORKSPACES, self._persistent[key], op)

    def rewrite(self, op: str, replacement: Callable[..., Any]) -> None:
        """Run `replacement(*args, **kwargs)` instead of `op`, its ops dispatched through here.

        A replacement that returns None declines: the op runs as it is.
        """
        self._rewrites[op] = replacement

    def mark_host_outputs(self, op: str, indices: tuple[int, ...]) -> None:
        """Outputs `indices` (flattened) of `op` live in host memory on a GPU; do not count them."""
        self._host_outputs[op] = indices

    @contextmanager
    def off_device(self) -> Iterator[None]:
        """Ops inside the block make host tensors: the device total does not count them."""
        before = self._off_device
        self._off_device = True
        try:
            yield
        finally:
            self._off_device = before

    def host_pinned(self, tensor: torch.Tensor) -> None:
        """Count `tensor`'s storage as a pinned host block until it dies."""
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._host_blocks:
            return
        size = pinned_size(storage.nbytes())
        finalizer = weakref.finalize(storage, self._host_free, key)
        finalizer.atexit = False
        self._host_blocks[key] = (size, finalizer)
        self.host_total += size
        self.host_peak = max(self.host_peak, self.host_total)

    def _host_free(self, key: int) -> None:
        block = self._host_blocks.pop(key, None)
        if block is not None:
            self.host_total -= block[0]

    # -- storages ----------------------------------------------------------------------------

    def track(self, tensor: torch.Tensor, component: Component, op: str = "track") -> None:
        """Count a tensor made outside the tracker (a parameter, an input), once per storage."""
        self._record(tensor, component, op)

    def label(self, tensor: torch.Tensor, component: Component) -> None:
        """Give the storage behind `tensor` a new role; counts it first if it is not yet tracked."""
        if is_traceable_wrapper_subclass(tensor):
            for inner in _inner_tensors(tensor):
                self.label(inner, component)
            return
        storage = tensor.untyped_storage()
        block = self._blocks.get(id(storage))
        if block is None:
            self._record(tensor, component, "label")
            return
        if block.component is component:
            return
        self.by_component[block.component] -= block.size
        self.by_component[component] += block.size
        block.component = component

    def component_of(self, tensor: torch.Tensor) -> Component | None:
        tensor = next(_inner_tensors(tensor))
        block = self._blocks.get(id(tensor.untyped_storage()))
        return None if block is None else block.component

    def resized(self, storage: torch.UntypedStorage, component: Component, op: str) -> None:
        """Re-count `storage` after its size changed outside the dispatcher
        (`UntypedStorage.resize_`, which FSDP uses to free and re-allocate its gathered
        parameters): freed at size 0, counted again as `component` when it grows back."""
        key = id(storage)
        size = allocated_size(storage.nbytes(), self.unit)
        block = self._blocks.get(key)
        if block is None:
            if size:
                self._record_storage(storage, component, op)
            return
        if size and block.size == 0:  # allocated again: it holds what the caller says now
            block.component = component
        self._resize_block(block, storage, size, op, empty_frees=True)

    def _resize_block(
        self,
        block: _Block,
        storage: torch.UntypedStorage,
        size: int,
        op: str,
        *,
        empty_frees: bool = False,
    ) -> None:
        """A storage resized in place (resize_, set_): new memory, the old freed."""
        allocator = self.allocator
        if allocator is not None:
            handle = -1 if empty_frees and not size else allocator.malloc(storage.nbytes())
            if block.handle >= 0:
                allocator.free(block.handle)
            block.handle = handle
        self._change(block.component, size - block.size, op)
        block.size = size

    def _record(self, tensor: torch.Tensor, component: Component, op: str) -> None:
        self._record_storage(tensor.untyped_storage(), component, op)

    def _record_storage(self, storage: torch.UntypedStorage, component: Component, op: str) -> None:
        key = id(storage)
        size = allocated_size(storage.nbytes(), self.unit)
        block = self._blocks.get(key)
        allocator = self.allocator
        if block is not None:
            if block.size != size:
                self._resize_block(block, storage, size, op)
            return
        finalizer = weakref.finalize(storage, self._free, key)
        finalizer.atexit = False
        handle = allocator.malloc(storage.nbytes()) if allocator is not None and size else -1
        self._blocks[key] = _Block(
            size=size, component=component, finalizer=finalizer, handle=handle
        )
        self._change(component, size, op)

    def _free(self, key: int) -> None:
        block = self._blocks.pop(key, None)
        if block is not None:
            if block.handle >= 0 and self.allocator is not None:
                self.allocator.free(block.handle)
            self._change(block.component, -block.size, "free")

    def _change(self, component: Component, delta: int, op: str) -> None:
        if delta == 0:
            return
        self._flush_pending()
        self.total += delta
        self.by_component[component] += delta
        if self.events is not None:
            self.events.append(MemoryEvent(op=op, delta=delta))
        if delta > 0:
            self._raise(self._peak, op)
            if self._phase_key is not None:
                self._raise(self._phase_peaks[self._phase_key], op)
                if self.allocator is not None:
                    key = self._phase_key
                    reserved = self.allocator.reserved
                    if reserved > self._phase_reserved.get(key, 0):
                        self._phase_reserved[key] = reserved

    def _raise(self, slot: _PeakSlot, op: str) -> None:
        if self.total > slot.total:
            slot.total = self.total
            slot.op = op
            slot.pending = True

    def _flush_pending(self) -> None:
        slots = [self._peak]
        if self._phase_key is not None:
            slots.append(self._phase_peaks[self._phase_key])
        for slot in slots:
            if slot.pending:
                slot.components = dict(self.by_component)
                slot.pending = False

    # -- phases ------------------------------------------------------------------------------

    def begin_phase(self, step: int, phase: Phase) -> None:
        """Open the window whose peak is recorded as (step, phase); closes the previous one."""
        self._flush_pending()
        self._phase_key = (step, phase)
        slot = self._phase_peaks.setdefault((step, phase), _PeakSlot())
        if self.allocator is not None:
            # The window inherits what the allocator holds when it opens.
            reserved = self.allocator.reserved
            self._phase_reserved[(step, phase)] = max(
                self._phase_reserved.get((step, phase), 0), reserved
            )
        if self.total > slot.total:  # the window starts at the level it inherits
            slot.total = self.total
            slot.op = "(start)"
            slot.components = dict(self.by_component)

    def end_phase(self) -> None:
        self._flush_pending()
        self._phase_key = None

    def mark(self, step: int, phase: Phase) -> None:
        """Record the live total and breakdown now as (step, phase)."""
        self._flush_pending()
        self._marks.append(
            PhaseSnapshot(
                step=step,
                phase=phase,
                snapshot=Snapshot(
                    allocated_bytes=self.total, components=dict(self.by_component), op="(mark)"
                ),
            )
        )

    @contextmanager
    def labelling(self, component: Component) -> Iterator[None]:
        """New allocations inside the block get `component`."""
        before = self.component
        self.component = component
        try:
            yield
        finally:
            self.component = before

    # -- results -----------------------------------------------------------------------------

    def peak(self) -> Snapshot:
        self._flush_pending()
        return self._peak.snapshot()

    def phase_peaks(self) -> list[PhaseSnapshot]:
        self._flush_pending()
        return [
            PhaseSnapshot(step=step, phase=phase, snapshot=slot.snapshot())
            for (step, phase), slot in self._phase_peaks.items()
        ]

    def phase_reserved(self) -> dict[tuple[int, Phase], int]:
        """The allocator model's reserved bytes at their highest in each (step, phase) window."""
        return dict(self._phase_reserved)

    def marks(self) -> list[PhaseSnapshot]:
        return list(self._marks)

    def peak_key(self) -> tuple[int, Phase] | None:
        """The (step, phase) window whose peak equals the overall peak (the first one)."""
        best = self.peak().allocated_bytes
        for (step, phase), slot in self._phase_peaks.items():
            if slot.total == best and slot.op != "(start)":
                return step, phase
        for (step, phase), slot in self._phase_peaks.items():
            if slot.total == best:
                return step, phase
        return None

    def check_consistent(self) -> None:
        """Raise if the breakdown does not sum to the live total (a tracker bug)."""
        if sum(self.by_component.values()) != self.total:
            raise RuntimeError("tracker breakdown does not sum to the live total")
        held = sum(b.size for b in self._blocks.values()) + sum(self._persistent.values())
        if held != self.total:
            raise RuntimeError("tracker blocks do not sum to the live total")

    def close(self) -> None:
        """Stop listening for frees (storages that outlive the trace are not counted)."""
        for block in self._blocks.values():
            block.finalizer.detach()
        self._blocks.clear()
        for _, finalizer in self._host_blocks.values():
            finalizer.detach()
        self._host_blocks.clear()
