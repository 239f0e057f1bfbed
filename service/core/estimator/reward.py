"""The reward model's step (TRL 1.16.0 RewardTrainer): the SFT step on the doubled
[chosen; rejected] batch, with a one-output score head in place of the LM head.

RewardTrainer builds `AutoModelForSequenceClassification` with `num_labels=1`
(trl/trainer/reward_trainer.py __init__); for a decoder that is transformers'
GenericForSequenceClassification (modeling_layers.py): the decoder, then `score`, a hidden -> 1
linear without bias, at every position, the last non-padding position's output pooled. Its
collator puts the chosen sequences, then the rejected ones, in one batch, so one forward runs
2 x batch_size rows; the loss, -logsigmoid(chosen - rejected) averaged (plus
center_rewards_coefficient x mean((chosen + rejected)^2) when that is set), holds a few
per-pair scalars. No vocabulary-wide logits exist: the layers are the SFT step's
(`_step` with `LossImpl.FUSED`, which adds no logits) on the model whose head is the score
(`ModelArch.score_head`: its weight, gradient, optimizer state, PEFT's SEQ_CLS trainable copy,
and the final norm's output it keeps for its weight's gradient).
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from service.core.arch import LinearKind, MlpKind, ModelArch, NormKind
from service.core.errors import InvalidSpecError
from service.core.estimator.ledger import _blk, _recipe_bytes
from service.core.estimator.preference import without_dropout
from service.core.estimator.step import _Step, _step
from service.core.estimator.step_context import _Moment
from service.core.spec import LossImpl, Method, Objective, TrainingSpec
from service.core.units import AUTOCAST_BYTES, DTYPE_BYTES, FP32_BYTES, HALF_BYTES

# A gated MLP's backward in the bottom layer, once down_proj's weight gradient is made: the
# gradient of down_proj's input and the product's two gradients (SiLU(gate)'s and up's), each
# tokens x intermediate_size in the MLP's dtype (reference trace
# qwen2_5-0_5b__full__reward__b2-s1024__ckpt, peak at aten.mul.Tensor in backward).
MLP_BACKWARD_INTERMEDIATES = 3


def reward_arch(arch: ModelArch) -> ModelArch:
    """`arch` built as RewardTrainer's one-label sequence classifier."""
    return replace(arch, score_head=True)


def reward_spec(spec: TrainingSpec) -> TrainingSpec:
    """The SFT step the reward model's forward and backward are: the doubled batch, no
    logits, and no dropout (RewardConfig.disable_dropout, True by default, sets every
    nn.Dropout's p to 0, LoRA's included: trl/trainer/utils.py disable_dropout_in_model)."""
    return replace(
        without_dropout(spec),
        batch_size=2 * spec.batch_size,
        objective=Objective.SFT,
        loss=LossImpl.FUSED,
    )


def check_reward_model(arch: ModelArch) -> None:
    """A reward model is modelled on a dense decoder-only LM."""
    if arch.encoder or arch.encoder_decoder:
        raise InvalidSpecError(
            "objective",
            f"objective 'reward' is modelled on decoder-only LMs, not {arch.model_type!r}",
        )
    if arch.is_moe:
        raise InvalidSpecError(
            "objective",
            "objective 'reward' on a mixture-of-experts model is not modelled (its router "
            "logits and load-balancing loss)",
        )


def _top_layer_forward(arch: ModelArch, spec: TrainingSpec, st: _Step) -> _Moment | None:
    """LoRA without checkpointing: the top layer's forward at up_proj (every layer below
    saved, the top one's tensors so far with up_proj's fp32 LoRA branch), the forward's
    largest moment when no logits follow it (reference trace
    qwen2_5-0_5b__lora__reward__r16-all-linear__b2-s512, peak at aten.mul.Tensor in the
    forward). At the forward's end the final RMSNorm's fp32 input and rstd, and its output
    kept for the score's weight gradient, are there instead."""
    plan = st.plan
    if spec.gradient_checkpointing or not plan.up_proj_moment or arch.norm is not NormKind.RMS:
        return None
    b, s = spec.batch_size, spec.seq_len
    tokens = b * s
    h = arch.hidden_size
    final_norm = (
        _blk(tokens * h * FP32_BYTES)
        + _blk(tokens * FP32_BYTES)
        + _blk(tokens * h * plan.flow.residual)
    )
    below = st.forward_end.activations - final_norm
    at_up = below - _recipe_bytes(plan.layer, b, s) + _recipe_bytes(plan.up_proj_moment, b, s)
    f = plan.flow
    down = next((lin for lin in arch.linears if lin.kind is LinearKind.MLP_OUT), None)
    at_down = 0
    wider = f.autocast and f.adapter != AUTOCAST_BYTES and not f.quantized
    if wider and down is not None and down.name in f.lora_targets:
        # Under autocast with wider adapters the top layer's down_proj is the larger
        # moment: the layer has saved everything (lora_A its half copy of the product),
        # and alive beside are the MLP's input and the residual it will join, the
        # product, PEFT's cast of it to the adapters' dtype (peft/tuners/lora/layer.py
        # Linear.forward `_cast_input_dtype`, held until the forward returns), the base
        # output, lora_B's half output and its scaled copy (reference trace
        # qwen2_5-0_5b__lora__reward__r16-all-linear__b2-s512__autocast, peak at
        # aten.mul.Tensor in the forward).
        tokens_i = tokens * down.in_features
        at_down = below + (
            _blk(tokens * h * f.norm_out)
            + _blk(tokens * h * f.residual)
            + _blk(tokens_i * f.norm_out)
            + _blk(tokens_i * f.adapter)
            + _blk(tokens * h * f.norm_out)
            + 2 * _blk(tokens * h * AUTOCAST_BYTES)
        )
    return st.forward_end._replace(activations=max(at_up, at_down))


def _bottom_mlp_backward(arch: ModelArch, spec: TrainingSpec, st: _Step) -> _Moment | None:
    """Full fine-tuning of a gated MLP: the bottom layer's MLP backward once down_proj's
    weight gradient is made. Every gradient but the embedding's and the rest of that layer's
    exists; the layer's saved tensors (recomputed under checkpointing) are there but for
    down_proj's input, which its backward consumed; the MLP's gradients and the one flowing
    down the residual stream are in flight."""
    plan = st.plan
    if spec.method is not Method.FULL or arch.mlp is not MlpKind.GATED or arch.is_moe:
        return None
    down = next(lin for lin in arch.linears if lin.kind is LinearKind.MLP_OUT)
    b, s = spec.batch_size, spec.seq_len
    tokens = b * s
    h = arch.hidden_size
    f = plan.flow
    p = plan.params
    weight_bytes = DTYPE_BYTES[spec.dtype]
    intermediate = _blk(tokens * arch.intermediate_size * f.norm_out)
    layer = _recipe_bytes(plan.layer, b, s) - intermediate
    grads = st.optimizer_step.gradients
    made = grads - p.embed_trainable - p.layer + _blk(down.weight_elements * weight_bytes)
    grad_hidden = _blk(tokens * h * max(f.residual, HALF_BYTES))
    checkpoint = _blk(tokens * h * f.residual) + _recipe_bytes(plan.kept_past_checkpoints, b, s)
    ckpt = spec.gradient_checkpointing
    return _Moment(
        gradients=made,
        activations=checkpoint if ckpt else layer,
        recompute=layer if ckpt else 0,
        backward_temporaries=MLP_BACKWARD_INTERMEDIATES * intermediate + grad_hidden,
    )


class RewardStep(NamedTuple):
    """The reward model's step and the notes on how it was built."""

    step: _Step
    assumptions: tuple[str, ...]


def reward_step(arch: ModelArch, spec: TrainingSpec, compute_capability: str | None) -> RewardStep:
    """The SFT step of `reward_spec` on `reward_arch`, with the moments no logits hide: the
    top layer's forward (LoRA) and the bottom layer's MLP backward (full fine-tuning)."""
    check_reward_model(arch)
    model = reward_arch(arch)
    run = reward_spec(spec)
    st = _step(model, run, compute_capability)
    top = _top_layer_forward(model, run, st)
    if top is not None:
        st = st._replace(forward_end=max(st.forward_end, top, key=sum))
    bottom = _bottom_mlp_backward(model, run, st)
    if bottom is not None:
        st = st._replace(backward=max(st.backward, bottom, key=sum))
    notes = [
        f"reward model (TRL 1.16.0 RewardTrainer): {spec.batch_size} pairs run as "
        f"{run.batch_size} sequences of {spec.seq_len} tokens ([chosen; rejected], one "
        "forward), unpadded",
        "a one-label sequence classifier: the score head (hidden -> 1) replaces the LM head, "
        "no vocabulary logits",
    ]
    if spec.method is not Method.FULL:
        notes.append("the score head trains whole beside the adapters (PEFT's SEQ_CLS task)")
    if spec.lora is not None and spec.lora.lora_dropout:
        notes.append("LoRA dropout off: RewardConfig.disable_dropout (default True) sets p = 0")
    return RewardStep(st, tuple(notes))
