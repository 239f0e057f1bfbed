"""Bodies of the estimate routes: one estimate, or a batch of them."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import Field, GetCoreSchemaHandler, PlainValidator, ValidationError
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import core_schema

from service.api.problems import FieldError, Problem, field_error
from service.api.schemas.base import Bytes, In, Out
from service.api.schemas.jobs import MAX_BATCH_JOBS, JobSpec
from service.calibration.factors import FactorState
from service.calibration.provider import AppliedCalibration, CalibratedPeaks
from service.core.calibration import AppliedFactor, Level
from service.core.result import PHASE_WORDS, Component, Estimate, Overhead, Phase


class PeakOut(Out):
    """The peak of one GPU of the job at the three levels, and the safe bound."""

    allocated_bytes: Bytes = Field(description="torch.cuda.max_memory_allocated() at the peak.")
    reserved_bytes: Bytes = Field(description="torch.cuda.max_memory_reserved() at the peak.")
    device_bytes: Bytes = Field(description="What nvidia-smi shows for the process (median).")
    device_bytes_upper: Bytes = Field(
        description="The safe bound to compare with a GPU: calibrated spread, or the prior margin."
    )
    step: int = Field(ge=1, le=2, description="1: no optimizer state yet; 2: the steady state.")
    phase: Phase = Field(description="Where in the step the peak happens.")
    phase_words: str = Field(max_length=256, description="The phase, in words.")


class LevelsOut(Out):
    """The estimator's own peaks, before calibration."""

    allocated_bytes: Bytes = Field(description="Allocated level.")
    reserved_bytes: Bytes = Field(description="Reserved level.")
    device_bytes: Bytes = Field(description="Device level.")
    device_bytes_upper: Bytes = Field(description="Device level with the prior margin.")


class PhaseOut(Out):
    """The allocated bytes at one phase of the step."""

    step: int = Field(ge=1, le=2, description="1: no optimizer state yet; 2: the steady state.")
    phase: Phase = Field(description="The phase.")
    allocated_bytes: Bytes = Field(description="Live bytes at this phase.")


class GenerationOut(Out):
    """GRPO's generation phase (model.generate) at its peak, step 2: its KV cache apart."""

    allocated_bytes: Bytes = Field(description="Live bytes at the generation's peak.")
    kv_cache_bytes: Bytes = Field(
        description="The generation's KV cache (component generation_kv_cache) at that moment."
    )


class ParamsOut(Out):
    total: int = Field(ge=0, description="Parameters of the model.")
    trainable: int = Field(ge=0, description="Parameters that take a gradient.")


class LevelCalibrationOut(Out):
    """The factor that corrected one peak level."""

    level: Level = Field(description="allocated, reserved or device.")
    scope: str = Field(max_length=64, description="Where it came from (model_gpu, model, ...).")
    factor: float = Field(ge=0.0, description="measured / estimated, multiplied into the level.")
    nodes: int = Field(ge=0, description="Voters (distinct upload keys) whose measurements voted.")
    samples: int = Field(ge=0, description="Measured runs behind the factor.")
    models: int = Field(
        ge=1, description="Models whose measurements voted: 1 unless the scope is global."
    )

    @classmethod
    def from_core(cls, applied: AppliedFactor) -> LevelCalibrationOut:
        factor = applied.factor
        return cls(
            level=applied.key.level,
            scope=applied.key.scope.value,
            factor=factor.ratio,
            nodes=factor.nodes,
            samples=factor.runs,
            models=factor.models,
        )


class CalibrationOut(Out):
    """The calibration applied: the device level's factor (the safe bound's), every level's
    factors, and whether the factors are fresh, stale (the store is down) or missing."""

    applied: bool = Field(description="Whether measured peaks corrected this estimate.")
    scope: str = Field(
        max_length=64,
        description="'none', or where the device level's factor came from (model, global, ...).",
    )
    factor: float | None = Field(
        default=None, ge=0.0, description="measured / estimated, multiplied into the estimate."
    )
    upper_multiplier: float | None = Field(
        default=None,
        ge=1.0,
        description="The safe bound over the calibrated device level: the measured spread, "
        "widened for few nodes.",
    )
    nodes: int = Field(ge=0, description="Voters (distinct upload keys) whose measurements voted.")
    samples: int = Field(ge=0, description="Measured runs behind the factor.")
    levels: list[LevelCalibrationOut] = Field(
        max_length=3, description="Every level a factor corrected (allocated, reserved, device)."
    )
    state: FactorState = Field(
        description="The factors used: fresh (loaded from the store within seconds), stale (the "
        "store is unreachable: the last ones loaded) or none (none could be loaded)."
    )
    table_id: str | None = Field(
        default=None,
        max_length=64,
        description="The identity of the factor table used (a digest of its factors): the "
        "same on every replica that applied the same table; null: this replica never loaded "
        "one (as GET /v1/factors `table_id`).",
    )

    @classmethod
    def from_core(cls, applied: AppliedCalibration) -> CalibrationOut:
        return cls(
            applied=applied.applied,
            scope=applied.scope,
            factor=applied.factor,
            upper_multiplier=applied.upper_multiplier,
            nodes=applied.nodes,
            samples=applied.samples,
            levels=[LevelCalibrationOut.from_core(level) for level in applied.levels],
            state=applied.state,
            table_id=applied.table_id,
        )


class GpuFitSummary(Out):
    """Whether the job fits the GPU named in the spec."""

    name: str | None = Field(max_length=128, description="Catalog name; null: by memory only.")
    memory_bytes: Bytes = Field(description="Total memory as the driver reports it.")
    usable_bytes: Bytes = Field(description="Memory a process can fill (total - driver's share).")
    fits: bool = Field(description="device_bytes_upper <= usable_bytes.")
    headroom_bytes: int = Field(description="usable - device_bytes_upper; negative: no fit.")


ComponentBytes = dict[Component, Bytes]
# Iterating an enum runs Python code per member: the members, once, with their values (the
# encoder takes a plain string at a fraction of an enum member's cost).
# The reference model's part is listed only where there is one (DPO full fine-tuning), so the
# answers of every other job keep the keys they had before it.
_OWN_COMPONENTS = (Component.REFERENCE_MODEL, Component.GENERATION_KV_CACHE)
_COMPONENTS = tuple((c, c.value) for c in Component if c not in _OWN_COMPONENTS)
_REFERENCE_MODEL = Component.REFERENCE_MODEL
_OVERHEADS = tuple((o, o.value) for o in Overhead)
_PHASES = {phase: phase.value for phase in Phase}


class EstimateOut(Out):
    """The peak memory of one GPU of the job, where it goes and when it happens."""

    model: str = Field(max_length=256, description="The catalog id, or 'hf_config'.")
    peak: PeakOut = Field(description="The peak, calibrated when calibration applies.")
    estimated: LevelsOut = Field(description="The estimator's peaks before calibration.")
    components: ComponentBytes = Field(
        description="Allocated bytes at the peak by role; they sum to estimated.allocated_bytes. "
        "reference_model appears only where there is one (DPO and KTO full fine-tuning's "
        "frozen copy)."
    )
    overheads: dict[Overhead, Bytes] = Field(
        description="Bytes above allocated: reserved and device levels add these."
    )
    phases: list[PhaseOut] = Field(max_length=16, description="Allocated bytes per phase.")
    generation: GenerationOut | None = Field(
        default=None,
        description="GRPO: the generation phase's peak with its KV cache apart; null for "
        "objectives that generate nothing.",
    )
    params: ParamsOut = Field(description="Parameter counts.")
    host_bytes: Bytes = Field(
        description="Host (CPU) memory one rank keeps for what it offloads (optimizer state, "
        "and parameters under parameter offload); 0 without offloading."
    )
    host_pinned_bytes: Bytes = Field(
        description="Pinned host (CPU) memory one rank holds for offloaded activations "
        "(activation_offloading); 0 without it."
    )
    upper_margin: float = Field(
        ge=0.0,
        description="The safe bound's margin over peak.device_bytes: the device factor's when "
        "calibration applied one, else the estimator's own.",
    )
    calibration: CalibrationOut = Field(description="The calibration applied.")
    gpu: GpuFitSummary | None = Field(default=None, description="Fit on the spec's GPU, if any.")
    assumptions: list[str] = Field(
        max_length=64,
        description="Defaults the estimate assumed; the last says what calibration applied: per "
        "level the factor, its scope, runs and nodes, and the safe bound's margin, or that none "
        "applied.",
    )
    warnings: list[str] = Field(max_length=64, description="What may make it wrong.")
    estimator_version: str = Field(max_length=32, description="Version of the estimator.")

    @classmethod
    def from_core(
        cls,
        model: str,
        est: Estimate,
        peaks: CalibratedPeaks,
        gpu: GpuFitSummary | None = None,
        warnings: tuple[str, ...] = (),
    ) -> EstimateOut:
        gpu_values = None if gpu is None else gpu.model_dump(mode="json")
        # One validation of plain values (pydantic-core) is cheaper than building each
        # nested model in Python.
        return cls.model_validate(estimate_values(model, est, peaks, gpu_values, warnings))


def estimate_values(
    model: str,
    est: Estimate,
    peaks: CalibratedPeaks,
    gpu: dict[str, Any] | None = None,
    warnings: tuple[str, ...] = (),
) -> dict[str, Any]:
    """An `EstimateOut` as the plain values it serialises to, in its fields' order.

    The estimate routes encode these straight to JSON (`pydantic_core.to_json`): the same
    bytes as the model's serialiser writes (tests/api/test_encoding.py holds them to it),
    without building and validating a model per answer. `gpu` is a `GpuFitSummary`'s values.
    """
    calibration = peaks.calibration
    upper_margin = calibration.upper_margin(est.upper_margin)
    described = _calibration_values(calibration)
    components = est.components
    overheads = est.overheads
    phases = _PHASES
    return {
        "model": model,
        "peak": {
            "allocated_bytes": peaks.allocated_bytes,
            "reserved_bytes": peaks.reserved_bytes,
            "device_bytes": peaks.device_bytes,
            "device_bytes_upper": peaks.device_bytes_upper,
            "step": est.peak_step,
            "phase": phases[est.peak_phase],
            "phase_words": PHASE_WORDS[est.peak_phase],
        },
        "estimated": {
            "allocated_bytes": est.allocated_bytes,
            "reserved_bytes": est.reserved_bytes,
            "device_bytes": est.device_bytes,
            "device_bytes_upper": est.device_bytes_upper,
        },
        "components": {
            **{key: components.get(c, 0) for c, key in _COMPONENTS},
            **{c.value: components[c] for c in _OWN_COMPONENTS if c in components},
        },
        "overheads": {key: overheads.get(o, 0) for o, key in _OVERHEADS},
        "phases": [
            {"step": ph.step, "phase": phases[ph.phase], "allocated_bytes": ph.allocated_bytes}
            for ph in est.phases
        ],
        "generation": _generation_values(est),
        "params": {"total": est.params.total, "trainable": est.params.trainable},
        "host_bytes": est.host_bytes,
        "host_pinned_bytes": est.host_pinned_bytes,
        "upper_margin": upper_margin,
        "calibration": described,
        "gpu": gpu,
        # Calibration alone says what it applied: the core knows no factors.
        "assumptions": [*_core_notes(est.assumptions), calibration.note(upper_margin)],
        "warnings": [*est.warnings, *warnings],
        "estimator_version": est.estimator_version,
    }


def _generation_values(est: Estimate) -> dict[str, int] | None:
    """GRPO's generation phase at step 2 (the steady state), or None without one."""
    for ph in est.phases:
        if ph.phase is Phase.GENERATION and ph.step == 2:
            return {
                "allocated_bytes": ph.allocated_bytes,
                "kv_cache_bytes": ph.components.get(Component.GENERATION_KV_CACHE, 0),
            }
    return None


# Calibrations described: a replica applies a few factor groups to many jobs. Forgotten whole
# when full; a new factor table brings new calibrations.
_MAX_DESCRIBED = 4096
_described: dict[AppliedCalibration, dict[str, Any]] = {}
_last_described: list[tuple[AppliedCalibration, dict[str, Any]]] = []


def _calibration_values(calibration: AppliedCalibration) -> dict[str, Any]:
    """A `CalibrationOut`'s values, shared between answers, which only encode them."""
    if _last_described:
        last, values = _last_described[0]
        if last is calibration:  # the same uncalibrated state, job after job
            return values
    found = _described.get(calibration)
    if found is None:
        if len(_described) >= _MAX_DESCRIBED:
            _described.clear()
        found = _described[calibration] = CalibrationOut.from_core(calibration).model_dump(
            mode="json"
        )
    _last_described[:] = [(calibration, found)]
    return found


# A parenthesis of a core note that speaks of calibration is left out: the calibration note,
# which the API adds, says what applied.
_CORE_CALIBRATION_WORDS = re.compile(r"\s*\([^()]*calibrat[^()]*\)", re.IGNORECASE)


_MAX_NOTE_SETS = 4096
_notes: dict[tuple[str, ...], list[str]] = {}


def _core_notes(notes: tuple[str, ...]) -> list[str]:
    """The core's notes without their words on calibration, remembered per set of notes (jobs
    of one kind share theirs): callers copy the list, never change it."""
    found = _notes.get(notes)
    if found is None:
        if len(_notes) >= _MAX_NOTE_SETS:
            _notes.clear()
        found = _notes[notes] = [
            _CORE_CALIBRATION_WORDS.sub("", n) if "calibrat" in n.lower() else n for n in notes
        ]
    return found


# ---------------------------------------------------------------------------------------------
# Batches


class RejectedJob:
    """A batch entry that failed the schema; its errors are relative to the job."""

    __slots__ = ("errors",)

    def __init__(self, errors: tuple[FieldError, ...]) -> None:
        self.errors = errors

    @classmethod
    def __get_pydantic_core_schema__(
        cls, _source: type[Any], _handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        # Never validated from input (the batch's validator builds it), never in the schema.
        return core_schema.is_instance_schema(cls)


def _job_or_rejection(value: Any) -> JobSpec | RejectedJob:
    try:
        return JobSpec.model_validate(value)
    except ValidationError as exc:
        return RejectedJob(
            tuple(
                field_error(
                    tuple(p for p in err["loc"] if isinstance(p, str | int)),
                    err["msg"],
                    err["type"],
                )
                for err in exc.errors()
            )
        )


BatchJob = Annotated[
    JobSpec | SkipJsonSchema[RejectedJob],
    PlainValidator(_job_or_rejection, json_schema_input_type=JobSpec),
]


class BatchIn(In):
    """Up to 1000 jobs estimated in one call; each job fails on its own."""

    jobs: list[BatchJob] = Field(
        min_length=1, max_length=MAX_BATCH_JOBS, description="The jobs, answered in this order."
    )


class JobsIn(In):
    """A batch whose every job passes the schema, read in one pass from the body's bytes;
    any other is read as `BatchIn`, whose jobs fail one by one. Not in the OpenAPI schema
    (`BatchIn` documents the body)."""

    jobs: list[JobSpec] = Field(min_length=1, max_length=MAX_BATCH_JOBS)


class BatchResultOut(Out):
    """One job's answer: its estimate, or the problem that stopped it."""

    index: int = Field(ge=0, lt=MAX_BATCH_JOBS, description="Position of the job in `jobs`.")
    status: int = Field(ge=200, le=599, description="200, or the problem's status.")
    estimate: EstimateOut | None = Field(default=None, description="The estimate, on success.")
    problem: Problem | None = Field(default=None, description="The problem, on failure.")


class BatchOut(Out):
    results: list[BatchResultOut] = Field(
        max_length=MAX_BATCH_JOBS, description="One result per job, in order."
    )
    succeeded: int = Field(ge=0, le=MAX_BATCH_JOBS, description="Jobs estimated.")
    failed: int = Field(ge=0, le=MAX_BATCH_JOBS, description="Jobs answered with a problem.")
