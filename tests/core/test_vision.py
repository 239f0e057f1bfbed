"""Vision-language jobs (Qwen2-VL): the image inputs, the tokens an image becomes, what is
refused, and the estimate's parts beside the language model's."""

from __future__ import annotations

from dataclasses import replace

import pytest

from service.catalog.models import default_catalog
from service.core.arch.vision import (
    DEFAULT_MAX_PIXELS,
    image_grid,
    image_tokens,
    smart_resize,
)
from service.core.errors import InvalidSpecError
from service.core.estimator import estimate
from service.core.fit import GpuOffer, Requirement, check_fit
from service.core.result import Component
from service.core.spec import AttnImpl, LoraSpec, Method, Objective, ParallelSpec, TrainingSpec
from service.core.spec.vision import VisionInputs
from service.core.units import GIB

CATALOG = default_catalog()
QWEN2_VL = CATALOG.resolve("Qwen/Qwen2-VL-2B-Instruct").arch
QWEN25_VL = CATALOG.resolve("Qwen/Qwen2.5-VL-7B-Instruct").arch
LM_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ONE_IMAGE = VisionInputs(images_per_sample=1, image_height=448, image_width=448)


def _spec(**kwargs: object) -> TrainingSpec:
    values: dict[str, object] = {
        "batch_size": 2,
        "seq_len": 1024,
        "lora": LoraSpec(r=16, lora_alpha=32, target_modules=LM_LINEARS),
        "vision": ONE_IMAGE,
        **kwargs,
    }
    return TrainingSpec(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"images_per_sample": 0, "image_tokens": 4}, "vision.images_per_sample"),
        ({"image_height": 448}, "vision.image_width"),
        ({"image_width": 448}, "vision.image_height"),
        ({}, "vision.image_height"),
        ({"image_tokens": 0}, "vision.image_tokens"),
        ({"image_tokens": 4, "image_height": 28, "image_width": 28}, "vision.image_tokens"),
        ({"image_tokens": 4, "min_pixels": 10, "max_pixels": 5}, "vision.min_pixels"),
    ],
)
def test_image_inputs_validate_themselves(kwargs: dict[str, int], field: str) -> None:
    with pytest.raises(InvalidSpecError) as info:
        VisionInputs(**kwargs)
    assert info.value.field == field


def test_seq_len_counts_the_image_tokens() -> None:
    TrainingSpec(
        batch_size=1, seq_len=200, vision=VisionInputs(images_per_sample=2, image_tokens=100)
    )
    with pytest.raises(InvalidSpecError) as info:
        TrainingSpec(
            batch_size=1, seq_len=199, vision=VisionInputs(images_per_sample=2, image_tokens=100)
        )
    assert info.value.field == "seq_len"
    with pytest.raises(InvalidSpecError) as info:
        estimate(QWEN2_VL, _spec(seq_len=255))  # 448 x 448 pixels: 256 tokens
    assert info.value.field == "seq_len"


@pytest.mark.parametrize(
    ("height", "width", "grid"),
    [
        (448, 448, (1, 32, 32)),  # multiples of 28 stay
        (672, 672, (1, 48, 48)),
        (500, 300, (1, 36, 22)),  # rounded to multiples of 28
        (20, 20, (1, 4, 4)),  # up to min_pixels (56 x 56)
        (4000, 3000, (1, 82, 60)),  # down to max_pixels
    ],
)
def test_images_become_patches_as_the_processor_resizes_them(
    height: int, width: int, grid: tuple[int, int, int]
) -> None:
    vision = QWEN2_VL.vision
    assert vision is not None
    inputs = VisionInputs(image_height=height, image_width=width)
    assert image_grid(vision, inputs) == grid
    t, h, w = grid
    assert image_tokens(vision, inputs) == t * h * w // 4
    assert h * w * 14 * 14 <= DEFAULT_MAX_PIXELS


def test_smart_resize_refuses_elongated_images() -> None:
    with pytest.raises(InvalidSpecError) as info:
        smart_resize(10, 2001, factor=28, min_pixels=3136, max_pixels=DEFAULT_MAX_PIXELS)
    assert info.value.field == "vision.image_height"


def test_image_tokens_override_the_size() -> None:
    vision = QWEN2_VL.vision
    assert vision is not None
    assert image_tokens(vision, VisionInputs(image_tokens=300)) == 300


def test_the_tower_adds_its_weights_inputs_and_checkpointed_graph() -> None:
    text_arch = replace(QWEN2_VL, vision=None)
    for ckpt in (False, True):
        spec = _spec(gradient_checkpointing=ckpt)
        vl = estimate(QWEN2_VL, spec)
        text = estimate(text_arch, replace(spec, vision=None))
        weights = (
            vl.components[Component.FROZEN_WEIGHTS] - text.components[Component.FROZEN_WEIGHTS]
        )
        assert weights >= 2 * QWEN2_VL.vision.params  # type: ignore[union-attr]
        pixels = 2 * 1024 * 1176 * 4  # two images of 32 x 32 patches, fp32
        assert vl.components[Component.INPUTS] - text.components[Component.INPUTS] > pixels
        graph = vl.components[Component.ACTIVATIONS] - text.components[Component.ACTIVATIONS]
        # with checkpointing every vision block keeps its input: 33 x 2048 x 1280 x 2 bytes
        assert (graph > 33 * 2048 * 1280 * 2) is ckpt
        assert vl.params.total == QWEN2_VL.total_params


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"vision": None}, "vision"),
        ({"method": Method.FULL, "lora": None}, "method"),
        ({"lora": LoraSpec(target_modules="all-linear")}, "lora.target_modules"),
        ({"lora": LoraSpec(target_modules=("q_proj", "fc1"))}, "lora.target_modules"),
        ({"lora": LoraSpec(target_modules=("qkv",))}, "lora.target_modules"),
        ({"lora": LoraSpec(target_modules=None)}, "lora.target_modules"),
        (
            {"lora": LoraSpec(target_modules=LM_LINEARS, modules_to_save=("lm_head",))},
            "lora.modules_to_save",
        ),
        ({"attn_implementation": AttnImpl.EAGER}, "attn_implementation"),
        ({"autocast": True}, "autocast"),
        ({"gradient_accumulation_steps": 2}, "gradient_accumulation_steps"),
    ],
)
def test_what_is_not_modelled_is_refused_naming_the_field(
    change: dict[str, object], field: str
) -> None:
    with pytest.raises(InvalidSpecError) as info:
        estimate(QWEN2_VL, _spec(**change))
    assert info.value.field == field


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"objective": Objective.DPO}, "objective"),
        ({"parallel": ParallelSpec(gpus=2)}, "parallel.gpus"),
        ({"method": Method.IA3, "lora": None}, "method"),
        ({"target_length": 8}, "target_length"),
    ],
)
def test_the_spec_refuses_images_beyond_sft_on_one_gpu(
    change: dict[str, object], field: str
) -> None:
    with pytest.raises(InvalidSpecError) as info:
        _spec(**change)
    assert info.value.field == field


def test_images_need_a_vision_model() -> None:
    text = CATALOG.resolve("Qwen/Qwen2.5-7B").arch
    with pytest.raises(InvalidSpecError) as info:
        estimate(text, _spec())
    assert info.value.field == "vision"


def test_qwen25_vl_tower_has_the_mlp_names_of_its_own() -> None:
    attention = LoraSpec(r=16, target_modules=LM_LINEARS[:4])
    estimate(QWEN25_VL, _spec(lora=attention))
    with pytest.raises(InvalidSpecError) as info:
        estimate(QWEN25_VL, _spec())  # gate_proj, up_proj, down_proj: the tower's MLP too
    assert info.value.field == "lora.target_modules"
    assert "gate_proj" in info.value.reason


def test_fit_takes_a_sequence_shorter_than_the_images_as_one_that_cannot_run() -> None:
    spec = _spec(vision=VisionInputs(images_per_sample=2, image_tokens=300))

    def requirement(job: TrainingSpec) -> Requirement:
        est = estimate(QWEN2_VL, job)
        return Requirement(device_bytes=est.device_bytes, device_bytes_upper=est.device_bytes_upper)

    small = GpuOffer(memory_bytes=10 * GIB)
    report = check_fit(spec, [small], requirement, max_batch_size=64, max_seq_len=32768)
    (fit,) = report.gpus
    assert fit.max_seq_len == 0 or fit.max_seq_len >= 600
