"""LitGPT's LLaMA-Adapter and LLaMA-Adapter v2: the spec's checks, the trainable parameters
(held to the counts LitGPT's resource tables publish, tests/data/published_peaks.csv), and
what the adapters add to the step."""

from __future__ import annotations

from typing import Any

import pytest

from service.catalog.models import default_catalog
from service.core.errors import InvalidSpecError
from service.core.estimator import estimate
from service.core.spec import Framework, Method, ParallelSpec, QuantSpec, QuantType, TrainingSpec

STABLELM = "stabilityai/stablelm-base-alpha-3b"
LLAMA2 = "meta-llama/Llama-2-7b-hf"
ADAPTERS = (Method.LLAMA_ADAPTER, Method.LLAMA_ADAPTER_V2)


def _spec(method: Method, **kwargs: Any) -> TrainingSpec:
    base: dict[str, Any] = {"batch_size": 1, "seq_len": 1034, "framework": Framework.LITGPT}
    return TrainingSpec(method=method, **{**base, **kwargs})


def _estimate(model: str, spec: TrainingSpec) -> Any:
    return estimate(default_catalog().resolve(model).arch, spec)


@pytest.mark.parametrize("method", ADAPTERS)
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"framework": Framework.HF}, "method"),
        ({"framework": Framework.TORCHTUNE}, "method"),
        ({"parallel": ParallelSpec(gpus=2)}, "parallel.gpus"),
        ({"gradient_checkpointing": True}, "gradient_checkpointing"),
        ({"autocast": True}, "autocast"),
        ({"quantization": QuantSpec(type=QuantType.INT8)}, "quantization.type"),
    ],
)
def test_what_is_not_modelled_is_refused_by_name(
    method: Method, kwargs: dict[str, Any], field: str
) -> None:
    with pytest.raises(InvalidSpecError) as caught:
        _spec(method, **kwargs)
    assert caught.value.field == field


@pytest.mark.parametrize(
    ("model", "method", "published"),
    [
        # lit_gpt/adapter.py: (16 - 2) layers x (10 x 4096 prompt + 32 gates)
        (STABLELM, Method.LLAMA_ADAPTER, 573_888),
        (LLAMA2, Method.LLAMA_ADAPTER, 1_229_760),
        # adapter_v2.py adds a bias and a scale per output of every linear (lm_head included)
        # and trains norm_1, norm_2, ln_f
        (STABLELM, Method.LLAMA_ADAPTER_V2, 2_125_248),
        (LLAMA2, Method.LLAMA_ADAPTER_V2, 4_279_744),
    ],
)
def test_trainable_parameters_match_litgpts_published_counts(
    model: str, method: Method, published: int
) -> None:
    seq = 1304 if model == LLAMA2 else 1034
    assert _estimate(model, _spec(method, seq_len=seq)).params.trainable == published
    quantized = _spec(method, seq_len=seq, quantization=QuantSpec(prepare_kbit=False))
    assert _estimate(model, quantized).params.trainable == published


def test_a_4bit_base_holds_less_and_v2_more_than_v1() -> None:
    plain = _estimate(STABLELM, _spec(Method.LLAMA_ADAPTER))
    nf4 = _estimate(STABLELM, _spec(Method.LLAMA_ADAPTER, quantization=QuantSpec()))
    v2 = _estimate(STABLELM, _spec(Method.LLAMA_ADAPTER_V2))
    assert nf4.allocated_bytes < plain.allocated_bytes < v2.allocated_bytes
    assert any("not traced" in a for a in plain.assumptions)


def test_the_prompt_adds_to_every_layer_from_the_start_layer() -> None:
    """Longer sequences cost the adapter's attention output per prompted layer: the step grows
    with the sequence faster than LoRA-free frozen inference would."""
    short = _estimate(LLAMA2, _spec(Method.LLAMA_ADAPTER, seq_len=512)).allocated_bytes
    long = _estimate(LLAMA2, _spec(Method.LLAMA_ADAPTER, seq_len=1024)).allocated_bytes
    assert long > short
