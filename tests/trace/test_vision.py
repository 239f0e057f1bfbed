"""The vision-language tracer's inputs and the image geometry against transformers' own
image processor code."""

from __future__ import annotations

import ast
import math
from pathlib import Path
from typing import Any

import pytest
import transformers

from service.core.arch.vision import DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS, smart_resize
from service.core.spec import TrainingSpec
from service.core.spec.vision import VisionInputs
from service.trace import vision

PROCESSOR = (
    Path(transformers.__file__).parent / "models" / "qwen2_vl" / "image_processing_qwen2_vl.py"
)


def _transformers_smart_resize() -> Any:
    """transformers' smart_resize, taken from its source: the module itself imports
    torchvision, which the tracer's environment does not install."""
    tree = ast.parse(PROCESSOR.read_text())
    (node,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "smart_resize"]
    namespace: dict[str, Any] = {"math": math}
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(PROCESSOR), "exec"), namespace)
    return namespace["smart_resize"]


@pytest.mark.parametrize(
    ("height", "width"),
    [(448, 448), (672, 672), (500, 300), (20, 20), (4000, 3000), (1080, 1920), (33, 6000)],
)
def test_smart_resize_is_the_processors(height: int, width: int) -> None:
    theirs = _transformers_smart_resize()
    for bounds in ((DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS), (256 * 28 * 28, 512 * 28 * 28)):
        expected = theirs(height, width, factor=28, min_pixels=bounds[0], max_pixels=bounds[1])
        assert smart_resize(
            height, width, factor=28, min_pixels=bounds[0], max_pixels=bounds[1]
        ) == tuple(expected)


def test_processor_defaults_are_the_image_processors() -> None:
    source = PROCESSOR.read_text()
    assert 'size = {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280}' in source
    assert DEFAULT_MIN_PIXELS == 56 * 56
    assert DEFAULT_MAX_PIXELS == 28 * 28 * 1280


def test_the_batch_places_each_samples_image_tokens() -> None:
    import json

    config = json.loads(Path("service/catalog/models/Qwen--Qwen2-VL-2B-Instruct.json").read_text())[
        "config"
    ]
    spec = TrainingSpec(
        batch_size=2,
        seq_len=600,
        vision=VisionInputs(images_per_sample=2, image_height=448, image_width=448),
    )
    batch = vision.batch(spec, config)
    assert tuple(batch["input_ids"].shape) == (2, 600)
    assert int((batch["input_ids"] == config["image_token_id"]).sum()) == 2 * 2 * 256
    assert int(batch["mm_token_type_ids"].sum()) == 2 * 2 * 256
    assert batch["image_grid_thw"].tolist() == [[1, 32, 32]] * 4
    assert tuple(batch["pixel_values"].shape) == (4 * 1024, 3 * 2 * 14 * 14)


@pytest.mark.parametrize(
    "catalog_file", ["Qwen--Qwen2-VL-2B-Instruct", "Qwen--Qwen2.5-VL-7B-Instruct"]
)
@pytest.mark.parametrize(
    "targets",
    [
        "all-linear",
        ("q_proj", "k_proj", "v_proj", "o_proj"),
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        ("qkv",),
        ("q_proj", "proj"),
    ],
)
def test_the_estimate_refuses_exactly_the_targets_peft_finds_in_the_tower(
    catalog_file: str, targets: str | tuple[str, ...]
) -> None:
    """PEFT's own matching on the model built on meta: the estimate refuses a LoRA job whose
    targets adapt a module of the vision tower, and only such a job."""
    import json
    import warnings

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForImageTextToText

    from service.core.arch.hf_config import from_hf_config
    from service.core.errors import InvalidSpecError
    from service.core.estimator import estimate
    from service.core.spec import LoraSpec

    values = dict(
        json.loads(Path(f"service/catalog/models/{catalog_file}.json").read_text())["config"]
    )
    values["num_hidden_layers"] = 1
    values["vision_config"] = {**values["vision_config"], "depth": 1}
    arch = from_hf_config(values)
    model_type = values.pop("model_type")
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForImageTextToText.from_config(AutoConfig.for_model(model_type, **values))
        peft_model = get_peft_model(
            model,
            LoraConfig(r=8, target_modules=targets if isinstance(targets, str) else list(targets)),
        )
    in_tower = any("lora_A" in n and ".visual." in n for n, _ in peft_model.named_parameters())
    spec = TrainingSpec(
        batch_size=1,
        seq_len=512,
        lora=LoraSpec(r=8, target_modules=targets),
        vision=VisionInputs(image_tokens=64),
    )
    refused = False
    try:
        estimate(arch, spec)
    except InvalidSpecError as exc:
        assert exc.field == "lora.target_modules"
        refused = True
    assert refused == in_tower


MLLAMA_PROCESSOR = (
    Path(transformers.__file__).parent / "models" / "mllama" / "image_processing_mllama.py"
)
MLLAMA_CATALOG = Path("service/catalog/models/meta-llama--Llama-3.2-11B-Vision.json")


def _transformers_tiled_canvas() -> Any:
    """transformers' get_optimal_tiled_canvas and the helper it calls, taken from the
    source (the module imports torchvision, which the tracer's environment lacks)."""
    import functools

    import numpy as np

    tree = ast.parse(MLLAMA_PROCESSOR.read_text())
    wanted = {"get_all_supported_aspect_ratios", "get_optimal_tiled_canvas"}
    nodes = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    assert {n.name for n in nodes} == wanted
    namespace: dict[str, Any] = {"np": np, "lru_cache": functools.lru_cache}
    exec(compile(ast.Module(body=nodes, type_ignores=[]), str(MLLAMA_PROCESSOR), "exec"), namespace)
    return namespace["get_optimal_tiled_canvas"]


@pytest.mark.parametrize(
    ("height", "width"),
    [(1120, 1120), (448, 448), (560, 1120), (853, 1280), (300, 1200), (2000, 500), (1, 3000)],
)
def test_tile_grid_is_the_processors(height: int, width: int) -> None:
    import json

    from service.core.arch.hf_config import from_hf_config
    from service.core.arch.mllama import tile_grid

    tower = from_hf_config(json.loads(MLLAMA_CATALOG.read_text())["config"]).mllama
    assert tower is not None
    canvas = _transformers_tiled_canvas()(height, width, tower.max_num_tiles, tower.image_size)
    rows, cols = tile_grid(height, width, tower)
    assert (rows * tower.image_size, cols * tower.image_size) == tuple(int(c) for c in canvas)


def test_the_mllama_batch_pads_every_image_to_the_largest_tiling() -> None:
    import json

    config = json.loads(MLLAMA_CATALOG.read_text())["config"]
    spec = TrainingSpec(
        batch_size=2,
        seq_len=64,
        vision=VisionInputs(images_per_sample=2, image_height=560, image_width=1120),
    )
    batch = vision.batch(spec, config)
    assert tuple(batch["input_ids"].shape) == (2, 64)
    assert int((batch["input_ids"] == config["image_token_index"]).sum()) == 2 * 2
    assert tuple(batch["pixel_values"].shape) == (2, 2, 4, 3, 560, 560)
    # (1, 2) is the second arrangement of the processor's list: id 2
    assert batch["aspect_ratio_ids"].tolist() == [[2, 2], [2, 2]]
    assert batch["aspect_ratio_mask"].tolist() == [[[1, 1, 0, 0]] * 2] * 2
    mask = batch["cross_attention_mask"]
    assert tuple(mask.shape) == (2, 64, 2, 4)
    # the first token sees the first image's two tiles, the later ones both images'
    assert mask[0, 0].tolist() == [[1, 1, 0, 0], [0, 0, 0, 0]]
    assert mask[0, 5].tolist() == [[1, 1, 0, 0], [1, 1, 0, 0]]


@pytest.mark.parametrize(
    "targets",
    [
        "all-linear",
        ("q_proj", "v_proj"),
        ("gate_proj", "up_proj", "down_proj"),
        ("down_proj",),
        ("fc1",),
        ("o_proj", "gate_proj"),
    ],
)
def test_the_mllama_estimate_refuses_exactly_the_targets_peft_finds_in_the_tower(
    targets: str | tuple[str, ...],
) -> None:
    """PEFT's own matching on Llama-3.2-Vision built on meta (one layer of each kind): the
    estimate refuses a LoRA job whose targets adapt the tower or the projector, and only
    such a job."""
    import json
    import warnings

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForImageTextToText

    from service.core.arch.hf_config import from_hf_config
    from service.core.errors import InvalidSpecError
    from service.core.estimator import estimate
    from service.core.spec import LoraSpec

    values = dict(json.loads(MLLAMA_CATALOG.read_text())["config"])
    values["text_config"] = {
        **values["text_config"],
        "num_hidden_layers": 2,
        "cross_attention_layers": [1],
    }
    values["vision_config"] = {
        **values["vision_config"],
        "num_hidden_layers": 1,
        "num_global_layers": 1,
        "intermediate_layers_indices": [0],
        "vision_output_dim": 2 * 1280,
    }
    arch = from_hf_config(values)
    model_type = values.pop("model_type")
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForImageTextToText.from_config(AutoConfig.for_model(model_type, **values))
        peft_model = get_peft_model(
            model,
            LoraConfig(r=8, target_modules=targets if isinstance(targets, str) else list(targets)),
        )
    outside = any(
        "lora_A" in n and ("vision_model" in n or "multi_modal_projector" in n)
        for n, _ in peft_model.named_parameters()
    )
    spec = TrainingSpec(
        batch_size=1,
        seq_len=512,
        lora=LoraSpec(r=8, target_modules=targets),
        vision=VisionInputs(image_height=560, image_width=560),
    )
    refused = False
    try:
        estimate(arch, spec)
    except InvalidSpecError as exc:
        assert exc.field == "lora.target_modules"
        refused = True
    assert refused == outside
