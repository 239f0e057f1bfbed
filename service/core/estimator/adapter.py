"""LitGPT's LLaMA-Adapter and LLaMA-Adapter v2: their trainable tensors and what they add to a
layer's saved tensors, modelled from LitGPT's source at the resource tables' commit (lit_gpt/
adapter.py and lit_gpt/adapter_v2.py at 0f021f3a, the PR that added those tables), not traced.

LLaMA-Adapter (lit_gpt/adapter.py CausalSelfAttention): from layer `adapter_start_layer` on,
each attention has a trainable prompt `adapter_wte` (nn.Embedding(adapter_prompt_length,
n_embd)) and a zero-initialised `gating_factor` (1, 1, n_head, 1). Its scaled_dot_product_
attention runs the layer's own fused qkv projection on the prompt for keys and values
(1, n_head, aT, head_size), attends every query to them with an all-True (T, aT) boolean mask,
and returns y + gating_factor * ay. `mark_only_adapter_as_trainable` trains those two only.

LLaMA-Adapter v2 (lit_gpt/adapter_v2.py): the same prompt, and every linear, lm_head included,
an AdapterV2Linear computing adapter_scale * (linear(x) + adapter_bias), both (out_features,);
its `adapter_filter` also trains norm_1, norm_2 and ln_f (weights, and biases of LayerNorm).
Under `--precision bf16-true` every parameter is bf16 (Fabric converts the module).
"""

from __future__ import annotations

from service.core.arch import ModelArch, NormKind
from service.core.errors import InvalidConfigError
from service.core.estimator.ledger import _Kind, _Ledger
from service.core.spec import Method, ResolvedSpec
from service.core.units import DTYPE_BYTES, FP32_BYTES

# lit_gpt/adapter.py Config: adapter_prompt_length: int = 10, adapter_start_layer: int = 2
# (finetune/adapter.py and finetune/adapter_v2.py build the model with these defaults).
ADAPTER_PROMPT_LENGTH = 10
ADAPTER_START_LAYER = 2
# torch 2.1 SDPA: the mask rules out flash, and the memory-efficient kernel takes the boolean
# mask converted to an additive bias in q's dtype (sdp_utils convert_boolean_attn_mask),
# padded along the keys to a multiple of 16 (attention.cpp preprocess_mask / pad_bias), and
# keeps it for backward with q, k, v, the output and the logsumexp.
MEM_EFFICIENT_BIAS_ALIGN = 16
# The keys the main (causal, flash) attention keeps, dropped when q, k and v take no gradient:
# the adapter's attention alone records then, keeping q (`q_rope`).
_MAIN_ATTENTION_KEYS = ("k_rope", "qkv_out", "v", "attn_out", "lse")


def is_adapter(rs: ResolvedSpec) -> bool:
    return rs.spec.method in (Method.LLAMA_ADAPTER, Method.LLAMA_ADAPTER_V2)


def is_v2(rs: ResolvedSpec) -> bool:
    return rs.spec.method is Method.LLAMA_ADAPTER_V2


def check_adapter_model(arch: ModelArch, rs: ResolvedSpec) -> None:
    """Refuse what LitGPT's adapters are not modelled on: mixture-of-experts layers (v2 wraps
    every expert's linears) and encoder-decoders (LitGPT builds decoders only)."""
    if is_adapter(rs) and (arch.is_moe or arch.encoder_decoder):
        raise InvalidConfigError(
            "model_type",
            f"method {rs.spec.method.value!r} is modelled on dense decoders, not "
            f"{arch.model_type!r}",
        )


def prompted_layers(arch: ModelArch) -> int:
    """Layers that carry the adapter prompt (adapter_start_layer onwards)."""
    return max(arch.num_hidden_layers - ADAPTER_START_LAYER, 0)


def adapter_tensors(arch: ModelArch, rs: ResolvedSpec) -> tuple[tuple[int, int, int, int], ...]:
    """The trainable tensors the adapters add, as (rows, cols, itemsize, count), in the
    model's dtype; v2's trained norms are the model's own (`weights._params(norms_train)`)."""
    if not is_adapter(rs):
        return ()
    md = DTYPE_BYTES[rs.spec.dtype]
    n = prompted_layers(arch)
    tensors = [
        (ADAPTER_PROMPT_LENGTH, arch.hidden_size, md, n),  # adapter_wte.weight
        (arch.num_attention_heads, 0, md, n),  # gating_factor (1, 1, n_head, 1)
    ]
    if is_v2(rs):
        L = arch.num_hidden_layers
        for lin in arch.linears:
            if not lin.expert:
                out = lin.out_features * lin.count
                tensors += [(out, 0, md, L), (out, 0, md, L)]  # adapter_bias, adapter_scale
        tensors += [(arch.vocab_size, 0, md, 1), (arch.vocab_size, 0, md, 1)]  # lm_head's
    return tuple(tensors)


def adapter_attention_saves(led: _Ledger, arch: ModelArch, attn: int, main_records: bool) -> None:
    """The prompt's attention: SDPA's memory-efficient kernel keeps q (the rotated query,
    already `q_rope`), the prompt's keys and values (views of the fused qkv projection's
    output on the aT prompt rows; copies when repeat_interleave spreads grouped heads), the
    additive mask, its output and the fp32 logsumexp. gating_factor * ay keeps ay (the
    output's transposed view) and the gate, a parameter. `main_records`: whether the causal
    attention itself records (its q, k or v take a gradient); `attn`: the attention's
    element size."""
    if not main_records:
        for key in _MAIN_ATTENTION_KEYS:
            led.items.pop(key, None)
    qkv_width = arch.q_dim + 2 * arch.kv_dim
    led.add("adapter.prompt_qkv", ADAPTER_PROMPT_LENGTH * qkv_width * attn, _Kind.CONSTANT)
    if arch.num_key_value_heads < arch.num_attention_heads:
        for key in ("adapter.k_rep", "adapter.v_rep"):
            led.add(key, ADAPTER_PROMPT_LENGTH * arch.q_dim * attn, _Kind.CONSTANT)
    led.add("adapter.mask_bias", MEM_EFFICIENT_BIAS_ALIGN * attn)
    led.add("adapter.attn_out", arch.q_dim * attn)
    led.add("adapter.lse", arch.num_attention_heads * FP32_BYTES, _Kind.TOKENS_PAD32)


def v2_linear_saves(led: _Ledger, name: str, out_features: int, nbytes: int) -> None:
    """AdapterV2Linear: adapter_scale * (linear(x) + adapter_bias) keeps the sum for the
    scale's gradient (and the scale, a parameter, for the sum's)."""
    led.add(f"{name}.v2_sum", out_features * nbytes)


def norm_product_bytes(arch: ModelArch, v2: bool, residual: int) -> int:
    """Bytes per element of what a trained norm's weight product keeps: LitGPT's RMSNorm
    (lit_gpt/rmsnorm.py) multiplies the weight into the fp32 x_normed."""
    if v2 and arch.norm is NormKind.RMS:
        return FP32_BYTES
    return residual
