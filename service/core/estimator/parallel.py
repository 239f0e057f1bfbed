"""What one rank of a multi-GPU job holds: its share of the model states, and the buffers its
strategy adds for the collectives.

Each strategy has its own function; `rank_layout` picks it. A one-GPU job without ZeRO or FSDP
holds everything and adds nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from service.core.estimator.weights import _gradients, _Params
from service.core.estimator.zero import zero_layout
from service.core.spec import ZERO_STAGES, Offload, Strategy, TrainingSpec

if TYPE_CHECKING:
    from service.core.estimator.plan import _Plan


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


def rank_layout(spec: TrainingSpec, plan: _Plan) -> RankLayout:
    """The layout of one rank of `spec` (per-GPU sizes), from the plan's parameters."""
    par = spec.parallel
    if par.strategy is Strategy.DDP:
        return _ddp(spec, plan) if par.gpus > 1 else plan.whole
    if par.strategy in ZERO_STAGES:
        return RankLayout(**zero_layout(plan.reserved.arch, spec, plan)._asdict())
    return _sharded(spec, plan)


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


def _ddp(spec: TrainingSpec, plan: _Plan) -> RankLayout:
    """DistributedDataParallel: every rank holds everything, plus the reducer's buckets.

    The reducer allocates one flat tensor per bucket when DDP wraps the model, covering every
    parameter that takes a gradient, in the gradient's dtype (torch/csrc/distributed/c10d/
    reducer.cpp `Reducer::initialize_buckets`): the buckets hold as many bytes as the
    gradients, for the whole run. With `gradient_as_bucket_view` each `.grad` is a view into
    its bucket and takes no memory of its own.
    """
    whole = plan.whole
    buckets = whole.gradients
    notes = [
        f"DDP over {spec.parallel.gpus} GPUs: every rank holds the whole model, its gradients "
        f"and its optimizer state, plus the reducer's gradient buckets "
        f"({spec.parallel.bucket_cap_mb} MB each)"
    ]
    if spec.parallel.gradient_as_bucket_view:
        notes.append("gradient_as_bucket_view: the gradients live in the buckets")
        return whole._replace(
            gradients=0,
            head_gradients=0,
            embed_gradients=0,
            comm_forward=buckets,
            comm_backward=buckets,
            comm_step=buckets,
            assumptions=tuple(notes),
        )
    return whole._replace(
        comm_forward=buckets, comm_backward=buckets, comm_step=buckets, assumptions=tuple(notes)
    )


def _sharded(spec: TrainingSpec, plan: _Plan) -> RankLayout:
    """ZeRO-1/2/3 and FSDP: optimizer state, then gradients, then parameters divided over the
    ranks (Rajbhandari et al. 2020, ZeRO, section 5)."""
    par = spec.parallel
    n = par.gpus
    params_n, grads_n, state_n = {
        Strategy.ZERO1: (1, 1, n),
        Strategy.ZERO2: (1, n, n),
    }.get(par.strategy, (n, n, n))
    whole = plan.whole
    state = whole.optimizer_state // state_n
    outside = whole.state_outside // state_n
    temps = whole.optimizer_temporaries // state_n
    host = 0
    notes = [f"{par.strategy} over {n} GPUs"]
    if par.offload is not Offload.NONE:
        host = state + outside
        state = outside = temps = 0
        notes.append("optimizer state offloaded to host memory")
    return whole._replace(
        frozen=whole.frozen // params_n,
        trainable=whole.trainable // params_n,
        gradients=whole.gradients // grads_n,
        head_gradients=whole.head_gradients // grads_n,
        embed_gradients=whole.embed_gradients // grads_n,
        optimizer_state=state,
        state_outside=outside,
        optimizer_temporaries=temps,
        host=host,
        assumptions=tuple(notes),
    )
