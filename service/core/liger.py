"""Which Liger Kernel patches HF Trainer's `use_liger_kernel=True` applies to a model type.

transformers 5.24's Trainer calls liger-kernel's `_apply_liger_kernel_to_instance` on the base
model (transformers/integrations/liger.py), which runs the model type's
`apply_liger_kernel_to_<type>` with its defaults (liger_kernel/transformers/monkey_patch.py,
liger-kernel 0.8.2, MODEL_TYPE_TO_APPLY_LIGER_FN). Every function read here defaults to
rope=True, rms_norm=True, the MLP kernel (swiglu or geglu) True, fused_linear_cross_entropy
True and cross_entropy False.
"""

from __future__ import annotations

from dataclasses import dataclass

LIGER_VERSION = "0.8.2"
# Streaming multiprocessors of the reference GPU (H200 and H100 SXM: 132, NVIDIA's H100/H200
# datasheets). LigerRMSNormFunction's backward gives each SM a row of fp32 partial weight
# gradients (liger_kernel/ops/rms_norm.py rms_norm_backward: `_dW` of (sm_count, n_cols)).
REFERENCE_SM_COUNT = 132


def liger_chunk_rows(tokens: int, vocab: int, hidden: int) -> int:
    """Rows of the logits chunk Liger's fused linear cross-entropy forms at a time
    (liger_kernel/ops/fused_linear_cross_entropy.py fused_linear_cross_entropy_forward:
    next_power_of_2(cdiv(BT, cdiv(V, H))), so a chunk's logits hold about BT x H elements),
    at most the tokens there are."""
    inc_factor = -(-vocab // hidden)
    rows = -(-tokens // inc_factor)
    return min(1 << (rows - 1).bit_length(), tokens)


@dataclass(frozen=True, slots=True, kw_only=True)
class LigerPatches:
    """One model type's patches, as its apply function applies them to an instance."""

    module: str  # the transformers.models package whose apply_rotary_pos_emb is replaced
    rope: bool = True  # liger_rotary_pos_emb
    # _patch_rms_norm_module on the final norm and these norms of every layer
    layer_norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    rms_offset: float = 0.0  # LigerRMSNorm's offset (1.0: Gemma's (1 + weight))
    rms_casting: str = "llama"  # casting_mode: 'llama' (rstd in fp32), 'gemma' (all fp32)
    rms_in_place: bool = True  # backward writes dX into dY's storage
    mlp: str = "swiglu"  # LigerSwiGLUMLP or LigerGEGLUMLP forward bound on each layer's MLP
    fused_linear_cross_entropy: bool = True  # the causal LM's forward replaced by lce_forward


# The model types whose patches the estimator models (dense Llama-family decoders: RMSNorm,
# gated MLP, RoPE). monkey_patch.py: apply_liger_kernel_to_llama, _mistral and _qwen2 patch
# the norms with _patch_rms_norm_module's defaults (offset 0, casting 'llama', in_place True)
# and each MLP with LigerSwiGLUMLP; apply_liger_kernel_to_gemma2 patches Gemma-2's four norms
# per layer with offset 1.0, casting 'gemma' and in_place False (its residual needs dY), and
# each MLP with LigerGEGLUMLP.
MODELLED_PATCHES: dict[str, LigerPatches] = {
    "llama": LigerPatches(module="llama"),
    "mistral": LigerPatches(module="mistral"),
    "qwen2": LigerPatches(module="qwen2"),
    "gemma2": LigerPatches(
        module="gemma2",
        layer_norms=(
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ),
        rms_offset=1.0,
        rms_casting="gemma",
        rms_in_place=False,
        mlp="geglu",
    ),
}

# Model types liger-kernel 0.8.2 patches (MODEL_TYPE_TO_APPLY_LIGER_FN) whose patches are not
# modelled here: each answers with a refusal naming the field.
PATCHED_NOT_MODELLED = frozenset(
    {
        "deepseek_v4",
        "exaone4",
        "falcon_h1",
        "gemma",
        "gemma3",
        "gemma3_text",
        "gemma4",
        "gemma4_text",
        "glm4",
        "glm4v",
        "glm4v_moe",
        "gpt_oss",
        "granite",
        "hunyuan_v1_dense",
        "hunyuan_v1_moe",
        "internvl",
        "llama4",
        "llama4_text",
        "llava",
        "ministral",
        "mixtral",
        "mllama",
        "mllama_text_model",
        "nemotron",
        "olmo2",
        "olmo3",
        "paligemma",
        "phi3",
        "pixtral",
        "qwen2_5_vl",
        "qwen2_5_vl_text",
        "qwen2_vl",
        "qwen2_vl_text",
        "qwen3",
        "qwen3_5",
        "qwen3_5_moe",
        "qwen3_5_moe_text",
        "qwen3_5_text",
        "qwen3_moe",
        "qwen3_next",
        "qwen3_vl",
        "qwen3_vl_moe",
        "qwen3_vl_moe_text",
        "qwen3_vl_text",
        "smollm3",
        "smolvlm",
    }
)


def liger_patches(model_type: str) -> LigerPatches | None:
    """The modelled patches of `model_type`, None where none are modelled."""
    return MODELLED_PATCHES.get(model_type)


def liger_refusal(model_type: str) -> str | None:
    """Why `use_liger_kernel` is not estimated for `model_type`; None when it is."""
    if model_type in MODELLED_PATCHES:
        return None
    if model_type in PATCHED_NOT_MODELLED:
        return (
            f"liger-kernel {LIGER_VERSION} patches model type {model_type!r}, but its patches "
            f"are modelled only for {', '.join(sorted(MODELLED_PATCHES))}"
        )
    return (
        f"liger-kernel {LIGER_VERSION} has no patches for model type {model_type!r} "
        "(monkey_patch.py MODEL_TYPE_TO_APPLY_LIGER_FN): HF Trainer would train it unpatched"
    )
