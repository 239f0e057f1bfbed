"""A vision-language model's vision tower (Qwen2-VL, Qwen2.5-VL), as its config.json's
`vision_config` describes it, and how its image processor turns an image into patches and
the language model's image tokens.

Qwen2-VL's tower (transformers models/qwen2_vl/modeling_qwen2_vl.py
Qwen2VisionTransformerPretrainedModel): a Conv3d patch embedding without bias, `depth` ViT
blocks (LayerNorm, a fused qkv linear, proj, fc1 -> act -> fc2, attention over each image's
patches), and a PatchMerger (LayerNorm, then merge^2 patches concatenated through
Linear -> GELU -> Linear into the language model's width). Qwen2.5-VL's
(models/qwen2_5_vl/modeling_qwen2_5_vl.py) has RMSNorms, a gated MLP with biases and
windowed attention in all blocks but `fullatt_block_indexes`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from service.core.errors import InvalidConfigError, InvalidSpecError
from service.core.spec.vision import VisionInputs

# The model types whose vision tower this module describes.
VISION_MODEL_TYPES = frozenset({"qwen2_vl", "qwen2_5_vl"})
# transformers Qwen2VLVisionConfig / Qwen2_5_VLVisionConfig defaults (configuration_qwen2_vl.py,
# configuration_qwen2_5_vl.py), for the keys a published vision_config may omit.
_VISION_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen2_vl": {
        "depth": 32,
        "embed_dim": 1280,
        "num_heads": 16,
        "mlp_ratio": 4,
        "hidden_act": "quick_gelu",
        "in_channels": 3,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
    },
    "qwen2_5_vl": {
        "depth": 32,
        "hidden_size": 3584,
        "intermediate_size": 3420,
        "num_heads": 16,
        "hidden_act": "silu",
        "in_channels": 3,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
    },
}
# Qwen2VLImageProcessor's size (models/qwen2_vl/image_processing_qwen2_vl.py, transformers
# 5.24): shortest_edge 56*56 and longest_edge 28*28*1280 pixels, the min/max_pixels bounds.
DEFAULT_MIN_PIXELS = 56 * 56
DEFAULT_MAX_PIXELS = 28 * 28 * 1280
# smart_resize refuses images more elongated than this (image_processing_qwen2_vl.py).
MAX_ASPECT_RATIO = 200


@dataclass(frozen=True, slots=True, kw_only=True)
class VisionArch:
    """A Qwen2-VL / Qwen2.5-VL vision tower and its patch merger."""

    model_type: str
    depth: int
    hidden_size: int  # the blocks' width (Qwen2-VL's embed_dim)
    num_heads: int
    intermediate_size: int  # the MLP's hidden width (Qwen2-VL: embed_dim * mlp_ratio)
    gated_mlp: bool  # Qwen2.5-VL: gate_proj/up_proj/down_proj, all with biases
    layer_norm: bool  # nn.LayerNorm (weight and bias); else an RMSNorm (weight)
    hidden_act: str
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int  # the merger's output: the language model's hidden_size
    window_size: int = 0  # Qwen2.5-VL's attention window in pixels; 0: every block global
    fullatt_blocks: tuple[int, ...] = ()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_features(self) -> int:
        """One flattened patch of pixel_values: channels x temporal x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_area(self) -> int:
        return self.spatial_merge_size**2

    @property
    def merged_width(self) -> int:
        """The merger's input width: merge^2 patches side by side."""
        return self.hidden_size * self.merge_area

    @property
    def norm_params(self) -> int:
        return self.hidden_size * (2 if self.layer_norm else 1)

    def linears(self) -> tuple[tuple[str, int, int], ...]:
        """Each block's nn.Linear modules (name, in, out), all with biases."""
        h, i = self.hidden_size, self.intermediate_size
        mlp = (
            (("gate_proj", h, i), ("up_proj", h, i), ("down_proj", i, h))
            if self.gated_mlp
            else (("fc1", h, i), ("fc2", i, h))
        )
        return (("qkv", h, 3 * h), ("proj", h, h), *mlp)

    def merger_linears(self) -> tuple[tuple[str, int, int], ...]:
        """The merger's nn.Sequential linears (mlp.0, mlp.2), with biases."""
        m = self.merged_width
        return (("mlp.0", m, m), ("mlp.2", m, self.out_hidden_size))

    @property
    def block_params(self) -> int:
        linear = sum(i * o + o for _, i, o in self.linears())
        return linear + 2 * self.norm_params

    @property
    def params(self) -> int:
        """The tower's parameters: patch embedding, blocks, merger."""
        patch = self.patch_features * self.hidden_size
        merger = self.norm_params + sum(i * o + o for _, i, o in self.merger_linears())
        return patch + self.depth * self.block_params + merger


def vision_from_config(model_type: str, raw: Mapping[str, Any], text_hidden: int) -> VisionArch:
    """The vision tower of a Qwen2-VL / Qwen2.5-VL config.json (its `vision_config`)."""
    given = raw.get("vision_config") or {}
    if not isinstance(given, Mapping):
        raise InvalidConfigError("vision_config", "must be a JSON object")
    c = {**_VISION_DEFAULTS[model_type], **given}

    def integer(key: str) -> int:
        value = c.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidConfigError(f"vision_config.{key}", "must be a positive integer")
        return value

    qwen2 = model_type == "qwen2_vl"
    width = integer("embed_dim") if qwen2 else integer("hidden_size")
    heads = integer("num_heads")
    if width % heads:
        raise InvalidConfigError("vision_config.num_heads", f"must divide the width {width}")
    if qwen2:
        ratio = c.get("mlp_ratio")
        if not isinstance(ratio, int | float) or ratio <= 0:
            raise InvalidConfigError("vision_config.mlp_ratio", "must be a positive number")
        intermediate = int(width * ratio)  # Qwen2VLVisionBlock: int(embed_dim * mlp_ratio)
        out = text_hidden  # PatchMerger(dim=config.hidden_size): the language model's width
    else:
        intermediate = integer("intermediate_size")
        out = integer("out_hidden_size")
    if out != text_hidden:
        raise InvalidConfigError(
            "vision_config.out_hidden_size",
            f"the merger's output ({out}) must be the language model's hidden_size ({text_hidden})",
        )
    full = c.get("fullatt_block_indexes") or []
    return VisionArch(
        model_type=model_type,
        depth=integer("depth"),
        hidden_size=width,
        num_heads=heads,
        intermediate_size=intermediate,
        gated_mlp=not qwen2,
        layer_norm=qwen2,
        hidden_act=str(c.get("hidden_act")),
        in_channels=integer("in_channels"),
        patch_size=integer("patch_size"),
        temporal_patch_size=integer("temporal_patch_size"),
        spatial_merge_size=integer("spatial_merge_size"),
        out_hidden_size=out,
        window_size=0 if qwen2 else integer("window_size"),
        fullatt_blocks=tuple(int(i) for i in full),
    )


def smart_resize(
    height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """The size Qwen2-VL's image processor resizes an image to: both sides multiples of
    `factor` (patch x merge), its area within [min_pixels, max_pixels], the aspect ratio kept
    as closely as that allows (image_processing_qwen2_vl.py smart_resize)."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise InvalidSpecError(
            "vision.image_height",
            f"the processor refuses aspect ratios above {MAX_ASPECT_RATIO} "
            f"({height} x {width} pixels)",
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def image_grid(vision: VisionArch, inputs: VisionInputs) -> tuple[int, int, int]:
    """One image's patch grid (t, h, w), as the processor's image_grid_thw row: t is 1 for an
    image (its patch is repeated temporal_patch_size times). With `image_tokens` given, a
    grid of that many merged tokens, one merge block high."""
    m = vision.spatial_merge_size
    if inputs.image_tokens is not None:
        return 1, m, m * inputs.image_tokens
    if inputs.image_height is None or inputs.image_width is None:
        raise InvalidSpecError("vision.image_height", "give the images' size or image_tokens")
    min_pixels = inputs.min_pixels or DEFAULT_MIN_PIXELS
    max_pixels = inputs.max_pixels or DEFAULT_MAX_PIXELS
    if min_pixels > max_pixels:
        raise InvalidSpecError("vision.min_pixels", f"must not exceed max_pixels ({max_pixels})")
    height, width = smart_resize(
        inputs.image_height,
        inputs.image_width,
        factor=vision.patch_size * m,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
    )
    return 1, height // vision.patch_size, width // vision.patch_size


def image_tokens(vision: VisionArch, inputs: VisionInputs) -> int:
    """The language-model tokens one image becomes: its patches over merge^2."""
    t, h, w = image_grid(vision, inputs)
    return t * h * w // vision.merge_area
