"""What one rank of a DeepSpeed ZeRO job holds, buffer by buffer, as DeepSpeed v0.19.5 builds it
(github.com/deepspeedai/DeepSpeed, tag v0.19.5, commit cf44300453eb0af79ed84ed8f1cb49d57478bd76),
driven by HF Trainer (transformers/integrations/deepspeed.py fills the "auto" settings).

Sources, by the names used below (paths under deepspeed/runtime/):
- zero/stage_1_and_2.py DeepSpeedZeroOptimizer (ZeRO-1 and ZeRO-2):
  `__init__` flattens each parameter group's trainable half-precision parameters into one buffer
  (`bit16_groups_flat`, padded to a multiple of 2 x world size elements by
  `flatten_dense_tensors_aligned`) and points every parameter into it; it keeps an fp32 copy of
  this rank's slice (`single_partition_of_fp32_groups`) as the optimizer's only parameter.
  `setup_buckets` allocates the reduce bucket (`ipg_buckets`, reduce_bucket_size elements in the
  parameters' dtype; a second one with overlap_comm) at each backward's first gradient, and
  `_release_ipg_buffers` drops it at the backward's end. `copy_grads_in_partition` allocates
  `grads_in_partition` (every parameter that overlaps this rank's slice, whole) at the first
  reduction. `step` copies each group's gradient slice into one flat half tensor and converts it
  to fp32 (`single_grad_partition`), checking it for inf/nan first (`_has_inf_or_nan`).
- zero/stage3.py DeepSpeedZeroOptimizer_Stage3 (ZeRO-3): `_create_fp16_partitions_with_
  defragmentation` (every parameter's shard, `ds_tensor`, in one flat buffer), `_create_fp32_
  partitions` (fp32 copy of the trainable shards, by sub-groups of sub_group_size elements),
  `_setup_for_real_optimizer` (the ipg bucket and `grad_partitions_flat_buffer`, both for the
  whole run), `_prepare_fp32_grad_for_sub_group` (flat half copy and fp32 gradient per sub-group).
- zero/partition_parameters.py (each parameter split into ceil(numel / N)-element shards,
  `partition_numel`) and zero/partitioned_param_coordinator.py (`fetch_sub_module` gathers the
  current module's parameters and prefetches up to stage3_prefetch_bucket_size elements, at most
  stage3_max_live_parameters available; `__params_to_release` keeps a parameter gathered when
  the recorded trace uses it again within max_reuse_distance elements).
- comm/coalesced_collectives.py `reduce_scatter_coalesced` (ZeRO-3's reduce-scatter copies the
  bucket into one flat tensor).
- engine.py `_cast_module_mixed_precision` (bf16/fp16 enabled: every floating parameter cast to
  that dtype), `communication_data_type` (bf16 or fp16 reductions), `get_data_types` (gradients
  accumulate in the model's dtype unless grad_accum_dtype is set).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import lru_cache
from typing import NamedTuple, Protocol

from service.core.arch import Linear, ModelArch, NormKind
from service.core.estimator.layer_flow import LayerFlow
from service.core.estimator.ledger import _blk
from service.core.estimator.weights import _optimizer_state, _Params, _params, _Tensor
from service.core.spec import (
    ZERO_STAGES,
    LoraSpec,
    Method,
    Offload,
    Optim,
    ParallelSpec,
    QuantSpec,
    ResolvedSpec,
    Strategy,
    TrainingSpec,
)
from service.core.units import BOOL_BYTES, DTYPE_BYTES, FP32_BYTES, GIB, DType

# stage_1_and_2.py __init__: `nccl_start_alignment_factor = 2` (4-byte alignment / 2-byte
# elements); each flat group is padded to a multiple of this times the world size.
NCCL_START_ALIGNMENT_FACTOR = 2
# stage_1_and_2.py `_has_inf_or_nan`: x.float() (4 bytes), isnan and isinf (1 byte each), their
# logical_or (1 byte) and its .float() (4 bytes) are alive together, per element of the
# gradient piece checked (bf16's check_grad_overflow defaults to True, precision_config.py).
OVERFLOW_CHECK_BYTES_PER_ELEMENT = 4 + 1 + 1 + 1 + 4
# zero/config.py DeepSpeedZeroConfig: max_reuse_distance 1e9 elements, sub_group_size 1e9.
ZERO3_MAX_REUSE_DISTANCE = 1_000_000_000
ZERO3_SUB_GROUP_SIZE = 1_000_000_000
# transformers/integrations/deepspeed.py HfTrainerDeepSpeedConfig.trainer_config_finalize: the
# "auto" values from the model's hidden size.
HF_AUTO_PREFETCH_FRACTION = 0.9  # stage3_prefetch_bucket_size = 0.9 * hidden_size ** 2
HF_AUTO_PERSISTENCE_FACTOR = 10  # stage3_param_persistence_threshold = 10 * hidden_size


@dataclasses.dataclass(frozen=True, slots=True)
class ZeroSettings:
    """DeepSpeed's `zero_optimization` values a job runs with, "auto" ones filled."""

    reduce_bucket_size: int  # elements
    prefetch_bucket_size: int  # elements (ZeRO-3)
    persistence_threshold: int  # elements (ZeRO-3)
    max_live_parameters: int  # elements (ZeRO-3)
    overlap_comm: bool
    contiguous_gradients: bool


def zero_settings(arch: ModelArch, par: ParallelSpec) -> ZeroSettings:
    """The settings of `par`, with None ("auto") filled as HF's DeepSpeed integration does, and
    overlap_comm's default per stage (zero/config.py `overlap_comm_valid`: on for stage 3)."""
    h = arch.hidden_size
    return ZeroSettings(
        reduce_bucket_size=par.reduce_bucket_size or h * h,
        prefetch_bucket_size=par.stage3_prefetch_bucket_size
        or int(HF_AUTO_PREFETCH_FRACTION * h * h),
        persistence_threshold=par.stage3_param_persistence_threshold
        if par.stage3_param_persistence_threshold is not None
        else HF_AUTO_PERSISTENCE_FACTOR * h,
        max_live_parameters=par.stage3_max_live_parameters,
        overlap_comm=par.overlap_comm
        if par.overlap_comm is not None
        else par.strategy is Strategy.ZERO3,
        # stage_1_and_2.py: "CPU-Offload requires contiguous gradients"
        contiguous_gradients=par.contiguous_gradients or par.offload is not Offload.NONE,
    )


def _over(n: int) -> str:
    return f"over {n} GPUs" if n > 1 else "on one GPU"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _cast_params(arch: ModelArch, job: _Job) -> tuple[_Params, int]:
    """The parameters after DeepSpeed's cast (engine.py `_cast_module_mixed_precision`): with
    bf16/fp16 enabled every floating parameter takes that dtype, LoRA's fp32 adapters and the
    fp32 copies `prepare_model_for_kbit_training` made included; 4-bit weights stay as they
    are. Returns the parameters and the half itemsize."""
    itemsize = DTYPE_BYTES[job.dtype]
    quant = job.quant
    adapter_dtype = job.adapter_dtype
    if job.dtype is not DType.FP32:
        adapter_dtype = job.dtype
        if quant is not None and quant.prepare_kbit:
            quant = dataclasses.replace(quant, prepare_kbit=False)
    p = _params(
        arch, job.method, job.dtype, job.lora, quant, adapter_dtype, job.adapted, job.head_quantized
    )
    return p, itemsize


def _groups(p: _Params) -> list[list[_Tensor]]:
    """HF Trainer's optimizer groups (trainer.py `get_decay_parameter_names`): weight decay for
    matrices, none for biases and norms (the 1-D tensors); empty groups dropped (engine.py
    `_configure_optimizer`)."""
    matrices = [t for t in p.tensors if t.cols]
    vectors = [t for t in p.tensors if not t.cols]
    return [g for g in (matrices, vectors) if g]


def _elements(group: Sequence[_Tensor]) -> int:
    return sum(t.elements * t.count for t in group)


def _fp32_partitions(sizes: Sequence[int]) -> _Params:
    """The optimizer's parameters: one flat fp32 tensor per group (or sub-group)."""
    tensors = tuple(_Tensor(s, 0, FP32_BYTES, 1) for s in sizes if s)
    return _Params(
        frozen=0,
        trainable=sum(t.nbytes for t in tensors),
        tensors=tensors,
        total_count=sum(sizes),
        trainable_count=sum(sizes),
        embed_trainable=0,
        head_trainable=0,
    )


def _step_scratch(
    sizes: Sequence[int], optim_temps: Sequence[int], itemsize: int, overflow_piece: int
) -> int:
    """The optimizer step's transient bytes beyond the states, the largest over the groups it
    steps one at a time: the flat half copy of the group's gradient slice beside its fp32
    conversion, then the fp32 gradient beside the optimizer's own scratch; or the inf/nan check
    of the largest gradient piece, which comes first."""
    worst = overflow_piece
    for s, temps in zip(sizes, optim_temps, strict=True):
        fp32_grad = _blk(s * FP32_BYTES)
        worst = max(worst, _blk(s * itemsize) + fp32_grad, fp32_grad + temps)
    return worst


class _Job(NamedTuple):
    """What a rank's layout depends on besides the model (the plan's choices and the parallel
    settings); the layouts are cached by it."""

    dtype: DType
    method: Method
    optim: Optim
    lora: LoraSpec | None  # resolved
    quant: QuantSpec | None  # resolved
    adapter_dtype: DType
    adapted: tuple[Linear, ...]
    head_quantized: bool
    parallel: ParallelSpec
    accumulating: bool  # gradient_accumulation_steps > 1


class PlanView(Protocol):
    """What this module reads of the estimator's plan (`plan._Plan`)."""

    @property
    def rs(self) -> ResolvedSpec: ...
    @property
    def adapted(self) -> tuple[Linear, ...]: ...
    @property
    def flow(self) -> LayerFlow: ...


class ZeroRank(NamedTuple):
    """One rank's states and buffers, bytes: the fields of `parallel.RankLayout`, in order."""

    frozen: int
    trainable: int
    gradients: int
    head_gradients: int
    embed_gradients: int
    optimizer_state: int
    state_outside: int
    optimizer_temporaries: int
    comm_forward: int
    comm_backward: int
    comm_step: int
    host: int
    assumptions: tuple[str, ...]


def zero_layout(arch: ModelArch, spec: TrainingSpec, plan: PlanView) -> ZeroRank:
    """One rank of DeepSpeed ZeRO stage 1, 2 or 3 (`spec.parallel.strategy`), `plan` being the
    spec's plan."""
    rs = plan.rs
    job = _Job(
        spec.dtype,
        spec.method,
        spec.optim,
        rs.lora,
        rs.quantization,
        rs.adapter_dtype,
        plan.adapted,
        plan.flow.head_quantized,
        spec.parallel,
        spec.gradient_accumulation_steps > 1,
    )
    return _zero_layout(arch, job)


@lru_cache(maxsize=1024)
def _zero_layout(arch: ModelArch, job: _Job) -> ZeroRank:
    if job.parallel.strategy is Strategy.ZERO3:
        return _stage3(arch, job)
    return _stage1_2(arch, job)


class _Flat(NamedTuple):
    """A ZeRO-1/2 rank's flat buffers: the trainable parameters whole, this rank's slices of
    them, their fp32 master weights and optimizer state, the gradients' partition buffer, the
    reduce bucket(s) and what a reduction holds in flight."""

    frozen: int
    trainable: int
    whole_gradients: int  # every trainable parameter's gradient, unpartitioned
    head_trainable: int
    embed_trainable: int
    itemsize: int
    slices: list[int]  # `partition_size` of each group
    largest: int  # the largest trainable parameter (elements)
    master: int
    state_parts: list[tuple[int, int, int]]  # per slice: state, outside, step temporaries
    grads_in_partition: int
    bucket: int
    ipg: int  # the bucket(s) gradients are reduced through (contiguous_gradients)
    collective: int
    reducing: int

    @property
    def state(self) -> int:
        return sum(s for s, _, _ in self.state_parts)

    @property
    def outside(self) -> int:
        return sum(o for _, o, _ in self.state_parts)


def _flat(arch: ModelArch, job: _Job, cfg: ZeroSettings) -> _Flat:
    n = job.parallel.gpus
    p, itemsize = _cast_params(arch, job)
    groups = _groups(p)
    align = NCCL_START_ALIGNMENT_FACTOR * n
    flat = [_cdiv(_elements(g), align) * align for g in groups]
    slices = [f // n for f in flat]  # `partition_size`
    largest_all = max((max(t.elements for t in g) for g in groups), default=0)
    # `grads_in_partition` holds every parameter that overlaps this rank's slice whole
    # (`params_in_partition`); the worst rank's, from the parameters' order.
    held = _partition_elements(arch, job, p, groups, slices, n)
    bucket = _blk(cfg.reduce_bucket_size * itemsize)
    ipg = (2 if cfg.overlap_comm else 1) * bucket if cfg.contiguous_gradients else 0
    # Reducing: the newest gradient (the largest parameter's, before its hook moves it into the
    # bucket or reduces it in place), and with several ranks the flat copy `allreduce_bucket`
    # makes of the bucket's (or that parameter's) per-rank slices.
    in_flight = _blk(largest_all * itemsize)
    collective = _blk(max(cfg.reduce_bucket_size, largest_all) * itemsize) if n > 1 else 0
    return _Flat(
        frozen=p.frozen,
        trainable=sum(_blk(f * itemsize) for f in flat),
        whole_gradients=p.trainable,
        head_trainable=p.head_trainable,
        embed_trainable=p.embed_trainable,
        itemsize=itemsize,
        slices=slices,
        largest=largest_all,
        master=sum(_blk(s * FP32_BYTES) for s in slices),
        state_parts=[_optimizer_state(_fp32_partitions([s]), job.optim) for s in slices],
        grads_in_partition=_blk(held * itemsize),
        bucket=bucket,
        ipg=ipg,
        collective=collective,
        reducing=in_flight + collective,
    )


def _stage1_2_notes(job: _Job, cfg: ZeroSettings, flat: _Flat) -> list[str]:
    par = job.parallel
    n = par.gpus
    notes = [
        f"ZeRO-{ZERO_STAGES[par.strategy]} {_over(n)} (DeepSpeed v0.19.5 "
        f"DeepSpeedZeroOptimizer): every rank holds the whole {job.dtype} trainable parameters "
        f"in one flat buffer; fp32 master weights and optimizer state for 1/{n} of them",
        f"reduce bucket of {cfg.reduce_bucket_size:,} elements"
        + (" (two: overlap_comm)" if flat.ipg == 2 * flat.bucket else "")
        + (" (HF auto: hidden_size squared)" if par.reduce_bucket_size is None else ""),
    ]
    if job.dtype is not DType.FP32 and job.method is not Method.FULL:
        notes.append(f"DeepSpeed casts every floating parameter, adapters included, to {job.dtype}")
    notes.append(
        f"not a phase here: at start-up flattening holds the trainable parameters twice "
        f"({2 * flat.trainable / GIB:.2f} GiB) when the GPU has room for it"
    )
    return notes


def _offloaded_stage1_2(job: _Job, flat: _Flat, notes: list[str]) -> ZeroRank:
    """stage_1_and_2.py with offload_optimizer: the fp32 slice, its fp32 gradient, a half copy
    of the slice and the optimizer state live in (pinned) host memory; the GPU keeps the flat
    parameters, the bucket(s) and `temp_grad_buffer_for_gpu_offload` (the largest parameter),
    and converts each gradient piece to fp32 before copying it out."""
    itemsize = flat.itemsize
    host_state = sum(s + o for s, o, _ in flat.state_parts)
    host = (
        flat.master
        + sum(_blk(s * FP32_BYTES) + _blk(s * itemsize) for s in flat.slices)
        + host_state
        + _blk(flat.largest * itemsize)  # temp_grad_buffer_for_cpu_offload
    )
    gpu_temp = _blk(flat.largest * itemsize)
    notes.append(
        "optimizer offloaded to CPU: fp32 master weights, their gradients and the optimizer "
        "state in pinned host memory; the optimizer step runs on the CPU"
    )
    comm = flat.ipg + gpu_temp
    return ZeroRank(
        frozen=flat.frozen,
        trainable=flat.trainable,
        gradients=0,
        head_gradients=0,
        embed_gradients=0,
        optimizer_state=0,
        state_outside=0,
        optimizer_temporaries=0,
        comm_forward=gpu_temp,
        comm_backward=comm + flat.reducing + _blk(flat.largest * FP32_BYTES),
        comm_step=gpu_temp,
        host=host,
        assumptions=tuple(notes),
    )


def _reduced_in_backward(job: _Job, flat: _Flat, scratch: int, notes: list[str]) -> ZeroRank:
    """ZeRO-2, or ZeRO-1 with overlap_comm: gradients are reduced during backward into the
    partition buffer; the rank that owns the last parameters holds it from the backward's
    first reduction on."""
    notes.append(
        f"gradients reduced during backward into this rank's 1/{job.parallel.gpus} partition "
        "buffer (contiguous_gradients)"
    )
    accumulated = 0
    if job.accumulating:
        # `independent_gradient_partition_epilogue` keeps each micro-batch's reduced
        # gradients (`all_grad_tensors`, views of its partition buffer) and adds the next
        # micro-batch's into them: the next backward fills a second partition buffer.
        accumulated = flat.grads_in_partition
        notes.append("gradient accumulation: a second partition buffer during each later backward")
    return ZeroRank(
        frozen=flat.frozen,
        trainable=flat.trainable,
        gradients=flat.grads_in_partition,
        head_gradients=flat.grads_in_partition,
        embed_gradients=0,
        optimizer_state=flat.state + flat.master,
        state_outside=flat.outside,
        optimizer_temporaries=scratch,
        comm_forward=0,
        comm_backward=flat.ipg + flat.reducing + accumulated,
        comm_step=0,
        host=0,
        assumptions=tuple(notes),
    )


def _reduced_after_backward(job: _Job, flat: _Flat, scratch: int, notes: list[str]) -> ZeroRank:
    """ZeRO-1 without overlap_comm: whole gradients until `reduce_gradients` after backward,
    which moves them bucket by bucket into the partition buffer; then the step."""
    whole = flat.whole_gradients
    reduce_moment = whole + flat.grads_in_partition + flat.ipg + flat.collective
    step_moment = flat.grads_in_partition + scratch
    notes.append(
        "ZeRO-1: whole gradients until they are reduced after backward; the optimizer step "
        f"works on this rank's 1/{job.parallel.gpus}"
    )
    return ZeroRank(
        frozen=flat.frozen,
        trainable=flat.trainable,
        gradients=whole,
        head_gradients=flat.head_trainable,
        embed_gradients=flat.embed_trainable,
        optimizer_state=flat.state + flat.master,
        state_outside=flat.outside,
        # the step's scratch beyond what the reduction held
        optimizer_temporaries=max(0, step_moment - reduce_moment),
        comm_forward=0,
        comm_backward=flat.ipg,
        comm_step=flat.grads_in_partition + flat.ipg + flat.collective,
        host=0,
        assumptions=tuple(notes),
    )


def _stage1_2(arch: ModelArch, job: _Job) -> ZeroRank:
    par = job.parallel
    cfg = zero_settings(arch, par)
    flat = _flat(arch, job, cfg)
    notes = _stage1_2_notes(job, cfg, flat)
    if par.offload is not Offload.NONE:
        return _offloaded_stage1_2(job, flat, notes)
    check = _blk(min(flat.largest, max(flat.slices, default=0)) * OVERFLOW_CHECK_BYTES_PER_ELEMENT)
    if job.dtype is DType.FP32:
        check = 0  # engine.py `_configure_zero_optimizer`: no overflow check without bf16/fp16
    temporaries = [t for _, _, t in flat.state_parts]
    scratch = _step_scratch(flat.slices, temporaries, flat.itemsize, check)
    if par.strategy is Strategy.ZERO2 or cfg.overlap_comm:
        return _reduced_in_backward(job, flat, scratch, notes)
    return _reduced_after_backward(job, flat, scratch, notes)


def _model_order(arch: ModelArch, job: _Job) -> list[tuple[int, bool]]:
    """The trainable tensors in model.parameters() order, as (elements, is a matrix): the
    embedding, each layer's linears (weight, bias; or a LoRA layer's lora_A and lora_B) and
    norms, the final norm, the LM head (`plan._model_order`'s order)."""
    full = job.method is Method.FULL
    saved = set(job.lora.modules_to_save) if job.lora is not None else set()
    r = job.lora.r if job.lora is not None else 0
    adapted = {lin.name for lin in job.adapted}
    h, v = arch.hidden_size, arch.vocab_size
    norm_tensors = 2 if arch.norm is NormKind.LAYER else 1
    out: list[tuple[int, bool]] = []
    if full or "embed_tokens" in saved:
        out.append((v * h, True))
    layer: list[tuple[int, bool]] = []
    for lin in arch.linears:
        if full:
            layer.append((lin.weight_elements, True))
            if lin.bias:
                layer.append((lin.out_features * lin.count, False))
        elif lin.name in adapted:
            layer += [(r * lin.in_features, True), (lin.out_features * r, True)]
    if full:
        layer += [(h, False)] * (arch.norms_per_layer * norm_tensors)
        if arch.qk_norm:
            layer += [(arch.head_dim, False)] * 2
    out += layer * arch.num_hidden_layers
    if full:
        out += [(h, False)] * norm_tensors
        if not arch.tie_word_embeddings:
            out.append((v * h, True))
            if arch.lm_head_bias:
                out.append((v, False))
    elif "lm_head" in saved and not arch.tie_word_embeddings:
        out.append((v * h, True))
    return out


def _partition_elements(
    arch: ModelArch,
    job: _Job,
    p: _Params,
    groups: list[list[_Tensor]],
    slices: list[int],
    n: int,
) -> int:
    """Elements of the parameters overlapping one rank's slices, whole, for the rank that holds
    the most (stage_1_and_2.py `get_partition_info`, `copy_grads_in_partition`). Each group
    is laid out in model order; when that order cannot be rebuilt, each boundary is taken to
    cut the group's largest parameter."""
    order = _model_order(arch, job)
    expected = sorted((t.elements, bool(t.cols)) for t in p.tensors for _ in range(t.count))
    if sorted(order) != expected:
        return sum(
            min(s + (2 * max(t.elements for t in g) if n > 1 else 0), _elements(g))
            for g, s in zip(groups, slices, strict=True)
        )
    kinds = [kind for kind in (True, False) if any(m == kind for _, m in order)]
    worst = [0] * n
    for kind, size in zip(kinds, slices, strict=True):
        start = 0
        for elements, matrix in order:
            if matrix is not kind:
                continue
            end = start + elements
            # ranks whose [rank * size, (rank + 1) * size) this parameter overlaps
            for rank in range(start // size, min(n - 1, (end - 1) // size) + 1):
                worst[rank] += elements
            start = end
    return max(worst)


def _module_params(arch: ModelArch, job: _Job) -> list[tuple[int, ...]]:
    """Each module's parameters (elements) in forward order, as ZeRO-3 fetches them: the
    embedding, each layer's linears (a LoRA layer's base linear, then lora_A and lora_B) and
    norms, the final norm, the LM head."""
    h, v = arch.hidden_size, arch.vocab_size
    r = job.lora.r if job.lora is not None else 0
    adapted = {lin.name for lin in job.adapted}
    norm_tensors = 2 if arch.norm is NormKind.LAYER else 1
    layer: list[tuple[int, ...]] = []
    for lin in arch.linears:
        bias = (lin.out_features * lin.count,) if lin.bias else ()
        layer.append((lin.weight_elements, *bias))
        if lin.name in adapted:
            layer.append((r * lin.in_features,))
            layer.append((lin.out_features * r,))
    layer += [(h,) * norm_tensors] * arch.norms_per_layer
    if arch.qk_norm:
        layer += [(arch.head_dim,), (arch.head_dim,)]
    modules: list[tuple[int, ...]] = [(v * h,)]
    modules += layer * arch.num_hidden_layers
    modules.append((h,) * norm_tensors)
    modules.append((v * h, v) if arch.lm_head_bias else (v * h,))
    return modules


def gathered_elements(
    modules: Sequence[tuple[int, ...]], threshold: int, prefetch: int, max_live: int
) -> tuple[int, int]:
    """Gathered (non-persistent) elements at the forward's end, and the most at any module of
    the layers. At each module: its own parameters and the prefetched ones that follow in the
    trace, added while fewer than min(prefetch bucket, max live) are in flight
    (`fetch_sub_module`). At the forward's end, also every module whose next use, in the
    backward, comes within max_reuse_distance elements (`__params_to_release`): the trailing
    modules' reuse lies twice the parameters after them away.

    A prefetch of several parameters is one coalesced all-gather whose flat tensor stays beside
    the parameters' own copies until the last of them is used (partition_parameters.py
    `AllGatherCoalescedHandle.wait` keeps `partitions`): such a set counts twice."""
    sizes = [sum(e for e in m if e > threshold) for m in modules]
    counts = [sum(1 for e in m if e > threshold) for m in modules]
    totals = [sum(m) for m in modules]
    cap = min(prefetch, max_live)

    def ahead(order: list[int], params: list[int], at: int) -> int:
        got = 0
        count = 0
        for size, n in zip(order[at + 1 :], params[at + 1 :], strict=True):
            if got >= cap:
                break
            got += size
            count += n
        return 2 * got if count > 1 else got

    peak = 0
    for order, params in ((sizes, counts), (sizes[::-1], counts[::-1])):
        for i, size in enumerate(order):
            peak = max(peak, size + ahead(order, params, i))
    retained = 0
    after = 0
    kept = 0
    for size, total in zip(sizes[::-1], totals[::-1], strict=True):
        if 2 * after >= ZERO3_MAX_REUSE_DISTANCE:
            break
        retained += size
        after += total
        kept += 1
    # and the backward's prefetch of the modules beyond those
    turn = retained + ahead(sizes[::-1], counts[::-1], kept - 1)
    return turn, peak


def _stage3(arch: ModelArch, job: _Job) -> ZeroRank:
    p, itemsize = _cast_params(arch, job)
    base = _params(arch, Method.FULL, job.dtype, None, None, job.dtype, (), False)
    full = job.method is Method.FULL
    return stage3_rank(
        Stage3Model(
            frozen=() if full else base.tensors,
            trainable=p.tensors,
            modules=tuple(_module_params(arch, job)),
            itemsize=itemsize,
            layer_largest=max(lin.weight_elements for lin in arch.linears),
        ),
        zero_settings(arch, job.parallel),
        job,
    )


class Stage3Model(NamedTuple):
    """A model as ZeRO-3 partitions and gathers it: every frozen and trainable parameter (after
    DeepSpeed's cast, `itemsize` bytes an element) and each module's own parameters (elements)
    in the order the step fetches them."""

    frozen: Sequence[_Tensor]
    trainable: Sequence[_Tensor]
    modules: Sequence[tuple[int, ...]]
    itemsize: int
    # The largest parameter inside the layers (elements): what backward gathers again.
    layer_largest: int


def _shard_elements(tensors: Sequence[_Tensor], n: int) -> int:
    """Each parameter split into ceil(numel / N)-element shards in one flat buffer."""
    return sum(t.count * _cdiv(t.elements, n) for t in tensors)


def _persistent_bytes(tensors: Sequence[_Tensor], threshold: int, itemsize: int) -> int:
    """Parameters of at most `threshold` elements, also kept whole once gathered (ds_persist)."""
    return sum(t.count * _blk(t.elements * itemsize) for t in tensors if t.elements <= threshold)


@dataclasses.dataclass(slots=True)
class _Stage3Holding:
    """What a ZeRO-3 rank holds, as the offloads move parts of it to the host."""

    frozen: int
    trainable: int
    state: int
    outside: int
    scratch: int
    grad_buffer: int  # grad_partitions_flat_buffer
    gathered_turn: int  # gathered as the forward turns into the backward
    gathered_layers: int  # gathered inside the layers' backward
    host: int
    notes: list[str]


def _stage3_notes(
    n: int, job: _Job, cfg: ZeroSettings, model: Stage3Model, sub_groups: list[int], turn: int
) -> list[str]:
    """The settings a ZeRO-3 rank runs with, and what happens at start-up."""
    threshold = cfg.persistence_threshold
    notes = [
        (
            f"ZeRO-3 over {n} GPUs (DeepSpeed v0.19.5): {job.dtype} parameters, gradients, fp32 "
            f"master weights and optimizer state each split over the {n} GPUs"
            if n > 1
            else f"ZeRO-3 on one GPU (DeepSpeed v0.19.5): {job.dtype} parameters, gradients, fp32 "
            "master weights and optimizer state each in one partition"
        )
        + f"; parameters of at most {threshold:,} elements kept whole",
        f"parameters gathered module by module, with up to {cfg.prefetch_bucket_size:,} elements "
        f"prefetched (at most {cfg.max_live_parameters:,} live); at the forward's end the last "
        f"modules stay gathered for the backward (max_reuse_distance "
        f"{ZERO3_MAX_REUSE_DISTANCE:,}): {turn / GIB:.2f} GiB",
        f"reduce bucket of {cfg.reduce_bucket_size:,} elements for the whole run",
    ]
    if job.parallel.offload is Offload.NONE and sub_groups:
        # stage3.py `initialize_optimizer_states`: a zeroed fp32 buffer as large as the
        # largest sub-group's parameters whole (`ds_numel`), freed once the states exist.
        start_up = _blk(
            min(sub_groups[0] * n, sum(t.elements * t.count for t in model.trainable)) * FP32_BYTES
        )
        notes.append(
            f"not a phase here: at start-up DeepSpeed briefly allocates a {start_up / GIB:.2f} "
            "GiB fp32 buffer for the optimizer's first sub-group (initialize_optimizer_states)"
        )
    if job.dtype is not DType.FP32 and job.method is not Method.FULL:
        notes.append(f"DeepSpeed casts every floating parameter, adapters included, to {job.dtype}")
    return notes


def _stage3_holding(model: Stage3Model, cfg: ZeroSettings, job: _Job) -> _Stage3Holding:
    """A ZeRO-3 rank's shards, master weights, optimizer state and gathered parameters, before
    any offload."""
    n = job.parallel.gpus
    itemsize = model.itemsize
    threshold = cfg.persistence_threshold
    train_shard = _shard_elements(model.trainable, n)
    sub_groups = [
        min(ZERO3_SUB_GROUP_SIZE, train_shard - i)
        for i in range(0, train_shard, ZERO3_SUB_GROUP_SIZE)
    ]
    state_parts = [_optimizer_state(_fp32_partitions([s]), job.optim) for s in sub_groups]
    master = sum(_blk(s * FP32_BYTES) for s in sub_groups)
    turn, layers_peak = gathered_elements(
        model.modules, threshold, cfg.prefetch_bucket_size, cfg.max_live_parameters
    )
    gathered_turn = _blk(turn * itemsize)
    notes = _stage3_notes(n, job, cfg, model, sub_groups, gathered_turn)
    check = _blk(train_shard * BOOL_BYTES) if job.dtype is not DType.FP32 else 0
    frozen_shard = _shard_elements(model.frozen, n)
    return _Stage3Holding(
        frozen=_blk(frozen_shard * itemsize) + _persistent_bytes(model.frozen, threshold, itemsize),
        trainable=_blk(train_shard * itemsize)
        + _persistent_bytes(model.trainable, threshold, itemsize),
        state=master + sum(s for s, _, _ in state_parts),
        outside=sum(o for _, o, _ in state_parts),
        scratch=_step_scratch(sub_groups, [t for _, _, t in state_parts], itemsize, check),
        grad_buffer=_blk(train_shard * itemsize),
        gathered_turn=gathered_turn,
        gathered_layers=_blk(layers_peak * itemsize),
        host=0,
        notes=notes,
    )


def _stage3_offload_optimizer(held: _Stage3Holding, model: Stage3Model, n: int) -> None:
    """stage3.py with offload_optimizer: the fp32 shards, their fp32 gradients, the gradient
    partition buffer and the optimizer state in pinned host memory; the step runs there."""
    train_shard = _shard_elements(model.trainable, n)
    held.host += held.state + held.outside + _blk(train_shard * FP32_BYTES) + held.grad_buffer
    held.state = held.outside = held.scratch = held.grad_buffer = 0
    held.notes.append(
        "optimizer offloaded to CPU: fp32 master weights, gradients and optimizer state in "
        "pinned host memory"
    )


def _stage3_offload_params(
    held: _Stage3Holding, model: Stage3Model, n: int, threshold: int
) -> None:
    """partition_parameters.py with offload_param: the shards live in pinned host memory; the
    GPU holds the persistent parameters and what is gathered."""
    itemsize = model.itemsize
    frozen_shard = _shard_elements(model.frozen, n)
    train_shard = _shard_elements(model.trainable, n)
    held.host += _blk(frozen_shard * itemsize) + _blk(train_shard * itemsize)
    held.frozen = _persistent_bytes(model.frozen, threshold, itemsize)
    held.trainable = _persistent_bytes(model.trainable, threshold, itemsize)
    # partition_parameters.py `all_gather_coalesced`, one parameter: its host shard is copied
    # to the GPU (`param_ds_tensor.to(device)`) as the all-gather's input, held by the
    # collective until the gathered buffer is waited on: a shard beside the whole parameter
    # while it is gathered. As the forward ends that is the LM head (the largest), inside
    # backward a layer's largest.
    largest_gathered = max((e for m in model.modules for e in m if e > threshold), default=0)
    shard_copy = _blk(_cdiv(largest_gathered, n) * itemsize)
    held.gathered_turn += shard_copy
    if model.layer_largest > threshold:
        held.gathered_layers += _blk(_cdiv(model.layer_largest, n) * itemsize)
    held.notes.append(
        "parameters offloaded to CPU: only gathered ones on the GPU, each gathered from a "
        f"copy of its host shard (up to {shard_copy / GIB:.2f} GiB beside the gathered "
        "parameter)"
    )


def stage3_rank(model: Stage3Model, cfg: ZeroSettings, job: _Job) -> ZeroRank:
    """One rank of ZeRO-3 holding `model` with the settings `cfg`."""
    par = job.parallel
    n = par.gpus
    itemsize = model.itemsize
    held = _stage3_holding(model, cfg, job)
    train_tensors = model.trainable
    bucket = _blk(cfg.reduce_bucket_size * itemsize) if cfg.contiguous_gradients else 0
    # Reducing: the newest gradient (the largest trainable parameter's, whole) and the flat
    # copy `reduce_scatter_coalesced` makes of the gradients a bucket holds: no more than the
    # bucket, and no more than every trainable parameter's (a LoRA job's fill a small part).
    largest = max((t.elements for t in train_tensors), default=0)
    filled = min(cfg.reduce_bucket_size, sum(t.elements * t.count for t in train_tensors))
    reducing = _blk(largest * itemsize) + _blk(filled * itemsize)
    if par.offload is not Offload.NONE:
        _stage3_offload_optimizer(held, model, n)
    if par.offload is Offload.OPTIMIZER_AND_PARAMS:
        _stage3_offload_params(held, model, n, cfg.persistence_threshold)
    forward = bucket + held.gathered_turn
    if not job.accumulating:
        # The gradient partition buffer exists from start-up, the forward included; the step
        # counts gradients at the forward's end only when accumulating, so it goes here.
        forward += held.grad_buffer
        held.notes.append(
            "the gradient partition buffer exists from start-up: at the forward's end it is "
            "counted with the communication buffers"
        )
    return ZeroRank(
        frozen=held.frozen,
        trainable=held.trainable,
        gradients=held.grad_buffer,
        head_gradients=held.grad_buffer,
        embed_gradients=0,
        optimizer_state=held.state,
        state_outside=held.outside,
        optimizer_temporaries=held.scratch,
        comm_forward=forward,
        comm_backward=bucket + max(held.gathered_turn, held.gathered_layers) + reducing,
        comm_step=bucket,
        host=held.host,
        assumptions=tuple(held.notes),
    )
