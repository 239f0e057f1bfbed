"""What an estimate needs that does not depend on batch or sequence length, cached."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import NamedTuple

from service.core.allocator import AllocatorConfig
from service.core.arch import (
    SCORE_OUTPUTS,
    Linear,
    LinearKind,
    MlpKind,
    ModelArch,
    NormKind,
    module_order,
)
from service.core.device import CUBLASLT_WORKSPACE, cublas_workspace
from service.core.estimator.activations import _layer_recipe, kept_past_checkpoints
from service.core.estimator.adapter import (
    ADAPTER_START_LAYER,
    adapter_tensors,
    check_adapter_model,
    is_adapter,
    is_v2,
)
from service.core.estimator.deepseek import deepseek_weights, dense_arch
from service.core.estimator.layer_flow import LayerFlow, layer_flow
from service.core.estimator.layout import RankLayout, whole_layout
from service.core.estimator.ledger import _blk, _Kind
from service.core.estimator.loss import _litgpt_dequant_bytes
from service.core.estimator.prefix import prefix_encoder_width, prefix_tokens
from service.core.estimator.tuners import check_tuner_model, tuner_tensors, virtual_tokens
from service.core.estimator.weights import (
    _lorafa_state,
    _optimizer_state,
    _Params,
    _params,
    adapted_linears,
    expert_adapters,
    loha_tensors,
    lokr_shape,
    vera_projection_sizes,
)
from service.core.reserved import ReservedPlan, norm_params
from service.core.spec import ResolvedSpec, TrainingSpec, resolve
from service.core.spec.choices import AttnImpl, Framework, LossImpl, Method, Optim, SdpaKernel
from service.core.spec.delta import AdaLoraSpec, BoftSpec, LohaSpec, LokrSpec, OftSpec, VeraSpec
from service.core.spec.lora import LoraSpec, QuantSpec, QuantType
from service.core.spec.prompt import IA3Spec, LnTuningSpec, PrefixTuningSpec, PromptTuningSpec
from service.core.units import DTYPE_BYTES, FP32_BYTES, DType

# Gradient accumulation: the reserved level's replay runs at most this many micro-batches per
# optimizer step (the first creates the gradients, later ones add into them in place).
REPLAYED_MICRO_BATCHES = 3


@dataclass(frozen=True, slots=True)
class _Plan:
    """What an estimate needs that depends on the model and settings but not on the batch or
    sequence length; cached, so a scheduler's many calls pay for it once."""

    rs: ResolvedSpec  # resolved with batch_size = seq_len = 1
    adapted: tuple[Linear, ...]
    flow: LayerFlow
    params: _Params
    optimizer: tuple[int, int, int]
    layer: tuple[tuple[int, _Kind, int], ...]
    first_layer: tuple[tuple[int, _Kind, int], ...]
    # a global layer among sliding-window ones (Gemma-3) when the sequence reaches the
    # window, else empty: it takes no mask, so SDPA may pick another kernel for it
    global_layer: tuple[tuple[int, _Kind, int], ...]
    # live at up_proj in a recomputed layer, when that moment is modelled (else empty)
    up_proj_moment: tuple[tuple[int, _Kind, int], ...]
    # a recomputed layer's saved tensors that its attention's backward still finds
    attention_part: tuple[tuple[int, _Kind, int], ...]
    # LitGPT's adapters: the layers between the first layer and the rest that save otherwise
    # (below adapter_start_layer), as (count, recipe); (0, ()) for every other method
    lower_layers: tuple[int, tuple[tuple[int, _Kind, int], ...]]
    dequant: int  # a transient dequantized copy of the largest 4-bit weight (QLoRA)
    # per layer, kept through the step despite checkpointing (`kept_past_checkpoints`)
    kept_past_checkpoints: tuple[tuple[int, _Kind, int], ...]
    lt_workspaces: tuple[int, int]  # cuBLASLt workspaces: the forward thread's, the backward's
    reserved: ReservedPlan  # what the reserved level's allocation schedule needs
    assumptions: tuple[str, ...]  # the resolved spec's, and the plan's own
    traits: _StepTraits  # the step's shape-independent choices (`_step_traits`)
    whole: RankLayout  # the states of a job on one GPU (`layout.whole_layout`)
    # DeepSeek's first `dense_layers` layers (a dense MLP), when the model has MoE layers too:
    # `first_layer` is then the first of them
    dense_layer: tuple[tuple[int, _Kind, int], ...] = ()


@dataclass(frozen=True, slots=True)
class _StepTraits:
    """The choices of `estimator.step._step` that depend on the plan's key alone, made once per
    plan rather than on every estimate."""

    embed_trains: bool  # the embedding takes a gradient (full fine-tuning, modules_to_save)
    head_trains: bool  # the LM head does
    # The recomputed first norm saves the layer's input itself (an fp32 residual stream, or
    # LayerNorm): that storage is the checkpoint.
    shares_input: bool
    # down_proj's in_features when checkpointing's recomputation stops at its saved half copy
    # of its input (an autocast LoRA on down_proj, see `_step`), else 0
    down_stop: int
    qlora_gated_down: bool  # QLoRA on a dense gated MLP: down_proj's backward is a moment
    scores: bool  # attention materialises b x heads x s x s scores
    eager_mask_kinds: int  # eager attention's explicit masks: one per kind of layer
    windowed: bool  # the sequence reaches the sliding window (`_PlanKey.windowed`)
    warnings: tuple[str, ...]  # warnings that hold for every batch and sequence length
    # Liger with PEFT's fp32 LoRA on a dense gated MLP's down_proj (no dropout): the top
    # layer's down_proj is a moment of the step (`step._step`)
    liger_down: bool = False


def _plan_params(
    arch: ModelArch, unit: TrainingSpec, rs: ResolvedSpec, adapted: tuple[Linear, ...], f: LayerFlow
) -> _Params:
    """The model's weights by role, DeepSeek's by their own layout."""
    if arch.is_mla:
        return deepseek_weights(arch, rs)
    return _params(
        arch,
        unit.method,
        unit.dtype,
        rs.lora,
        rs.quantization,
        rs.adapter_dtype,
        adapted,
        f.head_quantized,
        expert_adapters(arch, rs),
        tuner_tensors(arch, rs) + adapter_tensors(arch, rs),
        rs.lokr,
        is_v2(rs),
        rs.oft,
        rs.boft,
    )


def _dequant_bytes(arch: ModelArch, unit: TrainingSpec, rs: ResolvedSpec, f: LayerFlow) -> int:
    """A transient dequantized copy of the largest k-bit weight (0 without a k-bit base)."""
    largest = max(
        (lin for lin in (*arch.linears, *arch.dense_linears) if lin.nn_linear),
        key=lambda lin: lin.in_features * lin.out_features,
    )
    if not unit.kbit_base or (rs.quantization is not None and rs.quantization.type.packed):
        # (a GPTQ, AWQ, HQQ or torchao base's transient depends on the batch: estimator/step.py)
        return 0
    if unit.framework is Framework.LITGPT:
        return _litgpt_dequant_bytes(largest.in_features, largest.out_features, rs)
    if rs.quantization is not None and rs.quantization.type is QuantType.INT8:
        # MatMul8bitLt.backward: state.CB.to(A's dtype, copy=True), scaled in place.
        return _blk(largest.in_features * largest.out_features * f.residual)
    return _blk(largest.in_features * largest.out_features * DTYPE_BYTES[rs.compute_dtype])


def _plan_assumptions(
    arch: ModelArch, unit: TrainingSpec, rs: ResolvedSpec, f: LayerFlow
) -> tuple[str, ...]:
    """The resolved spec's assumptions, and those of the base's format and LitGPT's adapters."""
    assumptions = rs.assumptions
    if rs.quantization is not None and rs.quantization.type.packed:
        assumptions += (
            f"reserved level: the allocation schedule runs the {rs.quantization.type} linears "
            "as plain frozen linears (their dequantization temporaries are in the allocated "
            "peak, not in the allocator's replay)",
        )
    if rs.quantization is not None and rs.quantization.type is QuantType.INT8:
        assumptions += (
            "LLM.int8 base: no input column above bitsandbytes' outlier threshold (6.0); each "
            "one keeps a column of the layer's input more for backward",
        )
    if f.zero_pad_width and arch.fused_qkv_linear:
        assumptions += (
            "LitGPT adapts the query and value parts of the fused qkv projection "
            "(finetune/lora.py's lora_query and lora_value defaults)",
        )
    if is_adapter(rs):
        assumptions += (
            f"{unit.method.value} is modelled from LitGPT's lit_gpt/adapter*.py (prompt "
            f"length 10 from layer {ADAPTER_START_LAYER}, bf16-true parameters), not traced",
        )
    return assumptions


class _Recipes(NamedTuple):
    """The saved tensors of each kind of layer (and layer moment), by `_Plan`'s names."""

    dense_layer: tuple[tuple[int, _Kind, int], ...]
    layer: tuple[tuple[int, _Kind, int], ...]
    first_layer: tuple[tuple[int, _Kind, int], ...]
    lower_layers: tuple[int, tuple[tuple[int, _Kind, int], ...]]
    global_layer: tuple[tuple[int, _Kind, int], ...]
    up_proj_moment: tuple[tuple[int, _Kind, int], ...]
    attention_part: tuple[tuple[int, _Kind, int], ...]


def _recipes(
    arch: ModelArch, key: _PlanKey, unit: TrainingSpec, rs: ResolvedSpec, f: LayerFlow
) -> _Recipes:
    attn, kernel = unit.attn_implementation, unit.sdpa_kernel
    single, windowed = key.single_sequence, key.windowed
    lower = replace(f, adapter_prompt=0)
    first_arch = arch
    dense_layer: tuple[tuple[int, _Kind, int], ...] = ()
    if arch.dense_layers:
        first_arch = dense_arch(arch)
        dense_layer = _layer_recipe(first_arch, f, attn, kernel, True, single=single)
    layer = _layer_recipe(arch, f, attn, kernel, True, windowed=windowed, single=single)
    first_flow = lower if is_v2(rs) else f
    first_layer = _layer_recipe(
        first_arch, first_flow, attn, kernel, False, windowed=windowed, single=single
    )
    lower_layers = _lower_layers(arch, rs, lower, attn, kernel, single)
    global_layer = (
        _layer_recipe(arch, f, attn, kernel, True, windowed=False, single=single)
        if arch.global_layers and windowed
        else ()
    )
    up_proj_moment = (
        _layer_recipe(arch, f, attn, kernel, True, True, windowed=windowed, single=single)
        if (unit.method in (Method.LORA, Method.LORA_FA) or f.packed)
        and arch.mlp is MlpKind.GATED
        and not arch.is_moe
        else ()
    )
    attention_part = _layer_recipe(
        arch, f, attn, kernel, True, windowed=windowed, until_attention=True, single=single
    )
    return _Recipes(
        dense_layer, layer, first_layer, lower_layers, global_layer, up_proj_moment, attention_part
    )


@lru_cache(maxsize=4096)
def _plan(arch: ModelArch, key: _PlanKey) -> _Plan:
    unit = key.unit_spec()
    rs = resolve(unit)
    check_tuner_model(arch, rs)
    check_adapter_model(arch, rs)
    adapted = adapted_linears(arch, rs)
    f = layer_flow(arch, rs, adapted)
    p = _plan_params(arch, unit, rs, adapted, f)
    dequant = _dequant_bytes(arch, unit, rs, f)
    if unit.method is Method.LORA_FA:
        optimizer = _lorafa_state(p)
    else:
        optimizer = _optimizer_state(p, unit.optim)
    recipes = _recipes(arch, key, unit, rs, f)
    return _Plan(
        rs=rs,
        adapted=adapted,
        flow=f,
        params=p,
        optimizer=optimizer,
        whole=whole_layout(p, optimizer),
        dequant=dequant,
        kept_past_checkpoints=kept_past_checkpoints(arch, f),
        lt_workspaces=_lt_workspaces(arch, unit),
        reserved=_reserved_plan(arch, rs, f, p, key.gradient_checkpointing),
        assumptions=_plan_assumptions(arch, unit, rs, f),
        traits=_step_traits(arch, key, rs, f),
        **recipes._asdict(),
    )


def _lower_layers(
    arch: ModelArch,
    rs: ResolvedSpec,
    lower: LayerFlow,
    attn: AttnImpl,
    kernel: SdpaKernel,
    single: bool,
) -> tuple[int, tuple[tuple[int, _Kind, int], ...]]:
    """LitGPT's adapters below adapter_start_layer: LLaMA-Adapter trains nothing there and
    nothing before (those layers record nothing; the first layer that does is the first with
    a prompt, whose input takes no gradient); v2's layers there save their scale/bias
    products without a prompt, the first of them with an input that takes no gradient."""
    if not is_adapter(rs):
        return 0, ()
    start = min(ADAPTER_START_LAYER, arch.num_hidden_layers)
    if not is_v2(rs):
        return start, ()
    recipe = _layer_recipe(arch, lower, attn, kernel, True, single=single)
    return max(start - 1, 0), recipe


def _step_traits(arch: ModelArch, key: _PlanKey, rs: ResolvedSpec, f: LayerFlow) -> _StepTraits:
    saved = rs.lora.modules_to_save if rs.lora is not None else ()
    full = key.method is Method.FULL
    down = next((lin for lin in arch.linears if lin.kind is LinearKind.MLP_OUT), None)
    down_stop = (
        down.in_features
        if key.gradient_checkpointing
        and f.autocast
        and down is not None
        and down.name in f.lora_targets
        and not f.quantized
        and f.adapter != f.norm_out
        and not arch.is_moe
        else 0
    )
    warnings: list[str] = []
    if key.unit_spec().kbit_base and key.framework is Framework.LITGPT:
        warnings.append(
            "LitGPT with bitsandbytes <= 0.41 keeps each 4-bit layer's input until the next "
            "forward pass: a later iteration as long as the first can peak above this estimate"
        )
    return _StepTraits(
        embed_trains=full or "embed_tokens" in saved,
        # a reward model's score trains whole, or as PEFT's SEQ_CLS copy of it
        head_trains=full or "lm_head" in saved or arch.score_head,
        shares_input=(arch.norm is NormKind.LAYER and not f.autocast) or f.residual == FP32_BYTES,
        down_stop=down_stop,
        qlora_gated_down=key.method is Method.QLORA
        and arch.mlp is MlpKind.GATED
        and not arch.is_moe,
        scores=_materialises_scores(arch, key, f),
        eager_mask_kinds=2 if arch.model_type in ("gemma2", "gemma3_text") else 1,
        windowed=key.windowed,
        warnings=tuple(warnings),
        liger_down=f.liger
        and key.method is Method.LORA
        and arch.mlp is MlpKind.GATED
        and not arch.is_moe
        and not f.dropout
        and f.adapter != f.norm_out
        and down is not None
        and down.name in f.lora_targets,
    )


def _materialises_scores(arch: ModelArch, key: _PlanKey, f: LayerFlow) -> bool:
    """Whether attention builds b x heads x s x s scores (eager attention, SDPA's math
    kernel)."""
    if key.attn_implementation is AttnImpl.EAGER:
        return True
    if key.attn_implementation is not AttnImpl.SDPA:
        return False
    if key.sdpa_kernel is SdpaKernel.MATH or arch.kv_broadcast:
        return True
    if key.sdpa_kernel is not SdpaKernel.AUTO or f.attn != FP32_BYTES:
        return False
    return arch.num_key_value_heads < arch.num_attention_heads and not key.windowed


def _lt_workspaces(arch: ModelArch, spec: TrainingSpec) -> tuple[int, int]:
    """cuBLASLt workspaces in the allocator: one once a linear with a bias runs through addmm
    (not bitsandbytes' 4-bit path) on the Python thread, one more when checkpointing reruns
    such a linear on the autograd thread."""
    biased = any(lin.bias for lin in arch.linears if not lin.expert)
    # prefix tuning's projection MLP: two linears with biases
    biased = biased or bool(spec.prefix_tuning and spec.prefix_tuning.prefix_projection)
    lt = _blk(CUBLASLT_WORKSPACE) if biased and not spec.kbit_base else 0
    return lt, lt if spec.gradient_checkpointing else 0


def _workspaces(plan: _Plan, compute_capability: str | None) -> tuple[int, int]:
    """cuBLAS(Lt) workspace bytes with the forward thread's handle alone, and with the
    autograd thread's too (each handle takes one at its first GEMM)."""
    workspace = _blk(cublas_workspace(compute_capability))
    forward_lt, backward_lt = plan.lt_workspaces
    return workspace + forward_lt, 2 * workspace + forward_lt + backward_lt


def _model_order(
    arch: ModelArch, rs: ResolvedSpec, f: LayerFlow, adapted: tuple[Linear, ...]
) -> list[tuple[int, int]]:
    """The trainable tensors (bytes, elements) in model.parameters() order, the order an
    optimizer creates their state in: the embedding, then layer by layer each linear's weight
    and bias (or its adapters' A and B) and the layer's norms, the final norm, the LM head."""
    spec = rs.spec
    full = spec.method is Method.FULL
    md = DTYPE_BYTES[spec.dtype]
    quant = rs.quantization
    prep = spec.method is Method.QLORA and quant is not None and quant.prepare_kbit
    other = FP32_BYTES if prep else md
    saved = set(rs.lora.modules_to_save) if rs.lora else set()
    h, v = arch.hidden_size, arch.vocab_size

    def tensor(count: int, itemsize: int) -> tuple[int, int]:
        return _blk(count * itemsize), count

    out: list[tuple[int, int]] = []
    if full or "embed_tokens" in saved:
        out.append(tensor(v * h, other))
    layer: list[tuple[int, int]] = []
    # (transformers 4's looped experts one by one; `adapted` holds them stacked, by name)
    names = {lin.name for lin in adapted}
    adapted = tuple(lin for lin in module_order(arch) if lin.name in names)
    for lin in module_order(arch):
        if full:
            layer.append(tensor(lin.weight_elements, md))
            if lin.bias:
                layer.append(tensor(lin.out_features * lin.count, md))
        elif lin in adapted and f.lokr is not None:
            shape = lokr_shape(lin, f.r, f.lokr.decompose_both, f.lokr.decompose_factor)
            layer += [tensor(rows * cols, FP32_BYTES) for rows, cols in shape.tensors(f.r)]
        elif lin in adapted and f.loha:
            layer += [tensor(rows * cols, FP32_BYTES) for rows, cols in loha_tensors(lin, f.r)]
        elif lin in adapted and f.oft is not None:
            blocks, size = f.oft.blocks(lin.in_features)
            layer.append(tensor(blocks * size * (size - 1) // 2, FP32_BYTES))
        elif lin in adapted and f.boft is not None:
            factors, blocks, size = f.boft.blocks(lin.in_features)
            layer.append(tensor(factors * blocks * size * size, FP32_BYTES))  # boft_R
            layer.append(tensor(lin.out_features * lin.count, FP32_BYTES))  # boft_s
        elif lin in adapted and f.vera:
            layer.append(tensor(lin.out_features * lin.count, FP32_BYTES))  # vera_lambda_b
            layer.append(tensor(f.r, FP32_BYTES))  # vera_lambda_d
        elif lin in adapted:
            if not f.frozen_a:
                layer.append(tensor(f.r * lin.in_features, f.adapter))
            layer.append(tensor(lin.out_features * f.r, f.adapter))
            if f.dora:  # PEFT registers lora_magnitude_vector after lora_A and lora_B
                layer.append(tensor(lin.out_features, f.adapter))
            if f.adalora:  # AdaLoRA's lora_E and ranknum, registered after lora_A and lora_B
                layer += [tensor(f.r, f.adapter), tensor(1, FP32_BYTES)]
    if full:
        norm_tensors = arch.norms_per_layer * norm_params(arch)
        layer += [tensor(h, other)] * norm_tensors
        if arch.qk_norm:
            layer += [tensor(arch.head_dim, other)] * 2
    out += layer * arch.num_hidden_layers
    if arch.score_head:
        if full:
            out += [tensor(h, other)] * norm_params(arch)
        out.append(tensor(SCORE_OUTPUTS * h, other))
    elif full:
        out += [tensor(h, other)] * norm_params(arch)
        if not arch.tie_word_embeddings:
            out.append(tensor(v * h, other))
            if arch.lm_head_bias:
                out.append(tensor(v, other))
    elif "lm_head" in saved and not arch.tie_word_embeddings:
        out.append(tensor(v * h, other))
    return out


def _lokr_factors(
    adapted: tuple[Linear, ...], f: LayerFlow
) -> tuple[tuple[str, tuple[tuple[tuple[int, int], ...], ...]], ...]:
    """LoKr's factors of each adapted linear (`weights.LokrShape.tensors`), w1's then w2's."""
    if f.lokr is None:
        return ()
    out = []
    for lin in adapted:
        shape = lokr_shape(lin, f.r, f.lokr.decompose_both, f.lokr.decompose_factor)
        tensors = shape.tensors(f.r)
        split = 1 if shape.w1_whole else 2
        out.append((lin.name, (tensors[:split], tensors[split:])))
    return tuple(out)


def _reserved_plan(
    arch: ModelArch, rs: ResolvedSpec, f: LayerFlow, p: _Params, checkpointing: bool
) -> ReservedPlan:
    spec = rs.spec
    lora = rs.lora
    quant = rs.quantization
    prep = spec.method is Method.QLORA and quant is not None and quant.prepare_kbit
    sizes = []
    elements = []
    for t in p.tensors:
        sizes += [_blk(t.elements * t.itemsize)] * t.count
        elements += [t.elements] * t.count
    ordered = _model_order(arch, rs, f, adapted_linears(arch, rs))
    if sorted(ordered) == sorted(zip(sizes, elements, strict=True)):
        sizes = [n for n, _ in ordered]
        elements = [e for _, e in ordered]
    saved = set(lora.modules_to_save) if lora else set()
    return ReservedPlan(
        arch=arch,
        method=spec.method,
        dtype_bytes=DTYPE_BYTES[spec.dtype],
        residual=f.residual,
        compute=DTYPE_BYTES[rs.compute_dtype],
        fp16=spec.dtype is DType.FP16,
        adapter=f.adapter if lora or f.ia3_out or f.ia3_in else 0,
        rank=lora.r if lora else 0,
        dropout=f.dropout,
        adapted=f.lora_targets,
        quant_type=quant.type if quant else None,
        double_quant=bool(quant and quant.double_quant),
        attn=f.attn,
        attn_implementation=spec.attn_implementation,
        sdpa_kernel=spec.sdpa_kernel,
        loss=rs.loss,
        head_bytes=FP32_BYTES if prep else DTYPE_BYTES[spec.dtype],
        head_trainable=spec.method is Method.FULL or "lm_head" in saved or arch.score_head,
        embed_trainable=spec.method is Method.FULL or "embed_tokens" in saved,
        optim=spec.optim,
        trainable=tuple(sizes),
        trainable_elements=tuple(elements),
        checkpointing=checkpointing,
        allocator=spec.allocator,
        autocast=spec.autocast,
        clip=spec.max_grad_norm > 0,
        in_backward=spec.optimizer_in_backward,
        accumulation=spec.gradient_accumulation_steps,
        dora=f.dora,
        ia3_out=f.ia3_out,
        ia3_in=f.ia3_in,
        # (v2 trains the model's own norms, no copies)
        trained_norms=frozenset() if is_v2(rs) else f.trained_norms,
        virtual_tokens=virtual_tokens(spec),
        prefix_tokens=prefix_tokens(spec),
        prefix_encoder=prefix_encoder_width(arch, spec),
        liger=f.liger,
        frozen_a=f.frozen_a,
        vera=f.vera,
        loha=f.loha,
        lokr=_lokr_factors(adapted_linears(arch, rs), f),
        adalora=f.adalora,
        oft=tuple((lin.name, f.oft.blocks(lin.in_features)) for lin in adapted_linears(arch, rs))
        if f.oft is not None
        else (),
        boft=tuple((lin.name, f.boft.blocks(lin.in_features)) for lin in adapted_linears(arch, rs))
        if f.boft is not None
        else (),
        vera_projections=vera_projection_sizes(adapted_linears(arch, rs), lora.r)
        if f.vera and lora is not None
        else (),
    )


class _PlanKey(NamedTuple):
    """The fields a plan depends on (everything but sizes, steps and parallelism)."""

    method: Method
    lora: LoraSpec | None
    quantization: QuantSpec | None
    ia3: IA3Spec | None
    ln_tuning: LnTuningSpec | None
    prompt_tuning: PromptTuningSpec | None
    dtype: DType
    autocast: bool
    optim: Optim
    attn_implementation: AttnImpl
    sdpa_kernel: SdpaKernel
    loss: LossImpl | None
    framework: Framework
    windowed: bool  # the sequence reaches the model's sliding window (an explicit mask)
    gradient_checkpointing: bool
    allocator: AllocatorConfig
    clip: bool  # max_grad_norm > 0
    # micro-batches per step the reserved level's replay runs: the third and later repeat
    # the second's allocations on the allocator state it leaves
    replayed_micro_batches: int
    # one sequence per micro-batch: a strided view of a fused projection reshapes without a
    # copy (eager attention's value)
    single_sequence: bool
    vera: VeraSpec | None = None  # the options of the PEFT methods beside LoRA
    loha: LohaSpec | None = None
    lokr: LokrSpec | None = None
    adalora: AdaLoraSpec | None = None
    oft: OftSpec | None = None
    boft: BoftSpec | None = None
    prefix_tuning: PrefixTuningSpec | None = None
    optimizer_in_backward: bool = False  # torchtune's options (spec/train.py)
    activation_offloading: bool = False
    liger_kernel: bool = False  # HF Trainer's use_liger_kernel (service/core/liger.py)

    @classmethod
    def of(cls, spec: TrainingSpec, arch: ModelArch) -> _PlanKey:
        return cls(
            spec.method,
            spec.lora,
            spec.quantization,
            spec.ia3,
            spec.ln_tuning,
            spec.prompt_tuning,
            spec.dtype,
            spec.autocast,
            spec.optim,
            spec.attn_implementation,
            spec.sdpa_kernel,
            spec.loss,
            spec.framework,
            arch.windowed(spec.seq_len),
            spec.gradient_checkpointing,
            spec.allocator,
            spec.max_grad_norm > 0,
            min(spec.gradient_accumulation_steps, REPLAYED_MICRO_BATCHES),
            spec.batch_size == 1,
            spec.vera,
            spec.loha,
            spec.lokr,
            spec.adalora,
            spec.oft,
            spec.boft,
            spec.prefix_tuning,
            optimizer_in_backward=spec.optimizer_in_backward,
            activation_offloading=spec.activation_offloading,
            liger_kernel=spec.liger_kernel,
        )

    def unit_spec(self) -> TrainingSpec:
        fields = self._asdict()
        del fields["windowed"]
        del fields["single_sequence"]
        clip = fields.pop("clip")
        accumulation = fields.pop("replayed_micro_batches")
        return TrainingSpec(
            batch_size=1,
            seq_len=1,
            max_grad_norm=1.0 if clip else 0.0,
            gradient_accumulation_steps=accumulation,
            **fields,
        )
