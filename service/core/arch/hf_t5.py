"""The parser of T5-family config.json files (T5 v1.1, LM-adapted T5, T0, mT5, mT0): an
encoder-decoder whose blocks are named as transformers' modeling_t5.py names them."""

from __future__ import annotations

from service.core.arch import Linear, LinearKind, MlpKind, ModelArch, NormKind
from service.core.arch.hf_values import Config, dropout, linear
from service.core.errors import InvalidConfigError

# T5Config and MT5Config default tie_word_embeddings to True (the original T5 ties the lm_head).
T5_TIE_WORD_EMBEDDINGS = True
# transformers' T5Config defaults (models/t5/configuration_t5.py).
T5_DROPOUT = 0.1
T5_RELATIVE_ATTENTION_BUCKETS = 32
T5_FEED_FORWARD_PROJ = "relu"
# T5Config: "gated-gelu" runs NewGELUActivation ("gelu_new"), for backwards compatibility.
T5_GATED_GELU_ACT = "gelu_new"


def t5_arch(c: Config, model_type: str) -> ModelArch:
    """T5ForConditionalGeneration / MT5ForConditionalGeneration (transformers
    models/t5/modeling_t5.py): a shared embedding; encoder blocks of SelfAttention (q, k, v,
    o without bias, relative position bias) and DenseReluDense (wi or gated wi_0/wi_1, wo);
    decoder blocks with EncDecAttention between them; RMSNorms (T5LayerNorm) before each
    sublayer and after each stack; an lm_head."""
    h = c.integer("d_model")
    heads = c.integer("num_heads")
    d_kv = c.integer("d_kv", default=64)
    layers = c.integer("num_layers")
    if not heads or not h or not d_kv or not layers:
        raise InvalidConfigError(
            "num_heads", "d_model, num_heads, d_kv and num_layers must be positive"
        )
    ff = c.integer("d_ff")
    proj = c.string("feed_forward_proj", T5_FEED_FORWARD_PROJ)
    parts = proj.split("-")
    if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
        raise InvalidConfigError("feed_forward_proj", f"must be ACT or gated-ACT, got {proj!r}")
    gated = len(parts) == 2
    act = parts[-1]
    if act == "gelu" and gated:
        act = T5_GATED_GELU_ACT
    inner = heads * d_kv

    def attention(prefix: str) -> list[Linear]:
        return [
            linear(f"{prefix}.q", LinearKind.ATTN_QKV, h, inner),
            linear(f"{prefix}.k", LinearKind.ATTN_QKV, h, inner),
            linear(f"{prefix}.v", LinearKind.ATTN_QKV, h, inner),
            linear(f"{prefix}.o", LinearKind.ATTN_OUT, inner, h),
        ]

    ffn_in = ["DenseReluDense.wi_0", "DenseReluDense.wi_1"] if gated else ["DenseReluDense.wi"]
    ffn = [linear(n, LinearKind.MLP_IN, h, ff) for n in ffn_in]
    ffn.append(linear("DenseReluDense.wo", LinearKind.MLP_OUT, ff, h))
    rate = dropout(c, "dropout_rate", T5_DROPOUT)
    return ModelArch(
        model_type=model_type,
        hidden_size=h,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=d_kv,
        intermediate_size=ff,
        vocab_size=c.integer("vocab_size"),
        tie_word_embeddings=c.boolean("tie_word_embeddings", T5_TIE_WORD_EMBEDDINGS),
        hidden_act=act,
        # relative positions: no table bounds the length
        max_position_embeddings=c.integer("n_positions", default=512),
        norm=NormKind.RMS,
        norms_per_layer=2,
        qk_norm=False,
        mlp=MlpKind.GATED if gated else MlpKind.PLAIN,
        parallel_residual=False,
        lm_head_bias=False,
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
        sliding_window=None,
        linears=(*attention("SelfAttention"), *ffn),
        hidden_dropout=rate,
        attention_dropout=rate,
        decoder_layers=c.integer("num_decoder_layers", default=layers),
        decoder_linears=(*attention("SelfAttention"), *attention("EncDecAttention"), *ffn),
        relative_attention_num_buckets=c.integer(
            "relative_attention_num_buckets", default=T5_RELATIVE_ATTENTION_BUCKETS
        ),
    )
