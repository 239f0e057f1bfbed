"""A vision-language job's image inputs in a job request (service/core/spec/vision.py, where
each field is declared)."""

from __future__ import annotations

from service.api.schemas.declared import DeclaredIn, declared_model
from service.core.spec.vision import VisionInputs

VisionIn = declared_model(
    "VisionIn",
    VisionInputs,
    doc="""Each sample's images, all of one size: give image_height and image_width (pixels, as
    the images are before the processor resizes them) or image_tokens. Qwen2-VL / Qwen2.5-VL:
    seq_len counts the image tokens (the processor puts one placeholder per image token into
    input_ids), so images_per_sample x the tokens per image must fit in it. Llama-3.2-Vision:
    the size picks the processor's tiles (at most four of 560 x 560, every image padded to
    four), which enter through cross-attention: seq_len counts text tokens only (one
    <|image|> token per image); image_tokens, min_pixels and max_pixels do not apply.""",
    base=DeclaredIn,
)
