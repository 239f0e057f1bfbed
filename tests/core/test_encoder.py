"""Encoder models (BERT sequence classification): the parsed layout, the step against the
committed traces, and the options an encoder refuses."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from service.catalog.models import default_catalog
from service.core.arch import ModelArch
from service.core.arch.hf_config import from_hf_config
from service.core.device import REFERENCE_COMPUTE_CAPABILITY
from service.core.errors import InvalidConfigError, InvalidSpecError
from service.core.estimator import estimate, peak_levels
from service.core.result import Component
from service.core.spec import (
    AttnImpl,
    LoraSpec,
    Method,
    ParallelSpec,
    QuantSpec,
    Strategy,
    TrainingSpec,
)
from service.core.units import DType

TRACES = Path(__file__).resolve().parents[1] / "data" / "traces"
BERT_TRACES = sorted(TRACES.glob("bert-*.json"))


def _bert(name: str = "bert-base-uncased") -> ModelArch:
    return default_catalog().resolve(name).arch


def _layout_count(h: int, layers: int, inter: int, vocab: int, positions: int, labels: int) -> int:
    """BertForSequenceClassification's parameters, tensor by tensor."""
    embeddings = (vocab + positions + 2) * h + 2 * h  # word, position, token type; LayerNorm
    attention = 4 * (h * h + h) + 2 * h  # query, key, value, output dense; LayerNorm
    mlp = (h * inter + inter) + (inter * h + h) + 2 * h  # intermediate, output; LayerNorm
    pooler = h * h + h
    classifier = h * labels + labels
    return embeddings + layers * (attention + mlp) + pooler + classifier


@pytest.mark.parametrize(
    ("name", "h", "layers", "inter"),
    [("bert-base-uncased", 768, 12, 3072), ("bert-large-uncased", 1024, 24, 4096)],
)
def test_the_layout_counts_every_tensor(name: str, h: int, layers: int, inter: int) -> None:
    arch = _bert(name)
    assert arch.encoder and arch.num_labels == 2
    assert arch.total_params == _layout_count(h, layers, inter, 30522, 512, 2)
    assert [lin.name for lin in arch.linears] == [
        "query",
        "key",
        "value",
        "attention.output.dense",
        "intermediate.dense",
        "output.dense",
    ]
    assert all(lin.bias for lin in arch.linears)


def test_the_traces_count_what_the_catalog_counts() -> None:
    for path in BERT_TRACES:
        ref = json.loads(path.read_text())
        if ref["spec"]["method"] == "full":
            assert ref["params"]["total"] == _bert(ref["model_id"]).total_params


def test_labels_come_from_the_config() -> None:
    raw = dict(default_catalog().resolve("bert-base-uncased").config)
    assert from_hf_config({**raw, "id2label": {"0": "a", "1": "b", "2": "c"}}).num_labels == 3
    assert from_hf_config({**raw, "num_labels": 7}).num_labels == 7
    with pytest.raises(InvalidConfigError, match="hidden_dropout_prob"):
        from_hf_config({**raw, "hidden_dropout_prob": 1.5})


def test_every_bert_reference_is_committed() -> None:
    names = {p.stem for p in BERT_TRACES}
    assert len(names) == 9
    assert any("eager" in n for n in names) and any("ckpt" in n for n in names)
    assert any("autocast" in n for n in names) and any("lora" in n for n in names)


@pytest.mark.parametrize("path", BERT_TRACES, ids=[p.stem for p in BERT_TRACES])
def test_the_step_matches_its_trace(path: Path) -> None:
    from service.trace.reference import spec_from_json

    ref: dict[str, Any] = json.loads(path.read_text())
    arch = _bert(ref["model_id"])
    spec = spec_from_json(ref["spec"])
    est = estimate(arch, spec, compute_capability=REFERENCE_COMPUTE_CAPABILITY)
    assert abs(est.allocated_bytes / ref["peak"]["allocated_bytes"] - 1) <= 0.01
    assert abs(est.reserved_bytes / ref["reserved"]["bytes"] - 1) <= 0.02
    assert (est.peak_phase.value, est.peak_step) == (ref["peak"]["phase"], ref["peak"]["step"])
    assert est.params.trainable == ref["params"]["trainable"]
    levels = peak_levels(arch, spec, compute_capability=REFERENCE_COMPUTE_CAPABILITY)
    assert levels.allocated_bytes == est.allocated_bytes
    assert levels.device_bytes == est.device_bytes


def _spec(**kwargs: Any) -> TrainingSpec:
    return TrainingSpec(**{"batch_size": 4, "seq_len": 512, **kwargs})


def test_labels_size_the_classifier() -> None:
    arch = _bert()
    two = estimate(arch, _spec(method=Method.FULL, dtype=DType.FP32))
    many = estimate(arch, _spec(method=Method.FULL, dtype=DType.FP32, num_labels=1000))
    assert many.params.total - two.params.total == 998 * (arch.hidden_size + 1)
    assert many.params.trainable - two.params.trainable == 998 * (arch.hidden_size + 1)
    assert many.allocated_bytes > two.allocated_bytes


def test_lora_trains_the_default_targets_and_the_classifier() -> None:
    arch = _bert()
    est = estimate(arch, _spec(lora=LoraSpec(r=8)))
    adapters = arch.num_hidden_layers * 2 * 8 * (arch.hidden_size + arch.hidden_size)
    assert est.params.trainable == adapters + 2 * (arch.hidden_size + 1)
    named = estimate(arch, _spec(lora=LoraSpec(r=8, target_modules=("query", "value"))))
    assert named.allocated_bytes == est.allocated_bytes
    every = estimate(arch, _spec(lora=LoraSpec(r=8, target_modules="all-linear")))
    assert every.params.trainable > est.params.trainable


def test_checkpointing_and_mixed_precision_lower_the_peak() -> None:
    arch = _bert("bert-large-uncased")
    base = estimate(arch, _spec(method=Method.FULL, dtype=DType.FP32))
    ckpt = estimate(arch, _spec(method=Method.FULL, dtype=DType.FP32, gradient_checkpointing=True))
    mixed = estimate(arch, _spec(method=Method.FULL, dtype=DType.FP32, autocast=True))
    eager = estimate(
        arch, _spec(method=Method.FULL, dtype=DType.FP32, attn_implementation=AttnImpl.EAGER)
    )
    assert ckpt.allocated_bytes < mixed.allocated_bytes < base.allocated_bytes
    assert eager.allocated_bytes > base.allocated_bytes


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (_spec(lora=LoraSpec(target_modules=("q_proj", "v_proj"))), "lora.target_modules"),
        (_spec(lora=LoraSpec(modules_to_save=("lm_head",))), "lora.modules_to_save"),
        (_spec(method=Method.QLORA, quantization=QuantSpec()), "method"),
        (_spec(seq_len=1024), "seq_len"),
        (_spec(parallel=ParallelSpec(gpus=2, strategy=Strategy.FSDP2)), "parallel.strategy"),
    ],
)
def test_what_an_encoder_cannot_run_names_its_field(spec: TrainingSpec, field: str) -> None:
    with pytest.raises(InvalidSpecError) as caught:
        estimate(_bert(), spec)
    assert caught.value.field == field
    with pytest.raises(InvalidSpecError):
        peak_levels(_bert(), spec)


def test_num_labels_on_a_decoder_is_refused() -> None:
    decoder = default_catalog().resolve("Qwen/Qwen2.5-0.5B").arch
    with pytest.raises(InvalidSpecError) as caught:
        estimate(decoder, _spec(num_labels=3))
    assert caught.value.field == "num_labels"
    with pytest.raises(InvalidSpecError, match="num_labels"):
        peak_levels(decoder, _spec(num_labels=3))
    with pytest.raises(InvalidSpecError, match="num_labels"):
        _spec(num_labels=0)


def test_a_decoder_estimate_ignores_the_new_fields() -> None:
    decoder = default_catalog().resolve("Qwen/Qwen2.5-0.5B").arch
    assert not decoder.encoder and decoder.num_labels == 0
    assert replace(decoder, num_labels=0) == decoder


def test_ddp_adds_the_reducers_buckets() -> None:
    arch = _bert()
    one = estimate(arch, _spec(method=Method.FULL, dtype=DType.FP32))
    two = estimate(arch, _spec(method=Method.FULL, dtype=DType.FP32, parallel=ParallelSpec(gpus=2)))
    buckets = two.components[Component.COMMUNICATION]
    assert abs(buckets - 4 * one.params.trainable) < 2**20
    assert two.allocated_bytes == one.allocated_bytes + buckets
    assert two.device_bytes - two.reserved_bytes > one.device_bytes - one.reserved_bytes  # NCCL
