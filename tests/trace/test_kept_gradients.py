"""zero_grad(set_to_none=False), torch's default before 2.0, traced on the installed stack: the
estimate of a torch 1.x stack (`Stack.zero_grad_keeps_gradients`) matches it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from service.catalog.models import default_catalog
from service.core.estimator import estimate
from service.core.spec import AttnImpl, Method, Optim, TrainingSpec
from service.core.stack import Stack
from service.core.units import DType

pytest.importorskip("torch")

BERT = "google-bert/bert-base-uncased"
# The estimate's tolerance against a reference (tests/core/test_references.py).
TOLERANCE = 0.01


@pytest.mark.parametrize("autocast", [False, True])
def test_the_estimate_of_kept_gradients_matches_their_trace(autocast: bool) -> None:
    from service.trace.runner import trace

    entry = default_catalog().resolve(BERT)
    spec = TrainingSpec(
        method=Method.FULL,
        batch_size=2,
        seq_len=128,
        dtype=DType.FP32,
        autocast=autocast,
        optim=Optim.ADAMW_TORCH_FUSED,
        attn_implementation=AttnImpl.EAGER,  # torch 1.x has no SDPA
    )
    kept = trace(spec, entry.config, entry.id, keep_gradients=True)
    dropped = trace(spec, entry.config, entry.id)
    # torch 1.13: kept gradients, and softmax saves only its output as the installed torch's
    est = estimate(entry.arch, replace(spec, stack=Stack(torch="1.13.1")))
    assert est.allocated_bytes == pytest.approx(kept.peak.allocated_bytes, rel=TOLERANCE)
    assert est.reserved_bytes == pytest.approx(kept.reserved_bytes, rel=TOLERANCE)
    # the kept gradients raise the trace's peak, in step 2, as the estimate's
    assert kept.peak.allocated_bytes > dropped.peak.allocated_bytes
    assert kept.peak_step == est.peak_step == 2
    traced = {(p.step, p.phase): p.snapshot.allocated_bytes for p in kept.phases}
    for phase in est.phases:
        if (phase.step, phase.phase) in traced:
            want = traced[(phase.step, phase.phase)]
            assert phase.allocated_bytes == pytest.approx(want, rel=TOLERANCE), phase
