"""Llama-3.2-Vision (mllama): its config parsed, its image inputs and the jobs the estimate
refuses, each naming its field."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from service.catalog.models import default_catalog
from service.core.arch.hf_config import from_hf_config
from service.core.arch.mllama import tile_grid
from service.core.errors import InvalidConfigError, InvalidSpecError
from service.core.estimator import estimate
from service.core.spec import AttnImpl, LoraSpec, Method, QuantSpec, SdpaKernel, TrainingSpec
from service.core.spec.vision import SequenceTooShortError, VisionInputs
from service.core.units import DType

ENTRY = default_catalog().resolve("meta-llama/Llama-3.2-11B-Vision-Instruct")
ARCH = ENTRY.arch
MLP = ("gate_proj", "up_proj", "down_proj")


def _spec(**changes: Any) -> TrainingSpec:
    base = TrainingSpec(
        method=Method.LORA,
        batch_size=1,
        seq_len=1024,
        lora=LoraSpec(r=16, lora_alpha=32, target_modules=MLP),
        vision=VisionInputs(images_per_sample=1, image_height=1120, image_width=1120),
        gradient_checkpointing=True,
    )
    return replace(base, **changes)


def test_the_published_config_parses_to_its_parameter_count() -> None:
    tower = ARCH.mllama
    assert tower is not None
    assert (ARCH.num_hidden_layers, ARCH.hidden_size, ARCH.vocab_size) == (40, 4096, 128256)
    assert tower.cross_attention_layers == (3, 8, 13, 18, 23, 28, 33, 38)
    assert (tower.num_hidden_layers, tower.num_global_layers, tower.hidden_size) == (32, 8, 1280)
    assert tower.patches == 1601 and tower.padded_patches == 1608
    assert tower.image_tokens == 4 * 1601
    # transformers' model built from this config has 10,670,220,835 parameters, the figure
    # the catalog cites
    assert ARCH.total_params == ENTRY.published_params == 10_670_220_835


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        (("vision_config", "vision_output_dim"), 4096, "vision_config.vision_output_dim"),
        (("vision_config", "patch_size"), 15, "vision_config.patch_size"),
        (("vision_config", "intermediate_layers_indices"), [3, 40], None),
        (("text_config", "cross_attention_layers"), [3, 40], None),
        (("text_config", "cross_attention_layers"), [], None),
    ],
)
def test_a_malformed_config_names_its_field(
    path: tuple[str, str], value: Any, field: str | None
) -> None:
    config = dict(ENTRY.config)
    config[path[0]] = {**config[path[0]], path[1]: value}
    with pytest.raises(InvalidConfigError) as caught:
        from_hf_config(config)
    assert caught.value.field == (field or ".".join(path))


def test_an_mllama_config_needs_its_text_config() -> None:
    config = {k: v for k, v in ENTRY.config.items() if k != "text_config"}
    with pytest.raises(InvalidConfigError) as caught:
        from_hf_config(config)
    assert caught.value.field == "text_config"


@pytest.mark.parametrize(
    ("height", "width", "tiles"),
    [(1120, 1120, (2, 2)), (448, 448, (1, 1)), (560, 1120, (1, 2)), (2240, 300, (4, 1))],
)
def test_an_image_becomes_the_processors_tiles(
    height: int, width: int, tiles: tuple[int, int]
) -> None:
    assert ARCH.mllama is not None
    assert tile_grid(height, width, ARCH.mllama) == tiles


def test_every_image_takes_the_largest_tiling_whatever_its_size() -> None:
    """The processor pads every image to max_num_tiles tiles (pad_batches_and_tiles): the
    tower and the cross-attention layers see the same shapes for any image size."""
    small = estimate(ARCH, _spec(vision=VisionInputs(image_height=448, image_width=448)))
    large = estimate(ARCH, _spec())
    assert small.allocated_bytes == large.allocated_bytes


def test_more_images_and_checkpointing_move_the_estimate_as_the_physics_says() -> None:
    one = estimate(ARCH, _spec(gradient_checkpointing=False))
    two = estimate(
        ARCH,
        _spec(
            gradient_checkpointing=False,
            vision=VisionInputs(images_per_sample=2, image_height=1120, image_width=1120),
        ),
    )
    # each cross-attention layer keeps its keys and values expanded to 32 heads over the
    # sample's image tokens (4 x 1601 per image), bf16: 2 x 6404 x 4096 x 2 B per image more
    assert two.allocated_bytes - one.allocated_bytes > 8 * 2 * 6404 * 4096 * 2
    # checkpointing keeps the tower's whole graph (its layers are not checkpointed), still
    # far less than the language model's layers' activations
    assert estimate(ARCH, _spec()).allocated_bytes < one.allocated_bytes


def test_the_sequence_must_hold_each_images_token() -> None:
    vision = VisionInputs(images_per_sample=4, image_height=560, image_width=560)
    with pytest.raises(SequenceTooShortError) as caught:
        estimate(ARCH, _spec(seq_len=3, vision=vision))
    assert caught.value.field == "seq_len" and caught.value.minimum == 4


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"vision": None}, "vision"),
        ({"vision": VisionInputs(image_tokens=64)}, "vision.image_tokens"),
        (
            {"vision": VisionInputs(image_height=560, image_width=560, max_pixels=10**6)},
            "vision.max_pixels",
        ),
        ({"method": Method.FULL, "lora": None}, "method"),
        ({"method": Method.QLORA, "quantization": QuantSpec()}, "method"),
        ({"lora": LoraSpec(r=16, target_modules=None)}, "lora.target_modules"),
        ({"lora": LoraSpec(r=16, target_modules="all-linear")}, "lora.target_modules"),
        ({"lora": LoraSpec(r=16, target_modules=("q_proj", "v_proj"))}, "lora.target_modules"),
        ({"lora": LoraSpec(r=16, target_modules=MLP, use_dora=True)}, "lora.use_dora"),
        ({"attn_implementation": AttnImpl.EAGER}, "attn_implementation"),
        ({"attn_implementation": AttnImpl.FLASH_ATTENTION_2}, "attn_implementation"),
        ({"sdpa_kernel": SdpaKernel.MATH}, "sdpa_kernel"),
        ({"dtype": DType.FP32}, "dtype"),
        ({"autocast": True}, "autocast"),
        ({"gradient_accumulation_steps": 2}, "gradient_accumulation_steps"),
    ],
)
def test_what_is_not_modelled_is_refused_naming_its_field(
    changes: dict[str, Any], field: str
) -> None:
    with pytest.raises(InvalidSpecError) as caught:
        estimate(ARCH, _spec(**changes))
    assert caught.value.field == field


def test_a_first_cross_attention_layer_is_refused() -> None:
    """The first layer's input takes no gradient (LoRA): a cross-attention layer there keeps
    none of what the estimate counts for one."""
    config = dict(ENTRY.config)
    config["text_config"] = {**config["text_config"], "cross_attention_layers": [0, 8]}
    with pytest.raises(InvalidConfigError) as caught:
        estimate(from_hf_config(config), _spec())
    assert caught.value.field == "text_config.cross_attention_layers"
