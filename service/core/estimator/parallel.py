"""What one rank of a multi-GPU job holds: its share of the model states, and the buffers its
strategy adds for the collectives.

Each strategy has its own function; `rank_layout` picks it. A one-GPU job without ZeRO or FSDP
holds everything and adds nothing.
"""

from __future__ import annotations

from typing import NamedTuple

from service.core.arch import ModelArch
from service.core.estimator.layout import RankLayout
from service.core.estimator.ledger import _blk
from service.core.estimator.plan import _Plan
from service.core.estimator.zero import zero_layout
from service.core.spec import TrainingSpec
from service.core.spec.choices import Framework, Method
from service.core.spec.parallel import FsdpBackwardPrefetch, FsdpSharding, Offload, Strategy
from service.core.units import AUTOCAST_BYTES, DTYPE_BYTES, GIB


def rank_layout(arch: ModelArch, spec: TrainingSpec, plan: _Plan) -> RankLayout:
    """The layout of one rank of `spec` (per-GPU sizes), from the plan's parameters."""
    par = spec.parallel
    if par.strategy is Strategy.DDP:
        return _ddp(spec, plan) if par.gpus > 1 else plan.whole
    if par.strategy in (Strategy.FSDP, Strategy.FSDP2):
        layout = _fsdp(arch, spec, plan)
    else:
        # DeepSpeed ZeRO-1/2/3 (`ZERO_STAGES`), modelled from DeepSpeed's source
        layout = RankLayout(**zero_layout(arch, spec, plan)._asdict())
    if not layout.host:
        return layout
    per_node = par.node_size
    note = (
        f"host memory for what is offloaded: {layout.host / GIB:.2f} GiB per GPU, "
        f"{layout.host * per_node / GIB:.2f} GiB per node of {per_node} GPUs"
    )
    return layout._replace(assumptions=(*layout.assumptions, note))


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


class _Sharding(NamedTuple):
    """How FSDP shards and gathers: FSDP1 or FSDP2, over how many ranks a shard spans, whether
    units are resharded after forward and whether backward prefetches."""

    fsdp1: bool
    n: int
    reshard: bool
    prefetch: bool


def _sharding(spec: TrainingSpec) -> _Sharding:
    par = spec.parallel
    fsdp1 = par.strategy is Strategy.FSDP
    if fsdp1 and par.sharding_strategy is FsdpSharding.NO_SHARD:
        n = 1
    elif fsdp1 and par.sharding_strategy is FsdpSharding.HYBRID_SHARD:
        n = par.node_size  # sharded within a node, replicated across nodes
    else:
        n = par.gpus
    if fsdp1:
        reshard = par.sharding_strategy in (FsdpSharding.FULL_SHARD, FsdpSharding.HYBRID_SHARD)
        prefetch = par.backward_prefetch is not FsdpBackwardPrefetch.NO_PREFETCH
    else:
        reshard = par.reshard_after_forward
        prefetch = True
    return _Sharding(fsdp1, n, reshard, prefetch)


class _Units(NamedTuple):
    """The bytes each kind of FSDP unit holds gathered: the root (or tail) group, one layer,
    every layer, and FSDP2's untied embedding group; `one_group`: a PEFT model under FSDP2,
    every layer in the root group."""

    root: int
    layer: int
    layers: int
    embed: int
    one_group: bool


def _units(arch: ModelArch, spec: TrainingSpec, plan: _Plan, sh: _Sharding) -> _Units:
    p = plan.params
    layer = p.layer
    layers = arch.num_hidden_layers * layer
    # What stays gathered from the forward through the backward. FSDP1: the root unit, all
    # that is outside the layers. FSDP2 as accelerate 1.15 applies it (accelerate/utils/
    # fsdp_utils.py `fsdp2_prepare_model`): a tail group of the final norm and the LM head (and
    # the embedding when tied to the head) with reshard_after_forward=False; an untied
    # embedding is a group of its own, resharded after forward.
    embed = 0
    if not sh.fsdp1 and not arch.tie_word_embeddings:
        embed = _blk(arch.vocab_size * arch.hidden_size * DTYPE_BYTES[spec.dtype])
    root = p.outside_layers - embed
    # HF Trainer sets PEFT's wrap policy for a PEFT model (transformers/distributed/fsdp.py
    # `update_fsdp_plugin_peft`), which accelerate's FSDP2 path does not translate
    # (`fsdp2_prepare_auto_wrap_policy` returns None): the root group holds every layer, never
    # resharded after forward.
    one_group = not sh.fsdp1 and spec.method is not Method.FULL and spec.framework is Framework.HF
    if one_group:
        root, layer, layers = p.frozen + p.trainable - embed, 0, 0
    if sh.n == 1:
        root = layers = layer = embed = 0  # nothing is sharded, so nothing is gathered
    if spec.autocast and DTYPE_BYTES[spec.dtype] > AUTOCAST_BYTES:
        # HF Trainer's mixed precision under FSDP is FSDP's own (accelerate sets
        # MixedPrecision / MixedPrecisionPolicy with param_dtype the half dtype): a full-
        # precision model is gathered in half precision. Not traced.
        root, layer, layers, embed = (
            x * AUTOCAST_BYTES // DTYPE_BYTES[spec.dtype] for x in (root, layer, layers, embed)
        )
    return _Units(root, layer, layers, embed, one_group)


def _late_prefetch(spec: TrainingSpec, sh: _Sharding) -> bool:
    """HF Trainer wraps a PEFT model with PEFT's policy (`update_fsdp_plugin_peft`): every
    module with trainable weights, each LoRA A and B, is a unit of its own. FSDP1 prefetches
    the next unit in backward order (torch/distributed/fsdp/_runtime_utils.py
    `_prefetch_handle`), which inside a layer is its next adapter; the layer below is
    prefetched only by the layer's first adapter in forward order, as its backward ends
    (reference trace phi-3-mini-4k-instruct__lora__r16-all-linear__b1-s512__ckpt__fsdp-2gpu-
    full-shard: the layer below gathered at the input norm's backward). A layer recomputed
    for checkpointing has only its own parameters gathered beside the root's."""
    return (
        sh.fsdp1
        and sh.prefetch
        and sh.reshard
        and sh.n > 1
        and spec.method is not Method.FULL
        and spec.framework is Framework.HF
        and spec.gradient_checkpointing
    )


class _Gathered(NamedTuple):
    """The gathered parameters at each moment of the step, by `RankLayout`'s names."""

    comm_forward: int
    comm_backward_start: int
    comm_backward: int
    comm_bottom: int
    comm_end: int
    comm_forward_start: int | None
    comm_top: int | None


def _fsdp_communication(spec: TrainingSpec, plan: _Plan, sh: _Sharding, units: _Units) -> _Gathered:
    """The gathered parameters at each moment of the step (`RankLayout`'s comm_* fields)."""
    root, layer, layers, embed = units.root, units.layer, units.layers, units.embed
    gathered_forward = root if sh.reshard else root + layers
    # inside one layer's backward: the root, the layer, and the next one when prefetched
    one_layer_back = root + layer * (2 if sh.prefetch else 1)
    # At the top layer every layer is still gathered when none was resharded after forward;
    # layers are resharded after their backward, so at the bottom only the last are left.
    in_backward = one_layer_back if sh.reshard else max(one_layer_back, gathered_forward)
    # FSDP1 has resharded the first layer by the embedding's backward (reference traces
    # *fsdp-*-full-shard, full fine-tuning); FSDP2 still holds it then (*fsdp2-*), with an
    # untied embedding gathered again for its backward.
    at_end = root if sh.fsdp1 else root + layer + embed
    # FSDP2 all-gathers a group into one flat buffer and copies it out into the parameters'
    # own tensors (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py
    # `foreach_all_gather`, `foreach_all_gather_copy_out`): both exist as the first group is
    # gathered at the forward's start (the tail with a tied embedding, else the embedding's).
    # FSDP1 gathers straight into the unsharded flat parameter.
    forward_start = None if sh.fsdp1 or sh.n == 1 else 2 * (embed or root)
    # FSDP1 prefetches the last layer as the backward starts (its pre-backward hook on the
    # root's output); FSDP2 gathers it when the layer's backward begins.
    prefetched = sh.fsdp1 and sh.prefetch and sh.reshard
    backward_start = root + layer if prefetched else gathered_forward
    late_prefetch = _late_prefetch(spec, sh)
    if units.one_group and sh.n > 1:
        # With every layer in the root group, the tail group's flat all-gather buffer stays
        # until the loss (reference trace qwen2_5-0_5b__lora__r16-all-linear__b1-s512__fsdp2-
        # 8gpu: an LM-head-sized buffer freed after the log-softmax).
        gathered_forward += plan.params.outside_layers - embed
        # The root group is gathered (its flat buffer and its copies) as the forward starts; an
        # untied embedding's group is gathered and freed on its own (reference traces
        # *lora*fsdp2-2gpu of Phi-3-mini and Qwen2.5-0.5B).
        forward_start = 2 * root
    return _Gathered(
        comm_forward=gathered_forward,
        comm_backward_start=backward_start,
        comm_backward=in_backward,
        # (at the bottom layer there is no layer below to prefetch)
        comm_bottom=root + layer if late_prefetch else one_layer_back,
        comm_end=at_end,
        comm_forward_start=forward_start,
        comm_top=root + layer if late_prefetch else None,
    )


def _fsdp_gradients(
    spec: TrainingSpec, plan: _Plan, sh: _Sharding, units: _Units
) -> tuple[int, int | None, int, list[str]]:
    """The gradients a rank makes before sharding (LitGPT's whole-Block units make them for
    frozen weights too), those accumulated unsharded between optimizer steps, FSDP1's
    flattened copy in flight, and the notes."""
    par, p = spec.parallel, plan.params
    fsdp1, n = sh.fsdp1, sh.n
    notes = [
        f"{'FSDP1' if fsdp1 else 'FSDP2'} over {par.gpus} GPUs"
        + (f" (sharded within nodes of {n})" if n != par.gpus else "")
        + ": each rank keeps its shard of every parameter, gradient and optimizer state; one "
        "unit per decoder layer, the root holding the embedding, final norm and LM head"
    ]
    if not sh.reshard and not units.one_group and n > 1:
        notes.append(
            "every layer's gathered parameters kept from its forward to its backward "
            + ("(SHARD_GRAD_OP)" if fsdp1 else "(reshard_after_forward=False)")
        )
    if units.one_group and n > 1:
        notes.append(
            "FSDP2 with a PEFT model under HF Trainer: accelerate wraps no layer separately, so "
            "the whole model is gathered on every GPU from the forward through the backward"
        )
    grads = plan.whole.gradients
    if fsdp1 and spec.framework is Framework.LITGPT and spec.method is not Method.FULL and n > 1:
        # Fabric wraps whole Blocks, adapters inside: with use_orig_params a flat parameter
        # that holds any trainable tensor takes a gradient for all of it
        # (torch/distributed/fsdp/_flat_param.py `_validate_tensors_to_flatten`).
        grads = p.frozen + p.trainable
        notes.append(
            "LitGPT wraps each Block with its adapters: every flat parameter takes a whole "
            "gradient, frozen weights included"
        )
    in_flight = 0
    if fsdp1 and n > 1 and par.use_orig_params and spec.method is Method.FULL:
        # FSDP1 with use_orig_params flattens a unit's gradients into one unsharded flat
        # gradient (torch.cat) in its post-backward hook, beside the parameters' own
        # gradients, before reduce-scattering it: two copies of a layer's gradients (reference
        # trace phi-3-mini-4k-instruct__full__b1-s512__ckpt__fsdp-2gpu-full-shard, peak at
        # that cat).
        in_flight = 2 * units.layer - units.layer // n
    accumulated = None
    if spec.gradient_accumulation_steps > 1 and n > 1:
        # Between optimizer steps the micro-batches' gradients add up unsharded: HF Trainer
        # accumulates under accelerate's `no_sync` (FSDP1's no_sync, FSDP2's
        # set_requires_gradient_sync(False); accelerate/accelerator.py `Accelerator.no_sync`),
        # as LitGPT does under Fabric's `no_backward_sync`; only the last micro-batch's
        # backward reduce-scatters them.
        accumulated = grads
        notes.append(
            "gradient accumulation without synchronisation (accelerate's no_sync): the "
            "accumulated gradients are held unsharded"
        )
    return grads, accumulated, in_flight, notes


def _fsdp(arch: ModelArch, spec: TrainingSpec, plan: _Plan) -> RankLayout:
    """FSDP1 and FSDP2, wrapped as HF Trainer + accelerate wrap a decoder: one unit per decoder
    layer, the root holding what is outside the layers (embedding, final norm, LM head).

    Each rank keeps 1/N of every parameter, gradient and optimizer state. A unit's parameters
    are gathered whole for its forward and again for its backward; with resharding after
    forward (FSDP1's FULL_SHARD and HYBRID_SHARD, FSDP2's reshard_after_forward) they are
    freed after each, except the root's, which stay gathered from the forward through the
    backward (torch/distributed/fsdp/_runtime_utils.py `_post_forward_reshard`: not for the
    root; _fully_shard/_fsdp_state.py: the root's group is not resharded after forward).
    Backward prefetches the next unit's parameters, so two layers are gathered inside it
    (FSDP1's BACKWARD_PRE and BACKWARD_POST, FSDP2's default). SHARD_GRAD_OP and
    reshard_after_forward=False keep every unit gathered from its forward to its backward.
    The embedding's gradient is made whole before it is reduce-scattered.
    """
    whole = plan.whole
    sh = _sharding(spec)
    units = _units(arch, spec, plan, sh)
    comm = _fsdp_communication(spec, plan, sh, units)
    grads, accumulated, in_flight, notes = _fsdp_gradients(spec, plan, sh, units)
    n = sh.n
    state = whole.optimizer_state // n
    outside = whole.state_outside // n
    temps = whole.optimizer_temporaries // n
    frozen = whole.frozen // n
    trainable = whole.trainable // n
    held_grads = grads // n
    host = 0
    if spec.parallel.offload is Offload.OPTIMIZER_AND_PARAMS:
        # CPUOffload / CPUOffloadPolicy: shards, their gradients and the optimizer on the host
        host = frozen + trainable + held_grads + state + outside
        frozen = trainable = held_grads = state = outside = temps = 0
        notes.append("parameters, gradients and optimizer state offloaded to host memory")
    return whole._replace(
        frozen=frozen,
        trainable=trainable,
        gradients=held_grads,
        head_gradients=whole.head_gradients // n,
        embed_gradients=whole.embed_gradients // n,
        optimizer_state=state,
        state_outside=outside,
        optimizer_temporaries=temps,
        comm_step=0,
        host=host,
        assumptions=tuple(notes),
        embed_gradient_made=whole.embed_gradients,
        accumulated_gradients=accumulated,
        bottom_temporaries=in_flight,
        **comm._asdict(),
    )
