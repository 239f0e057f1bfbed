"""The reserved level: the step's allocation schedule replayed through the caching allocator.

`reserved_levels` builds the schedule of a spec (`service.core.schedule`) from the estimator's
plan, replays the model's weights and two training steps through `CachingAllocator`, and returns
the allocator's reserved peak with what it held at the end of each step. The weights' part
depends on the model and method alone and is replayed once per plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from functools import lru_cache
from typing import Any

from service.core.allocator import (
    DEFAULT_ALLOCATOR,
    AllocatorConfig,
    CachingAllocator,
    FrozenState,
)
from service.core.arch import (
    COMPOSITE_TANH_GELU,
    SCORE_OUTPUTS,
    Linear,
    LinearKind,
    MlpKind,
    ModelArch,
    NormKind,
    module_order,
)
from service.core.cold import starting_cold_work
from service.core.device import CUBLASLT_WORKSPACE, cublas_workspace
from service.core.libs.bitsandbytes import nf4_storage
from service.core.libs.optimizers import OPTIMIZERS, Optimizer
from service.core.libs.peft import LORA_FA
from service.core.libs.torch_allocator import block_bytes
from service.core.libs.torch_kernels import FLASH_MAX_HEAD_DIM
from service.core.limits import MAX_GPU_MEMORY_MIB
from service.core.schedule import (
    HALF_BYTES,
    Kernel,
    LinearShape,
    StepShape,
    step_events,
)
from service.core.schedule.shapes import model_sizes
from service.core.spec import AttnImpl, LossImpl, Method, Optim, QuantType, SdpaKernel
from service.core.units import FP32_BYTES, GIB, INT64_BYTES, MIB

# Above this allocated peak a job fits no GPU this service takes (a request's GPU is at most
# MAX_GPU_MEMORY_MIB), whatever the allocator reserves on top: the step is not replayed.
REPLAY_CEILING = MAX_GPU_MEMORY_MIB * MIB


@dataclass(frozen=True, slots=True, kw_only=True)
class ReservedPlan:
    """What the reserved level needs from the estimator's plan (hashable, cached on)."""

    arch: ModelArch
    method: Method
    dtype_bytes: int  # the model's dtype
    residual: int  # bytes per element of the residual stream
    compute: int  # the 4-bit linears' compute dtype
    fp16: bool = False  # the model's dtype is fp16
    adapter: int  # LoRA adapter dtype bytes (0 without LoRA)
    rank: int
    dropout: bool
    adapted: frozenset[str]
    quant_type: QuantType | None
    double_quant: bool
    attn: int  # bytes per element of q, k, v
    attn_implementation: AttnImpl
    sdpa_kernel: SdpaKernel
    loss: LossImpl
    head_bytes: int
    head_trainable: bool
    embed_trainable: bool
    optim: Optim
    trainable: tuple[int, ...]  # trainable tensors' bytes (gradients), parameter order
    trainable_elements: tuple[int, ...]
    checkpointing: bool
    allocator: AllocatorConfig = DEFAULT_ALLOCATOR
    compute_capability: str | None = None
    autocast: bool = False  # HF Trainer's mixed precision
    clip: bool = False  # gradients clipped to max_grad_norm
    in_backward: bool = False  # each gradient stepped and freed as it lands (torchtune)
    accumulation: int = 1  # micro-batches per optimizer step
    # (IA)^3's scaled linears (output, input) and LN tuning's trained norms
    ia3_out: frozenset[str] = frozenset()
    ia3_in: frozenset[str] = frozenset()
    trained_norms: frozenset[str] = frozenset()
    virtual_tokens: int = 0  # prompt tuning's
    # prefix tuning's virtual tokens, and its projection MLP's width (0: none)
    prefix_tokens: int = 0
    prefix_encoder: int = 0
    dora: bool = False  # PEFT's DoRA variant on the adapted linears
    frozen_a: bool = False  # LoRA-FA: lora_A frozen, B trained by PEFT's LoraFAOptimizer
    vera: bool = False  # VeRA's vectors on the adapted linears instead of LoRA's A and B
    vera_projections: tuple[int, ...] = ()  # VeRA's shared vera_A and vera_B, bytes
    loha: bool = False  # LoHa's two low-rank pairs on the adapted linears
    # LoKr on the adapted linears: by linear name, its factors' (rows, cols) per factor (one
    # whole parameter, or a rank-r pair's two)
    lokr: tuple[tuple[str, tuple[tuple[tuple[int, int], ...], ...]], ...] = ()
    # DPO (TRL's DPOTrainer): completion tokens per sequence (-1: not DPO; 0: the whole
    # sequence), the reference forward in the step, and the full fine-tuning reference copy
    dpo_completion: int = -1
    dpo_reference: bool = False
    dpo_reference_copy: bool = False
    # KTO (TRL's KTOTrainer) on the fused-head step: its KL batch's no-grad forwards, and a
    # policy head without is_top1
    kto_kl: bool = False
    dpo_top1: bool = True
    dpo_mean_logits: bool = True  # GRPO's policy head returns no mean logits
    generation: bool = False  # GRPO: model.generate before each step (dpo_completion tokens)
    # ORPO (TRL's ORPOTrainer): bytes per logit of the logits it keeps (0: not ORPO)
    orpo_logits: int = 0
    # AdaLoRA's triplets (A, B, E and the frozen ranknum) on the adapted linears, its
    # orthogonality penalty and its RankAllocator (service/core/schedule/adalora.py)
    adalora: bool = False
    # OFT's blocks on the adapted linears: by linear name, (block count, block size)
    oft: tuple[tuple[str, tuple[int, int]], ...] = ()
    # BOFT's on the adapted linears: by linear name, (factors, block count, block size)
    boft: tuple[tuple[str, tuple[int, int, int]], ...] = ()
    liger: bool = False  # HF Trainer's use_liger_kernel (service/core/liger.py)
    # A plan keys the replay caches on every estimate: its hash is computed once.
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        values = tuple(getattr(self, f.name) for f in fields(self) if f.name != "_hash")
        object.__setattr__(self, "_hash", hash(values))

    def __hash__(self) -> int:
        return self._hash


# Model types whose RoPE concatenates the rotated dimensions with the pass-through ones
# (transformers models/{phi3,glm,gpt_neox}/modeling_*.py apply_rotary_pos_emb).
ROPE_PASS_CAT = frozenset({"phi3", "glm", "gpt_neox"})


def resolve_kernel(plan: ReservedPlan, seq: int) -> tuple[Kernel, bool]:
    """The attention computation and whether an explicit mask exists (a sliding window
    shorter than the sequence makes transformers build one)."""
    arch = plan.arch
    windowed = arch.windowed(seq)
    impl = plan.attn_implementation
    if impl is AttnImpl.EAGER:
        return Kernel.EAGER, True
    if impl is AttnImpl.FLASH_ATTENTION_2:
        return Kernel.FLASH, False
    kernel = plan.sdpa_kernel
    if arch.kv_broadcast:  # one key/value head broadcast: only the math kernel takes it
        return Kernel.MATH, windowed
    if kernel is SdpaKernel.FLASH:
        return Kernel.FLASH, windowed
    if kernel is SdpaKernel.EFFICIENT:
        return Kernel.EFFICIENT, windowed
    if kernel is SdpaKernel.MATH:
        return Kernel.MATH, windowed
    # What CUDA picks (service/trace/kernels.py choose_sdpa_kernel, measured on an H200):
    # half precision without a mask takes flash; fp32 with grouped key/value heads (passed
    # as enable_gqa when there is no mask) takes math; the rest mem-efficient.
    half = plan.attn != FP32_BYTES
    if plan.prefix_tokens:  # prefix tuning's explicit mask over the longer keys
        return Kernel.EFFICIENT, windowed
    if half and not windowed and arch.head_dim <= FLASH_MAX_HEAD_DIM:
        return Kernel.FLASH, False
    gqa = arch.num_key_value_heads < arch.num_attention_heads and not windowed
    if not half and gqa:
        return Kernel.MATH, False
    return Kernel.EFFICIENT, windowed


def _linear_shape(lin: Linear, plan: ReservedPlan) -> LinearShape:
    factors = dict(plan.lokr).get(lin.name, ())
    return LinearShape(
        lokr_factors=tuple(
            0 if len(pair) == 1 else pair[0][0] * pair[1][1] * FP32_BYTES for pair in factors
        ),
        lokr_grads=tuple(
            tuple(rows * cols * FP32_BYTES for rows, cols in pair) for pair in factors
        ),
        name=lin.name,
        d_in=lin.in_features,
        d_out=lin.out_features * lin.count,
        adapted=lin.name in plan.adapted,
        trainable=plan.method is Method.FULL,
        weight_bytes=lin.in_features * lin.out_features * lin.count * plan.dtype_bytes,
        # (a GPTQ, AWQ, HQQ or torchao linear runs as a frozen plain linear in this schedule:
        # its dequantization is not scheduled, estimator/step.py adds it to the allocated peak)
        quantized=plan.quant_type is not None
        and plan.quant_type is not QuantType.INT8
        and not plan.quant_type.packed
        and not lin.expert,
        int8=plan.quant_type is QuantType.INT8 and not lin.expert,
        bias=lin.bias,
        scales_output=lin.name in plan.ia3_out,
        scales_input=lin.name in plan.ia3_in,
        oft_blocks=dict(plan.oft).get(lin.name, (0, 0)),
    )


def _optimizer(optim: Optim, method: Method) -> Optimizer:
    """The optimizer that steps: LoRA-FA's own in place of the AdamW a LoRA-FA job names."""
    return LORA_FA if method is Method.LORA_FA else OPTIMIZERS[optim]


def _states(plan: ReservedPlan, opt: Optimizer) -> tuple[int, ...]:
    """The optimizer's state tensors in the allocator, parameter by parameter (none for a
    paged one; the device `step` scalars, in the small pool, left out)."""
    if opt.paged:
        return ()
    states: list[int] = []
    for nbytes, elements in zip(plan.trainable, plan.trainable_elements, strict=True):
        states += opt.state_sizes(nbytes, elements)
    return tuple(states)


def step_shape(plan: ReservedPlan, batch: int, seq: int) -> StepShape:
    arch = plan.arch
    kernel, windowed = resolve_kernel(plan, seq)
    opt = _optimizer(plan.optim, plan.method)
    return StepShape(
        **model_sizes(arch, batch, seq),
        **_linear_fields(plan),
        residual=plan.residual,
        compute=plan.compute,
        half_is_fp16=plan.fp16,
        adapter=plan.adapter,
        rank=plan.rank,
        dropout=plan.dropout,
        double_quant=plan.double_quant,
        kernel=kernel,
        window_mask=windowed,
        masks=2 if arch.model_type in ("gemma2", "gemma3_text") else 1,
        # eager takes an additive mask in the embeddings' dtype, SDPA a boolean one
        mask_bytes=plan.residual if kernel is Kernel.EAGER else 1,
        # transformers' Phi-3, GLM and GPT-NeoX apply_rotary_pos_emb: cat([rotated, pass])
        rope_pass_cat=arch.model_type in ROPE_PASS_CAT,
        softcap=arch.attn_logit_softcapping is not None and kernel is Kernel.EAGER,
        final_softcap=arch.final_logit_softcapping is not None
        and plan.loss in (LossImpl.HF, LossImpl.PLAIN),
        gemma_norm=arch.model_type.startswith("gemma"),
        sandwich_norms=arch.norms_per_layer == 4,
        qk_norm=arch.qk_norm,
        composite_gelu=arch.hidden_act in COMPOSITE_TANH_GELU,
        embed_scale=arch.model_type.startswith("gemma"),
        checkpointing=plan.checkpointing,
        # prompt tuning's trainable virtual tokens are part of the first layer's input
        input_grad=plan.checkpointing
        or plan.embed_trainable
        or plan.method in (Method.FULL, Method.PROMPT_TUNING),
        norm_trainable=plan.method is Method.FULL,
        trained_norms=plan.trained_norms,
        virtual_tokens=plan.virtual_tokens,
        prefix_tokens=plan.prefix_tokens,
        prefix_width=arch.num_hidden_layers * 2 * arch.kv_dim,
        prefix_encoder=plan.prefix_encoder,
        loss_upcast=plan.loss is LossImpl.HF,
        loss_materialised=plan.loss in (LossImpl.HF, LossImpl.PLAIN),
        head_bytes=HALF_BYTES if plan.autocast else plan.head_bytes,
        head_trainable=plan.head_trainable,
        embed_trainable=plan.embed_trainable,
        tied=arch.tie_word_embeddings and not arch.score_head,
        updater=opt.updater,
        trainable=plan.trainable,
        states=_states(plan, opt),
        largest_trainable=max(plan.trainable_elements, default=0),
        workspace=cublas_workspace(plan.compute_capability),
        autocast=plan.autocast,
        liger=plan.liger,
        liger_norm_in_place=not (plan.liger and arch.model_type == "gemma2"),
        head_weight_copy=arch.vocab_size * arch.hidden_size * HALF_BYTES
        if plan.autocast
        and plan.head_bytes != HALF_BYTES
        and plan.loss in (LossImpl.HF, LossImpl.PLAIN)
        else 0,
        clip=plan.clip,
        in_backward=plan.in_backward,
        **_trainer_fields(plan, batch, seq),
        score_head=arch.score_head,
        param_bytes=plan.dtype_bytes,
        accumulation=plan.accumulation,
        alibi=arch.alibi,
        half_softmax=arch.model_type == "falcon" and kernel is Kernel.EAGER,
    )


def norm_params(arch: ModelArch) -> int:
    """The parameter tensors of one of the model's norms: LayerNorm's weight and bias, an
    RMSNorm's weight."""
    return 2 if arch.norm is NormKind.LAYER else 1


def _linear_fields(plan: ReservedPlan) -> dict[str, Any]:
    """`step_shape`'s linears: attention's, the MLP's, a MoE's shared expert and experts."""
    arch = plan.arch
    linears = [lin for lin in arch.linears if not lin.expert]
    by_kind: dict[LinearKind, list[Linear]] = {}
    for lin in linears:
        by_kind.setdefault(lin.kind, []).append(lin)
    mlp_in = tuple(_linear_shape(lin, plan) for lin in by_kind.get(LinearKind.MLP_IN, []))
    out_kind = by_kind.get(LinearKind.MLP_OUT)
    intermediate = arch.intermediate_size
    if arch.is_moe:
        intermediate = arch.shared_expert_intermediate_size
    if out_kind:
        mlp_out = _linear_shape(out_kind[0], plan)
    else:  # a MoE without a shared expert: nothing dense
        mlp_out = LinearShape(
            name="down_proj", d_in=1, d_out=1, adapted=False, trainable=False, weight_bytes=0
        )
    shared_gate = by_kind.get(LinearKind.SHARED_GATE)
    experts = {lin.kind: lin for lin in arch.linears if lin.expert}
    full = plan.method is Method.FULL
    qkv = by_kind.get(LinearKind.ATTN_QKV, [])
    if arch.is_mla:
        # Multi-head latent attention runs through the q/k/v schedule as three projections
        # (the query's last, kv_a_proj_with_mqa, kv_b_proj; q_a_proj's narrow latent left
        # out): an approximation of the replay, which sets only reserved - allocated; the
        # allocated level is modelled exactly (estimator/deepseek.py). Measured against the
        # reference traces deepseek-*: tests/core/test_references.py.
        qkv = [lin for lin in qkv if lin.name != "q_a_proj"]
    return dict(
        qkv=tuple(_linear_shape(lin, plan) for lin in qkv),
        out_proj=_linear_shape(by_kind[LinearKind.ATTN_OUT][0], plan),
        mlp_in=mlp_in,
        mlp_out=mlp_out,
        gated=arch.mlp is MlpKind.GATED,
        intermediate=intermediate,
        experts=arch.num_experts,
        top_k=arch.num_experts_per_tok,
        expert_intermediate=arch.expert_intermediate_size,
        shared_gate=_linear_shape(shared_gate[0], plan) if shared_gate else None,
        experts_trainable=full and arch.is_moe,
        expert_gate_up_bytes=experts[LinearKind.MLP_IN].weight_elements * plan.dtype_bytes
        if full and LinearKind.MLP_IN in experts
        else 0,
        expert_down_bytes=experts[LinearKind.MLP_OUT].weight_elements * plan.dtype_bytes
        if full and LinearKind.MLP_OUT in experts
        else 0,
        lt_workspace=CUBLASLT_WORKSPACE if any(lin.bias for lin in linears) else 0,
    )


def _trainer_fields(plan: ReservedPlan, batch: int, seq: int) -> dict[str, Any]:
    """`step_shape`'s trainer and PEFT method: DPO, KTO, GRPO and ORPO's, the adapters'."""
    return dict(
        dpo_scored=_dpo_scored(plan, batch, seq),
        dpo_reference=plan.dpo_reference,
        kto_kl=plan.kto_kl,
        dpo_top1=plan.dpo_top1,
        dpo_mean_logits=plan.dpo_mean_logits,
        # GRPO's generation batch: the micro-batch's rows times the steps per generation, its
        # prompts the sequence less the completion
        generation_rows=batch * plan.accumulation if plan.generation else 0,
        generation_prompt=max(1, seq - plan.dpo_completion) if plan.generation else 0,
        generation_tokens=plan.dpo_completion if plan.generation else 0,
        generation_kv_bytes=plan.attn,
        orpo_logits=plan.orpo_logits,
        dora=plan.dora,
        frozen_a=plan.frozen_a,
        vera=plan.vera,
        loha=plan.loha,
        lokr=bool(plan.lokr),
        adalora=plan.adalora,
        oft=bool(plan.oft),
        penalty=_penalty_sizes(plan),
        ranked=_penalty_sizes(plan, with_e=True),
    )


def _dpo_scored(plan: ReservedPlan, rows: int, seq: int) -> int:
    """Positions DPO's fused head scores over `rows` sequences (0 when not DPO)."""
    if plan.dpo_completion < 0:
        return 0
    completion = plan.dpo_completion or seq
    return rows * min(completion, seq - 1)


def _penalty_sizes(plan: ReservedPlan, *, with_e: bool = False) -> tuple[int, ...]:
    """The bytes of every lora_A and lora_B AdaLoRA's orthogonality penalty takes (with
    `with_e` and each lora_E, what its RankAllocator takes), in named_parameters order; empty
    for other methods."""
    if not plan.adalora:
        return ()
    layer: list[int] = []
    for lin in plan.arch.linears:
        if lin.name in plan.adapted and not lin.expert:
            layer.append(plan.rank * lin.in_features * plan.adapter)
            layer.append(lin.out_features * plan.rank * plan.adapter)
            if with_e:
                layer.append(plan.rank * plan.adapter)
    return tuple(layer * plan.arch.num_hidden_layers)


def weight_sizes(plan: ReservedPlan) -> tuple[int, ...]:
    """The model's tensors in the order they are made (module order): embedding, each layer's
    linears (weight, bias, LoRA A and B) and norms, the final norm, the LM head."""
    arch = plan.arch
    md = plan.dtype_bytes
    kbit = plan.quant_type is not None
    other = plan.residual if kbit else md
    sizes: list[int] = [arch.vocab_size * arch.hidden_size * other]
    layer: list[int] = []
    for lin in module_order(arch):  # (transformers 4's looped experts one by one)
        if kbit and lin.nn_linear and plan.quant_type is QuantType.INT8:
            # Int8Params: the int8 weight (CB) and one fp32 scale per output row (SCB)
            layer += [lin.in_features * lin.out_features, lin.out_features * FP32_BYTES]
        elif kbit and lin.nn_linear:
            layer += nf4_storage(lin.in_features * lin.out_features, plan.double_quant)
        else:
            layer.append(lin.weight_elements * md)
        if lin.bias:
            layer.append(lin.out_features * lin.count * other)
        if lin.name in plan.adapted and plan.vera:
            layer.append(lin.out_features * lin.count * FP32_BYTES)  # vera_lambda_b
            layer.append(plan.rank * FP32_BYTES)  # vera_lambda_d
        elif lin.name in plan.adapted and plan.lokr:
            for pair in dict(plan.lokr)[lin.name]:
                layer += [rows * cols * FP32_BYTES for rows, cols in pair]
        elif lin.name in plan.adapted and plan.oft:
            # the rotation's weight, then its int64 upper-triangle indices (rows, cols)
            blocks, size = dict(plan.oft)[lin.name]
            triangle = size * (size - 1) // 2
            layer += [blocks * triangle * FP32_BYTES] + [triangle * INT64_BYTES] * 2
        elif lin.name in plan.adapted and plan.boft:
            # the permutations' fp32 buffer boft_P, then boft_R and boft_s
            factors, blocks, size = dict(plan.boft)[lin.name]
            out = lin.out_features * lin.count
            layer += [factors * lin.in_features**2 * FP32_BYTES]
            layer += [factors * blocks * size * size * FP32_BYTES, out * FP32_BYTES]
        elif lin.name in plan.adapted and plan.loha:
            out = lin.out_features * lin.count
            layer += [out * plan.rank * FP32_BYTES, plan.rank * lin.in_features * FP32_BYTES] * 2
        elif lin.name in plan.adapted:
            layer.append(plan.rank * lin.in_features * plan.adapter)
            layer.append(lin.out_features * plan.rank * plan.adapter)
            if plan.adalora:  # lora_E, then ranknum (one fp32 element)
                layer += [plan.rank * plan.adapter, FP32_BYTES]
        if lin.name in plan.ia3_out:  # (IA)^3's vector
            layer.append(lin.out_features * plan.adapter)
        if lin.name in plan.ia3_in:
            layer.append(lin.in_features * plan.adapter)
    norm_tensors = arch.norms_per_layer * norm_params(arch)
    layer += [arch.hidden_size * other] * norm_tensors
    # LN tuning's trained copies (each after the norm it wraps; RMSNorm layers only)
    layer += [arch.hidden_size * md for key in ("norm1", "norm2") if key in plan.trained_norms]
    if arch.qk_norm:
        layer += [arch.head_dim * other] * 2
    sizes += layer * arch.num_hidden_layers
    sizes += plan.vera_projections
    sizes.append(arch.hidden_size * other)
    if "final" in plan.trained_norms:
        sizes.append(arch.hidden_size * md)
    if arch.score_head:
        # the sequence classifier's score, and PEFT's SEQ_CLS copy of it
        score = SCORE_OUTPUTS * arch.hidden_size * other
        sizes += [score] if plan.method is Method.FULL else [score, score]
    elif not arch.tie_word_embeddings:
        sizes.append(arch.vocab_size * arch.hidden_size * other)
    if plan.head_trainable and plan.method is not Method.FULL and not arch.score_head:
        sizes.append(arch.vocab_size * arch.hidden_size * other)  # modules_to_save copy
    if plan.embed_trainable and plan.method is not Method.FULL:
        sizes.append(arch.vocab_size * arch.hidden_size * other)
    if plan.virtual_tokens:
        # prompt tuning's fp32 PromptEmbedding, registered after the base model
        sizes.append(plan.virtual_tokens * arch.hidden_size * FP32_BYTES)
    if plan.prefix_tokens:
        # prefix tuning's fp32 PrefixEncoder, registered after the base model: the embedding,
        # or with the projection the embedding and the MLP's weights and biases
        width, kv, e = arch.num_hidden_layers * 2 * arch.kv_dim, arch.kv_dim, plan.prefix_encoder
        elements = [plan.prefix_tokens * kv, e * kv, e, width * e, width]
        sizes += [n * FP32_BYTES for n in (elements if e else [plan.prefix_tokens * width])]
    if plan.dpo_reference_copy:
        # DPOTrainer loads the reference model after the policy: the same tensors again
        sizes += sizes
    return tuple(sizes)


@lru_cache(maxsize=256)
def _after_weights(plan: ReservedPlan) -> FrozenState:
    """The allocator once the model is loaded (its blocks are held for good)."""
    starting_cold_work("the allocator's replay of the weights")
    allocator = CachingAllocator(plan.allocator)
    for nbytes in weight_sizes(plan):
        if nbytes > 0:
            allocator.malloc(nbytes)
    return allocator.frozen_state()


@dataclass(frozen=True, slots=True)
class ReservedPeaks:
    """The allocator model's reserved bytes: the peak over two steps, and per step; and the
    peak of the live tensors, each rounded to the allocator's 512 B as the estimator's
    allocated level counts them (not the blocks the allocator hands out, which may keep an
    unsplit remainder)."""

    peak: int
    by_step: tuple[int, ...]
    allocated_peak: int


def reserved_levels(plan: ReservedPlan, batch: int, seq: int) -> ReservedPeaks:
    """Replay the weights and two training steps of `plan` at `batch` x `seq`."""
    allocator = CachingAllocator(plan.allocator)
    allocator.resume(_after_weights(plan))
    events, ends = step_events(step_shape(plan, batch, seq))
    weights = sum(block_bytes(n) for n in weight_sizes(plan) if n > 0)
    return _replay(allocator, events, ends, weights)


def _replay(
    allocator: CachingAllocator,
    events: Sequence[tuple[int, int]],
    ends: Sequence[int],
    held: int = 0,
) -> ReservedPeaks:
    """Replay `events` on `allocator`, which already holds `held` bytes of tensors."""
    live: dict[int, tuple[int, int]] = {}  # key -> (allocator handle, tensor bytes)
    malloc, free = allocator.malloc, allocator.free
    by_step = []
    start = 0
    tensors = peak_tensors = held
    for end in ends:
        for key, nbytes in events[start:end]:
            if nbytes:
                size = block_bytes(nbytes)
                live[key] = (malloc(nbytes), size)
                tensors += size
                peak_tensors = max(peak_tensors, tensors)
            else:
                entry = live.pop(key, None)
                if entry is not None:
                    free(entry[0])
                    tensors -= entry[1]
        by_step.append(allocator.peak_reserved)
        start = end
    return ReservedPeaks(
        peak=allocator.peak_reserved,
        by_step=tuple(by_step),
        allocated_peak=peak_tensors,
    )


@lru_cache(maxsize=4096)
def _replayed_gap(plan: ReservedPlan, batch: int, seq: int) -> int:
    """The replay's reserved peak less its tensors' peak: what the allocator holds beyond
    the tensors, added to the allocated estimate."""
    starting_cold_work("the allocator's replay of a step")
    peaks = reserved_levels(plan, batch, seq)
    return max(0, peaks.peak - peaks.allocated_peak)


def clear_replay_caches() -> None:
    """Forget every replay (benchmarks time the first estimate of a job shape with it)."""
    _replayed_gap.cache_clear()
    _corner_gaps.cache_clear()
    _after_weights.cache_clear()


def _bracket(n: int) -> tuple[int, int]:
    """The powers of two around `n` (equal when `n` is one)."""
    low = 1 << (n.bit_length() - 1)
    return (low, low) if low == n else (low, 2 * low)


def reserved_gap(plan: ReservedPlan, batch: int, seq: int, *, allocated: int) -> tuple[int, str]:
    """reserved - allocated for `batch` x `seq` at an `allocated` peak: the replay's, where
    both are powers of two; between, interpolated (bilinearly in batch and sequence) from the
    replays at the powers of two around them, each replayed once per plan; above
    REPLAY_CEILING, not replayed (`unreplayed_note`). Returns the bytes and a note when
    interpolated or not replayed."""
    if allocated > REPLAY_CEILING:
        return 0, unreplayed_note(allocated)
    b0, b1 = _bracket(batch)
    s0, s1 = _bracket(seq)
    if b0 == b1 and s0 == s1:
        return _replayed_gap(plan, batch, seq), ""
    return reserved_gap_bytes(plan, batch, seq, allocated=allocated), _interpolated_note(
        b0, b1, s0, s1
    )


def unreplayed_note(allocated: int) -> str:
    """What the reserved level is where the step is not replayed (`reserved_gap`)."""
    return (
        f"reserved: not replayed; the allocated peak alone ({allocated / GIB:,.0f} GiB) is over "
        f"the largest GPU memory this service takes ({REPLAY_CEILING / GIB:,.0f} GiB), so the "
        "job fits no GPU: reserved is taken as allocated, its lower bound (the caching "
        "allocator's segments hold every allocated block)"
    )


def reserved_gap_bytes(plan: ReservedPlan, batch: int, seq: int, *, allocated: int) -> int:
    """`reserved_gap`'s bytes alone (what a fit-check's curves read at dozens of shapes)."""
    if allocated > REPLAY_CEILING:
        return 0
    b0 = 1 << (batch.bit_length() - 1)
    s0 = 1 << (seq.bit_length() - 1)
    if b0 == batch and s0 == seq:
        return _replayed_gap(plan, batch, seq)
    b1, wb = (b0, 0.0) if b0 == batch else (2 * b0, (batch - b0) / b0)
    s1, ws = (s0, 0.0) if s0 == seq else (2 * s0, (seq - s0) / s0)
    # the four corners' replays, weighted bilinearly (a corner of weight 0 is not replayed)
    g00, g01, g10, g11 = _corner_gaps(plan, b0, b1, s0, s1)
    gap = 0.0
    weight = (1 - wb) * (1 - ws)
    if weight:
        gap += weight * g00
    weight = (1 - wb) * ws
    if weight:
        gap += weight * g01
    weight = wb * (1 - ws)
    if weight:
        gap += weight * g10
    weight = wb * ws
    if weight:
        gap += weight * g11
    return round(gap)


@lru_cache(maxsize=4096)
def _corner_gaps(
    plan: ReservedPlan, b0: int, b1: int, s0: int, s1: int
) -> tuple[int, int, int, int]:
    """The replays' gaps at the corners (b0, s0), (b0, s1), (b1, s0) and (b1, s1) of a
    bracket, looked up once for every shape inside it; 0 at a corner an exact batch
    (b1 == b0) or sequence (s1 == s0) gives no weight, which is not replayed."""
    return (
        _replayed_gap(plan, b0, s0),
        _replayed_gap(plan, b0, s1) if s1 != s0 else 0,
        _replayed_gap(plan, b1, s0) if b1 != b0 else 0,
        _replayed_gap(plan, b1, s1) if b1 != b0 and s1 != s0 else 0,
    )


@lru_cache(maxsize=256)
def _interpolated_note(b0: int, b1: int, s0: int, s1: int) -> str:
    return (
        f"reserved: the allocator replay interpolated between batch {b0}-{b1} and sequence "
        f"length {s0}-{s1} (replayed exactly at powers of two)"
    )
