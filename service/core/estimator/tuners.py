"""PEFT's (IA)^3, LN tuning and prompt tuning: which modules they train, their trainable
tensors, and the sequence prompt tuning lengthens.

(IA)^3 (peft/tuners/ia3/layer.py Linear) puts one vector `ia3_l` on each targeted linear:
(out_features, 1), multiplying the output, or (1, in_features) for a feedforward module,
multiplying the input. Created in fp32 (torch.randn) and kept there by get_peft_model's
autocast_adapter_dtype=True. LN tuning (peft/tuners/ln_tuning/layer.py LNTuningLayer) wraps
each targeted norm and trains a deep copy of it; the original stays, frozen. Prompt tuning
(peft/peft_model.py PeftModelForCausalLM.forward) embeds the input, concatenates the virtual
tokens' embeddings (PromptEmbedding, an fp32 nn.Embedding, cast to the input's dtype) in
front, and -100 labels in front of the labels: every layer, the logits and the loss run on
seq_len + num_virtual_tokens positions, and the first layer's input takes a gradient.
"""

from __future__ import annotations

from dataclasses import replace

from service.core.arch import Linear, LinearKind, MlpKind, ModelArch, NormKind
from service.core.errors import InvalidConfigError, InvalidSpecError
from service.core.estimator.prefix import check_prefix_attention, prefix_tensors
from service.core.estimator.weights import adapted_linears
from service.core.spec import Method, ResolvedSpec, TrainingSpec
from service.core.spec.prompt import (
    IA3_FEEDFORWARD_MODULES,
    IA3_TARGET_MODULES,
    LN_TUNING_TARGET_MODULES,
)
from service.core.units import DTYPE_BYTES, FP32_BYTES

# The decoder families whose (IA)^3 and LN-tuning steps the reference traces cover (dense
# Llama-style layers: RMSNorm, a gated MLP, separate q/k/v projections).
TUNER_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})
# LN tuning's targets by the estimator's names for a layer's norms (transformers'
# LlamaDecoderLayer.input_layernorm / post_attention_layernorm, LlamaModel.norm).
NORM_KEYS = {"input_layernorm": "norm1", "post_attention_layernorm": "norm2", "norm": "final"}


def check_tuner_model(arch: ModelArch, rs: ResolvedSpec) -> None:
    """Refuse the architectures PEFT's prompt-side methods are not modelled on (and prefix
    tuning's attention other than SDPA's mem-efficient kernel)."""
    method = rs.spec.method
    if method not in (Method.IA3, Method.LN_TUNING, Method.PROMPT_TUNING, Method.PREFIX_TUNING):
        return
    dense = arch.mlp is MlpKind.GATED and not arch.is_moe and arch.norm is NormKind.RMS
    if arch.model_type not in TUNER_MODEL_TYPES or not dense:
        raise InvalidConfigError(
            "model_type",
            f"method {method.value!r} is modelled on {', '.join(sorted(TUNER_MODEL_TYPES))} "
            f"decoders, not {arch.model_type!r}",
        )
    check_prefix_attention(rs.spec)


def _match(arch: ModelArch, field: str, names: tuple[str, ...]) -> tuple[Linear, ...]:
    candidates = [lin for lin in arch.linears if not lin.expert]
    chosen = tuple(
        lin for lin in candidates if lin.name in names or lin.name.split(".")[-1] in names
    )
    unknown = [
        n for n in names if not any(n in (lin.name, lin.name.split(".")[-1]) for lin in candidates)
    ]
    if unknown or not chosen:
        known = ", ".join(sorted(lin.name for lin in candidates))
        raise InvalidSpecError(
            field, f"{', '.join(unknown or names)} not in this model (its linear layers: {known})"
        )
    return chosen


def ia3_targets(arch: ModelArch, rs: ResolvedSpec) -> tuple[tuple[Linear, bool], ...]:
    """Each linear (IA)^3 scales, with whether it is a feedforward module (its input scaled);
    empty for other methods. PEFT takes its per-architecture defaults for the fields left
    None (peft/tuners/ia3/model.py IA3Model._prepare_adapter_config)."""
    ia3 = rs.ia3
    if ia3 is None:
        return ()
    targets = ia3.target_modules or IA3_TARGET_MODULES.get(arch.model_type)
    if targets is None:
        raise InvalidSpecError(
            "ia3.target_modules",
            f"PEFT has no default target modules for model_type {arch.model_type!r}; name them",
        )
    feedforward = ia3.feedforward_modules
    if feedforward is None:
        feedforward = IA3_FEEDFORWARD_MODULES.get(arch.model_type, ())
    chosen = _match(arch, "ia3.target_modules", targets)
    if not any(lin.kind is LinearKind.ATTN_QKV for lin in chosen):
        # what the first layer records then depends on where the first vector sits
        raise InvalidSpecError(
            "ia3.target_modules",
            "(IA)^3 without a query, key or value projection among the targets is not modelled",
        )
    # peft/tuners/ia3/model.py _create_and_replace: is_feedforward when the module's key ends
    # with a feedforward name
    return tuple((lin, any(lin.name.endswith(name) for name in feedforward)) for lin in chosen)


def ln_tuning_targets(arch: ModelArch, rs: ResolvedSpec) -> frozenset[str]:
    """The norms LN tuning trains, by the estimator's keys (`NORM_KEYS`); empty for other
    methods."""
    ln = rs.ln_tuning
    if ln is None:
        return frozenset()
    names = ln.target_modules or LN_TUNING_TARGET_MODULES.get(arch.model_type)
    if names is None:
        raise InvalidSpecError(
            "ln_tuning.target_modules",
            f"PEFT has no default target modules for model_type {arch.model_type!r}; name them",
        )
    unknown = [name for name in names if name not in NORM_KEYS]
    if unknown:
        raise InvalidSpecError(
            "ln_tuning.target_modules",
            f"{', '.join(unknown)} not a norm of this model (its norms: {', '.join(NORM_KEYS)})",
        )
    trained = frozenset(NORM_KEYS[name] for name in names)
    if not trained & {"norm1", "norm2"}:
        # the final norm alone: no layer would record anything for backward
        raise InvalidSpecError(
            "ln_tuning.target_modules",
            "LN tuning of the final norm alone is not modelled: name a layer norm too",
        )
    return trained


def tuner_tensors(arch: ModelArch, rs: ResolvedSpec) -> tuple[tuple[int, int, int, int], ...]:
    """The trainable tensors the method adds, as (rows, cols, itemsize, count): per layer
    one (IA)^3 vector per scaled linear, or one weight per trained norm copy (in the model's
    dtype: PEFT's cast_adapter_dtype casts adapter parameters, not the modules LN tuning's
    ModuleDict holds), the final norm's once."""
    L = arch.num_hidden_layers
    tensors: list[tuple[int, int, int, int]] = []
    ad = DTYPE_BYTES[rs.adapter_dtype]
    for lin, feedforward in ia3_targets(arch, rs):
        shape = (1, lin.in_features) if feedforward else (lin.out_features, 1)
        tensors.append((*shape, ad, L))
    norms = ln_tuning_targets(arch, rs)
    md = DTYPE_BYTES[rs.spec.dtype]
    for key in ("norm1", "norm2"):
        if key in norms:
            tensors.append((arch.hidden_size, 0, md, L))
    if "final" in norms:
        tensors.append((arch.hidden_size, 0, md, 1))
    if rs.oft is not None:
        # OFTRotationModule.weight: (blocks, block_size * (block_size - 1) / 2), the upper
        # triangles of the skew-symmetric blocks, fp32 (torch.empty, kept by
        # autocast_adapter_dtype)
        for lin in adapted_linears(arch, rs):
            blocks, size = rs.oft.blocks(lin.in_features)
            tensors.append((blocks, size * (size - 1) // 2, FP32_BYTES, L))
    if rs.boft is not None:
        # BOFTLayer.update_layer: boft_R (factors, blocks, size, size) and boft_s (out, 1), fp32
        # (torch.zeros / torch.ones, kept by autocast_adapter_dtype)
        for lin in adapted_linears(arch, rs):
            factors, blocks, size = rs.boft.blocks(lin.in_features)
            tensors.append((factors * blocks * size, size, FP32_BYTES, L))
            tensors.append((lin.out_features * lin.count, 0, FP32_BYTES, L))
    if rs.prompt_tuning is not None:
        # PromptEmbedding.embedding: (num_virtual_tokens, token_dim), token_dim = hidden_size
        tensors.append((rs.prompt_tuning.num_virtual_tokens, arch.hidden_size, ad, 1))
    tensors += prefix_tensors(arch, rs.spec)
    return tuple(tensors)


def virtual_tokens(spec: TrainingSpec) -> int:
    """Positions prompt tuning prepends to every sequence (0 for other methods)."""
    if spec.method is Method.PROMPT_TUNING and spec.prompt_tuning is not None:
        return spec.prompt_tuning.num_virtual_tokens
    return 0


def sequence_spec(spec: TrainingSpec) -> TrainingSpec:
    """The spec as the model runs it: prompt tuning's sequences lengthened by the virtual
    tokens (`estimator.step._step` keeps the inputs at the given length)."""
    virtual = virtual_tokens(spec)
    return replace(spec, seq_len=spec.seq_len + virtual) if virtual else spec


def scaled_kinds(arch: ModelArch, rs: ResolvedSpec) -> tuple[frozenset[str], frozenset[str]]:
    """The names of the linears (IA)^3 scales at the output, and at the input."""
    targets = ia3_targets(arch, rs)
    return (
        frozenset(lin.name for lin, ff in targets if not ff),
        frozenset(lin.name for lin, ff in targets if ff),
    )


def attention_trains(arch: ModelArch, rs: ResolvedSpec) -> bool:
    """Whether something trains in the attention block or before it, so the first layer's
    attention records for backward even when the layer's input takes no gradient."""
    out, into = scaled_kinds(arch, rs)
    qkv = {lin.name for lin in arch.linears if lin.kind is LinearKind.ATTN_QKV}
    return bool(qkv & (out | into)) or "norm1" in ln_tuning_targets(arch, rs)
