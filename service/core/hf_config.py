"""Architectures from a model's `config.json` as published on the Hugging Face Hub: one parser
per `model_type`, each naming the modules as transformers builds them (service/core/architecture.py
holds what they build)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from service.core.architecture import (
    Linear,
    LinearKind,
    MlpKind,
    ModelArch,
    NormKind,
)
from service.core.architecture_mllama import MLLAMA_MODEL_TYPE, mllama_from_config
from service.core.architecture_vision import VISION_MODEL_TYPES, vision_from_config
from service.core.errors import InvalidConfigError
from service.core.hf_t5 import T5_TIE_WORD_EMBEDDINGS, _t5
from service.core.hf_values import _Config, _dropout, _linear

# model_type -> tie_word_embeddings when the config omits it (each transformers
# configuration_<model>.py default).
_TIE_DEFAULT = {
    "gemma": True,
    "gemma2": True,
    "gemma3_text": True,
    "falcon": True,
    "bloom": True,
    "t5": T5_TIE_WORD_EMBEDDINGS,
    "mt5": T5_TIE_WORD_EMBEDDINGS,
}

# Model types whose layout is the Llama one (q/k/v/o, gate/up/down, RMSNorm, pre-norm).
_LLAMA_LIKE = {
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "yi",
    "olmo2",
    "granite",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
}

# Encoder model types, run as transformers' <Model>ForSequenceClassification.
ENCODER_MODEL_TYPES = frozenset({"bert"})
# Encoder-decoder model types, run as transformers' <Model>ForConditionalGeneration.
ENCODER_DECODER_MODEL_TYPES = frozenset({"t5", "mt5"})
# Multi-head latent attention and DeepSeekMoE (transformers' deepseek_v2 and deepseek_v3).
_DEEPSEEK = {"deepseek_v2", "deepseek_v3"}

SUPPORTED_MODEL_TYPES = frozenset(
    _LLAMA_LIKE
    | _DEEPSEEK
    | {"phi3", "glm", "chatglm", "qwen", "gpt_neox", "phi", "stablelm", "falcon", "bloom"}
    | ENCODER_MODEL_TYPES
    | ENCODER_DECODER_MODEL_TYPES
    | VISION_MODEL_TYPES
    | {MLLAMA_MODEL_TYPE}
)


def from_hf_config(raw: Mapping[str, Any]) -> ModelArch:
    """Build a ModelArch from a config.json mapping as published on the Hugging Face Hub."""
    if not isinstance(raw, Mapping):
        raise InvalidConfigError("(root)", "must be a JSON object")
    model_type = raw.get("model_type")
    if isinstance(model_type, str) and model_type in VISION_MODEL_TYPES:
        return _vision_language(raw)
    if model_type == MLLAMA_MODEL_TYPE:
        return _mllama(raw)
    if "text_config" in raw and isinstance(raw["text_config"], Mapping):
        raw = {**raw["text_config"], **{k: v for k, v in raw.items() if k == "model_type"}}
        if raw.get("model_type") in ("gemma3",):
            raw = {**raw, "model_type": "gemma3_text"}
    c = _Config(raw)
    model_type = c.string("model_type", "")
    if not model_type:
        raise InvalidConfigError("model_type", "is required")
    if model_type not in SUPPORTED_MODEL_TYPES:
        known = ", ".join(sorted(SUPPORTED_MODEL_TYPES))
        raise InvalidConfigError("model_type", f"{model_type!r} is not supported (known: {known})")
    if model_type in _LLAMA_LIKE:
        return _llama_like(c, model_type)
    if model_type in _DEEPSEEK:
        return _deepseek(c, model_type)
    builders = {
        "phi3": _phi3,
        "glm": _glm,
        "chatglm": _chatglm,
        "qwen": _qwen_v1,
        "gpt_neox": _gpt_neox,
        "phi": _phi,
        "stablelm": _stablelm,
        "falcon": _falcon,
        "bloom": _bloom,
        "bert": _bert,
        "t5": _t5,
        "mt5": _t5,
    }
    return builders[model_type](c, model_type)


def _vision_language(raw: Mapping[str, Any]) -> ModelArch:
    """Qwen2-VL / Qwen2.5-VL: a Qwen2 language model (its keys at the top level, or under
    text_config) and a vision tower (architecture_vision.py)."""
    model_type = str(raw["model_type"])
    text = raw.get("text_config")
    values = {**raw, **text} if isinstance(text, Mapping) else dict(raw)
    lm = _llama_like(_Config({**values, "model_type": "qwen2"}), "qwen2")
    vision = vision_from_config(model_type, raw, lm.hidden_size)
    return replace(lm, model_type=model_type, vision=vision)


def _mllama(raw: Mapping[str, Any]) -> ModelArch:
    """Llama-3.2-Vision: a Llama language model under text_config (its cross-attention
    layers counted among num_hidden_layers) and a vision tower (architecture_mllama.py)."""
    text = raw.get("text_config")
    if not isinstance(text, Mapping):
        raise InvalidConfigError("text_config", "an mllama config needs its text_config object")
    lm = _llama_like(_Config({**text, "model_type": "llama"}), "llama")
    vision = mllama_from_config(raw, text, lm.hidden_size)
    return replace(lm, model_type=MLLAMA_MODEL_TYPE, mllama=vision)


def _common(c: _Config, model_type: str) -> dict[str, Any]:
    h = c.integer("hidden_size", "n_embd", "d_model")
    n_h = c.integer("num_attention_heads", "n_head")
    if n_h == 0 or h == 0:
        raise InvalidConfigError("num_attention_heads", "must be positive")
    n_kv = c.integer("num_key_value_heads", "multi_query_group_num", default=n_h)
    if n_kv == 0 or n_h % n_kv:
        raise InvalidConfigError(
            "num_key_value_heads", f"must divide num_attention_heads ({n_h}), got {n_kv}"
        )
    head_dim = c.integer("head_dim", "kv_channels", default=h // n_h)
    return {
        "model_type": model_type,
        "hidden_size": h,
        "num_hidden_layers": c.integer("num_hidden_layers", "num_layers", "n_layer"),
        "num_attention_heads": n_h,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "vocab_size": c.integer("vocab_size", "padded_vocab_size"),
        "tie_word_embeddings": c.boolean(
            "tie_word_embeddings", _TIE_DEFAULT.get(model_type, False)
        ),
        "hidden_act": c.string("hidden_act", "silu"),
        "max_position_embeddings": c.integer(
            "max_position_embeddings", "seq_length", "n_positions", default=2048
        ),
        "final_logit_softcapping": c.float_or_none("final_logit_softcapping"),
        "attn_logit_softcapping": c.float_or_none("attn_logit_softcapping"),
        "sliding_window": _sliding_window(c, model_type),
    }


def _sliding_window(c: _Config, model_type: str) -> int | None:
    """The window transformers applies on every layer (Gemma-3: on all but its global ones);
    Qwen2 turns it off with use_sliding_window, and Gemma-2's alternating windowed layers
    are modelled apart (its eager attention builds both masks at any length)."""
    if model_type == "gemma2" or not c.boolean("use_sliding_window", True):
        return None
    window = c.integer("sliding_window", default=0)
    return window or None


def _llama_like(c: _Config, model_type: str) -> ModelArch:
    base = _common(c, model_type)
    h, q, kv = base["hidden_size"], base["num_attention_heads"], base["num_key_value_heads"]
    d = base["head_dim"]
    qkv_bias = c.boolean("attention_bias", model_type in ("qwen2", "qwen2_moe"))
    o_bias = (
        c.boolean("attention_bias", False) if model_type not in ("qwen2", "qwen2_moe") else False
    )
    mlp_bias = c.boolean("mlp_bias", False)
    linears = [
        _linear("q_proj", LinearKind.ATTN_QKV, h, q * d, bias=qkv_bias),
        _linear("k_proj", LinearKind.ATTN_QKV, h, kv * d, bias=qkv_bias),
        _linear("v_proj", LinearKind.ATTN_QKV, h, kv * d, bias=qkv_bias),
        _linear("o_proj", LinearKind.ATTN_OUT, q * d, h, bias=o_bias),
    ]
    num_experts = c.integer("num_local_experts", "num_experts", default=0)
    intermediate = c.integer("intermediate_size")
    expert_i = shared_i = top_k = 0
    if num_experts:
        top_k = c.integer("num_experts_per_tok")
        expert_i = c.integer("moe_intermediate_size", default=intermediate)
        shared_i = c.integer("shared_expert_intermediate_size", default=0)
        linears += _routed_experts(h, num_experts, expert_i)
        if shared_i:
            linears += [
                _linear("gate_proj", LinearKind.MLP_IN, h, shared_i),
                _linear("up_proj", LinearKind.MLP_IN, h, shared_i),
                _linear("down_proj", LinearKind.MLP_OUT, shared_i, h),
                _linear("shared_expert_gate", LinearKind.SHARED_GATE, h, 1),
            ]
    else:
        linears += [
            _linear("gate_proj", LinearKind.MLP_IN, h, intermediate, bias=mlp_bias),
            _linear("up_proj", LinearKind.MLP_IN, h, intermediate, bias=mlp_bias),
            _linear("down_proj", LinearKind.MLP_OUT, intermediate, h, bias=mlp_bias),
        ]
    gemma2_like = model_type in ("gemma2", "gemma3_text")
    return ModelArch(
        **base,
        intermediate_size=intermediate,
        norm=NormKind.RMS,
        norms_per_layer=4 if gemma2_like else 2,
        qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text", "olmo2"),
        mlp=MlpKind.GATED,
        parallel_residual=False,
        lm_head_bias=False,
        linears=tuple(linears),
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        expert_intermediate_size=expert_i,
        shared_expert_intermediate_size=shared_i,
        global_layer_period=_global_layer_period(c) if model_type == "gemma3_text" else 0,
    )


# Gemma3TextConfig's sliding_window_pattern default: every sixth layer attends globally.
GEMMA3_SLIDING_WINDOW_PATTERN = 6


def _global_layer_period(c: _Config) -> int:
    """Gemma-3's period of global layers: from layer_types where the config lists them,
    else from sliding_window_pattern (transformers configuration_gemma3.py)."""
    types = c.raw.get("layer_types")
    if isinstance(types, list) and "full_attention" in types:
        return types.index("full_attention") + 1
    return c.integer("sliding_window_pattern", default=GEMMA3_SLIDING_WINDOW_PATTERN)


def _routed_experts(h: int, experts: int, expert_i: int) -> list[Linear]:
    """A MoE block's router and routed experts as transformers 5 keeps them: the router a bare
    Parameter, the experts 3-D parameters (MixtralExperts, Qwen2MoeExperts: gate_up_proj
    [E, 2I, h], down_proj [E, h, I]), which bitsandbytes' Linear4bit swap leaves in half
    precision; PEFT adapts them only where it converts the model type's targets to the experts'
    parameters (service/core/estimator/weights.py)."""
    return [
        Linear(
            name="gate",
            in_features=h,
            out_features=experts,
            bias=False,
            kind=LinearKind.ROUTER,
            expert=True,
        ),
        Linear(
            name="gate_up_proj",
            in_features=h,
            out_features=2 * expert_i,
            bias=False,
            kind=LinearKind.MLP_IN,
            count=experts,
            expert=True,
        ),
        Linear(
            name="down_proj",
            in_features=expert_i,
            out_features=h,
            bias=False,
            kind=LinearKind.MLP_OUT,
            count=experts,
            expert=True,
        ),
    ]


def _phi3(c: _Config, model_type: str) -> ModelArch:
    base = _common(c, model_type)
    h, d = base["hidden_size"], base["head_dim"]
    q, kv = base["num_attention_heads"], base["num_key_value_heads"]
    i = c.integer("intermediate_size")
    return ModelArch(
        **base,
        intermediate_size=i,
        norm=NormKind.RMS,
        norms_per_layer=2,
        qk_norm=False,
        mlp=MlpKind.GATED,
        parallel_residual=False,
        lm_head_bias=False,
        linears=(
            _linear("qkv_proj", LinearKind.ATTN_QKV, h, (q + 2 * kv) * d),
            _linear("o_proj", LinearKind.ATTN_OUT, q * d, h),
            _linear("gate_up_proj", LinearKind.MLP_IN, h, 2 * i),
            _linear("down_proj", LinearKind.MLP_OUT, i, h),
        ),
    )


def _glm(c: _Config, model_type: str) -> ModelArch:
    """transformers' GlmForCausalLM (THUDM/glm-4-9b-hf): q/k/v with bias, fused gate_up."""
    base = _common(c, model_type)
    h, d = base["hidden_size"], base["head_dim"]
    q, kv = base["num_attention_heads"], base["num_key_value_heads"]
    i = c.integer("intermediate_size")
    bias = c.boolean("attention_bias", True)
    return ModelArch(
        **base,
        intermediate_size=i,
        norm=NormKind.RMS,
        norms_per_layer=2,
        qk_norm=False,
        mlp=MlpKind.GATED,
        parallel_residual=False,
        lm_head_bias=False,
        linears=(
            _linear("q_proj", LinearKind.ATTN_QKV, h, q * d, bias=bias),
            _linear("k_proj", LinearKind.ATTN_QKV, h, kv * d, bias=bias),
            _linear("v_proj", LinearKind.ATTN_QKV, h, kv * d, bias=bias),
            _linear("o_proj", LinearKind.ATTN_OUT, q * d, h),
            _linear("gate_up_proj", LinearKind.MLP_IN, h, 2 * i),
            _linear("down_proj", LinearKind.MLP_OUT, i, h),
        ),
    )


def _chatglm(c: _Config, model_type: str) -> ModelArch:
    """THUDM's remote-code ChatGLM/GLM-4 (modeling_chatglm.py): fused query_key_value."""
    base = _common(c, model_type)
    h, d = base["hidden_size"], base["head_dim"]
    q, kv = base["num_attention_heads"], base["num_key_value_heads"]
    i = c.integer("ffn_hidden_size", "intermediate_size")
    qkv_bias = c.boolean("add_qkv_bias", False) or c.boolean("add_bias_linear", False)
    linear_bias = c.boolean("add_bias_linear", False)
    return ModelArch(
        **base,
        intermediate_size=i,
        norm=NormKind.RMS if c.boolean("rmsnorm", True) else NormKind.LAYER,
        norms_per_layer=2,
        qk_norm=False,
        mlp=MlpKind.GATED,
        parallel_residual=False,
        lm_head_bias=False,
        linears=(
            _linear("query_key_value", LinearKind.ATTN_QKV, h, (q + 2 * kv) * d, bias=qkv_bias),
            _linear("dense", LinearKind.ATTN_OUT, q * d, h, bias=linear_bias),
            _linear("dense_h_to_4h", LinearKind.MLP_IN, h, 2 * i, bias=linear_bias),
            _linear("dense_4h_to_h", LinearKind.MLP_OUT, i, h, bias=linear_bias),
        ),
    )


def _qwen_v1(c: _Config, model_type: str) -> ModelArch:
    """Qwen (v1) remote code: c_attn fused with bias; w1/w2 each intermediate_size / 2."""
    base = _common(c, model_type)
    h = base["hidden_size"]
    half = c.integer("intermediate_size") // 2
    return ModelArch(
        **base,
        intermediate_size=half,
        norm=NormKind.RMS,
        norms_per_layer=2,
        qk_norm=False,
        mlp=MlpKind.GATED,
        parallel_residual=False,
        lm_head_bias=False,
        linears=(
            _linear("c_attn", LinearKind.ATTN_QKV, h, 3 * h, bias=True),
            _linear("c_proj", LinearKind.ATTN_OUT, h, h),
            _linear("w1", LinearKind.MLP_IN, h, half),
            _linear("w2", LinearKind.MLP_IN, h, half),
            _linear("mlp.c_proj", LinearKind.MLP_OUT, half, h),
        ),
    )


def _gpt_neox(c: _Config, model_type: str) -> ModelArch:
    base = _common(c, model_type)
    base["hidden_act"] = c.string("hidden_act", "gelu")
    h = base["hidden_size"]
    i = c.integer("intermediate_size", default=4 * h)
    return ModelArch(
        **base,
        intermediate_size=i,
        norm=NormKind.LAYER,
        norms_per_layer=2,
        qk_norm=False,
        mlp=MlpKind.PLAIN,
        parallel_residual=c.boolean("use_parallel_residual", True),
        lm_head_bias=False,
        linears=(
            _linear("query_key_value", LinearKind.ATTN_QKV, h, 3 * h, bias=True),
            _linear("dense", LinearKind.ATTN_OUT, h, h, bias=True),
            _linear("dense_h_to_4h", LinearKind.MLP_IN, h, i, bias=True),
            _linear("dense_4h_to_h", LinearKind.MLP_OUT, i, h, bias=True),
        ),
    )


def _phi(c: _Config, model_type: str) -> ModelArch:
    """Phi-1/1.5/2: one LayerNorm per layer, parallel attention + MLP, lm_head with bias."""
    base = _common(c, model_type)
    base["hidden_act"] = c.string("hidden_act", "gelu_new")
    h = base["hidden_size"]
    i = c.integer("intermediate_size", default=4 * h)
    return ModelArch(
        **base,
        intermediate_size=i,
        norm=NormKind.LAYER,
        norms_per_layer=1,
        qk_norm=False,
        mlp=MlpKind.PLAIN,
        parallel_residual=True,
        lm_head_bias=True,
        residual_dropout=c.float_or_none("resid_pdrop") or 0.0,
        linears=(
            _linear("q_proj", LinearKind.ATTN_QKV, h, h, bias=True),
            _linear("k_proj", LinearKind.ATTN_QKV, h, h, bias=True),
            _linear("v_proj", LinearKind.ATTN_QKV, h, h, bias=True),
            _linear("dense", LinearKind.ATTN_OUT, h, h, bias=True),
            _linear("fc1", LinearKind.MLP_IN, h, i, bias=True),
            _linear("fc2", LinearKind.MLP_OUT, i, h, bias=True),
        ),
    )


def _stablelm(c: _Config, model_type: str) -> ModelArch:
    """StableLM (2, 3B-4E1T): Llama layout with LayerNorm."""
    arch = _llama_like(c, "llama")
    return ModelArch(
        **{
            **{f: getattr(arch, f) for f in ModelArch.__dataclass_fields__},
            "model_type": model_type,
            "norm": NormKind.LAYER,
            "parallel_residual": c.boolean("use_parallel_residual", False),
        }
    )


def _with_n_embed(c: _Config) -> _Config:
    """Falcon's and BLOOM's configurations take the older `n_embed` for hidden_size."""
    if c.raw.get("hidden_size") is None and c.raw.get("n_embed") is not None:
        return _Config({**c.raw, "hidden_size": c.integer("n_embed")})
    return c


def _falcon(c: _Config, model_type: str) -> ModelArch:
    """transformers' FalconForCausalLM (models/falcon/modeling_falcon.py, 5.24): one fused
    query_key_value, dense, a plain GELU MLP (dense_h_to_4h, dense_4h_to_h), LayerNorm, RoPE.
    The 7B layout (multi_query) has one key/value head and one LayerNorm read by attention and
    MLP in parallel; the new decoder architecture (40B, 180B, 11B) has num_kv_heads and two
    LayerNorms (ln_attn, ln_mlp) on the layer's input."""
    if c.boolean("alibi", False):
        raise InvalidConfigError("alibi", "Falcon with ALiBi (falcon-rw) is not supported")
    new_arch = c.boolean("new_decoder_architecture", False)
    parallel = c.boolean("parallel_attn", True)
    if not (new_arch or parallel):
        raise InvalidConfigError(
            "parallel_attn", "Falcon with sequential attention and MLP is not supported"
        )
    c = _with_n_embed(c)
    base = _common(c, model_type)
    base["hidden_act"] = c.string("activation", "gelu")
    h, n_h = base["hidden_size"], base["num_attention_heads"]
    if h % n_h:
        raise InvalidConfigError(
            "hidden_size", f"must be a multiple of num_attention_heads ({n_h})"
        )
    d = base["head_dim"] = h // n_h
    multi_query = not new_arch and c.boolean("multi_query", True)
    if new_arch:
        n_kv = c.integer("num_kv_heads", default=n_h)
    elif multi_query:
        n_kv = 1
    else:
        n_kv = n_h
    if n_kv == 0 or n_h % n_kv:
        raise InvalidConfigError(
            "num_kv_heads", f"must divide num_attention_heads ({n_h}), got {n_kv}"
        )
    base["num_key_value_heads"] = n_kv
    i = c.integer("ffn_hidden_size", default=4 * h)
    bias = c.boolean("bias", False)
    # FalconDecoderLayer: two LayerNorms when num_ln_in_parallel_attn is 2 (its default with the
    # new decoder architecture), else input_layernorm alone.
    norms = c.integer("num_ln_in_parallel_attn", default=2) if new_arch else 1
    if norms not in (1, 2):
        raise InvalidConfigError("num_ln_in_parallel_attn", f"must be 1 or 2, got {norms}")
    return ModelArch(
        **base,
        intermediate_size=i,
        norm=NormKind.LAYER,
        norms_per_layer=norms,
        qk_norm=False,
        mlp=MlpKind.PLAIN,
        parallel_residual=True,
        lm_head_bias=False,
        linears=(
            _linear("query_key_value", LinearKind.ATTN_QKV, h, (n_h + 2 * n_kv) * d, bias=bias),
            _linear("dense", LinearKind.ATTN_OUT, h, h, bias=bias),
            _linear("dense_h_to_4h", LinearKind.MLP_IN, h, i, bias=bias),
            _linear("dense_4h_to_h", LinearKind.MLP_OUT, i, h, bias=bias),
        ),
        # the new architecture broadcasts its key/value heads to the query heads before SDPA
        kv_broadcast=multi_query and n_h > 1,
        explicit_mask=True,
    )


def _bloom(c: _Config, model_type: str) -> ModelArch:
    """transformers' BloomForCausalLM (models/bloom/modeling_bloom.py, 5.24): fused
    query_key_value, dense, dense_h_to_4h, dense_4h_to_h, all with bias; LayerNorm before
    attention and MLP (sequential residual); a LayerNorm on the embedding output; ALiBi."""
    if c.boolean("apply_residual_connection_post_layernorm", False):
        raise InvalidConfigError(
            "apply_residual_connection_post_layernorm", "post-LayerNorm residuals are not supported"
        )
    c = _with_n_embed(c)
    base = _common(c, model_type)
    base["hidden_act"] = "gelu_pytorch_tanh"  # BloomGelu: the tanh approximation
    h = base["hidden_size"]
    n_h = base["num_attention_heads"]
    if h % n_h:
        raise InvalidConfigError("hidden_size", f"must be a multiple of n_head ({n_h})")
    base["head_dim"] = h // n_h
    base["num_key_value_heads"] = n_h
    i = 4 * h  # BloomMLP: dense_h_to_4h is hidden_size -> 4 * hidden_size
    return ModelArch(
        **base,
        intermediate_size=i,
        norm=NormKind.LAYER,
        norms_per_layer=2,
        qk_norm=False,
        mlp=MlpKind.PLAIN,
        parallel_residual=False,
        lm_head_bias=False,
        linears=(
            _linear("query_key_value", LinearKind.ATTN_QKV, h, 3 * h, bias=True),
            _linear("dense", LinearKind.ATTN_OUT, h, h, bias=True),
            _linear("dense_h_to_4h", LinearKind.MLP_IN, h, i, bias=True),
            _linear("dense_4h_to_h", LinearKind.MLP_OUT, i, h, bias=True),
        ),
        alibi=True,
        embedding_norm=True,
    )


# transformers' PreTrainedConfig: num_labels defaults to 2 (id2label of two classes).
DEFAULT_NUM_LABELS = 2
# transformers' BertConfig defaults (models/bert/configuration_bert.py).
BERT_DROPOUT = 0.1
BERT_TYPE_VOCAB_SIZE = 2


def _bert(c: _Config, model_type: str) -> ModelArch:
    """BertForSequenceClassification (transformers models/bert/modeling_bert.py): post-LN
    layers of query/key/value (bias), attention.output.dense, intermediate.dense (GELU) and
    output.dense; word, position and token-type embeddings with a LayerNorm; the pooler."""
    base = _common(c, model_type)
    base["hidden_act"] = c.string("hidden_act", "gelu")
    base["max_position_embeddings"] = c.integer("max_position_embeddings", default=512)
    base["tie_word_embeddings"] = False
    h = base["hidden_size"]
    if base["num_key_value_heads"] != base["num_attention_heads"]:
        raise InvalidConfigError("num_key_value_heads", "BERT has as many as attention heads")
    i = c.integer("intermediate_size", default=4 * h)
    labels = c.integer("num_labels", default=0)
    id2label = c.raw.get("id2label")
    if not labels and isinstance(id2label, Mapping) and id2label:
        labels = len(id2label)
    hidden_dropout = _dropout(c, "hidden_dropout_prob", BERT_DROPOUT)
    return ModelArch(
        **base,
        intermediate_size=i,
        norm=NormKind.LAYER,
        norms_per_layer=2,
        qk_norm=False,
        mlp=MlpKind.PLAIN,
        parallel_residual=False,
        lm_head_bias=False,
        linears=(
            _linear("query", LinearKind.ATTN_QKV, h, h, bias=True),
            _linear("key", LinearKind.ATTN_QKV, h, h, bias=True),
            _linear("value", LinearKind.ATTN_QKV, h, h, bias=True),
            _linear("attention.output.dense", LinearKind.ATTN_OUT, h, h, bias=True),
            _linear("intermediate.dense", LinearKind.MLP_IN, h, i, bias=True),
            _linear("output.dense", LinearKind.MLP_OUT, i, h, bias=True),
        ),
        encoder=True,
        type_vocab_size=c.integer("type_vocab_size", default=BERT_TYPE_VOCAB_SIZE),
        num_labels=labels or DEFAULT_NUM_LABELS,
        hidden_dropout=hidden_dropout,
        attention_dropout=_dropout(c, "attention_probs_dropout_prob", BERT_DROPOUT),
        classifier_dropout=_dropout(c, "classifier_dropout", hidden_dropout),
    )


# DeepSeek-V2's routers (transformers 5.24 DeepseekV2TopkRouter.forward): any other method
# leaves the top-k undefined.
_DEEPSEEK_V2_TOPK_METHODS = ("greedy", "group_limited_greedy")


def _deepseek(c: _Config, model_type: str) -> ModelArch:
    """DeepSeek-V2/V3 as transformers 5.24 builds them (modeling_deepseek_v2.py, _v3.py):
    multi-head latent attention (q_proj, or q_a_proj + q_a_layernorm + q_b_proj when
    q_lora_rank is set; kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj; o_proj), a dense MLP in
    the first `first_k_dense_replace` layers and DeepSeekMoE in the rest: an fp32 router, the
    routed experts as 3-D parameters, and `n_shared_experts` shared experts as one MLP of
    moe_intermediate_size * n_shared_experts. transformers ignores `moe_layer_freq` and
    builds no multi-token-prediction layers, and neither is counted."""
    base = _common(c, model_type)
    h, heads = base["hidden_size"], base["num_attention_heads"]
    layers = base["num_hidden_layers"]
    q_rank = c.integer("q_lora_rank", default=0)
    kv_rank = c.integer("kv_lora_rank")
    nope = c.integer("qk_nope_head_dim")
    rope = c.integer("qk_rope_head_dim")
    v_dim = c.integer("v_head_dim")
    for name, value in (
        ("kv_lora_rank", kv_rank),
        ("qk_rope_head_dim", rope),
        ("v_head_dim", v_dim),
    ):
        if value == 0:
            raise InvalidConfigError(name, "must be a positive integer")
    if rope % 2:
        raise InvalidConfigError("qk_rope_head_dim", f"must be even (RoPE pairs), got {rope}")
    qk_dim = nope + rope
    bias = c.boolean("attention_bias", False)
    attention = (
        [_linear("q_proj", LinearKind.ATTN_QKV, h, heads * qk_dim)]
        if not q_rank
        else [
            _linear("q_a_proj", LinearKind.ATTN_QKV, h, q_rank, bias=bias),
            _linear("q_b_proj", LinearKind.ATTN_QKV, q_rank, heads * qk_dim),
        ]
    )
    attention += [
        _linear("kv_a_proj_with_mqa", LinearKind.ATTN_QKV, h, kv_rank + rope, bias=bias),
        _linear("kv_b_proj", LinearKind.ATTN_QKV, kv_rank, heads * (nope + v_dim)),
        _linear("o_proj", LinearKind.ATTN_OUT, heads * v_dim, h, bias=bias),
    ]
    intermediate = c.integer("intermediate_size")
    mlp_bias = c.boolean("mlp_bias", False) if model_type == "deepseek_v2" else False
    dense_mlp = [
        _linear("gate_proj", LinearKind.MLP_IN, h, intermediate, bias=mlp_bias),
        _linear("up_proj", LinearKind.MLP_IN, h, intermediate, bias=mlp_bias),
        _linear("down_proj", LinearKind.MLP_OUT, intermediate, h, bias=mlp_bias),
    ]
    dense = c.integer("first_k_dense_replace", default=0 if model_type == "deepseek_v2" else 3)
    if dense > layers:
        raise InvalidConfigError(
            "first_k_dense_replace", f"must be at most num_hidden_layers ({layers}), got {dense}"
        )
    experts = c.integer("n_routed_experts", "num_experts")
    top_k = c.integer("num_experts_per_tok", default=0 if model_type == "deepseek_v2" else 8)
    if dense < layers and (experts == 0 or not 0 < top_k <= experts):
        raise InvalidConfigError(
            "num_experts_per_tok",
            f"must be between 1 and n_routed_experts ({experts}) for the MoE layers, got {top_k}",
        )
    groups = c.integer("n_group", default=0 if model_type == "deepseek_v2" else 8)
    method = c.string("topk_method", "greedy") if model_type == "deepseek_v2" else ""
    if method and method not in _DEEPSEEK_V2_TOPK_METHODS:
        raise InvalidConfigError(
            "topk_method", f"must be one of {', '.join(_DEEPSEEK_V2_TOPK_METHODS)}, got {method!r}"
        )
    if (method == "group_limited_greedy" or model_type == "deepseek_v3") and (
        groups == 0 or experts % groups
    ):
        raise InvalidConfigError(
            "n_group", f"must divide n_routed_experts ({experts}) for group-limited routing"
        )
    expert_i = c.integer("moe_intermediate_size")
    shared_i = expert_i * c.integer(
        "n_shared_experts", default=0 if model_type == "deepseek_v2" else 1
    )
    moe = _routed_experts(h, experts, expert_i)
    if shared_i:
        moe += [
            _linear("gate_proj", LinearKind.MLP_IN, h, shared_i),
            _linear("up_proj", LinearKind.MLP_IN, h, shared_i),
            _linear("down_proj", LinearKind.MLP_OUT, shared_i, h),
        ]
    all_dense = dense == layers
    return ModelArch(
        **{**base, "head_dim": qk_dim},
        intermediate_size=intermediate,
        norm=NormKind.RMS,
        norms_per_layer=2,
        qk_norm=False,
        mlp=MlpKind.GATED,
        parallel_residual=False,
        lm_head_bias=False,
        linears=tuple(attention + (dense_mlp if all_dense else moe)),
        num_experts=0 if all_dense else experts,
        num_experts_per_tok=0 if all_dense else top_k,
        expert_intermediate_size=0 if all_dense else expert_i,
        shared_expert_intermediate_size=0 if all_dense else shared_i,
        dense_layers=0 if all_dense else dense,
        dense_linears=() if all_dense or not dense else tuple(attention + dense_mlp),
        q_lora_rank=q_rank,
        kv_lora_rank=kv_rank,
        qk_rope_head_dim=rope,
        v_head_dim=v_dim,
    )
