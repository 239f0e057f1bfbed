"""A step's candidate peak moments, one function per kind, in the tables `step._step` runs."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from service.core.estimator.deepseek import deepseek_layer_trainable
from service.core.estimator.ledger import _blk
from service.core.estimator.model_attention import holds_scores_between_layers, softmax_moment
from service.core.estimator.step_context import _Moment, _Moments, _StepContext
from service.core.estimator.train_features import in_backward_gradients
from service.core.estimator.tuners import virtual_tokens
from service.core.spec import AttnImpl
from service.core.units import AUTOCAST_BYTES, FP32_BYTES, HALF_BYTES

# An RMS norm's backward with its fp32 upcast keeps four fp32 hidden-sized temporaries alive at
# once (div, pow, mul by a scalar, mul: reference trace phi-3-mini-4k-instruct__lora__r16-all-
# linear__b1-s512__ckpt__fsdp-2gpu-full-shard, the input norm's backward in the top layer).
NORM_BACKWARD_FP32_TEMPORARIES = 4


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
