"""Llama-3.2-Vision's step (transformers `mllama`): the language model's SFT step, with what
the tiled images add to it.

transformers 5.24 MllamaForConditionalGeneration (models/mllama/modeling_mllama.py) runs the
vision tower on every image's tiles (the processor pads each image to max_num_tiles tiles),
projects the concatenated features to the language model's width (`cross_attention_states`,
tiles x (patches + 1) tokens per image) and runs the language model on the text alone: the
images are no tokens of its sequence, so `seq_len` counts text tokens only. Its
`cross_attention_layers` take their keys and values from the image tokens. Beside the
language model's step (`step._step` on the language model as a Llama of all its layers) the
estimate holds:

- the tower's and projector's frozen weights, the cross-attention layers' q/k norms and tanh
  gates, the embedding's eight extra rows; the processor's inputs (fp32 pixel_values,
  aspect_ratio_ids, aspect_ratio_mask, cross_attention_mask) through the step;
- the cross-attention mask, expanded to every image token in the model's dtype
  (_prepare_cross_attention_mask), and the per-token row mask, until backward;
- without checkpointing, what each cross-attention layer's graph keeps instead of a
  self-attention layer's: q_norm's fp32 copy of q and its rstd, and SDPA's (with a mask: the
  mem-efficient kernel, transformers' repeat_kv expanding the key/value heads) query, expanded
  keys and values over the image tokens, output and log-sum-exp; and, at the loss, the
  language model's DynamicCache (text_config.use_cache stays true when only the top config's
  is switched off) holding each cross-attention layer's unexpanded keys and values and the
  first layer's, and the vision output the model's output keeps;
- with checkpointing (HF Trainer's enable_input_require_grads hooks the patch embedding too):
  the whole tower's graph, whose layers are not checkpointed (MllamaVisionEncoderLayer is no
  GradientCheckpointingLayer): each layer's LayerNorm inputs and statistics, SDPA's q, k, v,
  output and log-sum-exp, the GELU's input, the tower's attention mask, the patch
  embedding's output (a leaf requiring grad); and the projected image features, an argument
  every checkpointed cross-attention layer keeps.
"""

from __future__ import annotations

from dataclasses import replace

from service.core.arch import ModelArch
from service.core.arch.mllama import (
    EXTRA_EMBEDDING_ROWS,
    MllamaVision,
    tile_grid,
)
from service.core.device import CUBLASLT_WORKSPACE
from service.core.errors import InvalidConfigError, InvalidSpecError
from service.core.estimator.ledger import _blk
from service.core.estimator.step import _Step, _step
from service.core.estimator.step_context import _Moment
from service.core.libs.torch_kernels import EFFICIENT_LSE_PAD as EFFICIENT_LSE_ALIGN
from service.core.spec import ALL_LINEAR, AttnImpl, Method, SdpaKernel, TrainingSpec
from service.core.spec.vision import check_sequence
from service.core.units import DTYPE_BYTES, FP32_BYTES, INT64_BYTES, DType

# The processor's outputs: pixel_values fp32 (rescaled and normalised), the aspect-ratio ids
# and masks and the cross-attention mask torch.long (image_processing_mllama.py,
# processing_mllama.py BatchFeature of numpy int64 arrays).
PIXEL_BYTES = FP32_BYTES
LSE_BYTES = FP32_BYTES
# SDPA's philox seed and offset, two int64 scalars saved for backward by the flash and
# mem-efficient kernels alike (one 512-byte block each).
PHILOX_TENSORS = 2
# The cross-attention layers' and global tower layers' tanh gates: each `gate.tanh() *
# output` keeps the one-element tanh for backward (two per layer).
GATES_PER_LAYER = 2
# nn.LayerNorm keeps its mean and rstd in the tower's dtype (reference trace
# llama-3_2-11b-vision__lora__r16-gate_proj+up_proj+down_proj__b1-s1024__img1-1120x1120__ckpt).
LAYER_NORM_STATISTICS = 2
# Each encoder layer's two LayerNorms (input_layernorm, post_attention_layernorm).
NORMS_PER_LAYER = 2
# The tower's modules by name (the names PEFT matches a target against, by its last parts):
# each layer's attention and MLP linears, the projector.
_TOWER_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "fc1", "fc2", "multi_modal_projector")
# The language model's own linears: its MLP's (the tower's MLP is fc1/fc2).
LANGUAGE_MODEL_ONLY = ("gate_proj", "up_proj", "down_proj")


def _targets_in_tower(targets: tuple[str, ...] | str | None) -> list[str]:
    if targets == ALL_LINEAR:
        return [ALL_LINEAR]
    if targets is None or isinstance(targets, str):
        return []
    return [
        t for t in targets if any(name == t or name.endswith("." + t) for name in _TOWER_MODULES)
    ]


def check_mllama_job(arch: ModelArch, spec: TrainingSpec) -> MllamaVision:
    """What the estimate of a Llama-3.2-Vision job models, each refusal naming its field."""
    tower = arch.mllama
    if tower is None:
        raise InvalidSpecError("vision", f"{arch.model_type!r} has no mllama vision tower")
    if 0 in tower.cross_attention_layers:
        # the first layer's input takes no gradient: its graph is not the one modelled here
        raise InvalidConfigError(
            "text_config.cross_attention_layers", "a cross-attention first layer is not modelled"
        )
    inputs = spec.vision
    if inputs is None:
        raise InvalidSpecError(
            "vision",
            "Llama-3.2-Vision is a vision-language model: give its image inputs "
            "(images_per_sample, image_height and image_width)",
        )
    if inputs.image_tokens is not None:
        raise InvalidSpecError(
            "vision.image_tokens",
            "Llama-3.2-Vision's images are no tokens of the sequence (they enter through "
            "cross-attention): give image_height and image_width",
        )
    for name in ("min_pixels", "max_pixels"):
        if getattr(inputs, name) is not None:
            raise InvalidSpecError(
                f"vision.{name}",
                "a Qwen2-VL processor bound; Llama-3.2-Vision's processor tiles the image",
            )
    if spec.method is not Method.LORA:
        raise InvalidSpecError(
            "method",
            "Llama-3.2-Vision is modelled with LoRA on the language model (full fine-tuning "
            "trains the tower; QLoRA, whose k-bit preparation runs the tower and the residual "
            "stream in fp32, is not modelled yet)",
        )
    lora = spec.lora
    if lora is not None:
        if lora.target_modules is None:
            raise InvalidSpecError(
                "lora.target_modules",
                "PEFT has no default targets for mllama: name the language model's linears "
                f"({', '.join(LANGUAGE_MODEL_ONLY)})",
            )
        hits = _targets_in_tower(lora.target_modules)
        if hits:
            raise InvalidSpecError(
                "lora.target_modules",
                f"{', '.join(map(repr, hits))} adapt(s) modules of the vision tower or the "
                "projector (its layers have q_proj, k_proj, v_proj, o_proj, fc1 and fc2), "
                "whose training is not modelled: name linears only the language model has "
                f"({', '.join(LANGUAGE_MODEL_ONLY)})",
            )
        if lora.modules_to_save:
            raise InvalidSpecError("lora.modules_to_save", "not modelled for Llama-3.2-Vision")
        if lora.use_dora:
            raise InvalidSpecError("lora.use_dora", "not modelled for Llama-3.2-Vision")
    if spec.attn_implementation is not AttnImpl.SDPA:
        raise InvalidSpecError(
            "attn_implementation",
            "Llama-3.2-Vision is modelled with SDPA (transformers gives mllama no "
            "flash_attention_2; eager is not modelled)",
        )
    if spec.sdpa_kernel is not SdpaKernel.AUTO:
        raise InvalidSpecError(
            "sdpa_kernel",
            "Llama-3.2-Vision is modelled with PyTorch's choice (the masked cross-attention "
            "and tower attention run the mem-efficient kernel)",
        )
    if spec.dtype is DType.FP32:
        raise InvalidSpecError("dtype", "Llama-3.2-Vision is modelled in bf16 or fp16")
    if spec.autocast:
        raise InvalidSpecError("autocast", "not modelled for Llama-3.2-Vision yet")
    if spec.gradient_accumulation_steps != 1:
        raise InvalidSpecError(
            "gradient_accumulation_steps", "not modelled for Llama-3.2-Vision yet"
        )
    if inputs.image_height is None or inputs.image_width is None:
        raise InvalidSpecError("vision.image_height", "give the images' size")
    # each image is one <|image|> token of the text
    check_sequence(inputs, 1, spec.seq_len)
    return tower


def _weight_bytes(arch: ModelArch, tower: MllamaVision, dtype: int) -> int:
    """The tower, the projector, the cross-attention layers' extras and the embedding's extra
    rows, tensor by tensor in the model's dtype."""
    h, tiles, ids = tower.hidden_size, tower.max_num_tiles, tower.max_aspect_ratio_id + 1
    scalar = _blk(dtype)
    embeddings = (
        _blk(tower.num_channels * tower.patch_size**2 * h * dtype)  # patch_embedding
        + _blk(h * dtype)  # class_embedding
        + scalar  # gated_positional_embedding.gate
        + _blk(tower.patches * h * dtype)  # its position table
        + _blk(ids * tiles * tower.patches * h * dtype)  # its tile table
        + 2 * (scalar + _blk(ids * tiles * h * dtype))  # pre/post tile embeddings, gates
        + 2 * 2 * _blk(h * dtype)  # layernorm_pre, layernorm_post
    )
    linears = sum(
        _blk(i * o * dtype) + (_blk(o * dtype) if bias else 0)
        for _, i, o, bias in tower.layer_linears()
    )
    layer = linears + NORMS_PER_LAYER * 2 * _blk(h * dtype)
    layers = (tower.num_hidden_layers + tower.num_global_layers) * layer
    gates = GATES_PER_LAYER * tower.num_global_layers * scalar
    projector = _blk(tower.vision_output_dim * tower.out_hidden_size * dtype) + _blk(
        tower.out_hidden_size * dtype
    )
    cross = len(tower.cross_attention_layers) * (
        2 * _blk(arch.head_dim * dtype) + GATES_PER_LAYER * scalar
    )
    table = arch.vocab_size * arch.hidden_size * dtype
    extra_rows = _blk(table + EXTRA_EMBEDDING_ROWS * arch.hidden_size * dtype) - _blk(table)
    return embeddings + layers + gates + projector + cross + extra_rows


def _input_bytes(tower: MllamaVision, spec: TrainingSpec, images: int) -> int:
    """pixel_values, aspect_ratio_ids, aspect_ratio_mask, cross_attention_mask."""
    t, side = tower.max_num_tiles, tower.image_size
    n = spec.vision.images_per_sample if spec.vision is not None else 0
    return (
        _blk(images * t * tower.num_channels * side * side * PIXEL_BYTES)
        + _blk(images * INT64_BYTES)
        + _blk(images * t * INT64_BYTES)
        + _blk(spec.batch_size * spec.seq_len * n * t * INT64_BYTES)
    )


def _cross_layer_delta(arch: ModelArch, spec: TrainingSpec, keys: int, dtype: int) -> int:
    """What a cross-attention layer's graph keeps beyond a self-attention layer's (module
    docstring), per layer, without checkpointing."""
    b, s, h = spec.batch_size, spec.seq_len, arch.hidden_size
    heads, kv = arch.num_attention_heads, arch.kv_dim
    lse_rows = -(-s // EFFICIENT_LSE_ALIGN) * EFFICIENT_LSE_ALIGN
    cross = (
        2 * _blk(b * s * h * dtype)  # query and output
        + 2 * _blk(b * keys * heads * arch.head_dim * dtype)  # keys, values (repeat_kv)
        + _blk(b * heads * lse_rows * LSE_BYTES)
        + _blk(b * s * arch.q_dim * FP32_BYTES)  # q_norm's fp32 copy of q
        + _blk(b * heads * s * FP32_BYTES)  # and its rstd
        + GATES_PER_LAYER * _blk(dtype)
    )
    # a self-attention layer's flash SDPA: query, key, value (grouped), output, log-sum-exp
    # (the philox seed and offset, which both kernels keep, cancel out)
    own = (
        2 * _blk(b * s * h * dtype) + 2 * _blk(b * s * kv * dtype) + _blk(b * heads * s * LSE_BYTES)
    )
    return cross - own


def _tower_graph_bytes(tower: MllamaVision, images: int, dtype: int) -> int:
    """The tower's graph under enable_input_require_grads (module docstring)."""
    tokens = tower.max_num_tiles * tower.padded_patches  # an image's tokens in the encoders
    hidden = _blk(images * tokens * tower.hidden_size * dtype)
    stats = LAYER_NORM_STATISTICS * _blk(images * tokens * dtype)
    heads = tower.attention_heads
    lse_rows = -(-tokens // EFFICIENT_LSE_ALIGN) * EFFICIENT_LSE_ALIGN
    attention = (
        4 * hidden
        + _blk(images * heads * lse_rows * LSE_BYTES)
        + PHILOX_TENSORS * _blk(INT64_BYTES)
    )
    gelu = _blk(images * tokens * tower.intermediate_size * dtype)
    layer = NORMS_PER_LAYER * (hidden + stats) + attention + gelu
    layers = (tower.num_hidden_layers + tower.num_global_layers) * layer
    gates = GATES_PER_LAYER * tower.num_global_layers * _blk(dtype)
    mask = _blk(images * tokens * tokens * dtype)  # _prepare_aspect_ratio_attention_mask
    unpadded = images * tower.max_num_tiles * tower.patches
    pre = _blk(unpadded * tower.hidden_size * dtype) + LAYER_NORM_STATISTICS * _blk(
        unpadded * dtype
    )
    post = hidden + stats
    patch_leaf = _blk(
        images * tower.max_num_tiles * (tower.patches - 1) * tower.hidden_size * dtype
    )
    return layers + gates + mask + pre + post + patch_leaf


def mllama_step(arch: ModelArch, spec: TrainingSpec, compute_capability: str | None) -> _Step:
    """The language model's step with what the images add (module docstring)."""
    tower = check_mllama_job(arch, spec)
    inputs = spec.vision
    assert inputs is not None and inputs.image_height is not None  # checked above
    assert inputs.image_width is not None
    lm = replace(arch, model_type="llama", mllama=None)
    st = _step(lm, replace(spec, vision=None), compute_capability)
    dtype = DTYPE_BYTES[spec.dtype]
    b, s = spec.batch_size, spec.seq_len
    images = b * inputs.images_per_sample
    keys = inputs.images_per_sample * tower.image_tokens  # each sample's image tokens
    crosses = len(tower.cross_attention_layers)
    # the cross-attention mask in the model's dtype, expanded to every image token, and the
    # per-token row mask (full_text_row_masked_out_mask), kept until backward
    masks = _blk(b * s * keys * dtype) + _blk(b * s * dtype)
    features = _blk(b * keys * arch.hidden_size * dtype)  # cross_attention_states
    vision_output = _blk(b * keys * tower.vision_output_dim * dtype)
    if spec.gradient_checkpointing:
        held = masks + features + _tower_graph_bytes(tower, images, dtype)
        at_loss = vision_output
    else:
        held = masks + crosses * _cross_layer_delta(arch, spec, keys, dtype)
        # the DynamicCache: each cross-attention layer's keys and values, unexpanded, and
        # the first layer's (its input requires no grad, so no SDPA saves them)
        cache = 2 * crosses * _blk(b * keys * arch.kv_dim * dtype) + 2 * _blk(
            b * s * arch.kv_dim * dtype
        )
        at_loss = vision_output + cache
    lt = _blk(CUBLASLT_WORKSPACE)  # the tower's and projector's biased linears (addmm)
    one, both = st.workspaces
    fixed = st.fixed._replace(
        frozen_weights=st.fixed.frozen_weights + _weight_bytes(arch, tower, dtype),
        inputs=st.fixed.inputs + _input_bytes(tower, spec, images),
    )

    def with_held(moment: _Moment, extra: int = 0) -> _Moment:
        return moment._replace(activations=moment.activations + held + extra)

    rows, cols = tile_grid(inputs.image_height, inputs.image_width, tower)
    tower_note = (
        "; with checkpointing its graph is kept (the tower's layers are not checkpointed)"
        if spec.gradient_checkpointing
        else ""
    )
    params = replace(
        st.plan.params,
        total_count=st.plan.params.total_count
        + tower.params(arch.head_dim, EXTRA_EMBEDDING_ROWS * arch.hidden_size),
    )
    return st._replace(
        plan=replace(st.plan, params=params),
        fixed=fixed,
        workspaces=(one + lt, both + lt),
        forward_end=with_held(st.forward_end, at_loss),
        backward_start=with_held(st.backward_start),
        backward=with_held(st.backward),
        assumptions=[
            *st.assumptions,
            f"{images} image(s) of {rows} x {cols} tiles, each padded to "
            f"{tower.max_num_tiles} tiles ({tower.image_tokens} image tokens) for the "
            "cross-attention layers; seq_len counts text tokens only; the vision tower frozen"
            + tower_note,
        ],
    )
