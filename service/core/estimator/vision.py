"""A vision-language model's step (Qwen2-VL): the language model's SFT step, with what the
images add to it.

transformers' Qwen2VLForConditionalGeneration (models/qwen2_vl/modeling_qwen2_vl.py) runs
the vision tower on `pixel_values` (every image's patches), merges each 2 x 2 block of patches
into one token of the language model's width, embeds input_ids and scatters the image
features into the embeddings at the image placeholder tokens (`masked_scatter`), computes the
M-RoPE position ids (3, batch, seq) and runs the language model on the sequence, image
tokens included. Beside the language model's step (`step._step`, on the model without its
tower) the estimate holds:

- the tower's frozen weights (4-bit linears under QLoRA, the rest in fp32 after PEFT's k-bit
  preparation), and the processor's inputs (fp32 pixel_values, image_grid_thw,
  mm_token_type_ids) through the step;
- M-RoPE's cos and sin, (batch, seq, head_dim) rather than one row shared by the batch;
- with enable_input_require_grads (HF Trainer with checkpointing, PEFT's k-bit preparation),
  which hooks every input embedding of the model, the patch embedding's among them: the
  tower's autograd graph. Its checkpointed blocks keep their inputs, the merger its norm's
  input and statistics and its GELU's input, the rotary tables their fp32 cos and sin; the
  embedding's output, a leaf requiring grad, stays beside the scattered copy the layers take,
  and masked_scatter keeps the placeholder mask.
"""

from __future__ import annotations

from dataclasses import replace

from service.core.arch import ModelArch
from service.core.arch.vision import VisionArch, image_grid
from service.core.errors import InvalidSpecError
from service.core.estimator.ledger import _blk
from service.core.estimator.mllama import mllama_step
from service.core.estimator.step import _Step, _step
from service.core.estimator.step_context import _Moment
from service.core.estimator.weights import _quantized_matrix_bytes
from service.core.spec import ALL_LINEAR, AttnImpl, Method, TrainingSpec
from service.core.spec.vision import check_sequence
from service.core.units import BOOL_BYTES, DTYPE_BYTES, FP32_BYTES, INT32_BYTES, INT64_BYTES

# The image grid rows (t, h, w) and the token types are torch.long (the processor's
# BatchFeature of numpy int64 arrays); pixel_values are fp32 (its rescale and normalise).
GRID_COLUMNS = 3
PIXEL_BYTES = FP32_BYTES
# cu_seqlens: int32 cumulative patch counts, one more than the images
# (transformers vision_utils.py get_vision_cu_seqlens).
CU_SEQLENS_BYTES = INT32_BYTES
# The vision rotary tables are fp32 (Qwen2VLVisionRotaryEmbedding.forward: freqs in float).
VISION_ROPE_BYTES = FP32_BYTES
# get_rope_index keeps the (batch, 1) position deltas on the model (self.rope_deltas).
ROPE_DELTA_BYTES = INT64_BYTES
# The merger's LayerNorm keeps its mean and rstd in the tower's dtype (reference trace
# qwen2-vl-2b-instruct__lora__*__ckpt: two N x 2-byte tensors beside the norm's input).
MERGER_NORM_STATISTICS = 2


def _targets_in_tower(vision: VisionArch, targets: tuple[str, ...] | str | None) -> list[str]:
    """The LoRA targets that name a module of the vision tower (PEFT matches a name, or a
    name's last dotted parts)."""
    if targets == ALL_LINEAR:
        return [ALL_LINEAR]
    if targets is None or isinstance(targets, str):
        return []
    names = [name for name, _, _ in vision.linears()]
    names += ["merger.mlp.0", "merger.mlp.2", "patch_embed.proj", "mlp.0", "mlp.2"]
    hits = []
    for target in targets:
        if any(name == target or name.endswith("." + target) for name in names):
            hits.append(target)
    return hits


def check_vision_job(arch: ModelArch, spec: TrainingSpec) -> None:
    """What the estimate of a vision-language job models, each refusal naming its field."""
    vision = arch.vision
    if vision is None:
        if spec.vision is not None:
            raise InvalidSpecError(
                "vision", f"{arch.model_type!r} has no vision tower: it takes no image inputs"
            )
        return
    if spec.vision is None:
        raise InvalidSpecError(
            "vision",
            f"{arch.model_type!r} is a vision-language model: give its image inputs "
            "(images_per_sample and the images' size or image_tokens)",
        )
    if spec.method is Method.FULL:
        raise InvalidSpecError(
            "method",
            "full fine-tuning trains the vision tower, whose saved activations are not "
            "modelled yet: use LoRA or QLoRA on the language model's linears",
        )
    lora = spec.lora
    if lora is not None:
        hits = _targets_in_tower(vision, lora.target_modules)
        own = "q_proj, k_proj, v_proj, o_proj" + (
            "" if vision.gated_mlp else ", gate_proj, up_proj, down_proj"
        )
        if hits:
            raise InvalidSpecError(
                "lora.target_modules",
                f"{', '.join(map(repr, hits))} adapt(s) modules of the vision tower, whose "
                "training is not modelled yet: name language-model linears the tower does not "
                f"have ({own})",
            )
        if lora.modules_to_save:
            raise InvalidSpecError(
                "lora.modules_to_save", "not modelled for a vision-language model yet"
            )
        if lora.use_dora:
            raise InvalidSpecError("lora.use_dora", "not modelled for a vision-language model")
    if spec.attn_implementation is AttnImpl.EAGER:
        raise InvalidSpecError(
            "attn_implementation", "eager attention is not modelled for a vision-language model"
        )
    if spec.autocast:
        raise InvalidSpecError("autocast", "not modelled for a vision-language model yet")
    if spec.gradient_accumulation_steps != 1:
        raise InvalidSpecError(
            "gradient_accumulation_steps", "not modelled for a vision-language model yet"
        )
    t, h, w = image_grid(vision, spec.vision)
    check_sequence(spec.vision, t * h * w // vision.merge_area, spec.seq_len)


def vision_weight_bytes(vision: VisionArch, spec: TrainingSpec) -> int:
    """The tower's frozen weights, tensor by tensor: in the model's dtype, or under QLoRA its
    linears 4-bit (transformers' bitsandbytes swap skips only the LM head) and every other
    tensor fp32 after prepare_model_for_kbit_training (else the model's dtype)."""
    dtype = DTYPE_BYTES[spec.dtype]
    quant = spec.quantization
    qlora = spec.method is Method.QLORA
    rest = FP32_BYTES if qlora and (quant is None or quant.prepare_kbit) else dtype
    hv = vision.hidden_size

    # bitsandbytes' Linear4bit.forward casts its bias's data to the compute dtype in place
    # (bitsandbytes/nn/modules.py, 0.50): from the first forward on the bias is that dtype.
    compute = DTYPE_BYTES[quant.compute_dtype or spec.dtype] if quant is not None else dtype

    def linear(i: int, o: int) -> int:
        if qlora:
            return _quantized_matrix_bytes(i, o, quant) + _blk(o * compute)
        return _blk(i * o * dtype) + _blk(o * dtype)

    norm_tensors = 2 if vision.layer_norm else 1
    norm_bytes = rest if qlora else dtype
    norm = norm_tensors * _blk(hv * norm_bytes)
    block = sum(linear(i, o) for _, i, o in vision.linears()) + 2 * norm
    merger = norm + sum(linear(i, o) for _, i, o in vision.merger_linears())
    patch = _blk(vision.patch_features * hv * (rest if qlora else dtype))
    return patch + vision.depth * block + merger


def _input_bytes(vision: VisionArch, spec: TrainingSpec, patches: int, images: int) -> int:
    """pixel_values, image_grid_thw and mm_token_type_ids, held through the step."""
    return (
        _blk(patches * vision.patch_features * PIXEL_BYTES)
        + _blk(images * GRID_COLUMNS * INT64_BYTES)
        + _blk(spec.batch_size * spec.seq_len * INT64_BYTES)
    )


def _windows(vision: VisionArch, grid: tuple[int, int, int]) -> int:
    """Qwen2.5-VL's attention windows over one image: window_size pixels a side, in merged
    tokens, the last row and column of windows partial."""
    side = vision.window_size // vision.spatial_merge_size // vision.patch_size
    t, h, w = grid
    m = vision.spatial_merge_size
    return t * -(-(h // m) // side) * -(-(w // m) // side)


def _tower_graph_bytes(
    vision: VisionArch,
    arch: ModelArch,
    spec: TrainingSpec,
    grid: tuple[int, int, int],
    images: int,
    residual: int,
) -> int:
    """What the tower's graph keeps until backward reaches it, when its patch embedding's
    output requires grad (enable_input_require_grads), with the language model's side of it."""
    hv = vision.hidden_size
    patches = images * grid[0] * grid[1] * grid[2]
    half = DTYPE_BYTES[spec.dtype]
    if spec.method is Method.QLORA:
        # the k-bit preparation's fp32 patch embedding runs the tower in fp32
        half = FP32_BYTES
    b, s = spec.batch_size, spec.seq_len
    hidden = _blk(patches * hv * half)
    tokens = patches // vision.merge_area
    # each checkpointed block's input and the patch embedding's output (the first block's
    # input; Qwen2.5-VL's is its window-ordered copy, the output a leaf beside it)
    blocks = (vision.depth + 1) * hidden
    if vision.layer_norm:
        # the merger's LayerNorm: the last block's output, its mean and rstd
        norm = MERGER_NORM_STATISTICS * _blk(patches * half)
    else:
        # the merger's RMSNorm: its input's fp32 copy and rstd (Qwen2RMSNorm)
        norm = _blk(patches * hv * FP32_BYTES) + _blk(patches * FP32_BYTES)
    gelu_input = _blk(tokens * vision.merged_width * half)
    rope = 2 * _blk(patches * vision.head_dim * VISION_ROPE_BYTES)
    cu_seqlens = _blk((images + 1) * CU_SEQLENS_BYTES)
    if vision.window_size:
        # the window order and its inverse (argsort), saved by their index ops, and the
        # windows' cu_seqlens (vision_utils.get_vision_window_index)
        cu_seqlens += 2 * _blk(tokens * INT64_BYTES)
        cu_seqlens += _blk((_windows(vision, grid) * images + 1) * CU_SEQLENS_BYTES)
    # (in the residual stream's dtype: fp32 under the k-bit preparation)
    embedding_leaf = _blk(b * s * arch.hidden_size * residual)
    mask = _blk(b * s * BOOL_BYTES)
    return blocks + norm + gelu_input + rope + cu_seqlens + embedding_leaf + mask


def vision_step(arch: ModelArch, spec: TrainingSpec, compute_capability: str | None) -> _Step:
    """The language model's step with what the images add (module docstring)."""
    check_vision_job(arch, spec)
    vision, inputs = arch.vision, spec.vision
    assert vision is not None and inputs is not None  # check_vision_job refused the rest
    st = _step(replace(arch, vision=None), replace(spec, vision=None), compute_capability)
    t, h, w = image_grid(vision, inputs)
    images = spec.batch_size * inputs.images_per_sample
    patches = images * t * h * w
    b, s = spec.batch_size, spec.seq_len
    residual = st.plan.flow.residual
    # M-RoPE's cos and sin: (batch, seq, head_dim) where a text model's are (1, seq, head_dim)
    rope = 2 * (_blk(b * s * arch.head_dim * residual) - _blk(s * arch.head_dim * residual))
    held = rope + _blk(b * ROPE_DELTA_BYTES)
    # the tracer's and HF Trainer's enable_input_require_grads comes with checkpointing
    if spec.gradient_checkpointing:
        held += _tower_graph_bytes(vision, arch, spec, (t, h, w), images, residual)
    fixed = st.fixed._replace(
        frozen_weights=st.fixed.frozen_weights + vision_weight_bytes(vision, spec),
        inputs=st.fixed.inputs + _input_bytes(vision, spec, patches, images),
    )

    def with_held(moment: _Moment) -> _Moment:
        return moment._replace(activations=moment.activations + held)

    # the answer's parameter count is the plan's: the tower's are frozen ones
    params = replace(st.plan.params, total_count=st.plan.params.total_count + vision.params)
    return st._replace(
        plan=replace(st.plan, params=params),
        fixed=fixed,
        forward_end=with_held(st.forward_end),
        backward_start=with_held(st.backward_start),
        backward=with_held(st.backward),
        assumptions=[
            *st.assumptions,
            f"{images} image(s) of {t * h * w} patches, {t * h * w // vision.merge_area} "
            "tokens each, counted in seq_len; the vision tower frozen",
        ],
    )


def model_step(arch: ModelArch, spec: TrainingSpec, compute_capability: str | None) -> _Step:
    """The SFT step of a decoder, or of a vision-language model with its images."""
    if arch.mllama is not None:
        return mllama_step(arch, spec, compute_capability)
    if arch.vision is None and spec.vision is None:
        return _step(arch, spec, compute_capability)
    return vision_step(arch, spec, compute_capability)
