"""The events being built, the tensors a layer saves, and the builder's own state."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from service.core.schedule.shapes import Event, LinearShape, StepShape


@dataclass(slots=True)
class _Program:
    """The events and each live tensor's holders."""

    events: list[Event] = field(default_factory=list)
    refs: dict[int, int] = field(default_factory=dict)
    next_key: int = 1

    def alloc(self, nbytes: int) -> int:
        if nbytes <= 0:
            return 0
        key = self.next_key
        self.next_key += 1
        self.events.append((key, nbytes))
        self.refs[key] = 1
        return key

    def hold(self, key: int) -> int:
        if key:
            self.refs[key] += 1
        return key

    def free(self, *keys: int) -> None:
        refs = self.refs
        for key in keys:
            if not key:
                continue
            count = refs[key] - 1
            if count:
                refs[key] = count
            else:
                del refs[key]
                self.events.append((key, 0))


@dataclass(slots=True)
class _Saved:
    """What a layer's forward saved for its backward, by name (each slot holds its tensor)."""

    prog: _Program
    slots: dict[str, int] = field(default_factory=dict)

    def save(self, name: str, key: int) -> None:
        if key:
            self.slots[name] = self.prog.hold(key)

    def release(self, *names: str) -> None:
        for name in names:
            self.prog.free(self.slots.pop(name, 0))

    def release_all(self) -> None:
        self.prog.free(*self.slots.values())
        self.slots.clear()


@dataclass(frozen=True, slots=True)
class _Grad:
    """A linear's backward call (`linear_backward`'s arguments), as its overrides and its
    adapter's backward take it: the output's gradient `g` (in `nbytes` per element, released
    there), the linear and what its forward saved, whether the input takes a gradient, the
    gradient it is added to (`acc`, 0 for none), what runs before the saved tensors are read
    (a checkpoint's recomputation) and the input's bytes per element."""

    g: int
    nbytes: int
    lin: LinearShape
    saved: _Saved
    x_grad: bool
    acc: int
    before_saved: Callable[[], None] | None
    in_bytes: int


class _Stop(Exception):
    """Non-reentrant checkpointing stops recomputing once the last saved tensor exists."""


class _StepBase:
    """The builder's state and its allocation primitives."""

    def __init__(self, shape: StepShape, prog: _Program) -> None:
        self.sh = shape
        self.p = prog
        self.t = shape.tokens
        self.grads: list[int] = []
        self.handles: set[str] = set()
        self.workspaces: set[int] = set()  # the handles' workspaces, held to the end
        self.handle = "forward"
        self.states: list[int] = []
        self.stop_at: str | None = None  # the linear where a recomputation stops
        # what a checkpointed layer's first pass keeps outside its saved tensors (LLM.int8)
        self.pinned: list[int] | None = None
        self.pins: list[list[int]] = []  # each checkpointed layer's `pinned`
        self.softcap_tanh = 0
        self.head_copy = 0
        self.region: list[int] = []  # autocast's cached weight casts in the current region
        self.accumulated = False  # a previous micro-batch of this step made the gradients
        self.head_grad = 0  # a tied LM head's gradient waiting for the embedding's
        # what a decoder layer returned besides its output, held until the next one returns
        # (BLOOM's attention probabilities, in the model loop's `outputs`)
        self.held = 0
        self.dpo_saved: list[int] = []  # DPO: what the policy's fused head keeps
        # Liger's fused loss: the input's and the weight's gradients it keeps for backward
        self.liger_grads: tuple[int, int] = (0, 0)
        self.buffered: list[int] = []  # GRPO: the generation's batch, kept for the step
        self.pending = 0  # what the current layer will return besides its output
        self._input_grad = True
        # AdaLoRA (schedule/adalora.py): the penalty's gradients of lora_A and lora_B by bytes,
        # waiting in their AccumulateGrad input buffers; what the penalty keeps for backward;
        # the RankAllocator's three buffers per adapter parameter, kept across steps
        self.waiting: dict[int, list[int]] = {}
        self.penalty_saved: list[int] = []
        self.allocator_buffers: list[list[int]] = []

    def norm_trains(self, name: str) -> bool:
        """Whether the norm `name` has a trainable weight (full fine-tuning, LN tuning)."""
        return self.sh.norm_trainable or name in self.sh.trained_norms

    def a(self, per_token: int) -> int:
        return self.p.alloc(self.t * per_token)

    def add_and_cast_back(self, result: int, output: int, width: int, nbytes: int, ad: int) -> int:
        """PEFT's `result + output` for an adapter's output in the adapters' dtype (`ad`): the
        sum in the wider dtype, both operands let go, then cast back to the result's dtype
        (`nbytes`) when that is narrower (peft/tuners/lora/layer.py Linear.forward)."""
        wide = max(nbytes, ad)
        summed = self.a(wide * width)
        self.f(output, result)
        if wide == nbytes:
            return summed
        out = self.a(nbytes * width)
        self.f(summed)
        return out

    def f(self, *keys: int) -> None:
        self.p.free(*keys)

    def _plus(self, first: int, second: int, per_token: int) -> int:
        """`first + second` in a new tensor of `per_token` bytes a token, both let go;
        `second` itself when `first` is 0."""
        if not first:
            return second
        total = self.a(per_token)
        self.f(first, second)
        return total

    def gemm(self, bias: bool = False) -> None:
        """A GEMM on the current handle: its workspaces the first time (after the output)."""
        handle = self.handle
        if handle not in self.handles:
            self.handles.add(handle)
            self.workspaces.add(self.p.alloc(self.sh.workspace))
        if bias and self.sh.lt_workspace and f"{handle}.lt" not in self.handles:
            self.handles.add(f"{handle}.lt")
            self.workspaces.add(self.p.alloc(self.sh.lt_workspace))

    def grad(self, nbytes: int) -> None:
        """A trainable tensor's gradient, held until `zero_grad`; a later micro-batch's is
        added into it in place and freed."""
        key = self.p.alloc(nbytes)
        sh = self.sh
        if sh.in_backward:
            if not self.states:  # the optimizer's lazy state, from step 1's first gradient
                self.states = [k for k in map(self.p.alloc, sh.states) if k]
            if not (sh.tied and sh.embed_trainable and not self.grads):
                self.f(key)  # stepped, then set to None
                return
        if self.accumulated:
            self.f(key)
        elif key:
            self.grads.append(key)
