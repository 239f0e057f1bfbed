"""The structure hooks of the model families (service/core/arch/hf_config.py FAMILIES): what a
family builds beyond the modules its descriptor lists, each reading the config and completing
the fields of the ModelArch being read."""

from __future__ import annotations

from collections.abc import Mapping

from service.core.arch import Linear, LinearKind
from service.core.arch.hf_values import Config, Fields, dropout, linear
from service.core.errors import InvalidConfigError

# Gemma3TextConfig's sliding_window_pattern default: every sixth layer attends globally.
GEMMA3_SLIDING_WINDOW_PATTERN = 6
# transformers' PreTrainedConfig: num_labels defaults to 2 (id2label of two classes).
DEFAULT_NUM_LABELS = 2
# transformers' BertConfig defaults (models/bert/configuration_bert.py).
BERT_DROPOUT = 0.1
BERT_TYPE_VOCAB_SIZE = 2
BERT_MAX_POSITION_EMBEDDINGS = 512
_MLP_KINDS = (LinearKind.MLP_IN, LinearKind.MLP_OUT)


def routed_experts(h: int, experts: int, expert_i: int) -> list[Linear]:
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


def shared_mlp(h: int, width: int) -> list[Linear]:
    """The shared experts of a MoE block, one gated MLP of `width`."""
    return [
        linear("gate_proj", LinearKind.MLP_IN, h, width),
        linear("up_proj", LinearKind.MLP_IN, h, width),
        linear("down_proj", LinearKind.MLP_OUT, width, h),
    ]


def optional_experts(c: Config, f: Fields) -> None:
    """Mixtral / Qwen-MoE layouts: where the config names experts, routed experts (and Qwen's
    gated shared expert) replace the layer's MLP."""
    num_experts = c.integer("num_local_experts", "num_experts", default=0)
    expert_i = shared_i = top_k = 0
    if num_experts:
        h, intermediate = f["hidden_size"], f["intermediate_size"]
        top_k = c.integer("num_experts_per_tok")
        expert_i = c.integer("moe_intermediate_size", default=intermediate)
        shared_i = c.integer("shared_expert_intermediate_size", default=0)
        attention = [x for x in f["linears"] if x.kind not in _MLP_KINDS]
        moe = attention + routed_experts(h, num_experts, expert_i)
        if shared_i:
            moe += shared_mlp(h, shared_i)
            moe.append(linear("shared_expert_gate", LinearKind.SHARED_GATE, h, 1))
        f["linears"] = tuple(moe)
    f["num_experts"] = num_experts
    f["num_experts_per_tok"] = top_k
    f["expert_intermediate_size"] = expert_i
    f["shared_expert_intermediate_size"] = shared_i


def gemma3_global_layers(c: Config, f: Fields) -> None:
    """Gemma-3's period of global layers: from layer_types where the config lists them,
    else from sliding_window_pattern (transformers configuration_gemma3.py)."""
    types = c.raw.get("layer_types")
    if isinstance(types, list) and "full_attention" in types:
        f["global_layer_period"] = types.index("full_attention") + 1
    else:
        f["global_layer_period"] = c.integer(
            "sliding_window_pattern", default=GEMMA3_SLIDING_WINDOW_PATTERN
        )


def with_n_embed(c: Config) -> Config:
    """Falcon's and BLOOM's configurations take the older `n_embed` for hidden_size."""
    if c.raw.get("hidden_size") is None and c.raw.get("n_embed") is not None:
        return Config({**c.raw, "hidden_size": c.integer("n_embed")}, c.defaults)
    return c


def _heads_divide_hidden(f: Fields, name: str) -> int:
    """The head dimension of a family that derives it from hidden_size."""
    h: int = f["hidden_size"]
    n_h: int = f["num_attention_heads"]
    if h % n_h:
        raise InvalidConfigError("hidden_size", f"must be a multiple of {name} ({n_h})")
    f["head_dim"] = h // n_h
    return n_h


def falcon_prepare(c: Config) -> Config:
    """Falcon layouts transformers builds without ALiBi and with attention and MLP in parallel
    (falcon-rw's ALiBi and sequential layers are not supported)."""
    if c.boolean("alibi"):
        raise InvalidConfigError("alibi", "Falcon with ALiBi (falcon-rw) is not supported")
    new_arch = c.boolean("new_decoder_architecture")
    if not (new_arch or c.boolean("parallel_attn")):
        raise InvalidConfigError(
            "parallel_attn", "Falcon with sequential attention and MLP is not supported"
        )
    return with_n_embed(c)


def _falcon_multi_query(c: Config) -> bool:
    return not c.boolean("new_decoder_architecture") and c.boolean("multi_query")


def falcon_heads(c: Config, f: Fields) -> None:
    """The 7B layout (multi_query) has one key/value head; the new decoder architecture (40B,
    180B, 11B) has num_kv_heads."""
    n_h = _heads_divide_hidden(f, "num_attention_heads")
    if c.boolean("new_decoder_architecture"):
        n_kv = c.integer("num_kv_heads", default=n_h)
    elif _falcon_multi_query(c):
        n_kv = 1
    else:
        n_kv = n_h
    if n_kv == 0 or n_h % n_kv:
        raise InvalidConfigError(
            "num_kv_heads", f"must divide num_attention_heads ({n_h}), got {n_kv}"
        )
    f["num_key_value_heads"] = n_kv


def falcon_layer_norms(c: Config, f: Fields) -> None:
    """FalconDecoderLayer: two LayerNorms (ln_attn, ln_mlp) when num_ln_in_parallel_attn is 2
    (its default with the new decoder architecture), else input_layernorm alone, read by
    attention and MLP in parallel; the 7B layout broadcasts its key/value head to the query
    heads before SDPA."""
    new_arch = c.boolean("new_decoder_architecture")
    norms = c.integer("num_ln_in_parallel_attn", default=2) if new_arch else 1
    if norms not in (1, 2):
        raise InvalidConfigError("num_ln_in_parallel_attn", f"must be 1 or 2, got {norms}")
    f["norms_per_layer"] = norms
    f["kv_broadcast"] = _falcon_multi_query(c) and f["num_attention_heads"] > 1


def bloom_prepare(c: Config) -> Config:
    """BLOOM with LayerNorm before attention and MLP (post-LayerNorm residuals unsupported)."""
    if c.boolean("apply_residual_connection_post_layernorm"):
        raise InvalidConfigError(
            "apply_residual_connection_post_layernorm", "post-LayerNorm residuals are not supported"
        )
    return with_n_embed(c)


def bloom_heads(c: Config, f: Fields) -> None:
    """BloomAttention: as many key/value heads as heads, of hidden_size / n_head."""
    f["num_key_value_heads"] = _heads_divide_hidden(f, "n_head")


def bert_classifier(c: Config, f: Fields) -> None:
    """BertForSequenceClassification: untied word, position and token-type embeddings, the
    pooler and a classifier of num_labels (from id2label where the config omits it), and the
    dropouts of configuration_bert.py."""
    f["max_position_embeddings"] = c.integer(
        "max_position_embeddings", default=BERT_MAX_POSITION_EMBEDDINGS
    )
    f["tie_word_embeddings"] = False
    if f["num_key_value_heads"] != f["num_attention_heads"]:
        raise InvalidConfigError("num_key_value_heads", "BERT has as many as attention heads")
    labels = c.integer("num_labels", default=0)
    id2label = c.raw.get("id2label")
    if not labels and isinstance(id2label, Mapping) and id2label:
        labels = len(id2label)
    hidden_dropout = dropout(c, "hidden_dropout_prob", BERT_DROPOUT)
    f["encoder"] = True
    f["type_vocab_size"] = c.integer("type_vocab_size", default=BERT_TYPE_VOCAB_SIZE)
    f["num_labels"] = labels or DEFAULT_NUM_LABELS
    f["hidden_dropout"] = hidden_dropout
    f["attention_dropout"] = dropout(c, "attention_probs_dropout_prob", BERT_DROPOUT)
    f["classifier_dropout"] = dropout(c, "classifier_dropout", hidden_dropout)


# DeepSeek-V2's routers (transformers 5.24 DeepseekV2TopkRouter.forward): any other method
# leaves the top-k undefined.
_DEEPSEEK_V2_TOPK_METHODS = ("greedy", "group_limited_greedy")


def _mla_attention(c: Config, f: Fields) -> list[Linear]:
    """Multi-head latent attention: q_proj, or q_a_proj + q_a_layernorm + q_b_proj when
    q_lora_rank is set; kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj; o_proj."""
    h, heads = f["hidden_size"], f["num_attention_heads"]
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
    bias = c.boolean("attention_bias")
    attention = (
        [linear("q_proj", LinearKind.ATTN_QKV, h, heads * qk_dim)]
        if not q_rank
        else [
            linear("q_a_proj", LinearKind.ATTN_QKV, h, q_rank, bias=bias),
            linear("q_b_proj", LinearKind.ATTN_QKV, q_rank, heads * qk_dim),
        ]
    )
    attention += [
        linear("kv_a_proj_with_mqa", LinearKind.ATTN_QKV, h, kv_rank + rope, bias=bias),
        linear("kv_b_proj", LinearKind.ATTN_QKV, kv_rank, heads * (nope + v_dim)),
        linear("o_proj", LinearKind.ATTN_OUT, heads * v_dim, h, bias=bias),
    ]
    f.update(head_dim=qk_dim, q_lora_rank=q_rank, kv_lora_rank=kv_rank, qk_rope_head_dim=rope)
    f["v_head_dim"] = v_dim
    return attention


def _deepseek_routing(c: Config, f: Fields, dense: int) -> tuple[int, int]:
    """The routed experts and their top-k, checked against DeepSeek's group-limited routing."""
    layers = f["num_hidden_layers"]
    experts = c.integer("n_routed_experts", "num_experts")
    top_k = c.integer("num_experts_per_tok")
    if dense < layers and (experts == 0 or not 0 < top_k <= experts):
        raise InvalidConfigError(
            "num_experts_per_tok",
            f"must be between 1 and n_routed_experts ({experts}) for the MoE layers, got {top_k}",
        )
    groups = c.integer("n_group")
    v2 = f["model_type"] == "deepseek_v2"
    method = c.string("topk_method", "greedy") if v2 else ""
    if method and method not in _DEEPSEEK_V2_TOPK_METHODS:
        raise InvalidConfigError(
            "topk_method", f"must be one of {', '.join(_DEEPSEEK_V2_TOPK_METHODS)}, got {method!r}"
        )
    if (method == "group_limited_greedy" or not v2) and (groups == 0 or experts % groups):
        raise InvalidConfigError(
            "n_group", f"must divide n_routed_experts ({experts}) for group-limited routing"
        )
    return experts, top_k


def deepseek(c: Config, f: Fields) -> None:
    """DeepSeek-V2/V3 as transformers 5.24 builds them (modeling_deepseek_v2.py, _v3.py):
    multi-head latent attention, a dense MLP in the first `first_k_dense_replace` layers and
    DeepSeekMoE in the rest: an fp32 router, the routed experts as 3-D parameters, and
    `n_shared_experts` shared experts as one MLP of moe_intermediate_size * n_shared_experts.
    transformers ignores `moe_layer_freq` and builds no multi-token-prediction layers, and
    neither is counted."""
    h, layers = f["hidden_size"], f["num_hidden_layers"]
    attention = _mla_attention(c, f)
    intermediate = f["intermediate_size"]
    mlp_bias = c.boolean("mlp_bias") if f["model_type"] == "deepseek_v2" else False
    dense_mlp = [
        linear("gate_proj", LinearKind.MLP_IN, h, intermediate, bias=mlp_bias),
        linear("up_proj", LinearKind.MLP_IN, h, intermediate, bias=mlp_bias),
        linear("down_proj", LinearKind.MLP_OUT, intermediate, h, bias=mlp_bias),
    ]
    dense = c.integer("first_k_dense_replace")
    if dense > layers:
        raise InvalidConfigError(
            "first_k_dense_replace", f"must be at most num_hidden_layers ({layers}), got {dense}"
        )
    experts, top_k = _deepseek_routing(c, f, dense)
    expert_i = c.integer("moe_intermediate_size")
    shared_i = expert_i * c.integer("n_shared_experts")
    moe = routed_experts(h, experts, expert_i)
    if shared_i:
        moe += shared_mlp(h, shared_i)
    if dense == layers:
        f["linears"] = tuple(attention + dense_mlp)
        return
    f["linears"] = tuple(attention + moe)
    f.update(
        num_experts=experts,
        num_experts_per_tok=top_k,
        expert_intermediate_size=expert_i,
        shared_expert_intermediate_size=shared_i,
        dense_layers=dense,
        dense_linears=tuple(attention + dense_mlp) if dense else (),
    )
