"""Llama-3.2-Vision (transformers `mllama`): its vision tower, projector and cross-attention
layers as config.json's `vision_config` and `text_config` describe them, and how its image
processor cuts an image into tiles.

transformers 5.24 models/mllama/modeling_mllama.py: MllamaVisionModel embeds each tile of
`image_size` pixels a side into (image_size / patch_size)^2 patches (a Conv2d without bias),
prepends a class token, adds gated position and tile (aspect-ratio) embeddings, pads the
patches to a multiple of 8, and runs `num_hidden_layers` local ViT layers (LayerNorm with
bias, q/k/v/o without bias, fc1 -> GELU -> fc2 with biases) then `num_global_layers` gated
ones over all tiles of an image; the last hidden state and the local layers'
`intermediate_layers_indices` outputs are concatenated (`vision_output_dim` wide) and the
multi_modal_projector (Linear with bias) maps them to the language model's width. The language
model (MllamaTextModel) is a Llama whose `cross_attention_layers` attend, instead of to the
text, to every image token (tiles x (patches + 1) per image): q from the text, k and v from
the projected image features, per-head RMSNorms on q and k, tanh gates on the attention and
the MLP outputs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from service.core.errors import InvalidConfigError, InvalidSpecError

MLLAMA_MODEL_TYPE = "mllama"
# transformers MllamaVisionConfig / MllamaTextConfig defaults (configuration_mllama.py, 5.24),
# for the keys a published config may omit.
_VISION_DEFAULTS: dict[str, Any] = {
    "hidden_size": 1280,
    "num_hidden_layers": 32,
    "num_global_layers": 8,
    "attention_heads": 16,
    "num_channels": 3,
    "intermediate_size": 5120,
    "vision_output_dim": 7680,
    "image_size": 448,
    "patch_size": 14,
    "max_num_tiles": 4,
    "intermediate_layers_indices": [3, 7, 15, 23, 30],
}
DEFAULT_CROSS_ATTENTION_LAYERS = (3, 8, 13, 18, 23, 28, 33, 38)
# MllamaVisionModel.forward pads each tile's patches (class token included) to a multiple of
# this many before the encoders.
PATCH_PADDING_MULTIPLE = 8
# MllamaTextModel's embed_tokens has vocab_size + 8 rows (modeling_mllama.py __init__).
EXTRA_EMBEDDING_ROWS = 8


@dataclass(frozen=True, slots=True, kw_only=True)
class MllamaVision:
    """Llama-3.2-Vision's vision tower, projector and the language model's cross-attention
    layers (the other fields of the ModelArch describe the language model as a Llama)."""

    hidden_size: int
    num_hidden_layers: int  # the local encoder's layers
    num_global_layers: int  # the gated global encoder's layers
    attention_heads: int
    intermediate_size: int
    num_channels: int
    image_size: int  # a tile's side in pixels
    patch_size: int
    max_num_tiles: int
    vision_output_dim: int  # the concatenated features' width (the projector's input)
    intermediate_layers: int  # how many local layers' outputs are concatenated
    max_aspect_ratio_id: int  # the supported tile arrangements (ids 1..n; 0 pads)
    out_hidden_size: int  # the language model's hidden_size
    cross_attention_layers: tuple[int, ...]

    @property
    def patches(self) -> int:
        """One tile's patch tokens with the class token: (image_size / patch_size)^2 + 1."""
        return (self.image_size // self.patch_size) ** 2 + 1

    @property
    def padded_patches(self) -> int:
        """A tile's tokens in the encoders, padded to a multiple of 8."""
        m = PATCH_PADDING_MULTIPLE
        return -(-self.patches // m) * m

    @property
    def image_tokens(self) -> int:
        """The keys and values one image gives each cross-attention layer: every tile's
        patches and class token (the processor pads every image to max_num_tiles tiles)."""
        return self.max_num_tiles * self.patches

    def layer_linears(self) -> tuple[tuple[str, int, int, bool], ...]:
        """Each encoder layer's nn.Linear modules (name, in, out, bias)."""
        h, i = self.hidden_size, self.intermediate_size
        return (
            ("q_proj", h, h, False),
            ("k_proj", h, h, False),
            ("v_proj", h, h, False),
            ("o_proj", h, h, False),
            ("fc1", h, i, True),
            ("fc2", i, h, True),
        )

    @property
    def layer_params(self) -> int:
        linear = sum(i * o + (o if bias else 0) for _, i, o, bias in self.layer_linears())
        return linear + 2 * 2 * self.hidden_size  # two LayerNorms, weight and bias

    @property
    def embedding_params(self) -> int:
        """Patch embedding, class token, gated position embedding (its table and the tile
        table), the pre- and post-tile aspect-ratio embeddings with their gates, and the pre
        and post LayerNorms."""
        h, tiles, ids = self.hidden_size, self.max_num_tiles, self.max_aspect_ratio_id + 1
        patch = self.num_channels * self.patch_size**2 * h
        position = 1 + self.patches * h + ids * tiles * self.patches * h
        aspect = 2 * (ids * tiles * h + 1)
        return patch + h + position + aspect + 2 * 2 * h

    @property
    def tower_params(self) -> int:
        layers = self.num_hidden_layers + self.num_global_layers
        gates = 2 * self.num_global_layers  # gate_attn and gate_ffn of each global layer
        return self.embedding_params + layers * self.layer_params + gates

    @property
    def projector_params(self) -> int:
        return self.vision_output_dim * self.out_hidden_size + self.out_hidden_size

    def cross_layer_extra_params(self, head_dim: int) -> int:
        """What a cross-attention layer has beyond a Llama layer: q_norm, k_norm and the two
        tanh gates."""
        return 2 * head_dim + 2

    def params(self, head_dim: int, extra_embedding: int) -> int:
        """The tower, projector, cross-attention extras and the embedding's extra rows."""
        cross = len(self.cross_attention_layers) * self.cross_layer_extra_params(head_dim)
        return self.tower_params + self.projector_params + cross + extra_embedding


def mllama_from_config(
    raw: Mapping[str, Any], text: Mapping[str, Any], lm_hidden: int
) -> MllamaVision:
    """The vision tower and cross-attention layers of an mllama config.json."""
    given = raw.get("vision_config") or {}
    if not isinstance(given, Mapping):
        raise InvalidConfigError("vision_config", "must be a JSON object")
    c = {**_VISION_DEFAULTS, **given}

    def integer(key: str) -> int:
        value = c.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidConfigError(f"vision_config.{key}", "must be a positive integer")
        return value

    width, heads = integer("hidden_size"), integer("attention_heads")
    if width % heads:
        raise InvalidConfigError("vision_config.attention_heads", f"must divide {width}")
    image, patch = integer("image_size"), integer("patch_size")
    if image % patch:
        raise InvalidConfigError("vision_config.patch_size", f"must divide image_size {image}")
    layers = integer("num_hidden_layers")
    indices = c.get("intermediate_layers_indices")
    if not isinstance(indices, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers for i in indices
    ):
        raise InvalidConfigError(
            "vision_config.intermediate_layers_indices",
            f"must be a list of local layer indices below {layers}",
        )
    output = integer("vision_output_dim")
    if output != width * (len(indices) + 1):
        raise InvalidConfigError(
            "vision_config.vision_output_dim",
            f"must be hidden_size x (intermediate layers + 1) = {width * (len(indices) + 1)}",
        )
    tiles = integer("max_num_tiles")
    ratios = c.get("supported_aspect_ratios")
    # MllamaVisionConfig: max_aspect_ratio_id = len(supported_aspect_ratios), by default
    # every (w, h) with w * h <= max_num_tiles
    count = len(ratios) if isinstance(ratios, list) and ratios else len(aspect_ratios(tiles))
    cross = text.get("cross_attention_layers", list(DEFAULT_CROSS_ATTENTION_LAYERS))
    total = text.get("num_hidden_layers")
    if (
        not isinstance(cross, list)
        or not cross
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in cross)
        or not isinstance(total, int)
        or not all(0 <= i < total for i in cross)
        or len(set(cross)) != len(cross)
    ):
        raise InvalidConfigError(
            "text_config.cross_attention_layers",
            "must be a non-empty list of distinct layer indices below num_hidden_layers",
        )
    return MllamaVision(
        hidden_size=width,
        num_hidden_layers=layers,
        num_global_layers=integer("num_global_layers"),
        attention_heads=heads,
        intermediate_size=integer("intermediate_size"),
        num_channels=integer("num_channels"),
        image_size=image,
        patch_size=patch,
        max_num_tiles=tiles,
        vision_output_dim=output,
        intermediate_layers=len(indices),
        max_aspect_ratio_id=count,
        out_hidden_size=lm_hidden,
        cross_attention_layers=tuple(sorted(cross)),
    )


def aspect_ratios(max_tiles: int) -> list[tuple[int, int]]:
    """Every tile arrangement (width, height) of at most max_tiles tiles, in the image
    processor's order (image_processing_mllama.py get_all_supported_aspect_ratios)."""
    return [
        (w, h)
        for w in range(1, max_tiles + 1)
        for h in range(1, max_tiles + 1)
        if w * h <= max_tiles
    ]


def tile_grid(height: int, width: int, vision: MllamaVision) -> tuple[int, int]:
    """The tiles (rows, columns) the image processor cuts an image of height x width pixels
    into: the canvas of tiles that needs the smallest upscale, else the least downscale, the
    smaller area on a tie (image_processing_mllama.py get_optimal_tiled_canvas)."""
    if height < 1 or width < 1:
        raise InvalidSpecError("vision.image_height", "must be at least 1")
    tile = vision.image_size
    canvases = [(rows * tile, cols * tile) for rows, cols in aspect_ratios(vision.max_num_tiles)]
    scales = [min(ch / height, cw / width) for ch, cw in canvases]
    up = [s for s in scales if s >= 1]
    chosen = min(up) if up else max(scales)
    fits = [canvas for canvas, s in zip(canvases, scales, strict=True) if s == chosen]
    canvas_h, canvas_w = min(fits, key=lambda c: c[0] * c[1])
    return canvas_h // tile, canvas_w // tile
