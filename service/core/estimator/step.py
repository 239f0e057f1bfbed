"""The step's allocated bytes, phase by phase."""

from __future__ import annotations

from typing import NamedTuple

from service.core.arch import ModelArch
from service.core.estimator.moments import (
    _BACKWARD_MOMENTS,
    _BACKWARD_PASSES,
    _FORWARD_MOMENTS,
    _LATE_BACKWARD_MOMENTS,
    _backward_start,
    _layer_ends,
    _optimizer_step,
)
from service.core.estimator.plan import _Plan, _workspaces
from service.core.estimator.step_context import _context, _FixedParts, _model_inputs, _Moment
from service.core.result import Phase
from service.core.spec import TrainingSpec

# An estimate's phases, in order: step 1 (no optimizer state yet), step 2 (the steady state),
# then step 1's optimizer step.
PHASES: tuple[tuple[int, Phase], ...] = (
    (1, Phase.FORWARD_END),
    (1, Phase.BACKWARD_START),
    (1, Phase.BACKWARD),
    (2, Phase.FORWARD_END),
    (2, Phase.BACKWARD_START),
    (2, Phase.BACKWARD),
    (1, Phase.OPTIMIZER_STEP),
)


class _Step(NamedTuple):
    """A step's allocated bytes phase by phase, before they become an `Estimate`."""

    plan: _Plan
    fixed: _FixedParts
    # cuBLAS workspaces: the forward thread's handle's alone (it takes one at the step's first
    # GEMM), and with the autograd thread's (at its first: the LM head's backward)
    workspaces: tuple[int, int]
    optimizer_state: int  # from the first optimizer step on
    forward_end: _Moment
    backward_start: _Moment
    backward: _Moment  # the largest moment inside the layers' backward
    optimizer_step: _Moment
    paged_state: int  # optimizer state outside the allocator (paged optimizers)
    host: int  # host memory per rank (offloaded states)
    assumptions: list[str]
    warnings: list[str]
    host_pinned: int = 0  # pinned host memory of offloaded activations

    def parts(self) -> list[tuple[int, ...]]:
        """The parts of each of `PHASES`, in COMPONENT_ORDER."""
        one, both = self.workspaces
        fixed = self.fixed
        first = (*fixed, one, 0)
        steady = (*fixed, both, self.optimizer_state)
        return [
            first + self.forward_end,
            first + self.backward_start,
            (*fixed, both, 0, *self.backward),
            steady + self.forward_end,
            steady + self.backward_start,
            steady + self.backward,
            steady + self.optimizer_step,
        ]


def _step(
    arch: ModelArch,
    spec: TrainingSpec,
    compute_capability: str | None = None,
) -> _Step:
    """The step's allocated bytes phase by phase: each phase's peak is the largest of its
    candidate moments."""
    ctx = _context(arch, spec)
    ends = _layer_ends(ctx)
    backward = list(ends)
    for moments in _BACKWARD_MOMENTS:
        backward.extend(moments(ctx))
    for adjust in _BACKWARD_PASSES:
        backward = adjust(ctx, ends, backward)
    for moments in _LATE_BACKWARD_MOMENTS:
        backward.extend(moments(ctx))
    forward = [moment for moments in _FORWARD_MOMENTS for moment in moments(ctx)]
    rank = ctx.rank
    return _Step(
        plan=ctx.plan,
        fixed=_FixedParts(rank.frozen, rank.trainable, _model_inputs(ctx.spec)),
        workspaces=_workspaces(ctx.plan, compute_capability),
        optimizer_state=rank.optimizer_state + ctx.ada.allocator_state,
        forward_end=max(forward, key=sum),
        backward_start=_backward_start(ctx),
        backward=max(backward, key=sum),
        optimizer_step=_optimizer_step(ctx),
        paged_state=rank.state_outside,
        host=rank.host,
        assumptions=ctx.assumptions,
        warnings=ctx.warnings,
        host_pinned=ctx.host_pinned,
    )
