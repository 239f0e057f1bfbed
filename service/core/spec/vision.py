"""A vision-language job's image inputs: how many images each sample holds and how large
they are, as the model's image processor sees them.

The images' tokens are part of the language model's sequence: `seq_len` counts them (HF's
processors put one placeholder token per image token into `input_ids`, and the collators pad
and truncate that sequence), so every sample's image tokens must fit in `seq_len`. How many
tokens an image of `image_height` x `image_width` pixels becomes is the model's concern (for
Qwen2-VL its processor's `smart_resize`, service/core/estimator/vision.py); `image_tokens`
gives that count directly instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from service.core.errors import InvalidSpecError
from service.core.fields import job_field
from service.core.limits import MAX_IMAGE_SIDE, MAX_IMAGES_PER_SAMPLE, MAX_SEQ_LEN


@dataclass(frozen=True, slots=True, kw_only=True)
class VisionInputs:
    """Images per sample, each of one size: its pixels (`image_height`, `image_width`) or
    the tokens it contributes to the language model's sequence (`image_tokens`)."""

    images_per_sample: int = job_field(
        1, doc="Images in each sample.", ge=1, le=MAX_IMAGES_PER_SAMPLE
    )
    # The image's size in pixels before the processor resizes it.
    image_height: int | None = job_field(
        None,
        doc="The images' height in pixels; with image_width, the processor's resize (Qwen2-VL: "
        "smart_resize to multiples of 28 within min/max_pixels) gives the tokens, or "
        "(Llama-3.2-Vision) get_optimal_tiled_canvas the tiles.",
        ge=1,
        le=MAX_IMAGE_SIDE,
    )
    image_width: int | None = job_field(
        None, doc="The images' width in pixels.", ge=1, le=MAX_IMAGE_SIDE
    )
    # An override: the tokens one image takes in the language model's sequence (Qwen2-VL: its
    # merged patches, one <|image_pad|> placeholder each), instead of deriving them from pixels.
    image_tokens: int | None = job_field(
        None,
        doc="Instead of the size: the tokens one image takes in the language model's sequence "
        "(Qwen2-VL: its merged patches, a quarter of its 14 x 14 patches). Not for "
        "Llama-3.2-Vision, whose images are no tokens of the sequence.",
        ge=1,
        le=MAX_SEQ_LEN,
    )
    # Qwen2-VL's processor bounds on the resized image's pixels (Qwen2VLImageProcessor
    # min_pixels / max_pixels, its size's shortest_edge / longest_edge); None: the
    # processor's defaults.
    min_pixels: int | None = job_field(
        None,
        doc="Qwen2-VL's processor min_pixels; null: Qwen2VLImageProcessor's 3136.",
        mirrors="Qwen2VLImageProcessor.min_pixels",
        ge=1,
        le=MAX_IMAGE_SIDE**2,
    )
    max_pixels: int | None = job_field(
        None,
        doc="Qwen2-VL's processor max_pixels; null: Qwen2VLImageProcessor's 1003520 (28 x 28 x "
        "1280).",
        mirrors="Qwen2VLImageProcessor.max_pixels",
        ge=1,
        le=MAX_IMAGE_SIDE**2,
    )

    def __post_init__(self) -> None:
        if self.images_per_sample < 1:
            raise InvalidSpecError("vision.images_per_sample", "must be at least 1")
        for name in ("image_height", "image_width", "image_tokens", "min_pixels", "max_pixels"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InvalidSpecError(f"vision.{name}", "must be at least 1")
        sized = self.image_height is not None, self.image_width is not None
        if any(sized) and not all(sized):
            missing = "image_width" if sized[0] else "image_height"
            raise InvalidSpecError(f"vision.{missing}", "image_height and image_width go together")
        if self.image_tokens is None and not all(sized):
            raise InvalidSpecError(
                "vision.image_height",
                "give the images' size (image_height and image_width) or image_tokens",
            )
        if self.image_tokens is not None and all(sized):
            raise InvalidSpecError(
                "vision.image_tokens", "an override of image_height/image_width: give one of them"
            )
        if (
            self.min_pixels is not None
            and self.max_pixels is not None
            and self.min_pixels > self.max_pixels
        ):
            raise InvalidSpecError("vision.min_pixels", "must not exceed max_pixels")


class SequenceTooShortError(InvalidSpecError):
    """seq_len is shorter than the images' tokens; `minimum` is the shortest that holds them
    (a fit solver takes a shorter sequence as one that cannot run)."""

    def __init__(self, reason: str, minimum: int) -> None:
        super().__init__("seq_len", reason)
        self.minimum = minimum


def check_sequence(vision: VisionInputs, tokens_per_image: int, seq_len: int) -> None:
    """Every sample's image tokens must fit in its `seq_len` tokens (seq_len counts them)."""
    needed = vision.images_per_sample * tokens_per_image
    if needed > seq_len:
        raise SequenceTooShortError(
            f"{vision.images_per_sample} image(s) of {tokens_per_image} tokens take {needed} "
            f"tokens, more than seq_len {seq_len} (seq_len counts the image tokens)",
            needed,
        )


# What a vision-language job is modelled with: HF Trainer's causal-LM step (framework "hf",
# objective "sft") on one GPU, with these methods.
VISION_METHODS = ("full", "lora", "qlora")


def check_vision(spec: Any) -> None:
    """The spec-level checks of a TrainingSpec's `vision` (the model's own come with its
    architecture, in the estimator)."""
    vision: VisionInputs | None = spec.vision
    if vision is None:
        return
    if spec.method.value not in VISION_METHODS:
        raise InvalidSpecError(
            "method",
            f"a vision-language job is modelled with methods {', '.join(VISION_METHODS)}, not "
            f"{spec.method.value!r}",
        )
    if spec.objective.value != "sft":
        raise InvalidSpecError(
            "objective", "a vision-language job is modelled with objective 'sft' (HF Trainer's)"
        )
    if spec.framework.value != "hf":
        raise InvalidSpecError(
            "framework", "a vision-language job is modelled as HF Trainer's (framework 'hf')"
        )
    if spec.parallel.gpus != 1:
        raise InvalidSpecError("parallel.gpus", "a vision-language job is modelled on one GPU")
    if getattr(spec, "packing", False):
        raise InvalidSpecError("packing", "not modelled for a vision-language job")
    if spec.target_length is not None or spec.num_labels is not None:
        field = "target_length" if spec.target_length is not None else "num_labels"
        raise InvalidSpecError(field, "a vision-language model is a causal LM")
    if vision.image_tokens is not None:
        check_sequence(vision, vision.image_tokens, spec.seq_len)
