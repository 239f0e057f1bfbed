"""The estimate of an encoder's sequence-classification step (BERT).

The step is replayed op by op (`service.core.schedule.encoder`): the allocated level and its
breakdown come from the live tensors in each phase window, the reserved level from the same
events through the caching allocator model, the device level as for decoders.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from service.core import result
from service.core.allocator import AllocatorConfig, CachingAllocator
from service.core.arch import Linear, ModelArch
from service.core.cold import starting_cold_work
from service.core.device import CUBLASLT_WORKSPACE, cublas_workspace
from service.core.errors import InvalidSpecError
from service.core.estimator.answer import estimate_from, job_levels
from service.core.estimator.compiled import compile_notes
from service.core.estimator.ledger import _blk
from service.core.estimator.step import PHASES
from service.core.estimator.weights import adapted_linears
from service.core.libs.optimizers import OPTIMIZERS
from service.core.libs.torch_kernels import FLASH_MAX_HEAD_DIM
from service.core.overhead import AboveAllocated
from service.core.schedule import HALF_BYTES, Kernel, LinearShape, StepShape
from service.core.schedule.encoder import RELABEL, EncoderShape, encoder_events
from service.core.schedule.shapes import model_sizes
from service.core.spec import ResolvedSpec, TrainingSpec, resolve
from service.core.spec.choices import AttnImpl, Framework, Method, Optim, SdpaKernel
from service.core.spec.lora import ALL_LINEAR
from service.core.spec.parallel import Strategy
from service.core.stack import check_stack, stack_note
from service.core.units import DTYPE_BYTES, FP32_BYTES, INT64_BYTES

# The transformers class each encoder model type is run as.
_TASK_MODELS = {"bert": "BertForSequenceClassification"}


def check_encoder_spec(arch: ModelArch, spec: TrainingSpec) -> ResolvedSpec:
    """The spec resolved for an encoder, or InvalidSpecError naming what it cannot run."""
    if spec.method is Method.QLORA:
        raise InvalidSpecError(
            "method", f"qlora is not modelled for encoder models ({arch.model_type}): use lora"
        )
    if spec.parallel.gpus != 1 and spec.parallel.strategy is not Strategy.DDP:
        raise InvalidSpecError(
            "parallel.strategy",
            f"encoder models ({arch.model_type}) are modelled on one GPU or under DDP",
        )
    if spec.framework is not Framework.HF:
        raise InvalidSpecError(
            "framework", f"encoder models ({arch.model_type}) are modelled with HF Trainer"
        )
    if spec.loss is not None:
        raise InvalidSpecError(
            "loss",
            "an encoder's sequence classifier takes cross-entropy over num_labels; the loss "
            "options are for causal LMs",
        )
    if spec.seq_len > arch.max_position_embeddings:
        raise InvalidSpecError(
            "seq_len",
            f"{spec.seq_len} is longer than the model's position table "
            f"(max_position_embeddings {arch.max_position_embeddings})",
        )
    if spec.lora is not None and spec.lora.modules_to_save:
        raise InvalidSpecError(
            "lora.modules_to_save",
            "an encoder's classifier is trained whole by PEFT's sequence-classification task; "
            "embed_tokens and lm_head do not exist in it",
        )
    _kernel(arch, spec)
    check_stack(spec.stack, arch.is_moe, encoder=True)
    return resolve(spec)


def _kernel(arch: ModelArch, spec: TrainingSpec) -> Kernel:
    """The attention computation CUDA runs (service/trace/kernels.py choose_sdpa_kernel: no
    mask, so flash for half precision, mem-efficient for fp32)."""
    half = spec.autocast or DTYPE_BYTES[spec.dtype] == HALF_BYTES
    if spec.attn_implementation is AttnImpl.EAGER or not spec.stack.has_sdpa:
        return Kernel.EAGER
    if spec.attn_implementation is AttnImpl.FLASH_ATTENTION_2:
        return Kernel.FLASH
    kernel = spec.sdpa_kernel
    if kernel is SdpaKernel.MATH:
        raise InvalidSpecError(
            "sdpa_kernel", "the math kernel with attention dropout is not modelled for encoders"
        )
    flash_ok = half and arch.head_dim <= FLASH_MAX_HEAD_DIM
    if kernel is SdpaKernel.FLASH:
        if not flash_ok:
            raise InvalidSpecError("sdpa_kernel", "flash needs fp16/bf16 and head_dim <= 256")
        return Kernel.FLASH
    if kernel is SdpaKernel.EFFICIENT or not flash_ok:
        return Kernel.EFFICIENT
    return Kernel.FLASH


def num_labels(arch: ModelArch, spec: TrainingSpec) -> int:
    """The classifier's classes: the request's, else the config's."""
    return spec.num_labels if spec.num_labels is not None else arch.num_labels


@dataclass(frozen=True, slots=True)
class _Tensors:
    """The model's tensors: trainable ones in parameter order (bytes, elements, bytes per
    element), every one
    in creation order with its component."""

    trainable: tuple[tuple[int, int, int], ...]
    created: tuple[tuple[int, result.Component], ...]


def _tensors(arch: ModelArch, rs: ResolvedSpec, adapted: tuple[Linear, ...]) -> _Tensors:
    spec = rs.spec
    md = DTYPE_BYTES[spec.dtype]
    full = spec.method is Method.FULL
    h, labels = arch.hidden_size, num_labels(arch, spec)
    base = result.Component.TRAINABLE_PARAMS if full else result.Component.FROZEN_WEIGHTS
    created: list[tuple[int, result.Component]] = [
        # BertEmbeddings' position_ids and token_type_ids buffers, (1, max_position) int64
        (arch.max_position_embeddings * INT64_BYTES, result.Component.FROZEN_WEIGHTS),
        (arch.max_position_embeddings * INT64_BYTES, result.Component.FROZEN_WEIGHTS),
    ]
    model: list[int] = [
        arch.vocab_size * h,
        arch.max_position_embeddings * h,
        arch.type_vocab_size * h,
        h,
        h,
    ]
    for lin in arch.linears:
        model += [lin.weight_elements, lin.out_features]
        if lin.name in ("attention.output.dense", "output.dense"):
            model += [h, h]  # the LayerNorm after the residual add
    layer = model[5:]
    model = model[:5] + layer * arch.num_hidden_layers + [h * h, h, labels * h, labels]
    created += [(n * md, base) for n in model]
    trainable = [(_blk(n * md), n, md) for n in model] if full else []
    if rs.lora is not None:
        ad = DTYPE_BYTES[rs.adapter_dtype]
        r = rs.lora.r
        adapters = []
        for lin in adapted:
            adapters += [r * lin.in_features, lin.out_features * r]
        adapters *= arch.num_hidden_layers
        if _pooler_adapted(rs):
            adapters += [r * h, h * r]
        created += [(n * ad, result.Component.TRAINABLE_PARAMS) for n in adapters]
        trainable += [(_blk(n * ad), n, ad) for n in adapters]
        # PEFT's SEQ_CLS task: a trained copy of the classifier (ModulesToSaveWrapper)
        head = [labels * h, labels]
        created += [(n * md, result.Component.TRAINABLE_PARAMS) for n in head]
        trainable += [(_blk(n * md), n, md) for n in head]
    return _Tensors(trainable=tuple(trainable), created=tuple(created))


def _pooler_adapted(rs: ResolvedSpec) -> bool:
    """PEFT adapts the pooler's dense too under "all-linear" (every linear but the output
    layer, the classifier) or a target named "dense" (matched as a name suffix)."""
    targets = rs.lora.target_modules if rs.lora is not None else None
    return targets == ALL_LINEAR or (isinstance(targets, tuple) and "dense" in targets)


def _states(optim: Optim, trainable: tuple[tuple[int, int, int], ...]) -> tuple[int, ...]:
    """The optimizer's state tensors in creation order, as its descriptor lays them out (a
    fused AdamW's `step` first, an fp32 scalar on the device); none in the allocator for a
    paged one."""
    opt = OPTIMIZERS[optim]
    if opt.paged:
        return ()
    states: list[int] = []
    for nbytes, elements, _ in trainable:
        if opt.device_step:
            states.append(FP32_BYTES)
        states += opt.state_sizes(nbytes, elements)
    return tuple(states)


def _paged_state(optim: Optim, trainable: tuple[tuple[int, int, int], ...]) -> int:
    """Optimizer state in managed memory, outside the allocator (bitsandbytes' paged ones)."""
    opt = OPTIMIZERS[optim]
    if not opt.paged:
        return 0
    return sum(_blk(n) for nbytes, e, _ in trainable for n in opt.state_sizes(nbytes, e))


def encoder_shape(
    arch: ModelArch, spec: TrainingSpec, compute_capability: str | None = None
) -> EncoderShape:
    """What the encoder's schedule is built from, for `spec` (InvalidSpecError when the spec
    asks for what an encoder is not modelled with)."""
    rs = check_encoder_spec(arch, spec)
    adapted = adapted_linears(arch, rs)
    md = DTYPE_BYTES[spec.dtype]
    full = spec.method is Method.FULL
    names = {lin.name for lin in adapted}
    tensors = _tensors(arch, rs, adapted)
    updater = OPTIMIZERS[spec.optim].updater

    def shape(lin: Linear) -> LinearShape:
        return LinearShape(
            name=lin.name,
            d_in=lin.in_features,
            d_out=lin.out_features,
            adapted=lin.name in names,
            trainable=full,
            weight_bytes=lin.weight_elements * md,
        )

    by_name = {lin.name: shape(lin) for lin in arch.linears}
    lora = rs.lora
    step = StepShape(
        **model_sizes(arch, spec.batch_size, spec.seq_len),
        qkv=(by_name["query"], by_name["key"], by_name["value"]),
        out_proj=by_name["attention.output.dense"],
        mlp_in=(by_name["intermediate.dense"],),
        mlp_out=by_name["output.dense"],
        gated=False,
        intermediate=arch.intermediate_size,
        residual=md,
        compute=md,
        adapter=DTYPE_BYTES[rs.adapter_dtype] if lora else 0,
        rank=lora.r if lora else 0,
        dropout=bool(lora and rs.lora_dropout > 0),
        double_quant=False,
        kernel=_kernel(arch, spec),
        window_mask=False,
        masks=0,
        mask_bytes=0,
        rope_pass_cat=False,
        softcap=False,
        final_softcap=False,
        gemma_norm=False,
        sandwich_norms=False,
        embed_scale=False,
        checkpointing=spec.gradient_checkpointing,
        # HF Trainer's enable_input_require_grads() for a PEFT model under checkpointing
        input_grad=full or spec.gradient_checkpointing,
        norm_trainable=full,
        loss_upcast=True,
        loss_materialised=True,
        head_bytes=md,
        head_trainable=full,
        embed_trainable=full,
        tied=False,
        updater=updater,
        trainable=tuple(n for n, _, _ in tensors.trainable),
        states=_states(spec.optim, tensors.trainable),
        largest_trainable=max((e for _, e, _ in tensors.trainable), default=0),
        workspace=cublas_workspace(compute_capability),
        lt_workspace=CUBLASLT_WORKSPACE,
        autocast=spec.autocast,
        clip=spec.max_grad_norm > 0,
        param_bytes=md,
        accumulation=spec.gradient_accumulation_steps,
        grads_kept=spec.stack.zero_grad_keeps_gradients,
        softmax_saves_input=spec.stack.softmax_saves_input,
    )
    return EncoderShape(
        step=step,
        labels=num_labels(arch, spec),
        positions=arch.max_position_embeddings,
        type_vocab=arch.type_vocab_size,
        hidden_dropout=arch.hidden_dropout > 0,
        attention_dropout=arch.attention_dropout > 0,
        classifier_dropout=arch.classifier_dropout > 0,
        head_trainable=full,
        classifier_trainable=True,
        weights=tensors.created,
        buckets=_ddp_buckets(spec, tensors.trainable) if spec.parallel.gpus > 1 else (),
        grads_in_buckets=spec.parallel.gpus > 1 and spec.parallel.gradient_as_bucket_view,
    )


# torch/nn/parallel/distributed.py: DDP's first bucket holds 1 MiB (_DEFAULT_FIRST_BUCKET_BYTES),
# later ones bucket_cap_mb.
DDP_FIRST_BUCKET_BYTES = 1024 * 1024
MIB_BYTES = 1024 * 1024


def _ddp_buckets(
    spec: TrainingSpec, trainable: tuple[tuple[int, int, int], ...]
) -> tuple[int, ...]:
    """The reducer's flat buckets (torch/csrc/distributed/c10d/reducer.cpp
    compute_bucket_assignment_by_size): parameters in reverse order, a bucket closed once it
    reaches its cap (the first 1 MiB, then bucket_cap_mb), each in the gradients' dtype."""
    buckets: list[int] = []
    current = 0
    cap = DDP_FIRST_BUCKET_BYTES
    for _, elements, itemsize in reversed(trainable):
        current += elements * itemsize
        if current >= cap:
            buckets.append(current)
            current = 0
            cap = spec.parallel.bucket_cap_mb * MIB_BYTES
    if current:
        buckets.append(current)
    return tuple(buckets)


@dataclass(frozen=True, slots=True)
class _Replayed:
    """Each (step, phase) window's allocated peak with its parts, and the reserved peak."""

    windows: dict[tuple[int, result.Phase], tuple[int, tuple[int, ...]]]
    reserved: int


@lru_cache(maxsize=256)
def _replay(shape: EncoderShape, allocator_config: AllocatorConfig) -> _Replayed:
    ev = encoder_events(shape)
    index = {c: i for i, c in enumerate(result.COMPONENT_ORDER)}
    gradients = index[result.Component.GRADIENTS]
    parts = [0] * len(result.COMPONENT_ORDER)
    live: dict[int, tuple[int, int, int]] = {}  # key -> (bytes, component index, handle)
    allocator = CachingAllocator(allocator_config)
    total = 0
    windows: dict[tuple[int, result.Phase], tuple[int, tuple[int, ...]]] = {}
    bounds = [*ev.windows[1:], (0, result.Phase.FORWARD_END, len(ev.events))]
    key_now: tuple[int, result.Phase] | None = None
    best = -1
    next_bound = 0
    for position, (key, nbytes) in enumerate(ev.events):
        while next_bound < len(bounds) and bounds[next_bound][2] <= position:
            step, phase, _ = bounds[next_bound]
            key_now = (step, phase)
            best = windows.get(key_now, (-1, ()))[0]
            next_bound += 1
        if nbytes == RELABEL:
            size, c, handle = live[key]
            parts[c] -= size
            parts[gradients] += size
            live[key] = (size, gradients, handle)
        elif nbytes:
            size = _blk(nbytes)
            c = index[ev.labels[key]]
            live[key] = (size, c, allocator.malloc(nbytes))
            parts[c] += size
            total += size
            if key_now is not None and total > best:
                best = total
                windows[key_now] = (total, tuple(parts))
        else:
            entry = live.pop(key, None)
            if entry is not None:
                size, c, handle = entry
                parts[c] -= size
                total -= size
                allocator.free(handle)
    return _Replayed(windows=windows, reserved=allocator.peak_reserved)


def _phases(
    arch: ModelArch, spec: TrainingSpec, cc: str | None
) -> tuple[EncoderShape, _Replayed, tuple[result.PhasePeak, ...]]:
    starting_cold_work("an encoder's step")  # (not compiled: each estimate runs it)
    shape = encoder_shape(arch, spec, cc)
    replayed = _replay(shape, spec.allocator)
    phases = []
    for step, phase in PHASES:
        allocated, parts = replayed.windows.get(
            (step, phase), (0, (0,) * len(result.COMPONENT_ORDER))
        )
        phases.append(result.PhasePeak(step, phase, allocated, parts))
    return shape, replayed, tuple(phases)


def encoder_estimate(
    arch: ModelArch, spec: TrainingSpec, *, compute_capability: str | None, version: str
) -> result.Estimate:
    """The estimate of an encoder's step: the phase windows' allocated peaks and breakdowns
    from the replay, the reserved peak from the allocator model, the device level above."""
    starting_cold_work("the allocator's replay of an encoder step")
    shape, replayed, phases = _phases(arch, spec, compute_capability)
    peak = max(phases, key=lambda ph: (ph.allocated_bytes, -ph.step))
    rs = resolve(spec)
    over = _levels(arch, spec, shape, peak.allocated_bytes, replayed, compute_capability)
    total = arch.total_params - arch.classifier_params(arch.num_labels)
    total += arch.classifier_params(shape.labels)
    trainable = sum(e for _, e, _ in _tensors(arch, rs, adapted_linears(arch, rs)).trainable)
    assumptions = [
        *rs.assumptions,
        f"sequence classification as transformers' "
        f"{_TASK_MODELS.get(arch.model_type, arch.model_type)} runs it, {shape.labels} labels, "
        "dropout on as in training",
    ]
    if spec.method is not Method.FULL:
        assumptions.append("PEFT's sequence-classification task trains the classifier whole")
    if spec.attn_implementation is not AttnImpl.EAGER and not spec.stack.has_sdpa:
        assumptions.append(
            f"eager attention: torch {spec.stack.torch} has no scaled_dot_product_attention "
            f"(torch 2.0 added it), whatever attn_implementation asks for"
        )
    if spec.parallel.gpus > 1:
        assumptions.append(
            f"DDP over {spec.parallel.gpus} GPUs: every rank holds the whole model, its "
            f"gradients and optimizer state, plus the reducer's gradient buckets "
            f"({spec.parallel.bucket_cap_mb} MB each)"
        )
    return estimate_from(
        phases,
        peak,
        over,
        params=result.ParamCounts(total=total, trainable=trainable),
        assumptions=(*assumptions, *over.assumptions, *compile_notes(spec), stack_note(spec.stack)),
        warnings=(),
        version=version,
    )


def encoder_peak_levels(
    arch: ModelArch, spec: TrainingSpec, *, compute_capability: str | None
) -> result.PeakLevels:
    """`encoder_estimate`'s four levels without the breakdown."""
    shape, replayed, phases = _phases(arch, spec, compute_capability)
    allocated = max(ph.allocated_bytes for ph in phases)
    over = _levels(arch, spec, shape, allocated, replayed, compute_capability)
    return result.PeakLevels(allocated, over.reserved, over.device, over.device_upper)


def _levels(
    arch: ModelArch,
    spec: TrainingSpec,
    shape: EncoderShape,
    allocated: int,
    replayed: _Replayed,
    compute_capability: str | None,
) -> AboveAllocated:
    rs = resolve(spec)
    trainable = _tensors(arch, rs, adapted_linears(arch, rs)).trainable
    fused = shape.step.kernel is Kernel.FLASH
    return job_levels(
        arch,
        spec,
        allocated=allocated,
        reserved=replayed.reserved,
        paged_state=_paged_state(spec.optim, trainable),
        fused_attention=fused,
        compute_capability=compute_capability,
    )
