"""The step's allocated bytes, phase by phase."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple

from service.core.architecture import ModelArch, NormKind
from service.core.cold import starting_cold_work
from service.core.errors import InvalidSpecError
from service.core.estimator.activations import LayerFlow
from service.core.estimator.adalora import AdaLoraParts, adalora_parts
from service.core.estimator.adapter import norm_product_bytes
from service.core.estimator.deepseek import (
    check_deepseek_spec,
    deepseek_layer_trainable,
    deepseek_rope_bytes,
)
from service.core.estimator.layout import RankLayout
from service.core.estimator.ledger import _blk, _Kind, _recipe_bytes
from service.core.estimator.looped_experts import is_looped, looped_arch, looped_note
from service.core.estimator.loss import _loss_bytes, _LossBytes
from service.core.estimator.model_attention import holds_scores_between_layers, softmax_moment
from service.core.estimator.parallel import rank_layout
from service.core.estimator.plan import _Plan, _plan, _PlanKey, _StepTraits, _workspaces
from service.core.estimator.prefix import prefix_tokens, projection_saved_bytes
from service.core.estimator.train_features import (
    check_offloadable,
    host_pinned_bytes,
    in_backward_gradients,
    resident_layer_inputs,
)
from service.core.estimator.tuners import virtual_tokens
from service.core.liger import liger_refusal
from service.core.quant_formats import dequant_transient
from service.core.result import COMPONENT_ORDER, Component, Phase
from service.core.spec import (
    AttnImpl,
    Framework,
    Method,
    ResolvedSpec,
    SdpaKernel,
    TrainingSpec,
)
from service.core.stack import check_stack
from service.core.units import (
    AUTOCAST_BYTES,
    BOOL_BYTES,
    DTYPE_BYTES,
    FP32_BYTES,
    GIB,
    HALF_BYTES,
    INT64_BYTES,
    DType,
)


def _warnings(arch: ModelArch, spec: TrainingSpec, plan: _Plan) -> list[str]:
    warnings = list(plan.traits.warnings)
    if spec.seq_len > arch.max_position_embeddings:
        warnings.append(
            f"seq_len {spec.seq_len} is longer than the model's max_position_embeddings "
            f"({arch.max_position_embeddings}); quality may suffer without RoPE scaling"
        )
    quant = plan.rs.quantization
    if spec.method is Method.QLORA and arch.is_moe and quant is not None and not is_looped(arch):
        experts = sum(lin.weight_elements for lin in arch.linears if lin.expert)
        moe_layers = arch.num_hidden_layers - arch.dense_layers  # DeepSeek's are dense first
        dtype = "fp32 (kbit preparation casts them)" if quant.prepare_kbit else str(spec.dtype)
        warnings.append(
            f"the routed experts ({experts * moe_layers / 1e9:.2f}B parameters) "
            f"stay unquantized in {dtype}: transformers 5 keeps them as 3-D parameters, which "
            "bitsandbytes does not replace"
        )
    return warnings


class _FixedParts(NamedTuple):
    """The allocated bytes that every phase holds alike, by component."""

    frozen_weights: int
    trainable_params: int
    inputs: int


class _Moment(NamedTuple):
    """The allocated bytes at one moment of a phase, by component, beyond what the phase holds
    throughout (the fixed parts, the workspaces and the optimizer state)."""

    gradients: int
    activations: int
    recompute: int = 0
    logits_loss: int = 0
    backward_temporaries: int = 0
    optimizer_temporaries: int = 0
    communication: int = 0
    reference_model: int = 0  # DPO full fine-tuning's frozen reference copy
    generation_kv_cache: int = 0  # GRPO's generation phase: model.generate's KV cache


# What a phase holds throughout besides the fixed parts, in this order (`_Step.parts`).
_HELD = (Component.WORKSPACES, Component.OPTIMIZER_STATE)
# An RMS norm's backward with its fp32 upcast keeps four fp32 hidden-sized temporaries alive at
# once (div, pow, mul by a scalar, mul: reference trace phi-3-mini-4k-instruct__lora__r16-all-
# linear__b1-s512__ckpt__fsdp-2gpu-full-shard, the input norm's backward in the top layer).
NORM_BACKWARD_FP32_TEMPORARIES = 4
# An estimate keeps a phase's parts as one tuple in COMPONENT_ORDER (`PhasePeak.parts`): the
# fixed parts, the held ones, then a moment's. Checked once, here.
if (*_FixedParts._fields, *_HELD, *_Moment._fields) != COMPONENT_ORDER:
    raise AssertionError("the phase records' fields are not in COMPONENT_ORDER")


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


# Model types whose decoder linears subclass nn.Linear (FalconLinear): transformers 5.24's
# bitsandbytes integration swaps only modules whose type is exactly nn.Linear
# (integrations/bitsandbytes.py replace_with_bnb_linear), so a 4-bit load quantizes none of
# them (reference trace falcon-7b__qlora__*).
_UNQUANTIZED_LINEARS = frozenset({"falcon"})


def _unquantized(arch: ModelArch, spec: TrainingSpec) -> TrainingSpec | None:
    """What a QLoRA spec runs as where the 4-bit swap finds no linear: LoRA on the loaded
    weights, all cast to fp32 by prepare_model_for_kbit_training. None where it does not
    apply."""
    if not (
        spec.method is Method.QLORA
        and spec.framework is Framework.HF
        and arch.model_type in _UNQUANTIZED_LINEARS
    ):
        return None
    prepared = spec.quantization is None or spec.quantization.prepare_kbit
    return replace(
        spec,
        method=Method.LORA,
        quantization=None,
        dtype=DType.FP32 if prepared else spec.dtype,
    )


def _packed_dequant(arch: ModelArch, rs: ResolvedSpec, batch: int, tokens: int) -> int:
    """A GPTQ, AWQ, HQQ or torchao base: the largest transient one quantized linear's matmul
    allocates (quant_formats.dequant_transient), for the largest quantized weight."""
    quant = rs.quantization
    if quant is None or not quant.type.packed:
        return 0
    largest = max(
        (lin for lin in arch.linears if not lin.expert),
        key=lambda lin: lin.in_features * lin.out_features * lin.count,
    )
    nbytes = dequant_transient(
        quant.type.value,
        largest.in_features,
        largest.out_features * largest.count,
        DTYPE_BYTES[rs.spec.dtype],
        batch,
        tokens,
    )
    return _blk(nbytes)


def check_liger(arch: ModelArch, spec: TrainingSpec) -> None:
    """Refuse use_liger_kernel where its patches are not modelled for the model type."""
    if spec.liger_kernel and (refusal := liger_refusal(arch.model_type)):
        raise InvalidSpecError("liger_kernel", refusal)


def _check_modelled(arch: ModelArch, spec: TrainingSpec) -> None:
    """Refuse the settings of a DeepSeek (multi-head latent attention) job that no reference
    trace has checked (`check_deepseek_spec`)."""
    if arch.is_mla or arch.dense_layers:
        check_deepseek_spec(spec)


def _runs_as(arch: ModelArch, spec: TrainingSpec) -> tuple[ModelArch, TrainingSpec, bool, bool]:
    """The checked job as it runs: the architecture (transformers 4's looped experts), the
    spec (a QLoRA job whose 4-bit swap finds no linear, BLOOM's own attention), whether the
    spec was unquantized and whether the attention is the model's own."""
    starting_cold_work("the step's run")
    _check_modelled(arch, spec)
    check_liger(arch, spec)
    arch = looped_arch(arch, spec)
    check_stack(spec.stack, arch.is_moe, model_type=arch.model_type)
    unquantized = _unquantized(arch, spec)
    if unquantized is not None:
        spec = unquantized
    if (
        arch.kv_broadcast
        and spec.attn_implementation is AttnImpl.SDPA
        and spec.sdpa_kernel in (SdpaKernel.FLASH, SdpaKernel.EFFICIENT)
    ):
        raise InvalidSpecError(
            "sdpa_kernel",
            f"{spec.sdpa_kernel.value} cannot run {arch.model_type}'s single key/value head "
            "(passed without enable_gqa, only SDPA's math kernel broadcasts it)",
        )
    own_attention = arch.alibi and spec.attn_implementation is not AttnImpl.EAGER
    if own_attention:
        # transformers 5.24 gives BLOOM no SDPA or flash path (from_pretrained falls back to
        # eager): its attention is its own baddbmm and softmax whatever is requested.
        spec = replace(spec, attn_implementation=AttnImpl.EAGER)
    return arch, spec, unquantized is not None, own_attention


def _notes(
    arch: ModelArch, spec: TrainingSpec, plan: _Plan, unquantized: bool, own_attention: bool
) -> tuple[list[str], list[str]]:
    """The step's assumptions and warnings from the plan and how the job runs."""
    warnings = _warnings(arch, spec, plan)
    assumptions = list(plan.assumptions)
    if own_attention:
        assumptions.append("BLOOM runs its own attention (eager): transformers has no SDPA path")
    if is_looped(arch):
        assumptions.append(looped_note(arch, spec))
    if unquantized:
        warnings.append(
            f"{arch.model_type}: transformers' 4-bit loading quantizes no layer (its linears "
            "subclass nn.Linear); the job runs as LoRA on "
            f"{spec.dtype.value} weights"
        )
    return assumptions, warnings


class _Layers(NamedTuple):
    """The saved bytes of each kind of decoder layer, and what checkpointing keeps of them."""

    per_layer: int
    dense: int  # DeepSeek's first layers run a dense MLP (`per_layer` elsewhere)
    first: int
    globals_: int  # Gemma-3's global layers among sliding-window ones (how many)
    global_layer: int
    top: int  # the top layer, recomputed first under checkpointing
    checkpoint_input: int
    checkpoint: int  # what each checkpointed layer keeps
    stored_checkpoints: int  # every layer's checkpoint, or the few an offloading job keeps


def _layers(arch: ModelArch, spec: TrainingSpec, plan: _Plan, prefix: int) -> _Layers:
    """Each kind of layer's saved bytes at the job's shape."""
    b, s = spec.batch_size, spec.seq_len
    per_layer = _recipe_bytes(plan.layer, b, s, prefix)
    # HF Trainer calls enable_input_require_grads() for PEFT models with checkpointing; without
    # it (and with a frozen embedding) the first layer's input takes no gradient, unless
    # trainable virtual tokens are part of it.
    # DeepSeek's first layers run a dense MLP: the first layer is one of them
    dense_layer = _recipe_bytes(plan.dense_layer, b, s) if plan.dense_layer else per_layer
    first_layer = (
        dense_layer
        if plan.traits.embed_trains or spec.gradient_checkpointing or virtual_tokens(spec)
        else _recipe_bytes(plan.first_layer, b, s, prefix)
    )
    # Gemma-3's global layers among sliding-window ones, where their saved tensors differ
    globals_ = arch.global_layers if plan.global_layer else 0
    global_layer = _recipe_bytes(plan.global_layer, b, s, prefix) if globals_ else per_layer
    # the top layer, recomputed first under checkpointing: global when the period divides L
    L = arch.num_hidden_layers
    top_layer = global_layer if globals_ and L % arch.global_layer_period == 0 else per_layer
    checkpoint_input = _blk(b * s * arch.hidden_size * plan.flow.residual)
    # what each checkpointed layer keeps: its input, and what checkpointing cannot drop
    checkpoint = checkpoint_input + _recipe_bytes(plan.kept_past_checkpoints, b, s, prefix)
    return _Layers(
        per_layer=per_layer,
        dense=dense_layer,
        first=first_layer,
        globals_=globals_,
        global_layer=global_layer,
        top=top_layer,
        checkpoint_input=checkpoint_input,
        checkpoint=checkpoint,
        stored_checkpoints=L * checkpoint,
    )


def _offloaded(
    arch: ModelArch, spec: TrainingSpec, plan: _Plan, layers: _Layers, assumptions: list[str]
) -> tuple[_Layers, int]:
    """torchtune's activation offloading: the few layer inputs the GPU still holds, and the
    pinned host memory of the others (0 without offloading)."""
    if not spec.activation_offloading:
        return layers, 0
    L, h, tokens = arch.num_hidden_layers, arch.hidden_size, spec.batch_size * spec.seq_len
    embed_trains = plan.traits.embed_trains
    check_offloadable(arch.norm is NormKind.RMS)
    kept = resident_layer_inputs(embed_trains)
    stored = layers.stored_checkpoints + (kept - L) * layers.checkpoint_input
    host_pinned = host_pinned_bytes(
        layers=L,
        tokens=tokens,
        hidden=h,
        layer_input_bytes=tokens * h * plan.flow.residual,
        embed_trains=embed_trains,
        norm_trains=spec.method is Method.FULL,
    )
    assumptions.append(
        f"activation offloading: {kept} layer inputs stay on the GPU, "
        f"{host_pinned / GIB:.2f} GiB of pinned host memory"
    )
    return layers._replace(stored_checkpoints=stored), host_pinned


def _model_inputs(spec: TrainingSpec) -> int:
    """input_ids and labels (torch.long); a packed row's position_ids beside them (TRL's
    padding-free collator, estimator/packing.py)."""
    b, s = spec.batch_size, spec.seq_len
    return (3 if spec.packing else 2) * _blk(b * (s - virtual_tokens(spec)) * INT64_BYTES)


def _final_norm_saves(arch: ModelArch, spec: TrainingSpec, plan: _Plan) -> int:
    """What the final norm saves for backward (and the LM head's input where it is kept)."""
    f = plan.flow
    tokens, h = spec.batch_size * spec.seq_len, arch.hidden_size
    final_norm = _blk(tokens * h * FP32_BYTES) + _blk(tokens * FP32_BYTES)
    if f.liger:
        # LigerRMSNorm saves the last layer's output itself and an fp32 rstd per token
        # (`activations._norm_saves`)
        final_norm = _blk(tokens * h * f.residual) + _blk(tokens * FP32_BYTES)
    if "final" in f.trained_norms:
        # LN tuning's copy of the final norm: its weight's product keeps the normed input
        final_norm += _blk(tokens * h * norm_product_bytes(arch, f.adapter_v2, f.residual))
    if arch.norm is NormKind.LAYER and spec.framework is Framework.HF:
        # nn.LayerNorm saves its input (the last layer's output; its fp32 copy under autocast)
        # with its fp32 mean and rstd (reference traces falcon-7b__*, bloom-560m__*).
        saved_input = FP32_BYTES if spec.autocast else f.residual
        final_norm = _blk(tokens * h * saved_input) + 2 * _blk(tokens * FP32_BYTES)
    return final_norm


def _rope_and_alibi(arch: ModelArch, spec: TrainingSpec, residual: int) -> tuple[int, int]:
    """RoPE's cos and sin, (1, s, head_dim) in the residual dtype, computed once per forward
    and saved by every layer's rotation (transformers LlamaRotaryEmbedding); BLOOM's ALiBi
    bias instead."""
    s = spec.seq_len
    rope = 2 * _blk(s * arch.head_dim * residual)
    if arch.is_mla:
        rope = deepseek_rope_bytes(arch, s, residual)
    alibi = 0
    if arch.alibi:
        # BLOOM has no rotary tables; its ALiBi bias, (b * heads, 1, s) in the residual dtype
        # (BloomModel.forward), is every layer's argument: kept with the checkpoints.
        rope = 0
        alibi = _blk(spec.batch_size * arch.num_attention_heads * s * residual)
    return rope, alibi


def _checkpointed_masks(arch: ModelArch, spec: TrainingSpec, plan: _Plan, alibi: int) -> int:
    """Masks that checkpointing keeps as every layer's input until backward ends."""
    if not spec.gradient_checkpointing:
        return 0
    b, s = spec.batch_size, spec.seq_len
    masks = 0
    if plan.traits.windowed and spec.attn_implementation is AttnImpl.SDPA:
        # transformers' boolean sliding-window mask: (1, 1, s, s) expanded to (b, 1, s, s) as
        # a view when nothing is padded (masking_utils.sdpa_mask: the mask functions do not
        # depend on the batch index)
        masks = _blk(s * s * BOOL_BYTES)
    if spec.attn_implementation is AttnImpl.EAGER:
        # Eager attention takes an explicit (b, 1, s, s) causal mask in the embeddings' dtype;
        # Gemma-2 alternates global and sliding-window layers, with a mask for each kind.
        masks = plan.traits.eager_mask_kinds * _blk(b * s * s * plan.flow.residual)
    return masks + alibi


class _Beside(NamedTuple):
    """What the forward saves beside the decoder layers, by what it is."""

    final_norm: int  # the final norm's saves, with everything below it in this record
    rope: int
    masks: int
    embed_norm: int


def _beside_layers(arch: ModelArch, spec: TrainingSpec, plan: _Plan) -> _Beside:
    """What the forward saves beside the decoder layers: the final norm's, the rotary tables,
    checkpointed masks, BLOOM's embedding norm, the LM head's input and PEFT's projections."""
    f, traits = plan.flow, plan.traits
    b, tokens, h = spec.batch_size, spec.batch_size * spec.seq_len, arch.hidden_size
    final_norm = _final_norm_saves(arch, spec, plan)
    rope, alibi = _rope_and_alibi(arch, spec, f.residual)
    final_norm += rope
    embed_norm = 0
    if arch.embedding_norm and (traits.embed_trains or spec.gradient_checkpointing):
        # BLOOM's word_embeddings_layernorm saves the embedding output (its input needs a
        # gradient), with its mean and rstd.
        embed_norm = _blk(tokens * h * f.residual) + 2 * _blk(tokens * FP32_BYTES)
        final_norm += embed_norm
    if (traits.head_trains and not f.liger) or f.head_quantized:
        # lm_head's input: for its weight grad, or kept by a 4-bit head (bitsandbytes 0.41.1
        # MatMul4Bit's ctx.tensors)
        final_norm += _blk(tokens * h * f.residual)
    masks = _checkpointed_masks(arch, spec, plan, alibi)
    final_norm += masks
    final_norm += projection_saved_bytes(arch, spec, b)
    virtual = virtual_tokens(spec)
    if virtual and spec.gradient_checkpointing:
        # prompt tuning: enable_input_require_grads makes the embedded input ids a leaf that
        # takes a gradient; the concatenation's AccumulateGrad keeps it until backward ends
        final_norm += _blk(b * (spec.seq_len - virtual) * h * f.residual)
    return _Beside(final_norm, rope, masks, embed_norm)


def _stack_activations(
    arch: ModelArch,
    spec: TrainingSpec,
    plan: _Plan,
    layers: _Layers,
    final_norm: int,
    assumptions: list[str],
) -> tuple[int, int]:
    """The activations the forward leaves for backward, and the recomputed layer's."""
    if spec.gradient_checkpointing:
        activations = layers.stored_checkpoints + final_norm
        # The recomputed first norm saves the layer's input itself when it needs no fp32 copy
        # (an fp32 residual stream, or LayerNorm): that storage is the checkpoint.
        shared = layers.checkpoint_input if plan.traits.shares_input else 0
        assumptions.append("gradient checkpointing: one layer's input kept, one layer recomputed")
        return activations, layers.top - shared
    L = arch.num_hidden_layers
    # LitGPT's adapters: the layers below adapter_start_layer (`plan._lower_layers`)
    n_low, low_recipe = plan.lower_layers
    low = _recipe_bytes(low_recipe, spec.batch_size, spec.seq_len, prefix_tokens(spec))
    activations = (
        (L - 1 - layers.globals_ - n_low) * layers.per_layer
        + n_low * low
        + layers.globals_ * layers.global_layer
        + layers.first
        + final_norm
    )
    if arch.dense_layers:
        activations += (arch.dense_layers - 1) * (layers.dense - layers.per_layer)
    return activations, 0


def _eager_warning(arch: ModelArch, spec: TrainingSpec, warnings: list[str]) -> None:
    if spec.attn_implementation is AttnImpl.EAGER:
        b, s = spec.batch_size, spec.seq_len
        extra = (FP32_BYTES + HALF_BYTES) * b * arch.num_attention_heads * s * s
        L = arch.num_hidden_layers
        warnings.append(
            f"eager attention stores heads*s^2 scores and probabilities: about "
            f"{extra * (1 if spec.gradient_checkpointing else L) / GIB:.1f} GiB"
        )


@dataclass(frozen=True, slots=True)
class _StepContext:
    """What every moment of the step is computed from: the job, its plan and rank layout, the
    forward's saved bytes and the gradients."""

    arch: ModelArch
    spec: TrainingSpec
    plan: _Plan
    rank: RankLayout
    ada: AdaLoraParts
    layers: _Layers
    beside: _Beside
    loss: _LossBytes
    activations: int  # what the forward leaves for backward
    recompute: int  # the recomputed layer's saved bytes under checkpointing
    ga_grads: int  # gradients accumulated from earlier micro-batches (0 without)
    grad_hidden: int  # the gradient flowing down the stack
    dequant: int  # the largest transient dequantized weight
    host_pinned: int  # pinned host memory of offloaded activations
    assumptions: list[str]
    warnings: list[str]

    @property
    def tokens(self) -> int:
        return self.spec.batch_size * self.spec.seq_len

    @property
    def f(self) -> LayerFlow:
        return self.plan.flow

    @property
    def traits(self) -> _StepTraits:
        return self.plan.traits

    @property
    def ckpt(self) -> bool:
        return self.spec.gradient_checkpointing

    @property
    def held_checkpoints(self) -> int:
        """Every checkpoint with the rotary tables and masks: what a recomputed layer's
        moments hold besides it."""
        return self.layers.stored_checkpoints + self.beside.rope + self.beside.masks

    def recipe(self, recipe: tuple[tuple[int, _Kind, int], ...]) -> int:
        spec = self.spec
        return _recipe_bytes(recipe, spec.batch_size, spec.seq_len, prefix_tokens(spec))

    @property
    def in_flight(self) -> int:
        """The gradients flowing down and a dequantized weight, at every layer's backward."""
        return 2 * self.grad_hidden + self.dequant

    @property
    def tied_head(self) -> bool:
        # (a reward model's score head ties nothing to the embedding)
        return self.arch.tie_word_embeddings and not self.arch.score_head

    @property
    def embed_made(self) -> int:
        rank = self.rank
        return (
            rank.embed_gradients if rank.embed_gradient_made is None else rank.embed_gradient_made
        )

    @property
    def bottom_grads(self) -> int:
        """The gradients alive at the bottom layer's backward."""
        rank = self.rank
        grads = rank.gradients
        bottom = self.ga_grads if self.ga_grads else grads - rank.embed_gradients
        if is_looped(self.arch) and not self.ga_grads:
            # transformers 4's looped experts: the bottom layer's backward peaks as its MoE
            # block's begins, the layer recomputed whole and none of its adapters' gradients
            # made yet; each expert's backward then frees more saved rows than its adapters'
            # gradients take (reference traces *transformers4_48_0*ckpt, peak at the first
            # mul's backward)
            bottom -= (
                grads - rank.head_gradients - rank.embed_gradients
            ) // self.arch.num_hidden_layers
        return bottom

    @property
    def bottom_acts(self) -> int:
        return self.layers.checkpoint if self.ckpt else self.layers.first


def _context(arch: ModelArch, spec: TrainingSpec) -> _StepContext:
    """The checked job's plan, rank layout and saved bytes."""
    arch, spec, unquantized, own_attention = _runs_as(arch, spec)
    plan = _plan(arch, _PlanKey.of(spec, arch))
    assumptions, warnings = _notes(arch, spec, plan, unquantized, own_attention)
    rank = rank_layout(arch, spec, plan)
    assumptions.extend(rank.assumptions)
    ada = adalora_parts(arch, plan.rs)
    layers = _layers(arch, spec, plan, prefix_tokens(spec))
    layers, host_pinned = _offloaded(arch, spec, plan, layers, assumptions)
    beside = _beside_layers(arch, spec, plan)
    loss = _loss_bytes(arch, plan.rs, spec.batch_size, spec.seq_len)
    activations, recompute = _stack_activations(
        arch, spec, plan, layers, beside.final_norm, assumptions
    )
    _eager_warning(arch, spec, warnings)
    tokens = spec.batch_size * spec.seq_len
    if spec.gradient_accumulation_steps > 1:
        acc = rank.accumulated_gradients
        ga_grads = rank.gradients if acc is None else acc
    else:
        ga_grads = 0
    # bitsandbytes' 4-bit matmul dequantizes one weight to the compute dtype for each forward
    # and backward matmul (bitsandbytes/autograd/_functions.py MatMul4Bit): a transient copy
    # of the largest quantized weight.
    dequant = plan.dequant or _packed_dequant(arch, plan.rs, spec.batch_size, tokens)
    return _StepContext(
        arch=arch,
        spec=spec,
        plan=plan,
        rank=rank,
        ada=ada,
        layers=layers,
        beside=beside,
        loss=loss,
        activations=activations,
        recompute=recompute,
        ga_grads=ga_grads,
        grad_hidden=_blk(tokens * arch.hidden_size * max(plan.flow.residual, HALF_BYTES)),
        dequant=dequant,
        host_pinned=host_pinned,
        assumptions=assumptions,
        warnings=warnings,
    )


# -- the moments: each kind of moment the step may peak at, one function each ---------------

_Moments = Callable[[_StepContext], list[_Moment]]


class _LayerEnds(NamedTuple):
    """The layers' backward at its top layer, its bottom layer and the embedding's."""

    top: _Moment
    bottom: _Moment
    end: _Moment


def _top_layer_moment(ctx: _StepContext) -> _Moment:
    """At the top layer every activation is still alive (plus one recomputed layer when
    checkpointing) and only the head's gradients exist."""
    f, traits, tokens, h = ctx.f, ctx.traits, ctx.tokens, ctx.arch.hidden_size
    recompute_end = ctx.recompute
    if traits.down_stop:
        # The recomputation stops at down_proj's saved half copy of its input (non-reentrant
        # checkpointing; an autocast LoRA on down_proj, `plan._step_traits`): alive then
        # beside the layer's saved tensors are the MLP's input and the residual it will join,
        # the product down_proj takes, its base output, and PEFT's cast of the product to the
        # adapters' dtype.
        out = f.norm_out
        recompute_end += (
            _blk(tokens * h * out)
            + _blk(tokens * h * f.residual)
            + _blk(tokens * traits.down_stop * out)
            + _blk(tokens * h * out)
            + _blk(tokens * traits.down_stop * f.adapter)
        )
    return _Moment(
        gradients=ctx.ga_grads if ctx.ga_grads else ctx.rank.head_gradients,
        logits_loss=ctx.ada.penalty_gradients,
        activations=ctx.activations,
        recompute=recompute_end,
        backward_temporaries=ctx.in_flight,
    )


def _bottom_layer_moment(ctx: _StepContext) -> _Moment:
    """At the first layer the activations are gone and every gradient but the embedding's
    exists."""
    return _Moment(
        gradients=ctx.bottom_grads,
        activations=ctx.bottom_acts,
        recompute=ctx.recompute,
        backward_temporaries=ctx.in_flight + ctx.rank.bottom_temporaries,
    )


def _embedding_moment(ctx: _StepContext) -> _Moment:
    """The embedding's gradient comes last. It is a temporary until it lands in .grad, with
    the gradient flowing into the embedding's backward beside it. A tied embedding already
    holds the LM head's gradient: AccumulateGrad adds out of place, so the old gradient, the
    new one and their sum coexist (reference traces of Qwen2.5-0.5B and Gemma-2 full
    fine-tuning). Sharding strategies make it whole and shard it after."""
    grads, embed_grads, made = ctx.rank.gradients, ctx.rank.embed_gradients, ctx.embed_made
    if embed_grads and ctx.tied_head and ctx.f.liger:
        # Liger's fused loss made the head's gradient in the forward: it waits in the tied
        # weight's input buffer as the loss's tensor, beside the embedding's and their sum
        return _Moment(
            gradients=grads - embed_grads,
            activations=0,
            logits_loss=made,
            backward_temporaries=2 * made,
        )
    if embed_grads and ctx.tied_head:
        return _Moment(gradients=grads - embed_grads, activations=0, backward_temporaries=3 * made)
    if embed_grads:
        return _Moment(
            gradients=grads - embed_grads,
            activations=0,
            backward_temporaries=made + ctx.grad_hidden,
        )
    return _Moment(gradients=grads, activations=0)


def _layer_ends(ctx: _StepContext) -> _LayerEnds:
    return _LayerEnds(_top_layer_moment(ctx), _bottom_layer_moment(ctx), _embedding_moment(ctx))


def _expert_slots(ctx: _StepContext) -> tuple[int, int]:
    """A MoE layer's experts in backward: the down GEMM's merged weight gradient, and the
    gradients of its output and input per routed slot."""
    arch, f, tokens, h = ctx.arch, ctx.f, ctx.tokens, ctx.arch.hidden_size
    e, ie, k = arch.num_experts, arch.expert_intermediate_size, arch.num_experts_per_tok
    merged_grad = _blk(e * h * ie * f.norm_out)
    slots = _blk(tokens * k * h * f.norm_out) + _blk(tokens * k * ie * f.norm_out)
    return merged_grad, slots


def _expert_lora_moments(ctx: _StepContext) -> list[_Moment]:
    """The bottom layer's experts in backward (PEFT adapters on the experts' weights): the
    down_proj grouped matmul's backward has made its merged weight's gradient, beside the
    gradients of its output and input per routed slot, which the down outputs and products it
    saved are no longer kept for; that layer's adapters have no gradient yet (reference traces
    qwen3-30b-a3b__lora__*ckpt)."""
    if not ctx.f.expert_lora:
        return []
    rank, ckpt = ctx.rank, ctx.ckpt
    merged_grad, slots = _expert_slots(ctx)
    layer_grads = (
        rank.gradients - rank.head_gradients - rank.embed_gradients
    ) // ctx.arch.num_hidden_layers
    return [
        _bottom_layer_moment(ctx)._replace(
            gradients=ctx.bottom_grads - layer_grads,
            activations=ctx.bottom_acts - (0 if ckpt else slots),
            recompute=ctx.recompute - (slots if ckpt else 0),
            # (no 4-bit weight is dequantized at that moment)
            backward_temporaries=2 * ctx.grad_hidden + merged_grad + slots,
        )
    ]


def _deepseek_expert_moments(ctx: _StepContext) -> list[_Moment]:
    """DeepSeek: the lowest MoE layer's experts in backward, as for Qwen3-MoE
    (`_expert_lora_moments`): the down GEMM's merged weight gradient beside the gradients of
    its output and input per routed slot; that layer's and the dense layers' adapters have no
    gradient yet, the dense layers' checkpoints (or activations) are still held, with the
    rotary table (reference traces deepseek-v2-lite__*lora__*ckpt, peak at aten._grouped_mm)."""
    if "down" not in ctx.f.expert_parts:
        return []
    arch, layers, ckpt, ga_grads = ctx.arch, ctx.layers, ctx.ckpt, ctx.ga_grads
    merged_grad, slots = _expert_slots(ctx)
    n_dense = arch.dense_layers
    moe_grads, dense_grads = deepseek_layer_trainable(arch, ctx.plan.rs)
    if ckpt:
        below = (n_dense + 1) * layers.checkpoint
    else:
        below = layers.first + (n_dense - 1) * layers.dense
    in_flight_experts = 2 * ctx.grad_hidden + merged_grad + slots
    moments = [
        _Moment(
            gradients=ga_grads or ctx.bottom_grads - moe_grads - n_dense * dense_grads,
            activations=below + ctx.beside.rope + (0 if ckpt else layers.per_layer - slots),
            recompute=ctx.recompute - slots if ckpt else 0,
            backward_temporaries=in_flight_experts,
        )
    ]
    if not ckpt:
        # Without checkpointing the top layer's is the larger: every layer's saved tensors
        # but the final norm's fp32 input (consumed) and the slots, only the head's
        # gradients (reference traces deepseek-*__lora__*-s*, no ckpt: the backward
        # phase's peak at aten._grouped_mm in the top layer).
        tokens, h = ctx.tokens, arch.hidden_size
        norm_input = _blk(tokens * h * FP32_BYTES) + _blk(tokens * FP32_BYTES)
        moments.append(
            _Moment(
                gradients=ga_grads or ctx.rank.head_gradients,
                activations=ctx.activations - norm_input - slots,
                backward_temporaries=in_flight_experts,
            )
        )
    return moments


def _up_proj_moments(ctx: _StepContext) -> list[_Moment]:
    """Recomputing the top layer: every checkpoint (the final norm's saved tensors are
    gone), the gradient arriving from the head (an fp32 and two bf16 hidden-sized tensors,
    per the reference traces) and the recomputed layer at its up_proj."""
    if not (ctx.ckpt and ctx.plan.up_proj_moment):
        return []
    tokens, h, f = ctx.tokens, ctx.arch.hidden_size, ctx.f
    arriving = _blk(tokens * h * FP32_BYTES) + 2 * _blk(tokens * h * HALF_BYTES)
    # (under Liger the gradient arriving from the final norm is the fused loss's saved
    # input gradient, its storage handed on in place: the loss's tensor)
    from_loss = _blk(tokens * h * HALF_BYTES) if f.liger else 0
    return [
        _Moment(
            gradients=ctx.ga_grads,
            activations=ctx.held_checkpoints,
            recompute=ctx.recipe(ctx.plan.up_proj_moment),
            logits_loss=from_loss,
            # a GPTQ/AWQ/HQQ/torchao base: up_proj's dequantization in flight (the
            # larger of its forward and backward transient, `_packed_dequant`)
            backward_temporaries=arriving - from_loss + (ctx.dequant if f.packed else 0),
        )
    ]


def _qlora_down_moments(ctx: _StepContext) -> list[_Moment]:
    """down_proj's backward in the top layer: its saved input is consumed, and the gradient
    of that input exists three times in the MLP's dtype: through the LoRA branch, through the
    4-bit matmul (upcast back from the compute dtype), and their sum (reference trace
    mistral-7b-v0_1__qlora__...__ckpt); with the gradient of the layer's output, in the
    residual dtype."""
    if not ctx.traits.qlora_gated_down:
        return []
    f, tokens, h, ckpt = ctx.f, ctx.tokens, ctx.arch.hidden_size, ctx.ckpt
    lora = ctx.plan.rs.lora
    rs_r = lora.r if lora else 0
    # What the adapter's two matmuls saved is consumed: lora_A's input (the product itself
    # when PEFT's cast to the adapters' dtype is a no-op, else that cast; under autocast its
    # half copy) and lora_A's output (`activations._linear_saves`); under autocast the bf16
    # copy, not the product, is what lora_A kept (reference traces *__qlora__*__autocast of
    # objectives without logits).
    i_bytes = tokens * ctx.arch.intermediate_size
    lora_in = AUTOCAST_BYTES if f.autocast else f.adapter
    down_input = _blk(i_bytes * lora_in) + _blk(tokens * rs_r * lora_in)
    grads_in = 3 * _blk(i_bytes * f.norm_out) + _blk(tokens * h * f.residual)
    per_layer = ctx.layers.per_layer
    layer_now = (ctx.recompute if ckpt else per_layer) - down_input
    if ckpt:
        acts_now = ctx.held_checkpoints
    else:
        beside = ctx.beside
        acts_now = ctx.activations - beside.final_norm + beside.rope + beside.masks - per_layer
    # (without checkpointing the layer's tensors are its saved activations, not a
    # recomputation: reference trace qwen2_5-0_5b__qlora__reward__*__b2-s512)
    return [
        _Moment(
            gradients=ctx.ga_grads,
            activations=acts_now if ckpt else acts_now + layer_now,
            recompute=layer_now if ckpt else 0,
            backward_temporaries=grads_in,
        )
    ]


def _attention_scores_moments(ctx: _StepContext) -> list[_Moment]:
    """The attention's backward in the top layer (recomputed under checkpointing) with the
    scores materialised: the probabilities' gradient and the scores' (fp32 for SDPA's math
    kernel) beside the saved probabilities, with the output's gradient made contiguous and the
    residual stream's gradient (reference traces *qlora*b1-s8192*, peak at
    _softmax_backward_data)."""
    if not ctx.traits.scores:
        return []
    arch, spec, f = ctx.arch, ctx.spec, ctx.f
    b, s = spec.batch_size, spec.seq_len
    score_bytes = FP32_BYTES
    if arch.model_type == "falcon" and spec.attn_implementation is AttnImpl.EAGER:
        # FalconAttention's eager softmax runs in the model's dtype, its backward too
        score_bytes = f.attn
    scores = _blk(b * arch.num_attention_heads * s * s * score_bytes)
    # (SDPA's fp32 softmax backward also takes a scores-sized scratch on CUDA: an H200
    # allocator history, service/trace/kernels.py _SafeSoftmax.)
    copies = 2 if spec.attn_implementation is not AttnImpl.SDPA else 3
    grads_now = copies * scores + 2 * _blk(ctx.tokens * arch.q_dim * max(f.attn, f.residual))
    attention_part = ctx.recipe(ctx.plan.attention_part)
    if ctx.ckpt:
        if ctx.traits.shares_input:
            attention_part -= ctx.layers.checkpoint_input  # the first norm saved it itself
        return [
            _Moment(
                gradients=ctx.ga_grads,
                activations=ctx.held_checkpoints,
                recompute=attention_part,
                backward_temporaries=grads_now,
            )
        ]
    # At the top layer's attention backward that layer keeps only what its attention's
    # backward reads: its MLP's saved tensors are consumed (reference traces
    # llama-3_2-1b__qlora__dpo__*__b2-s1024, peak at the scores' backward).
    beside = ctx.beside
    acts_now = ctx.activations - beside.final_norm + beside.rope + beside.masks
    acts_now -= ctx.layers.per_layer - attention_part
    return [_Moment(gradients=ctx.ga_grads, activations=acts_now, backward_temporaries=grads_now)]


def _head_in_backward_moments(ctx: _StepContext) -> list[_Moment]:
    """The LM head's backward, every activation alive: the logits' gradient in the model's
    dtype, the head weight's gradient and the hidden states' (reference traces
    *__torchtune__optim-in-bwd, peak of the backward phase at aten.mm); with gradients freed
    as they land, no later moment holds more."""
    if not (ctx.spec.optimizer_in_backward and ctx.traits.head_trains):
        return []
    head_grad = ctx.embed_made if ctx.tied_head else ctx.rank.head_gradients
    return [
        _Moment(
            gradients=0,
            activations=ctx.activations,
            logits_loss=_blk(ctx.tokens * ctx.arch.vocab_size * ctx.f.residual),
            backward_temporaries=head_grad + ctx.grad_hidden,
        )
    ]


def _liger_down_backward_moments(ctx: _StepContext) -> list[_Moment]:
    """Without logits the top layer's down_proj can hold the step's peak (reference traces
    *__liger, LoRA with fp32 adapters, no checkpointing). Its backward, at lora_A's input
    gradient (fp32, intermediate-wide): the final norm's saved input is gone; the gradient
    arriving is the fused loss's input gradient (handed on in place), beside the base
    branch's gradient cast back to the MLP's dtype and lora_A's weight gradient."""
    if not (ctx.traits.liger_down and not ctx.ckpt):
        return []
    f, tokens, h, i_size = ctx.f, ctx.tokens, ctx.arch.hidden_size, ctx.arch.intermediate_size
    lora = ctx.plan.rs.lora
    rs_r = lora.r if lora else 0
    out, ad = f.norm_out, f.adapter
    return [
        _Moment(
            gradients=ctx.ga_grads,
            activations=ctx.activations - _liger_final_norm(ctx),
            logits_loss=_blk(tokens * h * f.residual),
            backward_temporaries=_blk(tokens * h * out)
            + _blk(tokens * i_size * ad)
            + _blk(rs_r * i_size * ad),
        )
    ]


def _liger_final_norm(ctx: _StepContext) -> int:
    """LigerRMSNorm's saves: the last layer's output and an fp32 rstd per token."""
    tokens, h = ctx.tokens, ctx.arch.hidden_size
    return _blk(tokens * h * ctx.f.residual) + _blk(tokens * FP32_BYTES)


_Pass = Callable[[_StepContext, _LayerEnds, list[_Moment]], list[_Moment]]


def _stepped_in_backward(
    ctx: _StepContext, ends: _LayerEnds, candidates: list[_Moment]
) -> list[_Moment]:
    """The optimizer in backward: each gradient is stepped and freed as it lands; a tied
    head's waits for the embedding."""
    if not ctx.spec.optimizer_in_backward:
        return candidates
    held_head = ctx.rank.head_gradients if ctx.tied_head else 0
    ctx.assumptions.append("optimizer in backward: each gradient freed after its step")
    return [
        m._replace(gradients=in_backward_gradients(m.gradients, held_head=held_head))
        for m in candidates
    ]


def _with_communication(
    ctx: _StepContext, ends: _LayerEnds, candidates: list[_Moment]
) -> list[_Moment]:
    """Gathered parameters and buckets: the bottom layer's and the embedding's moments may
    have their own; every other moment is at the top layer."""
    rank = ctx.rank
    if not (rank.comm_backward or rank.comm_end or rank.comm_bottom):
        return candidates
    comm_bottom = rank.comm_backward if rank.comm_bottom is None else rank.comm_bottom
    comm_end = rank.comm_backward if rank.comm_end is None else rank.comm_end
    comm_top = rank.comm_backward if rank.comm_top is None else rank.comm_top
    candidates = [
        moment._replace(
            communication=comm_bottom
            if moment is ends.bottom
            else comm_end
            if moment is ends.end
            else comm_top
        )
        for moment in candidates
    ]
    if rank.comm_top is not None:
        # The top layer's end, where the layer below is gathered (`RankLayout.comm_top`):
        # its input norm's backward, with the norm's fp32 input (saved by the recompute) and
        # its fp32 temporaries beside the gradients flowing down (reference trace
        # phi-3-mini-4k-instruct__lora__r16-all-linear__b1-s512__ckpt__fsdp-2gpu-full-shard,
        # peak at aten.mul.Tensor).
        fp32_hidden = _blk(ctx.tokens * ctx.arch.hidden_size * FP32_BYTES)
        candidates.append(
            ends.top._replace(
                recompute=fp32_hidden,
                backward_temporaries=ctx.in_flight + NORM_BACKWARD_FP32_TEMPORARIES * fp32_hidden,
                communication=rank.comm_backward,
            )
        )
    return candidates


def _forward_end_moments(ctx: _StepContext) -> list[_Moment]:
    """The forward's end: every activation saved, the logits and loss at their peak."""
    return [
        _Moment(
            gradients=ctx.ga_grads,
            activations=ctx.activations + ctx.ada.penalty_saved,
            logits_loss=ctx.loss.forward_peak,
            communication=ctx.rank.comm_forward,
        )
    ]


def _liger_down_forward_moments(ctx: _StepContext) -> list[_Moment]:
    """Without logits the top layer's down_proj can hold the step's peak (reference traces
    *__liger, LoRA with fp32 adapters, no checkpointing). Its forward, at lora_B's scaled
    output: every layer's saved tensors but the final norm's, the embedding's output (the
    model's forward holds it; the first layer saved nothing of it), the MLP's input and
    LigerSiLUMulFunction's product (only their fp32 casts are saved), the base output, lora_B's
    output and its scaled copy."""
    if not (ctx.traits.liger_down and not ctx.ckpt):
        return []
    f, tokens, h = ctx.f, ctx.tokens, ctx.arch.hidden_size
    out, ad = f.norm_out, f.adapter
    embedded = ctx.traits.embed_trains or virtual_tokens(ctx.spec)
    embed_out = 0 if embedded else _blk(tokens * h * f.residual)
    in_forward = (
        embed_out
        + _blk(tokens * h * out)
        + _blk(tokens * ctx.arch.intermediate_size * out)
        + _blk(tokens * h * out)
        + 2 * _blk(tokens * h * ad)
    )
    activations = ctx.activations - _liger_final_norm(ctx) + in_forward
    return [_Moment(gradients=ctx.ga_grads, activations=activations)]


def _softmax_forward_moments(ctx: _StepContext) -> list[_Moment]:
    """The last layer's forward at its softmax, every checkpoint kept (reference trace
    falcon-7b__lora__r16-all-linear__b1-s2048__ckpt__eager)."""
    if not (ctx.ckpt and holds_scores_between_layers(ctx.arch, ctx.spec)):
        return []
    spec = ctx.spec
    softmax = softmax_moment(ctx.arch, ctx.f, spec.batch_size, spec.seq_len)
    held = ctx.held_checkpoints + ctx.beside.embed_norm + softmax
    return [_Moment(gradients=ctx.ga_grads, activations=held)]


def _forward_start_moments(ctx: _StepContext) -> list[_Moment]:
    """The forward's start, before any activation exists, with its own gathered parameters."""
    start = ctx.rank.comm_forward_start
    if start is None:
        return []
    return [_Moment(gradients=ctx.ga_grads, activations=0, communication=start)]


def _backward_start(ctx: _StepContext) -> _Moment:
    rank = ctx.rank
    comm = rank.comm_forward if rank.comm_backward_start is None else rank.comm_backward_start
    return _Moment(
        gradients=ctx.ga_grads,
        activations=ctx.activations,
        logits_loss=ctx.loss.backward_peak + ctx.ada.penalty_gradients,
        communication=comm,
    )


def _optimizer_step(ctx: _StepContext) -> _Moment:
    """The optimizer step: every gradient with the optimizer's temporaries, or nothing left
    for it when the optimizer ran in backward."""
    rank, ada = ctx.rank, ctx.ada
    if ctx.spec.optimizer_in_backward:
        grads = temps = 0
    else:
        grads = rank.gradients
        temps = max(rank.optimizer_temporaries, ada.allocator_temporaries)
    return _Moment(
        gradients=grads,
        activations=0,
        optimizer_temporaries=temps,
        communication=rank.comm_step,
    )


# The forward phase's candidate moments (its end first: the first of equal peaks is taken).
_FORWARD_MOMENTS: tuple[_Moments, ...] = (
    _forward_end_moments,
    _liger_down_forward_moments,
    _softmax_forward_moments,
    _forward_start_moments,
)
# The moments inside the layers' backward besides the layer ends, in order.
_BACKWARD_MOMENTS: tuple[_Moments, ...] = (
    _expert_lora_moments,
    _deepseek_expert_moments,
    _up_proj_moments,
    _qlora_down_moments,
    _attention_scores_moments,
    _head_in_backward_moments,
)
# What the strategy makes of those moments, in order.
_BACKWARD_PASSES: tuple[_Pass, ...] = (_stepped_in_backward, _with_communication)
# Moments that neither pass changes.
_LATE_BACKWARD_MOMENTS: tuple[_Moments, ...] = (_liger_down_backward_moments,)


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
