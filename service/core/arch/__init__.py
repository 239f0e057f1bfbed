"""Model architectures from HF `config.json` values: module layout and parameter counts.

An architecture is the list of the modules a decoder layer holds, named as transformers names
them (so PEFT's `target_modules` match), plus embeddings, norms and the LM head. Parameter
counts, LoRA targets, quantized weights and saved activations are all derived from it.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, field, replace
from enum import StrEnum

from service.core.arch.mllama import EXTRA_EMBEDDING_ROWS, MllamaVision
from service.core.arch.vision import VisionArch
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
    # transformers 4's MoE layout (`service.core.estimator.looped_experts`): a MoE block's
    # router, or its experts' linears, as `count` nn.Linear modules (one per expert) run in a
    # Python loop over the experts; bitsandbytes quantizes each and PEFT adapts each.
    looped: bool = False

    @property
    def nn_linear(self) -> bool:
        """Whether it is an nn.Linear module (each of `count`), which bitsandbytes quantizes
        and PEFT's "all-linear" matches."""
        return not self.expert or self.looped

    @property
    def weight_elements(self) -> int:
        return self.in_features * self.out_features * self.count

    @property
    def params(self) -> int:
        return self.weight_elements + (self.out_features * self.count if self.bias else 0)


# Activations transformers composes from elementwise ops (activations.py NewGELUActivation)
# rather than calling one fused kernel, so autograd keeps their intermediates.
COMPOSITE_TANH_GELU = frozenset({"gelu_new"})
# A reward model's outputs: TRL's RewardTrainer builds its sequence classifier with
# num_labels=1 (trl 1.16.0 trl/trainer/reward_trainer.py __init__).
SCORE_OUTPUTS = 1


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
    # ALiBi position biases instead of RoPE (BLOOM): no rotation of q and k
    alibi: bool = False
    # A LayerNorm on the embedding's output before the first layer (BLOOM's
    # word_embeddings_layernorm)
    embedding_norm: bool = False
    # One key/value head that reaches SDPA unexpanded, without enable_gqa (Falcon-7B's
    # multi-query FalconAttention): only SDPA's math kernel takes it, broadcasting it.
    kv_broadcast: bool = False
    # The model always builds an explicit causal mask (FalconModel calls create_causal_mask
    # with allow_is_causal_skip=False), so SDPA never runs without one.
    explicit_mask: bool = False
    # Encoders (BERT): bidirectional attention, LayerNorm after each residual add, absolute
    # position and token-type embeddings, a pooler and a sequence-classification head.
    encoder: bool = False
    type_vocab_size: int = 0
    num_labels: int = 0  # the classification head's classes (config.num_labels)
    hidden_dropout: float = 0.0  # hidden_dropout_prob
    attention_dropout: float = 0.0  # attention_probs_dropout_prob
    classifier_dropout: float = 0.0  # classifier_dropout, else hidden_dropout_prob
    # DeepSeek-V2/V3: the first `dense_layers` layers run a dense MLP (`dense_linears` replace
    # the MLP entries of `linears` there), the rest the MoE block.
    dense_layers: int = 0
    dense_linears: tuple[Linear, ...] = ()
    # Multi-head latent attention (DeepSeek-V2/V3): the latent widths (q_lora_rank 0 when q
    # has one projection) and the rotary and value head dims; kv_lora_rank 0 without MLA.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # Dropout on the attention and MLP outputs before the residual add (Phi's resid_pdrop),
    # active in training: each call keeps a one-byte mask per element for its backward.
    residual_dropout: float = 0.0
    # Every n-th layer attends globally, the others within `sliding_window` (Gemma-3's
    # sliding_window_pattern, transformers' layer_types); 0 when every layer is alike.
    global_layer_period: int = 0
    # Encoder-decoders (T5, mT5): `linears` and `num_hidden_layers` are the encoder's blocks,
    # these the decoder's (self-attention, cross-attention over the encoder's output, the
    # feed-forward); each stack's first block holds a relative-position bias table
    # (relative_attention_num_buckets x heads), and each stack ends in a final RMSNorm.
    decoder_layers: int = 0
    decoder_linears: tuple[Linear, ...] = ()
    relative_attention_num_buckets: int = 0
    # A decoder built as a sequence classifier with one label (a reward model: transformers'
    # GenericForSequenceClassification, modeling_layers.py): a `score` linear, hidden -> 1
    # without bias, replaces the LM head, and nothing is tied to the embedding.
    score_head: bool = False
    # A vision-language model's vision tower and patch merger (Qwen2-VL, Qwen2.5-VL); the
    # fields above describe its language model.
    vision: VisionArch | None = None
    # Llama-3.2-Vision's tower, projector and cross-attention layers (mllama); the fields
    # above describe its language model as a Llama of all its layers.
    mllama: MllamaVision | None = None
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
    def encoder_decoder(self) -> bool:
        """A sequence-to-sequence model (T5): an encoder stack and a decoder stack."""
        return self.decoder_layers > 0

    @property
    def global_layers(self) -> int:
        """Layers attending globally in a stack of sliding-window ones (layer i is global
        when (i + 1) % period == 0, transformers' Gemma3TextConfig.layer_types)."""
        period = self.global_layer_period
        return self.num_hidden_layers // period if period else 0

    def windowed(self, seq_len: int) -> bool:
        """Whether transformers builds an explicit mask for `seq_len` tokens: a sliding window
        from the window's length on (masking_utils._ignore_causal_mask_sdpa keeps the mask
        when kv_length >= local_attention_size), or a model that always builds one."""
        if self.explicit_mask:
            return True
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
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def layer_norm_params(self) -> int:
        qk = 2 * self.head_dim if self.qk_norm else 0
        # MLA's RMSNorms on the latents (q_a_layernorm, kv_a_layernorm)
        latent = self.q_lora_rank + self.kv_lora_rank
        return self.norms_per_layer * self.norm_params + qk + latent

    @property
    def layer_params(self) -> int:
        """One layer's parameters (a MoE layer's where the first layers are dense)."""
        return sum(lin.params for lin in self.linears) + self.layer_norm_params

    @property
    def dense_layer_params(self) -> int:
        """One of the leading dense layers' parameters (0 when there are none)."""
        if not self.dense_layers:
            return 0
        return sum(lin.params for lin in self.dense_linears) + self.layer_norm_params

    @property
    def layers_params(self) -> int:
        """All decoder layers' parameters."""
        sparse = self.num_hidden_layers - self.dense_layers
        encoder = sparse * self.layer_params + self.dense_layers * self.dense_layer_params
        return encoder + self.decoder_layers * self.decoder_layer_params + self.position_bias_params

    @property
    def decoder_layer_params(self) -> int:
        """One decoder block of an encoder-decoder: its linears and three RMSNorms (before
        self-attention, cross-attention and the feed-forward)."""
        if not self.encoder_decoder:
            return 0
        return sum(lin.params for lin in self.decoder_linears) + 3 * self.norm_params

    @property
    def position_bias_params(self) -> int:
        """An encoder-decoder's relative attention bias tables, one per stack."""
        if not self.encoder_decoder:
            return 0
        return 2 * self.relative_attention_num_buckets * self.num_attention_heads

    @property
    def embedding_params(self) -> int:
        """The input embeddings: words (and an encoder's positions and token types)."""
        rows = self.vocab_size
        if self.encoder:
            rows += self.max_position_embeddings + self.type_vocab_size
        return rows * self.hidden_size

    @property
    def pooler_params(self) -> int:
        """An encoder's pooler: dense (hidden x hidden, bias) on the first token."""
        return self.hidden_size * self.hidden_size + self.hidden_size if self.encoder else 0

    def classifier_params(self, num_labels: int) -> int:
        """An encoder's classifier: Linear(hidden, num_labels) with bias."""
        return (self.hidden_size + 1) * num_labels if self.encoder else 0

    @property
    def lm_head_params(self) -> int:
        """Parameters the LM head adds (zero when tied to the embedding); an encoder's head is
        its pooler and classifier."""
        if self.encoder:
            return self.pooler_params + self.classifier_params(self.num_labels)
        if self.score_head:
            return self.hidden_size * SCORE_OUTPUTS
        if self.tie_word_embeddings:
            return 0
        return self.vocab_size * self.hidden_size + (self.vocab_size if self.lm_head_bias else 0)

    @property
    def total_params(self) -> int:
        return (
            self.embedding_params
            + self.layers_params
            + self.norm_params * (2 if self.embedding_norm or self.encoder_decoder else 1)
            + self.lm_head_params
            + (self.vision.params if self.vision is not None else 0)
            + (
                self.mllama.params(self.head_dim, EXTRA_EMBEDDING_ROWS * self.hidden_size)
                if self.mllama is not None
                else 0
            )
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
        return self.total_params - (self.num_hidden_layers - self.dense_layers) * inactive


# The module path PEFT matches each looped expert's linears under (...mlp.experts.<i>.<name>).
EXPERTS_PREFIX = "experts."

# The order an expert's __init__ registers its linears (MixtralBlockSparseTop2MLP: w1, w2, w3;
# Qwen2MoeMLP: gate_proj, up_proj, down_proj), the order a load makes their tensors and
# model.parameters() lists their adapters.
REGISTRATION_ORDER = ("w1", "w2", "w3", "gate_proj", "up_proj", "down_proj")


def module_order(arch: ModelArch) -> tuple[Linear, ...]:
    """A layer's linears in module order, one entry per module: the looped experts expanded
    expert by expert (each expert's linears in registration order, `count` 1), in place of
    their stacked entries; `arch.linears` itself when nothing is looped."""
    experts = [lin for lin in arch.linears if lin.looped and lin.kind is not LinearKind.ROUTER]
    if not experts:
        return arch.linears
    one = sorted(
        (replace(lin, count=1) for lin in experts),
        key=lambda lin: REGISTRATION_ORDER.index(lin.name.removeprefix(EXPERTS_PREFIX)),
    )
    out: list[Linear] = []
    for lin in arch.linears:
        if lin is experts[0]:
            out += one * arch.num_experts
        elif lin not in experts:
            out.append(lin)
    return tuple(out)
