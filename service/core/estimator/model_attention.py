"""Falcon's eager and BLOOM's attention as the models code them: what a checkpointed layer's
forward holds at its softmax, where these models peak at long sequences."""

from __future__ import annotations

from service.core.arch import ModelArch
from service.core.estimator.layer_flow import LayerFlow
from service.core.estimator.ledger import _blk
from service.core.spec import AttnImpl, TrainingSpec
from service.core.units import FP32_BYTES


def holds_scores_between_layers(arch: ModelArch, spec: TrainingSpec) -> bool:
    """Whether a decoder layer returns its attention probabilities, which the model's loop
    keeps (`outputs`) until the next layer returns: BLOOM always, Falcon with eager attention
    (transformers 5.24 modeling_bloom.py, modeling_falcon.py)."""
    return arch.alibi or (
        arch.model_type == "falcon" and spec.attn_implementation is AttnImpl.EAGER
    )


def softmax_moment(arch: ModelArch, f: LayerFlow, b: int, s: int) -> int:
    """A checkpointed layer's forward (no autograd) at its softmax: the normed input, the
    fused projection's output, the attention's inputs and its score-sized tensors, and the
    previous layer's probabilities (see `holds_scores_between_layers`)."""
    tokens = b * s
    h = arch.hidden_size
    scores = b * arch.num_attention_heads * s * s
    qkv = arch.q_dim + 2 * arch.kv_dim
    held = _blk(tokens * h * f.norm_out) + _blk(tokens * qkv * f.attn)
    if arch.alibi:
        # q, k and v reshaped into copies; baddbmm's scores and the masked scores (both held
        # until the attention returns), the fp32 copy softmax takes and its fp32 output
        held += 3 * _blk(tokens * arch.q_dim * f.attn)
        held += 2 * _blk(scores * f.attn)
        if f.attn != FP32_BYTES:
            held += _blk(scores * FP32_BYTES)
        held += _blk(scores * FP32_BYTES)
        return held + _blk(scores * f.attn)  # the previous layer's probabilities
    # Falcon: the rotated q and k, v; the scores (scaled in place), the masked scores and
    # softmax's output in the model's dtype
    kd = arch.kv_dim if arch.kv_broadcast else arch.q_dim
    held += _blk(tokens * arch.q_dim * f.attn) + 2 * _blk(tokens * kd * f.attn)
    return held + 4 * _blk(scores * f.attn)
