"""What a step's candidate moments read: the job as it runs, its layers' and fixed parts'
bytes, and the context each moment function takes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple

from service.core.arch import ModelArch, NormKind
from service.core.cold import starting_cold_work
from service.core.errors import InvalidSpecError
from service.core.estimator.adalora import AdaLoraParts, adalora_parts
from service.core.estimator.adapter import norm_product_bytes
from service.core.estimator.deepseek import check_deepseek_spec, deepseek_rope_bytes
from service.core.estimator.layer_flow import LayerFlow
from service.core.estimator.layout import RankLayout
from service.core.estimator.ledger import _blk, _Kind, _recipe_bytes
from service.core.estimator.looped_experts import is_looped, looped_arch, looped_note
from service.core.estimator.loss import _loss_bytes, _LossBytes
from service.core.estimator.parallel import rank_layout
from service.core.estimator.plan import _Plan, _plan, _PlanKey, _StepTraits
from service.core.estimator.prefix import prefix_tokens, projection_saved_bytes
from service.core.estimator.train_features import (
    check_offloadable,
    host_pinned_bytes,
    resident_layer_inputs,
)
from service.core.estimator.tuners import virtual_tokens
from service.core.liger import liger_refusal
from service.core.quant_formats import dequant_transient
from service.core.result import COMPONENT_ORDER, Component
from service.core.spec import AttnImpl, Framework, Method, ResolvedSpec, SdpaKernel, TrainingSpec
from service.core.stack import check_stack
from service.core.units import (
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
# An estimate keeps a phase's parts as one tuple in COMPONENT_ORDER (`PhasePeak.parts`): the
# fixed parts, the held ones, then a moment's. Checked once, here.
if (*_FixedParts._fields, *_HELD, *_Moment._fields) != COMPONENT_ORDER:
    raise AssertionError("the phase records' fields are not in COMPONENT_ORDER")


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


# The signature of a moment function (moments.py).

_Moments = Callable[[_StepContext], list[_Moment]]
