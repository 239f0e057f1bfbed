"""Model architectures from HF `config.json` values: module layout and parameter counts.

An architecture is the list of the modules a decoder layer holds, named as transformers names
them (so PEFT's `target_modules` match), plus embeddings, norms and the LM head. Parameter
counts, LoRA targets, quantized weights and saved activations are all derived from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import astuple, dataclass, field
from enum import StrEnum
from typing import Any

from service.core.errors import InvalidConfigError


class LinearKind(StrEnum):
    ATTN_QKV = "attn_qkv"  # q, k, v projections (separate or fused)
    ATTN_OUT = "attn_out"
    MLP_IN = "mlp_in"  # gate/up (or fc1); reads the layer's normed hidden state
    MLP_OUT = "mlp_out"  # down (or fc2)
    ROUTER = "router"
    SHARED_GATE = "shared_gate"


@dataclass(frozen=True, slots=True, kw_only=True)
class Linear:
    """One nn.Linear of a decoder layer; `count` > 1 for a stack of MoE experts."""

    name: str
    in_features: int
    out_features: int
    bias: bool
    kind: LinearKind
    count: int = 1
    # Not an nn.Linear in transformers 5 (MoE experts and routers are bare Parameters):
    # never a LoRA "all-linear" target, never quantized.
    expert: bool = False

    @property
    def weight_elements(self) -> int:
        return self.in_features * self.out_features * self.count

    @property
    def params(self) -> int:
        return self.weight_elements + (self.out_features * self.count if self.bias else 0)


# Activations transformers composes from elementwise ops (activations.py NewGELUActivation)
# rather than calling one fused kernel, so autograd keeps their intermediates.
COMPOSITE_TANH_GELU = frozenset({"gelu_new"})


class NormKind(StrEnum):
    RMS = "rmsnorm"
    LAYER = "layernorm"  # weight and bias


class MlpKind(StrEnum):
    GATED = "gated"  # act(gate(x)) * up(x) -> down  (SwiGLU, GeGLU)
    PLAIN = "plain"  # act(fc1(x)) -> fc2


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelArch:
    """A decoder-only transformer, as its config.json describes it."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    hidden_act: str
    max_position_embeddings: int
    norm: NormKind
    norms_per_layer: int
    qk_norm: bool  # per-head RMSNorm on q and k (Qwen3)
    mlp: MlpKind
    parallel_residual: bool  # attention and MLP read the same input (GPT-NeoX, Phi-1.5)
    lm_head_bias: bool
    final_logit_softcapping: float | None
    attn_logit_softcapping: float | None  # Gemma-2: tanh on the attention scores (eager)
    # Attention limited to this many previous tokens (Mistral v0.1, Phi-3); None when off.
    sliding_window: int | None
    linears: tuple[Linear, ...]
    num_experts: int = 0
    num_experts_per_tok: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    # Dropout on the attention and MLP outputs before the residual add (Phi's resid_pdrop),
    # active in training: each call keeps a one-byte mask per element for its backward.
    residual_dropout: float = 0.0
    # Every n-th layer attends globally, the others within `sliding_window` (Gemma-3's
    # sliding_window_pattern, transformers' layer_types); 0 when every layer is alike.
    global_layer_period: int = 0
    # An architecture keys the estimator's caches on every call: its hash is computed once.
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            if getattr(self, name) < 1:
                raise InvalidConfigError(name, "must be a positive integer")
        object.__setattr__(self, "_hash", hash(astuple(self)[:-1]))

    def __hash__(self) -> int:
        return self._hash

    @property
    def global_layers(self) -> int:
        """Layers attending globally in a stack of sliding-window ones (layer i is global
        when (i + 1) % period == 0, transformers' Gemma3TextConfig.layer_types)."""
        period = self.global_layer_period
        return self.num_hidden_layers // period if period else 0

    def windowed(self, seq_len: int) -> bool:
        """Whether transformers builds an explicit sliding-window mask for `seq_len` tokens:
        from the window's length on (masking_utils._ignore_causal_mask_sdpa keeps the mask
        when kv_length >= local_attention_size)."""
        return self.sliding_window is not None and seq_len >= self.sliding_window

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def fused_qkv_linear(self) -> bool:
        """q, k and v come from one projection (GPT-NeoX's query_key_value, Phi-3's qkv_proj)."""
        return sum(1 for lin in self.linears if lin.kind is LinearKind.ATTN_QKV) == 1

    @property
    def norm_params(self) -> int:
        per = self.hidden_size * (2 if self.norm is NormKind.LAYER else 1)
        return per

    @property
    def layer_norm_params(self) -> int:
        qk = 2 * self.head_dim if self.qk_norm else 0
        return self.norms_per_layer * self.norm_params + qk

    @property
    def layer_params(self) -> int:
        return sum(lin.params for lin in self.linears) + self.layer_norm_params

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        """Parameters the LM head adds (zero when tied to the embedding)."""
        if self.tie_word_embeddings:
            return 0
        return self.vocab_size * self.hidden_size + (self.vocab_size if self.lm_head_bias else 0)

    @property
    def total_params(self) -> int:
        return (
            self.embedding_params
            + self.num_hidden_layers * self.layer_params
            + self.norm_params
            + self.lm_head_params
        )

    @property
    def active_params(self) -> int:
        """Parameters one token passes through (MoE: only the routed experts)."""
        if not self.is_moe:
            return self.total_params
        inactive = sum(
            lin.params // lin.count * (lin.count - self.num_experts_per_tok)
            for lin in self.linears
            if lin.expert and lin.count > 1
        )
        return self.total_params - self.num_hidden_layers * inactive


# ---------------------------------------------------------------------------------------------
# config.json parsing


def _linear(
    name: str, kind: LinearKind, in_features: int, out_features: int, *, bias: bool = False
) -> Linear:
    """One nn.Linear of a layer, as the parsers below list them."""
    return Linear(
        name=name, in_features=in_features, out_features=out_features, bias=bias, kind=kind
    )


class _Config:
    """Typed reads of a config.json mapping, naming the field on error."""

    def __init__(self, raw: Mapping[str, Any]) -> None:
        self.raw = raw

    def integer(self, *names: str, default: int | None = None) -> int:
        for name in names:
            value = self.raw.get(name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidConfigError(name, f"must be a non-negative integer, got {value!r}")
            return value
        if default is None:
            raise InvalidConfigError(names[0], "is required")
        return default

    def boolean(self, name: str, default: bool) -> bool:
        value = self.raw.get(name, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise InvalidConfigError(name, f"must be true or false, got {value!r}")
        return value

    def string(self, name: str, default: str) -> str:
        value = self.raw.get(name, default)
        if not isinstance(value, str):
            raise InvalidConfigError(name, f"must be a string, got {value!r}")
        return value

    def float_or_none(self, name: str) -> float | None:
        value = self.raw.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidConfigError(name, f"must be a number, got {value!r}")
        return float(value)


# model_type -> tie_word_embeddings when the config omits it (each transformers
# configuration_<model>.py default).
_TIE_DEFAULT = {"gemma": True, "gemma2": True, "gemma3_text": True}

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

SUPPORTED_MODEL_TYPES = frozenset(
    _LLAMA_LIKE | {"phi3", "glm", "chatglm", "qwen", "gpt_neox", "phi", "stablelm"}
)


def from_hf_config(raw: Mapping[str, Any]) -> ModelArch:
    """Build a ModelArch from a config.json mapping as published on the Hugging Face Hub."""
    if not isinstance(raw, Mapping):
        raise InvalidConfigError("(root)", "must be a JSON object")
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
    builders = {
        "phi3": _phi3,
        "glm": _glm,
        "chatglm": _chatglm,
        "qwen": _qwen_v1,
        "gpt_neox": _gpt_neox,
        "phi": _phi,
        "stablelm": _stablelm,
    }
    return builders[model_type](c, model_type)


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
        # transformers 5 keeps experts as 3-D parameters (MixtralExperts, Qwen2MoeExperts:
        # gate_up_proj [E, 2I, h], down_proj [E, h, I]) and the router as a bare Parameter,
        # so neither PEFT's "all-linear" nor bitsandbytes' Linear4bit swap touches them.
        linears.append(
            Linear(
                name="gate",
                in_features=h,
                out_features=num_experts,
                bias=False,
                kind=LinearKind.ROUTER,
                expert=True,
            )
        )
        linears.append(
            Linear(
                name="gate_up_proj",
                in_features=h,
                out_features=2 * expert_i,
                bias=False,
                kind=LinearKind.MLP_IN,
                count=num_experts,
                expert=True,
            )
        )
        linears.append(
            Linear(
                name="down_proj",
                in_features=expert_i,
                out_features=h,
                bias=False,
                kind=LinearKind.MLP_OUT,
                count=num_experts,
                expert=True,
            )
        )
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
