"""One rank's share of a job's states and its communication buffers (`RankLayout`), and the
layout of a job on one GPU, where everything is whole."""

from __future__ import annotations

from typing import NamedTuple

from service.core.estimator.weights import _gradients, _Params


class RankLayout(NamedTuple):
    """One rank's model states and communication buffers, bytes."""

    frozen: int  # frozen weights held between uses (this rank's shard under FSDP, ZeRO-3)
    trainable: int  # trainable parameters held between uses
    gradients: int  # every gradient this rank holds once backward is done
    head_gradients: int  # of which the LM head's and final norm's (they come first)
    embed_gradients: int  # of which the input embedding's (it comes last)
    optimizer_state: int  # optimizer state in the allocator (fp32 master weights included)
    state_outside: int  # optimizer state outside the allocator (paged optimizers)
    optimizer_temporaries: int  # the optimizer step's scratch
    # The communication component (gathered parameters, buckets) at each moment of the step.
    comm_forward: int  # at the forward's end and the backward's start
    comm_backward: int  # inside the layers' backward
    comm_step: int  # during the optimizer step
    host: int  # host memory this rank keeps (offloaded states)
    assumptions: tuple[str, ...]
    # At the backward's start (the loss gradient), when it differs from comm_forward.
    comm_backward_start: int | None = None
    # At the backward's end (the embedding's gradient), when it differs from comm_backward.
    comm_end: int | None = None
    # At the bottom layer's backward, when it differs from comm_backward (the top layer's).
    comm_bottom: int | None = None
    # At the forward's start, when gathering the first parameters is a moment of its own (no
    # activations yet), else None.
    comm_forward_start: int | None = None
    # The embedding's gradient as backward makes it, before any reduction shards it; None: as
    # held (`embed_gradients`).
    embed_gradient_made: int | None = None
    # Gradients in flight at the bottom layer's backward beyond the one-GPU step's.
    bottom_temporaries: int = 0
    # The gradients held between micro-batches under gradient accumulation; None: as after
    # backward (`gradients`).
    accumulated_gradients: int | None = None
    # At the top layer's recompute when the next layer's parameters are gathered only near the
    # layer's end (`comm_backward` then holds at that end); None: no such moment.
    comm_top: int | None = None


def whole_layout(p: _Params, optimizer: tuple[int, int, int]) -> RankLayout:
    """Every state whole on the one GPU, nothing to communicate."""
    state, outside, temps = optimizer
    return RankLayout(
        frozen=p.frozen,
        trainable=p.trainable,
        gradients=_gradients(p),
        head_gradients=p.head_trainable,
        embed_gradients=p.embed_trainable,
        optimizer_state=state,
        state_outside=outside,
        optimizer_temporaries=temps,
        comm_forward=0,
        comm_backward=0,
        comm_step=0,
        host=0,
        assumptions=(),
    )
