"""LitGPT's LLaMA-Adapter and LLaMA-Adapter v2: the spec's checks, the trainable parameters
(held to the counts LitGPT's resource tables publish, tests/data/published_peaks.csv), and
what the adapters add to the step."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.catalog.models import default_catalog
from service.core.errors import InvalidConfigError, InvalidSpecError
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


@settings(max_examples=20, deadline=None)
@given(
    st.sampled_from([STABLELM, LLAMA2]),
    st.sampled_from(ADAPTERS),
    st.sampled_from([None, QuantSpec(prepare_kbit=False)]),
    st.integers(1, 8),
    st.integers(1, 4096),
    st.integers(1, 4),
    st.integers(1, 2048),
)
def test_peak_non_decreasing_in_batch_and_sequence(
    model: str,
    method: Method,
    quant: QuantSpec | None,
    batch: int,
    seq: int,
    more_batch: int,
    more_seq: int,
) -> None:
    spec = _spec(method, batch_size=batch, seq_len=seq, quantization=quant)
    peak = _estimate(model, spec).allocated_bytes
    longer = _estimate(model, replace(spec, seq_len=seq + more_seq)).allocated_bytes
    wider = _estimate(model, replace(spec, batch_size=batch + more_batch)).allocated_bytes
    assert longer >= peak
    assert wider >= peak


@pytest.mark.parametrize("method", ADAPTERS)
def test_mixture_of_experts_models_are_refused(method: Method) -> None:
    with pytest.raises(InvalidConfigError) as caught:
        _estimate("Qwen/Qwen3-30B-A3B", _spec(method, seq_len=128))
    assert "dense decoders" in caught.value.reason
