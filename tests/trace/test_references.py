"""The committed references: well-formed, covering the matrix, and reproduced by a re-trace."""

from __future__ import annotations

from typing import Any

import pytest

from service.core.result import Component, Phase
from service.core.units import GIB, DType
from service.trace.reference import (
    REFERENCE_DIR,
    iter_references,
    matrix,
    measured_part,
    reference_name,
    spec_from_json,
    spec_to_json,
)
from tests.trace.phases import expected_phases

pytestmark = pytest.mark.trace

REFERENCES = dict((path.stem, doc) for path, doc in iter_references())

# Cheap references (Qwen2.5-0.5B, short sequences) traced again from scratch by the tests.
RETRACED = (
    "qwen2_5-0_5b__lora__r16-all-linear__b1-s128__ckpt",
    "qwen2_5-0_5b__qlora__r16-all-linear__nf4-dq__b1-s128",
    "qwen2_5-0_5b__qlora__r16-all-linear__int8__b1-s128__ckpt",
    "qwen2_5-0_5b__lora__r16-all-linear__b1-s128__ckpt__autocast",
    "bloom-560m__lora__r8-default__b4-s512__eager",
    "bert-base-uncased__lora__r8-default__b4-s512",
    "t5-v1_1-small__lora__r8-default__b4-s128__t32__eager",
    "qwen2_5-0_5b__ia3__b2-s512__ckpt",
    "qwen2_5-0_5b__prompt-tuning__20-virtual__b2-s512",
    "qwen2_5-0_5b__prefix-tuning__20-virtual__b2-s512",
    "qwen2_5-0_5b__full__dpo__b1-s512",
    "qwen2_5-0_5b__lora__reward__r16-all-linear__b2-s512",
    "qwen2_5-0_5b__lora__orpo__r16-all-linear__b2-s512",
    "qwen2_5-0_5b__adalora__r12-default__target8-tinit2__b1-s512__ckpt",
    "llama-3_2-1b__full__b1-s256__loss-hf__clip0__torchtune__optim-in-bwd",
    "qwen2_5-0_5b__full__b2-s512__ckpt__liger",
)

# The tensors' peaks (GiB, two decimals) the tracer's first version recorded for these
# references, before it also replayed the cuBLAS workspaces (version 2): a re-trace keeps them.
MEMORY_MODEL_TABLE = {
    "qwen2_5-7b__lora__r16-all-linear__b1-s512__ckpt": 15.61,
    "qwen2_5-7b__lora__r16-all-linear__b4-s2048__ckpt": 30.20,
    "qwen2_5-7b__lora__r16-all-linear__b4-s2048": 97.15,
    "qwen2_5-7b__lora__r16-all-linear__bf16-adapters__b4-s2048": 73.47,
    "qwen2_5-7b__qlora__r16-all-linear__nf4-dq__b4-s2048__ckpt": 24.74,
    "llama-3_1-8b__lora__r16-all-linear__b4-s2048__ckpt": 29.29,
    "qwen2_5-0_5b__full__b1-s2048": 8.88,
}


def test_every_matrix_case_has_a_reference_and_nothing_else_is_there() -> None:
    names = {case.name for case in matrix()}
    assert len(names) >= 80
    assert set(REFERENCES) == names, f"regenerate: vramcast trace --matrix ({REFERENCE_DIR})"


def test_the_matrix_spans_the_axes_it_promises() -> None:
    cases = matrix()
    assert len({c.model_id for c in cases}) >= 6
    specs = [c.spec for c in cases]
    assert {s.method.value for s in specs} == {
        "full",
        "lora",
        "qlora",
        "ia3",
        "ln-tuning",
        "prompt-tuning",
        "prefix-tuning",
        "lora-fa",
        "vera",
        "loha",
        "lokr",
        "adalora",
        "oft",
        "boft",
    }
    assert {s.gradient_checkpointing for s in specs} == {True, False}
    assert {s.autocast for s in specs} == {True, False}
    assert {s.dtype for s in specs if s.autocast} >= {DType.BF16, DType.FP16, DType.FP32}
    assert {s.max_grad_norm for s in specs} >= {0.0, 1.0}
    assert {s.optim.value for s in specs} >= {"adamw_torch_fused", "adamw_torch", "adamw_bnb_8bit"}
    assert {s.attn_implementation.value for s in specs} >= {"sdpa", "eager"}
    assert {s.sdpa_kernel.value for s in specs} >= {"auto", "efficient", "math"}
    assert max(s.seq_len for s in specs) >= 8192
    lora = [s.lora for s in specs if s.lora is not None]
    assert {str(x.adapter_dtype) for x in lora} >= {"None", "bf16"}
    assert {x.r for x in lora} >= {8, 16, 64}
    assert any(x.modules_to_save for x in lora)
    quant = [s.quantization for s in specs if s.quantization is not None]
    assert {q.prepare_kbit for q in quant} == {True, False}
    assert {q.double_quant for q in quant} == {True, False}


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_a_reference_is_well_formed(name: str) -> None:
    document = REFERENCES[name]
    spec = spec_from_json(document["spec"])
    assert spec_from_json(spec_to_json(spec)) == spec
    assert reference_name(document["model_id"], spec) == name == document["name"]
    peak = document["peak"]
    _check_snapshot(peak)
    assert Phase(peak["phase"]) in Phase
    assert peak["step"] in (1, 2)
    phases = document["phases"]
    assert [(p["step"], p["phase"]) for p in phases] == expected_phases(spec)
    for entry in phases:
        _check_snapshot(entry)
        assert entry["allocated_bytes"] <= peak["allocated_bytes"]
    steps = document["steps"]
    assert [s["step"] for s in steps] == [1, 2]
    for entry in steps:
        _check_snapshot(entry)
    assert max(s["allocated_bytes"] for s in steps) == peak["allocated_bytes"]
    assert steps[peak["step"] - 1]["allocated_bytes"] == peak["allocated_bytes"]
    assert steps[peak["step"] - 1]["phase"] == peak["phase"]
    assert set(document["versions"]) == {"torch", "transformers", "peft", "bitsandbytes", "tracer"}


def _check_snapshot(entry: dict[str, Any]) -> None:
    components = entry["components"]
    # the reference model's part is written only where there is one (DPO full fine-tuning);
    # references traced before GRPO have no generation_kv_cache
    own = {Component.REFERENCE_MODEL.value, Component.GENERATION_KV_CACHE.value}
    assert set(components) | own == {c.value for c in Component}
    assert sum(components.values()) == entry["allocated_bytes"]
    assert entry["allocated_bytes"] % 512 == 0
    assert all(v >= 0 for v in components.values())


@pytest.mark.parametrize(("name", "gib"), sorted(MEMORY_MODEL_TABLE.items()))
def test_references_reproduce_the_memory_models_measured_peaks(name: str, gib: float) -> None:
    peak = REFERENCES[name]["peak"]
    tensors = peak["allocated_bytes"] - peak["components"][Component.WORKSPACES.value]
    assert round(tensors / GIB, 2) == gib


@pytest.mark.parametrize("name", RETRACED)
def test_a_retrace_reproduces_the_committed_reference_exactly(name: str) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("peft")
    from service.catalog.models import default_catalog
    from service.trace.reference import result_to_json
    from service.trace.runner import trace

    document = REFERENCES[name]
    entry = default_catalog().resolve(document["model_id"])
    result = trace(spec_from_json(document["spec"]), entry.config, entry.id)
    assert measured_part(result_to_json(name, result)) == measured_part(document)
