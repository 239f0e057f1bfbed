"""Bodies of the fit-check route: a job and the GPU types it might run on."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import Field, JsonValue, field_validator

from service.api.schemas.base import Bytes, In, Out, integers
from service.api.schemas.estimates import EstimateOut
from service.api.schemas.jobs import (
    MAX_FIT_GPUS,
    GpuOfferField,
    JobSpec,
)
from service.core.codec import OMITTED, SPEC_FIELDS, spec_field
from service.core.fit import GpuFit, Suggestion
from service.core.fit_changes import CHANGE_WORDS, Change
from service.core.limits import MAX_BATCH_SIZE, MAX_GPUS, MAX_SEQ_LEN
from service.core.placement import DEFAULT_MAX_GPUS, MAX_PLACEMENT_GPUS, Outcome
from service.core.spec import DEFAULT_GPUS_PER_NODE, Strategy, TrainingSpec


class PlacementIn(In):
    """Find the fewest GPUs of each type that hold the job, per strategy: counts 1 up to one
    node's GPUs, then whole nodes, up to max_gpus. The job's batch_size and seq_len stay per
    GPU; a GPU's `count` is not used."""

    placement_integer_fields = integers("max_gpus", "gpus_per_node")

    strategies: list[Strategy] | None = Field(
        default=None,
        min_length=1,
        max_length=len(Strategy),
        description="Strategies to place the job under; null: the job's parallel.strategy.",
        json_schema_extra={"uniqueItems": True},  # (`_distinct` refuses a repeated one)
    )
    max_gpus: int = Field(
        default=DEFAULT_MAX_GPUS,
        ge=1,
        le=MAX_PLACEMENT_GPUS,
        description="The most GPUs of one type the job may span.",
    )
    gpus_per_node: int | None = Field(
        default=None,
        ge=1,
        le=MAX_GPUS,
        description=f"GPUs per node; null: parallel.gpus_per_node, else {DEFAULT_GPUS_PER_NODE}.",
    )

    @field_validator("strategies")
    @classmethod
    def _distinct(cls, value: list[Strategy] | None) -> list[Strategy] | None:
        if value is not None and len(set(value)) < len(value):
            raise ValueError("a strategy is listed twice")
        return value


class FitCheckIn(In):
    """A job and the GPU types it might run on."""

    job: JobSpec = Field(description="The job (its `gpu` field is not used here).")
    gpus: list[GpuOfferField] = Field(
        min_length=1,
        max_length=MAX_FIT_GPUS,
        description="GPU types: a name (string), or {name | memory_mib, count, price_per_hour}.",
    )
    placement: PlacementIn | None = Field(
        default=None,
        description="Also find the fewest GPUs per GPU type and strategy; null: do not.",
    )


class GpuOut(Out):
    """A GPU as asked for, and as the catalog knows it."""

    requested: str = Field(max_length=128, description="The name or memory, as given.")
    name: str | None = Field(max_length=128, description="Catalog name; null: not in it.")
    driver_name: str | None = Field(max_length=128, description="The name nvidia-smi prints.")
    memory_mib: int = Field(ge=0, description="Total memory as the driver reports it, MiB.")
    memory_bytes: Bytes = Field(description="The same total in bytes.")
    matched_by: Literal["name", "memory_mib"] = Field(description="How it was matched.")
    bf16: bool | None = Field(description="Computes in bf16; null: unknown.")
    fp8: bool | None = Field(description="Computes in fp8; null: unknown.")
    compute_capability: str | None = Field(
        default=None,
        max_length=8,
        description="CUDA compute capability ('9.0'); picks the device level's row.",
    )


class SuggestionOut(Out):
    """A change to the job and the requirement it leads to."""

    changes: list[Change] = Field(max_length=16, description="What to change, in rank order.")
    description: str = Field(max_length=1024, description="The changes, in words.")
    set: dict[str, JsonValue] = Field(
        max_length=32, description="The job fields to set (as in the request), new values."
    )
    required_bytes: Bytes = Field(description="The safe bound after the change.")
    fits: bool = Field(description="Whether the changed job fits this GPU.")


class GpuFitOut(Out):
    """The job on one GPU type."""

    gpu: GpuOut = Field(description="The GPU.")
    count: int = Field(ge=1, le=MAX_GPUS, description="GPUs the job spans on this type.")
    fits: bool = Field(description="required_bytes <= usable_bytes.")
    usable_bytes: Bytes = Field(description="Driver-reported total minus what CUDA cannot use.")
    required_bytes: Bytes = Field(description="The job's safe bound (device_bytes_upper).")
    required_bytes_median: Bytes = Field(description="The job's median device-level peak.")
    headroom_bytes: int = Field(description="usable - required; negative when it does not fit.")
    utilisation: float = Field(ge=0.0, description="required / usable.")
    max_batch_size: int = Field(
        ge=0, le=MAX_BATCH_SIZE, description="Largest micro-batch that fits at this seq_len."
    )
    max_seq_len: int = Field(
        ge=0,
        le=MAX_SEQ_LEN,
        description="Longest sequence that fits at this batch, up to the model's context.",
    )
    suggestions: list[SuggestionOut] = Field(
        max_length=16, description="Changes that lower the requirement, those that fit first."
    )
    cost_per_hour: float | None = Field(
        default=None, ge=0.0, description="price_per_hour * count, when a price was given."
    )


class CheapestOut(Out):
    index: int = Field(ge=0, lt=MAX_FIT_GPUS, description="Position in `gpus`.")
    name: str = Field(max_length=128, description="The GPU, as requested.")
    cost_per_hour: float = Field(ge=0.0, description="price_per_hour * count.")


class PlacementOut(Out):
    """One GPU type under one strategy: the fewest GPUs that hold the job, or why none."""

    gpu_index: int = Field(ge=0, lt=MAX_FIT_GPUS, description="Position in `gpus`.")
    gpu: str = Field(max_length=128, description="The GPU, as requested.")
    strategy: Strategy = Field(description="The parallel strategy.")
    outcome: Outcome = Field(
        description="fits; does_not_fit (not within max_gpus); not_possible (the job cannot "
        "run under this strategy)."
    )
    count: int | None = Field(
        default=None, ge=1, le=MAX_PLACEMENT_GPUS, description="Fewest GPUs that fit."
    )
    nodes: int | None = Field(default=None, ge=1, description="Nodes of gpus_per_node.")
    cost_per_hour: float | None = Field(
        default=None, ge=0.0, description="price_per_hour * count, when a price was given."
    )
    usable_bytes: Bytes = Field(description="One GPU's usable memory.")
    required_bytes: Bytes | None = Field(
        default=None, description="The per-GPU safe bound on `count` GPUs."
    )
    headroom_bytes: int | None = Field(default=None, description="usable - required.")
    previous_count: int | None = Field(
        default=None,
        ge=1,
        description="The count tried below `count`, which does not fit; null: count is 1.",
    )
    previous_required_bytes: Bytes | None = Field(
        default=None, description="The per-GPU safe bound on previous_count GPUs."
    )
    reason: str | None = Field(
        default=None, max_length=1024, description="Why none fits, in words."
    )
    per_gpu: EstimateOut | None = Field(
        default=None, description="The estimate of one GPU of the job on `count` GPUs."
    )


class PlacementRefOut(Out):
    """A placement picked out of `placements`."""

    index: int = Field(ge=0, description="Position in `placements`.")
    gpu: str = Field(max_length=128, description="The GPU, as requested.")
    strategy: Strategy = Field(description="The parallel strategy.")
    count: int = Field(ge=1, le=MAX_PLACEMENT_GPUS, description="GPUs.")
    cost_per_hour: float | None = Field(default=None, ge=0.0, description="price * count.")


class PlacementsOut(Out):
    """The fewest GPUs per GPU type and strategy, the cheapest and the fewest overall."""

    strategies: list[Strategy] = Field(max_length=len(Strategy), description="As searched.")
    max_gpus: int = Field(ge=1, le=MAX_PLACEMENT_GPUS, description="The most GPUs tried.")
    gpus_per_node: int = Field(ge=1, le=MAX_GPUS, description="GPUs per node.")
    counts: list[int] = Field(
        max_length=MAX_PLACEMENT_GPUS, description="The GPU counts a placement may take."
    )
    placements: list[PlacementOut] = Field(
        max_length=MAX_FIT_GPUS * len(Strategy),
        description="Per GPU in order, per strategy in order.",
    )
    cheapest: PlacementRefOut | None = Field(
        default=None, description="The lowest cost_per_hour that fits; null: no priced fit."
    )
    fewest: PlacementRefOut | None = Field(
        default=None, description="The fewest GPUs that fit (then the cheapest); null: none."
    )
    evaluations: int = Field(ge=0, description="Per-GPU requirements estimated by the search.")


class FitCheckOut(Out):
    """Per GPU type: does the job fit, how far it can grow, and what makes it fit."""

    job: EstimateOut = Field(description="The job's estimate as specified.")
    results: list[GpuFitOut] = Field(
        max_length=MAX_FIT_GPUS, description="One per requested GPU, in order."
    )
    cheapest: CheapestOut | None = Field(
        default=None, description="The cheapest priced GPU that fits; null: none."
    )
    placement: PlacementsOut | None = Field(
        default=None, description="With `placement` in the request: where the job fits."
    )


def suggestion_values(job: TrainingSpec, suggestion: Suggestion) -> dict[str, Any]:
    """A `SuggestionOut` as the plain values it serialises to, in its fields' order."""
    changes = suggestion.changes
    return {
        "changes": [c.value for c in changes],
        "description": "; ".join(CHANGE_WORDS[c] for c in changes),
        "set": spec_changes(job, suggestion.spec),
        "required_bytes": suggestion.requirement.device_bytes_upper,
        "fits": suggestion.fits,
    }


def gpu_fit_values(
    gpu: dict[str, Any], fit: GpuFit, describe: Callable[[Suggestion], dict[str, Any]]
) -> dict[str, Any]:
    """A `GpuFitOut` as the plain values it serialises to, in its fields' order: `gpu` is a
    `GpuOut`'s values, `describe` turns a suggestion into its values (`suggestion_values`;
    GPUs of one check share most suggestions)."""
    need = fit.requirement
    return {
        "gpu": gpu,
        "count": fit.count,
        "fits": fit.fits,
        "usable_bytes": fit.usable_bytes,
        "required_bytes": need.device_bytes_upper,
        "required_bytes_median": need.device_bytes,
        "headroom_bytes": fit.headroom_bytes,
        "utilisation": fit.utilisation,
        "max_batch_size": fit.max_batch_size,
        "max_seq_len": fit.max_seq_len,
        "suggestions": [describe(s) for s in fit.suggestions],
        "cost_per_hour": fit.cost_per_hour,
    }


def spec_changes(old: TrainingSpec, new: TrainingSpec) -> dict[str, JsonValue]:
    """The job fields that differ, named and valued as in the request body (as
    `spec_to_dict` writes them), in the spec's field order; only the differing fields are
    written."""
    changed: dict[str, JsonValue] = {}
    for name in SPEC_FIELDS:
        if getattr(old, name) == getattr(new, name):
            continue
        value = spec_field(new, name)
        if value is OMITTED:
            continue
        was = spec_field(old, name)  # options written only when set (dpo) may be new
        if was is OMITTED:
            was = None
        if value == was:
            continue
        if isinstance(value, dict) and isinstance(was, dict):
            changed[name] = {k: v for k, v in value.items() if was.get(k) != v}
        else:
            changed[name] = value
    return changed
