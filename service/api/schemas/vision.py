"""A vision-language job's image inputs in a job request (service/core/spec_vision.py)."""

from __future__ import annotations

from pydantic import Field

from service.api.schemas.base import In, integers
from service.core.limits import MAX_IMAGE_SIDE, MAX_IMAGES_PER_SAMPLE, MAX_SEQ_LEN
from service.core.spec_vision import VisionInputs


class VisionIn(In):
    """Each sample's images, all of one size: give image_height and image_width (pixels, as
    the images are before the processor resizes them) or image_tokens. Qwen2-VL / Qwen2.5-VL:
    seq_len counts the image tokens (the processor puts one placeholder per image token into
    input_ids), so images_per_sample x the tokens per image must fit in it. Llama-3.2-Vision:
    the size picks the processor's tiles (at most four of 560 x 560, every image padded to
    four), which enter through cross-attention: seq_len counts text tokens only (one
    <|image|> token per image); image_tokens, min_pixels and max_pixels do not apply."""

    integer_fields = integers(
        "images_per_sample",
        "image_height",
        "image_width",
        "image_tokens",
        "min_pixels",
        "max_pixels",
    )

    images_per_sample: int = Field(
        default=1, ge=1, le=MAX_IMAGES_PER_SAMPLE, description="Images in each sample."
    )
    image_height: int | None = Field(
        default=None,
        ge=1,
        le=MAX_IMAGE_SIDE,
        description="The images' height in pixels; with image_width, the processor's resize "
        "(Qwen2-VL: smart_resize to multiples of 28 within min/max_pixels) gives the tokens, "
        "or (Llama-3.2-Vision) get_optimal_tiled_canvas the tiles.",
    )
    image_width: int | None = Field(
        default=None, ge=1, le=MAX_IMAGE_SIDE, description="The images' width in pixels."
    )
    image_tokens: int | None = Field(
        default=None,
        ge=1,
        le=MAX_SEQ_LEN,
        description="Instead of the size: the tokens one image takes in the language model's "
        "sequence (Qwen2-VL: its merged patches, a quarter of its 14 x 14 patches). Not for "
        "Llama-3.2-Vision, whose images are no tokens of the sequence.",
    )
    min_pixels: int | None = Field(
        default=None,
        ge=1,
        le=MAX_IMAGE_SIDE**2,
        description="Qwen2-VL's processor min_pixels; null: Qwen2VLImageProcessor's 3136.",
    )
    max_pixels: int | None = Field(
        default=None,
        ge=1,
        le=MAX_IMAGE_SIDE**2,
        description="Qwen2-VL's processor max_pixels; null: Qwen2VLImageProcessor's 1003520 "
        "(28 x 28 x 1280).",
    )

    def to_spec(self) -> VisionInputs:
        return VisionInputs(
            images_per_sample=self.images_per_sample,
            image_height=self.image_height,
            image_width=self.image_width,
            image_tokens=self.image_tokens,
            min_pixels=self.min_pixels,
            max_pixels=self.max_pixels,
        )
