"""Architectures from a model's `config.json` as published on the Hugging Face Hub: each
supported `model_type` belongs to a Family (service/core/arch/hf_values.py) in FAMILIES, which names
the modules as transformers builds them, and one reader builds the ModelArch of any family
(service/core/arch/__init__.py holds what it builds)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from service.core.arch import LinearKind, MlpKind, ModelArch, NormKind
from service.core.arch.hf_structure import (
    bert_classifier,
    bloom_heads,
    bloom_prepare,
    deepseek,
    falcon_heads,
    falcon_layer_norms,
    falcon_prepare,
    gemma3_global_layers,
    optional_experts,
)
from service.core.arch.hf_t5 import T5_TIE_WORD_EMBEDDINGS, t5_arch
from service.core.arch.hf_values import Config, Family, Fields, LinearSpec, flag, linear, resolve
from service.core.arch.mllama import MLLAMA_MODEL_TYPE, mllama_from_config
from service.core.arch.vision import VISION_MODEL_TYPES, vision_from_config
from service.core.errors import InvalidConfigError

# transformers' PretrainedConfig and LlamaConfig defaults (configuration_utils.py,
# models/llama/configuration_llama.py), which a family's `defaults` override.
COMMON_DEFAULTS: Mapping[str, Any] = {
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
}
# max_position_embeddings where the config gives none of its keys
DEFAULT_MAX_POSITION_EMBEDDINGS = 2048

_QKV, _OUT = LinearKind.ATTN_QKV, LinearKind.ATTN_OUT
_IN, _DOWN = LinearKind.MLP_IN, LinearKind.MLP_OUT
_ATTENTION_BIAS = flag("attention_bias")
_MLP_BIAS = flag("mlp_bias")

# LlamaAttention and LlamaMLP (models/llama/modeling_llama.py): q/k/v/o with attention_bias,
# gate/up/down with mlp_bias.
_LLAMA_LINEARS = (
    LinearSpec("q_proj", _QKV, "h", "q*d", _ATTENTION_BIAS),
    LinearSpec("k_proj", _QKV, "h", "kv*d", _ATTENTION_BIAS),
    LinearSpec("v_proj", _QKV, "h", "kv*d", _ATTENTION_BIAS),
    LinearSpec("o_proj", _OUT, "q*d", "h", _ATTENTION_BIAS),
    LinearSpec("gate_proj", _IN, "h", "i", _MLP_BIAS),
    LinearSpec("up_proj", _IN, "h", "i", _MLP_BIAS),
    LinearSpec("down_proj", _DOWN, "i", "h", _MLP_BIAS),
)
# Qwen2Attention (models/qwen2/modeling_qwen2.py): q/k/v with bias, o_proj without.
_QWEN2_LINEARS = (
    *_LLAMA_LINEARS[:3],
    LinearSpec("o_proj", _OUT, "q*d", "h"),
    *_LLAMA_LINEARS[4:],
)
# GPTNeoX, BLOOM, Falcon and ChatGLM: fused query_key_value, dense, dense_h_to_4h, dense_4h_to_h.
_NEOX_LINEARS = (
    LinearSpec("query_key_value", _QKV, "h", "3h", True),
    LinearSpec("dense", _OUT, "h", "h", True),
    LinearSpec("dense_h_to_4h", _IN, "h", "i", True),
    LinearSpec("dense_4h_to_h", _DOWN, "i", "h", True),
)
_FALCON_BIAS = flag("bias")
_TIED = {"tie_word_embeddings": True}

FAMILIES: tuple[Family, ...] = (
    Family(
        ("llama", "mistral", "yi", "granite", "mixtral"),
        "models/llama/modeling_llama.py (Mistral, Mixtral, Granite alike)",
        _LLAMA_LINEARS,
        structure=(optional_experts,),
    ),
    Family(
        ("qwen2", "qwen2_moe"),
        "models/qwen2/modeling_qwen2.py, models/qwen2_moe/modeling_qwen2_moe.py",
        _QWEN2_LINEARS,
        defaults={"attention_bias": True},
        structure=(optional_experts,),
    ),
    Family(
        ("qwen3", "qwen3_moe", "olmo2"),
        "models/qwen3/modeling_qwen3.py, models/olmo2/modeling_olmo2.py: RMSNorm on q and k",
        _LLAMA_LINEARS,
        qk_norm=True,
        structure=(optional_experts,),
    ),
    Family(
        ("gemma",),
        "models/gemma/configuration_gemma.py: tied embeddings",
        _LLAMA_LINEARS,
        defaults=_TIED,
        structure=(optional_experts,),
    ),
    Family(
        ("gemma2",),
        "models/gemma2/modeling_gemma2.py: four RMSNorms a layer; its alternating windowed "
        "layers are modelled apart (eager attention builds both masks at any length)",
        _LLAMA_LINEARS,
        defaults=_TIED,
        norms_per_layer=4,
        sliding_window=False,
        structure=(optional_experts,),
    ),
    Family(
        ("gemma3_text",),
        "models/gemma3/modeling_gemma3.py: four RMSNorms a layer, q/k norms, a window on all "
        "but the global layers",
        _LLAMA_LINEARS,
        defaults=_TIED,
        norms_per_layer=4,
        qk_norm=True,
        structure=(optional_experts, gemma3_global_layers),
    ),
    Family(
        ("stablelm",),
        "models/stablelm/modeling_stablelm.py (2, 3B-4E1T): the Llama layout with LayerNorm",
        _LLAMA_LINEARS,
        defaults={"use_parallel_residual": False},
        rms_norm=False,
        parallel_residual=flag("use_parallel_residual"),
        structure=(optional_experts,),
    ),
    Family(
        ("deepseek_v2",),
        "models/deepseek_v2/configuration_deepseek_v2.py, modeling_deepseek_v2.py (5.24)",
        defaults={
            "first_k_dense_replace": 0,
            "num_experts_per_tok": 0,
            "n_group": 0,
            "n_shared_experts": 0,
        },
        structure=(deepseek,),
    ),
    Family(
        ("deepseek_v3",),
        "models/deepseek_v3/configuration_deepseek_v3.py, modeling_deepseek_v3.py (5.24)",
        defaults={
            "first_k_dense_replace": 3,
            "num_experts_per_tok": 8,
            "n_group": 8,
            "n_shared_experts": 1,
        },
        structure=(deepseek,),
    ),
    Family(
        ("phi3",),
        "models/phi3/modeling_phi3.py: fused qkv_proj and gate_up_proj",
        (
            LinearSpec("qkv_proj", _QKV, "h", "qkv*d"),
            LinearSpec("o_proj", _OUT, "q*d", "h"),
            LinearSpec("gate_up_proj", _IN, "h", "2i"),
            LinearSpec("down_proj", _DOWN, "i", "h"),
        ),
    ),
    Family(
        ("glm",),
        "models/glm/modeling_glm.py (THUDM/glm-4-9b-hf): q/k/v with bias, fused gate_up_proj",
        (
            *_LLAMA_LINEARS[:3],
            LinearSpec("o_proj", _OUT, "q*d", "h"),
            LinearSpec("gate_up_proj", _IN, "h", "2i"),
            LinearSpec("down_proj", _DOWN, "i", "h"),
        ),
        defaults={"attention_bias": True},
    ),
    Family(
        ("chatglm",),
        "THUDM's remote-code ChatGLM/GLM-4 (modeling_chatglm.py): fused query_key_value",
        (
            LinearSpec(
                "query_key_value", _QKV, "h", "qkv*d", flag("add_qkv_bias", "add_bias_linear")
            ),
            LinearSpec("dense", _OUT, "q*d", "h", flag("add_bias_linear")),
            LinearSpec("dense_h_to_4h", _IN, "h", "2i", flag("add_bias_linear")),
            LinearSpec("dense_4h_to_h", _DOWN, "i", "h", flag("add_bias_linear")),
        ),
        defaults={"add_qkv_bias": False, "add_bias_linear": False, "rmsnorm": True},
        intermediate_keys=("ffn_hidden_size", "intermediate_size"),
        rms_norm=flag("rmsnorm"),
    ),
    Family(
        ("qwen",),
        "Qwen (v1) remote code (modeling_qwen.py): c_attn fused with bias; w1/w2 each "
        "intermediate_size / 2",
        (
            LinearSpec("c_attn", _QKV, "h", "3h", True),
            LinearSpec("c_proj", _OUT, "h", "h"),
            LinearSpec("w1", _IN, "h", "i"),
            LinearSpec("w2", _IN, "h", "i"),
            LinearSpec("mlp.c_proj", _DOWN, "i", "h"),
        ),
        intermediate_divisor=2,
    ),
    Family(
        ("gpt_neox",),
        "models/gpt_neox/configuration_gpt_neox.py, modeling_gpt_neox.py",
        _NEOX_LINEARS,
        defaults={"hidden_act": "gelu", "use_parallel_residual": True},
        intermediate_ratio=4,
        rms_norm=False,
        mlp=MlpKind.PLAIN,
        parallel_residual=flag("use_parallel_residual"),
    ),
    Family(
        ("phi",),
        "models/phi/modeling_phi.py (Phi-1/1.5/2): one LayerNorm a layer, parallel attention "
        "and MLP, lm_head with bias",
        (
            LinearSpec("q_proj", _QKV, "h", "h", True),
            LinearSpec("k_proj", _QKV, "h", "h", True),
            LinearSpec("v_proj", _QKV, "h", "h", True),
            LinearSpec("dense", _OUT, "h", "h", True),
            LinearSpec("fc1", _IN, "h", "i", True),
            LinearSpec("fc2", _DOWN, "i", "h", True),
        ),
        defaults={"hidden_act": "gelu_new"},
        intermediate_ratio=4,
        rms_norm=False,
        norms_per_layer=1,
        mlp=MlpKind.PLAIN,
        parallel_residual=True,
        lm_head_bias=True,
        residual_dropout_key="resid_pdrop",
    ),
    Family(
        ("falcon",),
        "models/falcon/configuration_falcon.py, modeling_falcon.py (5.24): one fused "
        "query_key_value, a plain GELU MLP, LayerNorm, RoPE, attention and MLP in parallel",
        (
            LinearSpec("query_key_value", _QKV, "h", "qkv*d", _FALCON_BIAS),
            LinearSpec("dense", _OUT, "h", "h", _FALCON_BIAS),
            LinearSpec("dense_h_to_4h", _IN, "h", "i", _FALCON_BIAS),
            LinearSpec("dense_4h_to_h", _DOWN, "i", "h", _FALCON_BIAS),
        ),
        defaults={
            **_TIED,
            "activation": "gelu",
            "alibi": False,
            "bias": False,
            "multi_query": True,
            "new_decoder_architecture": False,
            "parallel_attn": True,
        },
        intermediate_keys=("ffn_hidden_size",),
        intermediate_ratio=4,
        activation_key="activation",
        rms_norm=False,
        mlp=MlpKind.PLAIN,
        parallel_residual=True,
        arch_fields={"explicit_mask": True},
        prepare=falcon_prepare,
        heads=falcon_heads,
        structure=(falcon_layer_norms,),
    ),
    Family(
        ("bloom",),
        "models/bloom/configuration_bloom.py, modeling_bloom.py (5.24): LayerNorm before "
        "attention and MLP, a LayerNorm on the embedding output, ALiBi; BloomGelu is the tanh "
        "approximation and dense_h_to_4h is hidden_size -> 4 * hidden_size",
        _NEOX_LINEARS,
        defaults={
            **_TIED,
            "hidden_act": "gelu_pytorch_tanh",
            "apply_residual_connection_post_layernorm": False,
        },
        intermediate_keys=(),
        intermediate_ratio=4,
        activation_key=None,
        rms_norm=False,
        mlp=MlpKind.PLAIN,
        arch_fields={"alibi": True, "embedding_norm": True},
        prepare=bloom_prepare,
        heads=bloom_heads,
    ),
    Family(
        ("bert",),
        "models/bert/configuration_bert.py, modeling_bert.py: post-LN layers of query/key/value "
        "(bias), attention.output.dense, intermediate.dense (GELU) and output.dense",
        (
            LinearSpec("query", _QKV, "h", "h", True),
            LinearSpec("key", _QKV, "h", "h", True),
            LinearSpec("value", _QKV, "h", "h", True),
            LinearSpec("attention.output.dense", _OUT, "h", "h", True),
            LinearSpec("intermediate.dense", _IN, "h", "i", True),
            LinearSpec("output.dense", _DOWN, "i", "h", True),
        ),
        defaults={"hidden_act": "gelu"},
        intermediate_ratio=4,
        rms_norm=False,
        mlp=MlpKind.PLAIN,
        task="encoder",
        structure=(bert_classifier,),
    ),
    Family(
        ("t5", "mt5"),
        "models/t5/configuration_t5.py, modeling_t5.py (service/core/arch/hf_t5.py)",
        defaults={"tie_word_embeddings": T5_TIE_WORD_EMBEDDINGS},
        task="seq2seq",
        reader=t5_arch,
    ),
)

FAMILY_OF: Mapping[str, Family] = {t: f for f in FAMILIES for t in f.model_types}

# Encoder model types, run as transformers' <Model>ForSequenceClassification.
ENCODER_MODEL_TYPES = frozenset(t for f in FAMILIES if f.task == "encoder" for t in f.model_types)
# Encoder-decoder model types, run as transformers' <Model>ForConditionalGeneration.
ENCODER_DECODER_MODEL_TYPES = frozenset(
    t for f in FAMILIES if f.task == "seq2seq" for t in f.model_types
)

SUPPORTED_MODEL_TYPES = frozenset(FAMILY_OF) | VISION_MODEL_TYPES | {MLLAMA_MODEL_TYPE}


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
    model_type = Config(raw).string("model_type", "")
    if not model_type:
        raise InvalidConfigError("model_type", "is required")
    if model_type not in FAMILY_OF:
        known = ", ".join(sorted(SUPPORTED_MODEL_TYPES))
        raise InvalidConfigError("model_type", f"{model_type!r} is not supported (known: {known})")
    return read_family(FAMILY_OF[model_type], raw, model_type)


def _vision_language(raw: Mapping[str, Any]) -> ModelArch:
    """Qwen2-VL / Qwen2.5-VL: a Qwen2 language model (its keys at the top level, or under
    text_config) and a vision tower (architecture_vision.py)."""
    model_type = str(raw["model_type"])
    text = raw.get("text_config")
    values = {**raw, **text} if isinstance(text, Mapping) else dict(raw)
    lm = read_family(FAMILY_OF["qwen2"], {**values, "model_type": "qwen2"}, "qwen2")
    vision = vision_from_config(model_type, raw, lm.hidden_size)
    return replace(lm, model_type=model_type, vision=vision)


def _mllama(raw: Mapping[str, Any]) -> ModelArch:
    """Llama-3.2-Vision: a Llama language model under text_config (its cross-attention
    layers counted among num_hidden_layers) and a vision tower (architecture_mllama.py)."""
    text = raw.get("text_config")
    if not isinstance(text, Mapping):
        raise InvalidConfigError("text_config", "an mllama config needs its text_config object")
    lm = read_family(FAMILY_OF["llama"], {**text, "model_type": "llama"}, "llama")
    vision = mllama_from_config(raw, text, lm.hidden_size)
    return replace(lm, model_type=MLLAMA_MODEL_TYPE, mllama=vision)


def read_family(family: Family, raw: Mapping[str, Any], model_type: str) -> ModelArch:
    """The ModelArch of a config of `family`: the fields every family reads alike, the
    family's head counts and MLP width, its layer's modules, and its structure hooks."""
    c = Config(raw, {**COMMON_DEFAULTS, **family.defaults})
    if family.reader is not None:
        return family.reader(c, model_type)
    if family.prepare is not None:
        c = family.prepare(c)
    fields = _common(c, model_type, family)
    if family.heads is not None:
        family.heads(c, fields)
    fields["intermediate_size"] = _intermediate(c, family, fields["hidden_size"])
    dims = layer_dims(fields)
    fields.update(
        norm=NormKind.RMS if resolve(family.rms_norm, c) else NormKind.LAYER,
        norms_per_layer=family.norms_per_layer,
        qk_norm=family.qk_norm,
        mlp=family.mlp,
        parallel_residual=resolve(family.parallel_residual, c),
        lm_head_bias=family.lm_head_bias,
        linears=tuple(
            linear(
                s.name, s.kind, dims[s.in_features], dims[s.out_features], bias=resolve(s.bias, c)
            )
            for s in family.linears
        ),
        **family.arch_fields,
    )
    if family.residual_dropout_key is not None:
        fields["residual_dropout"] = c.float_or_none(family.residual_dropout_key) or 0.0
    for hook in family.structure:
        hook(c, fields)
    return ModelArch(**fields)


def _common(c: Config, model_type: str, family: Family) -> Fields:
    """The fields every family reads alike, under the keys their configurations use."""
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
    fields: Fields = {
        "model_type": model_type,
        "hidden_size": h,
        "num_hidden_layers": c.integer("num_hidden_layers", "num_layers", "n_layer"),
        "num_attention_heads": n_h,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "vocab_size": c.integer("vocab_size", "padded_vocab_size"),
        "tie_word_embeddings": c.boolean("tie_word_embeddings"),
        "hidden_act": c.string("hidden_act"),
        "max_position_embeddings": c.integer(
            "max_position_embeddings",
            "seq_length",
            "n_positions",
            default=DEFAULT_MAX_POSITION_EMBEDDINGS,
        ),
        "final_logit_softcapping": c.float_or_none("final_logit_softcapping"),
        "attn_logit_softcapping": c.float_or_none("attn_logit_softcapping"),
        "sliding_window": _sliding_window(c, family),
    }
    if family.activation_key is None:
        fields["hidden_act"] = str(c.defaults["hidden_act"])
    elif family.activation_key != "hidden_act":
        fields["hidden_act"] = c.string(family.activation_key)
    return fields


def _sliding_window(c: Config, family: Family) -> int | None:
    """The window transformers applies on every layer (Gemma-3: on all but its global ones);
    Qwen2 turns it off with use_sliding_window."""
    if not family.sliding_window or not c.boolean("use_sliding_window", True):
        return None
    window = c.integer("sliding_window", default=0)
    return window or None


def _intermediate(c: Config, family: Family, h: int) -> int:
    """The MLP width: the first of the family's keys the config gives, else
    intermediate_ratio * hidden_size (required where the family has no ratio)."""
    ratio_default = family.intermediate_ratio * h or None
    if not family.intermediate_keys:
        return family.intermediate_ratio * h
    return (
        c.integer(*family.intermediate_keys, default=ratio_default) // family.intermediate_divisor
    )


def layer_dims(fields: Fields) -> dict[str, int]:
    """The dimensions a LinearSpec names: h (hidden), i (MLP width), q*d and kv*d (query and
    key/value heads times head_dim), qkv*d (both fused), 2i and 3h (fused pairs and triples)."""
    h, i, d = fields["hidden_size"], fields["intermediate_size"], fields["head_dim"]
    q, kv = fields["num_attention_heads"], fields["num_key_value_heads"]
    return {
        "h": h,
        "i": i,
        "2i": 2 * i,
        "3h": 3 * h,
        "q*d": q * d,
        "kv*d": kv * d,
        "qkv*d": (q + 2 * kv) * d,
    }
