"""What voters can do to a safe bound (service/core/calibration.py's module docstring), over
`fit_table`: fewer than MIN_NODES voters move nothing, however many node ids they name; with
more, a safe bound never comes below a run that supports its factor, and rises past the
clamps' ceiling only to such a run."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from service.core.calibration import (
    MIN_LOG_SPREAD,
    MIN_NODES,
    OUTLIER_Z,
    UPPER_MULTIPLIER_CEILING,
    AppliedFactor,
    Level,
    Observation,
    Outcome,
    Sample,
    SampleRuns,
    Scope,
    Support,
    calibrate,
    fit_table,
    global_support,
    model_support,
)
from service.core.result import PeakLevels
from service.core.units import GIB

MODELS = ("org/small-1b", "org/mid-3b", "org/phi-2", "org/other-7b")
METHODS = ("lora", "full")
GPUS = ("A100", "H100")
ENVIRONMENTS = ("torch 2.5, cuda 12.4", "torch 2.4, cuda 12.1")
# The device level most often: the safe bound's.
LEVELS = (Level.DEVICE, Level.DEVICE, Level.RESERVED, Level.ALLOCATED)


@dataclass(frozen=True, slots=True, kw_only=True)
class Run:
    """An upload's run at one level: its job's estimate there and the peak it measured."""

    node_id: str  # what the body names: free text, not the voter
    observation: Observation
    estimated_bytes: int
    measured_bytes: int

    def job(self) -> PeakLevels:
        """The run's job's estimate, its level being the device level."""
        device = self.estimated_bytes
        return PeakLevels(device * 8 // 10, device * 9 // 10, device, device * 115 // 100)


@st.composite
def runs(draw: st.DrawFn, voters: list[str], node_ids: int) -> list[Run]:
    """Runs of a few models, each model's agreeing around a center (within the clamps or far
    beyond them), with some far off and some OOM; each run's body names one of `node_ids`."""
    models = draw(st.lists(st.sampled_from(MODELS), min_size=1, max_size=4, unique=True))
    centers = {model: draw(st.sampled_from((0.001, 0.5, 1.0, 1.2, 3.0))) for model in models}
    found: list[Run] = []
    for voter in voters:
        for model in models:
            for _ in range(draw(st.integers(min_value=1, max_value=3))):
                off = draw(st.integers(min_value=0, max_value=9)) == 0
                ratio = (
                    draw(st.floats(min_value=0.001, max_value=20.0))
                    if off
                    else centers[model] * draw(st.floats(min_value=0.92, max_value=1.1))
                )
                estimated = draw(st.integers(min_value=GIB // 4, max_value=40 * GIB))
                measured = max(1, round(estimated * ratio))
                oom = draw(st.integers(min_value=0, max_value=9)) == 0
                sample = Sample(
                    voter=voter,
                    ratio=measured / estimated,
                    outcome=Outcome.OOM if oom else Outcome.COMPLETED,
                )
                found.append(
                    Run(
                        node_id=f"node-{draw(st.integers(0, node_ids - 1))}",
                        observation=Observation(
                            model=model,
                            method=draw(st.sampled_from(METHODS)),
                            level=draw(st.sampled_from(LEVELS)),
                            gpu=draw(st.sampled_from(GPUS)),
                            environment=draw(st.sampled_from(ENVIRONMENTS)),
                            sample=sample,
                        ),
                        estimated_bytes=estimated,
                        measured_bytes=measured,
                    )
                )
    return found


@st.composite
def few_keys(draw: st.DrawFn) -> list[Run]:
    """Uploads with fewer than MIN_NODES keys, under at least MIN_NODES node ids each."""
    keys = draw(st.integers(min_value=1, max_value=MIN_NODES - 1))
    return draw(runs([f"key-{index}" for index in range(keys)], node_ids=MIN_NODES + 2))


@st.composite
def fleets(draw: st.DrawFn) -> list[Run]:
    """Uploads with MIN_NODES keys or more."""
    keys = draw(st.integers(min_value=MIN_NODES, max_value=6))
    return draw(runs([f"key-{index}" for index in range(keys)], node_ids=3))


def as_node_votes(found: list[Run]) -> list[Observation]:
    """The observations as if each node id the bodies name cast a vote."""
    return [
        Observation(
            model=run.observation.model,
            method=run.observation.method,
            level=run.observation.level,
            gpu=run.observation.gpu,
            environment=run.observation.environment,
            sample=Sample(
                voter=run.node_id,
                ratio=run.observation.sample.ratio,
                outcome=run.observation.sample.outcome,
            ),
        )
        for run in found
    ]


@given(found=few_keys())
@settings(max_examples=150, deadline=None)
def test_fewer_than_min_nodes_keys_move_no_level_and_no_bound(found: list[Run]) -> None:
    table = fit_table(run.observation for run in found)
    assert table.factors == {}
    for run in found:
        for model in MODELS:  # the models uploaded for and every other one
            for gpu in (None, *GPUS):
                job = run.job()
                calibrated = calibrate(
                    job, table, model=model, method=run.observation.method, gpu=gpu
                )
                levels = (
                    calibrated.allocated_bytes,
                    calibrated.reserved_bytes,
                    calibrated.device_bytes,
                    calibrated.device_bytes_upper,
                )
                assert levels == tuple(job)
                assert calibrated.device_bytes_upper >= job.device_bytes


def test_node_ids_are_not_voters() -> None:
    # One key naming three node ids: three votes by node, none by key.
    found = [
        Run(
            node_id=f"node-{index}",
            observation=Observation(
                model=model,
                method="lora",
                level=Level.DEVICE,
                gpu=GPUS[0],
                environment=ENVIRONMENTS[0],
                sample=Sample(voter="key-0", ratio=0.001),
            ),
            estimated_bytes=GIB,
            measured_bytes=GIB // 1000,
        )
        for index in range(MIN_NODES)
        for model in MODELS[:3]
    ]
    assert fit_table(as_node_votes(found)).factors != {}
    assert fit_table(run.observation for run in found).factors == {}


def support_of(applied: AppliedFactor, found: list[Run]) -> tuple[Support, list[Run]]:
    """The votes behind a factor, and the runs of its group, as `fit_table` grouped them."""
    key = applied.key
    group = [
        run
        for run in found
        if run.observation.method == key.method
        and run.observation.level is key.level
        and (key.model is None or run.observation.model == key.model)
        and (key.scope is not Scope.MODEL_GPU or run.observation.gpu == key.variant)
        and (key.scope is not Scope.MODEL_ENVIRONMENT or run.observation.environment == key.variant)
    ]
    held = SampleRuns((run.observation.model, run.observation.sample) for run in group)
    support = (
        global_support(held) if key.scope is Scope.GLOBAL else model_support(held, key.model or "")
    )
    assert support is not None
    return support, group


def supporting(support: Support, group: list[Run]) -> list[Run]:
    """The completed runs of the kept voters, less those far above the votes' median."""
    reach = OUTLIER_Z * max(support.log_spread, MIN_LOG_SPREAD)
    cap = math.exp(support.log_center + reach)
    return [
        run
        for run in group
        if run.observation.sample.outcome is Outcome.COMPLETED
        and support.selection.supports(run.observation.model, run.observation.sample.voter)
        and run.observation.sample.ratio <= cap
    ]


@given(found=fleets())
@settings(max_examples=150, deadline=None)
def test_a_safe_bound_stays_between_the_runs_that_support_it(found: list[Run]) -> None:
    table = fit_table(run.observation for run in found)
    for key, factor in table.factors.items():
        if key.level is not Level.DEVICE:
            continue
        support, group = support_of(AppliedFactor(key=key, factor=factor), found)
        ratios = [run.observation.sample.ratio for run in supporting(support, group)]
        assert ratios, key
        # Down: at or above every run that supports it; up: past the clamps' ceiling only to
        # the largest of them.
        assert factor.upper_ratio >= max(ratios)
        assert factor.upper_ratio <= max(UPPER_MULTIPLIER_CEILING, max(ratios)) * (1 + 1e-12)
    # In bytes: the job of each supporting run, calibrated as an estimate of it would be
    # (its model, method and GPU), keeps a safe bound at or above the peak it measured.
    for run in found:
        obs = run.observation
        if obs.level is not Level.DEVICE:
            continue
        calibrator = table.calibrator(model=obs.model, method=obs.method, gpu=obs.gpu)
        applied = calibrator.applied.get(Level.DEVICE)
        if applied is None:
            continue
        support, group = support_of(applied, found)
        if run in supporting(support, group):
            _, _, _, upper = calibrator.levels(run.job())
            assert upper >= run.measured_bytes, (applied.key, run)
