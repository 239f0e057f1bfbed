"""A vision-language model's batch in the trace (Qwen2-VL, Qwen2.5-VL): what the processor
and a collator hand the model beside input_ids and labels.

Qwen2-VL's processor (models/qwen2_vl/processing_qwen2_vl.py) returns `pixel_values`, every
image's patches flattened to (patches, channels x temporal x patch x patch) in fp32,
`image_grid_thw`, one (t, h, w) row per image, and `mm_token_type_ids` (1 at an image's
placeholder tokens). The model reads values from the grid, the ids and the token types
(the vision tower's position ids and cu_seqlens, the per-image attention splits, the
placeholder mask), which a fake tensor cannot answer; so these three are made as constants
that the fake mode evaluates for real (the pixels stay fake), with its limit on the size of
constants raised while the step runs. The M-RoPE index (get_rope_index) builds its positions
from torch.arange, which no constant comes from: a stand-in returns tensors of its outputs'
shapes and dtypes. Qwen2.5-VL's window index (vision_utils.get_vision_window_index) indexes
with a boolean mask of an arange: it is computed for real from the grid's constant value,
outside the fake mode, and its two outputs made constants of the same values.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from service.core.arch.hf_config import from_hf_config
from service.core.arch.mllama import MLLAMA_MODEL_TYPE, aspect_ratios, tile_grid
from service.core.arch.vision import VISION_MODEL_TYPES, image_grid
from service.core.spec import TrainingSpec

# transformers Qwen2VLConfig / Qwen2_5_VLConfig image_token_id default.
DEFAULT_IMAGE_TOKEN_ID = 151655
# mm_token_type_ids' value at an image token (modeling_qwen2_vl.py get_rope_index: text 0,
# image 1, video 2).
IMAGE_TOKEN_TYPE = 1
# Ids of the text tokens around the images (any id but the image token's).
TEXT_TOKEN_ID = 0
# Tensors of at most this many elements stay constants in the fake mode while a vision
# batch runs: the token ids and types, the grid and what the model computes from them.
CONSTANT_ELEMENTS = 1 << 22


# transformers MllamaConfig image_token_index default (the <|image|> token).
MLLAMA_IMAGE_TOKEN_ID = 128256


def is_vision_language(config: Mapping[str, Any]) -> bool:
    model_type = config.get("model_type")
    return model_type in VISION_MODEL_TYPES or model_type == MLLAMA_MODEL_TYPE


def batch(spec: TrainingSpec, config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """input_ids and the image inputs of one micro-batch: each sample's images first (their
    placeholder tokens), then text."""
    vision = spec.vision
    if vision is None:
        raise ValueError("a vision-language trace needs the spec's vision inputs")
    if config.get("model_type") == MLLAMA_MODEL_TYPE:
        return _mllama_batch(spec, config)
    tower = from_hf_config(config).vision
    if tower is None:
        raise ValueError("the config has no vision tower")
    t, h, w = image_grid(tower, vision)
    tokens = t * h * w // tower.merge_area
    image_id = int(config.get("image_token_id", DEFAULT_IMAGE_TOKEN_ID))
    n_image = vision.images_per_sample * tokens
    row = [image_id] * n_image + [TEXT_TOKEN_ID] * (spec.seq_len - n_image)
    types = [IMAGE_TOKEN_TYPE] * n_image + [0] * (spec.seq_len - n_image)
    images = spec.batch_size * vision.images_per_sample
    return {
        # torch.tensor lifts its data: a constant of the fake mode
        "input_ids": torch.tensor([row] * spec.batch_size, dtype=torch.long),
        "mm_token_type_ids": torch.tensor([types] * spec.batch_size, dtype=torch.long),
        "image_grid_thw": torch.tensor([[t, h, w]] * images, dtype=torch.long),
        "pixel_values": torch.zeros(images * t * h * w, tower.patch_features),
    }


def _mllama_batch(spec: TrainingSpec, config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Llama-3.2-Vision's processor outputs (processing_mllama.py, image_processing_mllama.py):
    pixel_values (batch, images, max_num_tiles, channels, tile, tile) in fp32, every image
    padded to max_num_tiles tiles (pad_batches_and_tiles); aspect_ratio_ids (batch, images),
    the tile arrangement's index + 1; aspect_ratio_mask (batch, images, max_num_tiles), 1 at
    the image's tiles; cross_attention_mask (batch, seq, images, max_num_tiles), 1 where a
    token attends to a tile: every token from the image's <|image|> token on
    (convert_sparse_cross_attention_mask_to_dense). input_ids hold one <|image|> token per
    image, then text."""
    vision = spec.vision
    tower = from_hf_config(config).mllama
    if vision is None or tower is None or vision.image_height is None or vision.image_width is None:
        raise ValueError("an mllama trace needs the model's tower and the images' size")
    rows, cols = tile_grid(vision.image_height, vision.image_width, tower)
    # the arrangement's index in the processor's list, + 1 (convert_aspect_ratios_to_ids)
    ratio_id = aspect_ratios(tower.max_num_tiles).index((rows, cols)) + 1
    tiles, n = rows * cols, vision.images_per_sample
    b, s, t = spec.batch_size, spec.seq_len, tower.max_num_tiles
    image_id = int(config.get("image_token_index", MLLAMA_IMAGE_TOKEN_ID))
    row = [image_id] * n + [TEXT_TOKEN_ID] * (s - n)
    tile_mask = [1] * tiles + [0] * (t - tiles)
    # token i attends to image j's tiles from the image's token on
    cross = [[tile_mask if i >= j else [0] * t for j in range(n)] for i in range(s)]
    side = tower.image_size
    return {
        "input_ids": torch.tensor([row] * b, dtype=torch.long),
        "pixel_values": torch.zeros(b, n, t, tower.num_channels, side, side),
        "aspect_ratio_ids": torch.tensor([[ratio_id] * n] * b, dtype=torch.long),
        "aspect_ratio_mask": torch.tensor([[tile_mask] * n] * b, dtype=torch.long),
        "cross_attention_mask": torch.tensor([cross] * b, dtype=torch.long),
    }


def _rope_index(self: Any, input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """get_rope_index's outputs: position ids (3, batch, seq) in input_ids' dtype, created as
    the real one creates them (torch.zeros), and the (batch, 1) position deltas."""
    b, s = input_ids.shape
    positions = torch.zeros(3, b, s, dtype=input_ids.dtype, device=input_ids.device)
    return positions, torch.zeros(b, 1, dtype=torch.long, device=input_ids.device)


def _real_window_index(original: Any) -> Any:
    def window_index(grid_thw: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        from torch.utils._python_dispatch import _disable_current_modes

        grid = getattr(grid_thw, "constant", None)
        if grid is None:
            raise ValueError("image_grid_thw is not a constant of the fake mode")
        with _disable_current_modes():
            index, cu_window_seqlens = original(grid.clone(), *args, **kwargs)
            values = index.tolist(), index.dtype, cu_window_seqlens.tolist()
            cu_dtype = cu_window_seqlens.dtype
        return torch.tensor(values[0], dtype=values[1]), torch.tensor(values[2], dtype=cu_dtype)

    return window_index


@contextlib.contextmanager
def constants() -> Iterator[None]:
    """The fake mode keeps outputs computed from constants as constants up to
    CONSTANT_ELEMENTS elements (torch._subclasses.fake_tensor.CONSTANT_NUMEL_LIMIT, 1 by
    default)."""
    from torch._subclasses import fake_tensor
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

    before = fake_tensor.CONSTANT_NUMEL_LIMIT
    fake_tensor.CONSTANT_NUMEL_LIMIT = CONSTANT_ELEMENTS
    originals = {cls: cls.get_rope_index for cls in (Qwen2VLModel, Qwen2_5_VLModel)}
    window = modeling_qwen2_5_vl.get_vision_window_index
    try:
        for cls in originals:
            cls.get_rope_index = _rope_index  # type: ignore[method-assign,assignment]
        modeling_qwen2_5_vl.get_vision_window_index = _real_window_index(window)
        yield
    finally:
        fake_tensor.CONSTANT_NUMEL_LIMIT = before
        modeling_qwen2_5_vl.get_vision_window_index = window
        for cls, original in originals.items():
            cls.get_rope_index = original  # type: ignore[method-assign]
