"""Rank 0 of multi-GPU jobs: the committed references in tests/data/traces_parallel/, their
shards and collective buffers, and one re-traced from scratch."""

from __future__ import annotations

from typing import Any

import pytest

from service.core.result import Component, Phase
from service.core.spec import Method, Objective, Strategy
from service.core.units import DTYPE_BYTES
from service.trace.reference import (
    PARALLEL_REFERENCE_DIR,
    iter_references,
    measured_part,
    parallel_matrix,
    reference_name,
    spec_from_json,
    spec_to_json,
)
from tests.trace.phases import expected_phases

pytestmark = pytest.mark.trace

REFERENCES = dict((path.stem, doc) for path, doc in iter_references(PARALLEL_REFERENCE_DIR))
# A cheap FSDP2 reference (Qwen2.5-0.5B, 512 tokens), traced again from scratch.
RETRACED = "qwen2_5-0_5b__full__b1-s512__fsdp2-2gpu"
# bf16 weights (the matrix's dtype).
BF16_BYTES = 2
# FSDP pads each parameter to a multiple of the GPU count and the tracker rounds every storage up
# to 512 bytes: a rank's shard is at most this much above an even split.
SHARD_SLACK = 0.01


def _by_strategy(strategy: Strategy, method: Method) -> list[str]:
    return sorted(
        name
        for name, doc in REFERENCES.items()
        if spec_from_json(doc["spec"]).parallel.strategy is strategy
        and spec_from_json(doc["spec"]).method is method
    )


def _phase(document: dict[str, Any], step: int, phase: Phase) -> dict[str, int]:
    for entry in document["phases"]:
        if entry["step"] == step and entry["phase"] == phase.value:
            return dict(entry["components"])
    raise AssertionError(f"no {phase} in step {step}")


def test_every_parallel_matrix_case_has_a_reference_and_nothing_else_is_there() -> None:
    cases = parallel_matrix()
    names = {case.name for case in cases}
    assert len(names) == len(cases)
    assert set(REFERENCES) == names, (
        f"regenerate: vramcast trace --matrix --only gpu ({PARALLEL_REFERENCE_DIR})"
    )
    specs = [case.spec for case in cases]
    assert {s.parallel.strategy for s in specs} == {Strategy.DDP, Strategy.FSDP, Strategy.FSDP2}
    assert {s.parallel.gpus for s in specs} >= {2, 8}
    assert {s.method for s in specs} == {Method.FULL, Method.LORA}
    assert {s.gradient_checkpointing for s in specs} == {True, False}
    assert len({case.model_id for case in cases}) >= 3


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_a_parallel_reference_is_well_formed(name: str) -> None:
    document = REFERENCES[name]
    spec = spec_from_json(document["spec"])
    assert spec_from_json(spec_to_json(spec)) == spec
    assert spec.parallel.gpus > 1
    assert reference_name(document["model_id"], spec) == name == document["name"]
    assert f"{spec.parallel.strategy.value}-{spec.parallel.gpus}gpu" in name
    peak = document["peak"]
    assert [(p["step"], p["phase"]) for p in document["phases"]] == expected_phases(spec)
    # the reference model's part is written only where there is one (DPO's and KTO's full
    # fine-tuning)
    reference_copy = spec.objective in (Objective.DPO, Objective.KTO) and spec.method is Method.FULL
    for entry in [peak, *document["phases"], *document["steps"]]:
        components = entry["components"]
        assert (Component.REFERENCE_MODEL.value in components) is reference_copy
        own = {Component.REFERENCE_MODEL.value, Component.GENERATION_KV_CACHE.value}
        assert set(components) | own == {c.value for c in Component}
        assert sum(components.values()) == entry["allocated_bytes"]
        assert all(v >= 0 for v in components.values())
        assert entry["allocated_bytes"] <= peak["allocated_bytes"]
    assert max(s["allocated_bytes"] for s in document["steps"]) == peak["allocated_bytes"]
    assert any("fake process group" in note for note in document["assumptions"])


@pytest.mark.parametrize("strategy", [Strategy.FSDP2, Strategy.FSDP])
def test_a_sharded_rank_holds_its_share_of_the_weights(strategy: Strategy) -> None:
    names = _by_strategy(strategy, Method.FULL)
    assert names
    for name in names:
        document = REFERENCES[name]
        gpus = spec_from_json(document["spec"]).parallel.gpus
        even = document["params"]["total"] * BF16_BYTES / gpus
        parts = _phase(document, 1, Phase.FORWARD_END)
        held = parts[Component.TRAINABLE_PARAMS.value]
        assert even <= held <= even * (1 + SHARD_SLACK), name
        # Gradients and optimizer state are sharded alike: exp_avg and exp_avg_sq per shard.
        step = _phase(document, 2, Phase.FORWARD_END)
        assert 2 * even <= step[Component.OPTIMIZER_STATE.value] <= 2 * even * (1 + SHARD_SLACK)
        grads = _phase(document, 1, Phase.OPTIMIZER_STEP)[Component.GRADIENTS.value]
        assert even <= grads <= even * (1 + SHARD_SLACK), name


def test_ddp_keeps_a_bucket_byte_for_every_gradient_byte_in_communication() -> None:
    names = _by_strategy(Strategy.DDP, Method.FULL)
    assert names
    for name in names:
        document = REFERENCES[name]
        spec = spec_from_json(document["spec"])
        if spec.parallel.gradient_as_bucket_view:
            continue  # the gradients are views of the buckets: counted as gradients
        weights = document["params"]["total"] * DTYPE_BYTES[spec.dtype]
        for step in (1, 2):
            parts = _phase(document, step, Phase.FORWARD_END)
            # Every rank holds the whole model and buckets as large as its gradients.
            assert parts[Component.TRAINABLE_PARAMS.value] >= weights
            buckets = parts[Component.COMMUNICATION.value]
            assert weights <= buckets <= weights * (1 + SHARD_SLACK), name


def test_fsdp_gathers_parameters_into_communication_and_ddp_replicates_them() -> None:
    for strategy in (Strategy.FSDP, Strategy.FSDP2):
        for name in _by_strategy(strategy, Method.FULL):
            backward = _phase(REFERENCES[name], 1, Phase.BACKWARD)
            assert backward[Component.COMMUNICATION.value] > 0, name


def test_a_parallel_retrace_reproduces_the_committed_reference_exactly() -> None:
    pytest.importorskip("torch")
    from service.catalog.models import default_catalog
    from service.trace.reference import result_to_json
    from service.trace.runner import trace

    document = REFERENCES[RETRACED]
    entry = default_catalog().resolve(document["model_id"])
    result = trace(spec_from_json(document["spec"]), entry.config, entry.id)
    assert measured_part(result_to_json(RETRACED, result)) == measured_part(document)
