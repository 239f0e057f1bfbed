"""Bodies of the fit-check route: a job and the GPU types it might run on."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from pydantic import Field, JsonValue

from service.api.schemas.base import Bytes, In, Out
from service.api.schemas.estimates import EstimateOut
from service.api.schemas.jobs import (
    MAX_FIT_GPUS,
    GpuOfferField,
    JobSpec,
)
from service.core.codec import spec_to_dict
from service.core.fit import CHANGE_WORDS, Change, GpuFit, Suggestion
from service.core.limits import MAX_BATCH_SIZE, MAX_GPUS, MAX_SEQ_LEN
from service.core.spec import TrainingSpec


class FitCheckIn(In):
    """A job and the GPU types it might run on."""

    job: JobSpec = Field(description="The job (its `gpu` field is not used here).")
    gpus: list[GpuOfferField] = Field(
        min_length=1,
        max_length=MAX_FIT_GPUS,
        description="GPU types: a name (string), or {name | memory_mib, count, price_per_hour}.",
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

    @classmethod
    def from_core(cls, job: TrainingSpec, suggestion: Suggestion) -> SuggestionOut:
        return cls(
            changes=list(suggestion.changes),
            description="; ".join(CHANGE_WORDS[c] for c in suggestion.changes),
            set=spec_changes(job, suggestion.spec),
            required_bytes=suggestion.requirement.device_bytes_upper,
            fits=suggestion.fits,
        )


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

    @classmethod
    def from_core(
        cls, gpu: GpuOut, fit: GpuFit, describe: Callable[[Suggestion], SuggestionOut]
    ) -> GpuFitOut:
        """`describe` turns a suggestion into its answer (GPUs of one check share most)."""
        return cls(
            gpu=gpu,
            count=fit.count,
            fits=fit.fits,
            usable_bytes=fit.usable_bytes,
            required_bytes=fit.requirement.device_bytes_upper,
            required_bytes_median=fit.requirement.device_bytes,
            headroom_bytes=fit.headroom_bytes,
            utilisation=fit.utilisation,
            max_batch_size=fit.max_batch_size,
            max_seq_len=fit.max_seq_len,
            suggestions=[describe(s) for s in fit.suggestions],
            cost_per_hour=fit.cost_per_hour,
        )


class CheapestOut(Out):
    index: int = Field(ge=0, lt=MAX_FIT_GPUS, description="Position in `gpus`.")
    name: str = Field(max_length=128, description="The GPU, as requested.")
    cost_per_hour: float = Field(ge=0.0, description="price_per_hour * count.")


class FitCheckOut(Out):
    """Per GPU type: does the job fit, how far it can grow, and what makes it fit."""

    job: EstimateOut = Field(description="The job's estimate as specified.")
    results: list[GpuFitOut] = Field(
        max_length=MAX_FIT_GPUS, description="One per requested GPU, in order."
    )
    cheapest: CheapestOut | None = Field(
        default=None, description="The cheapest priced GPU that fits; null: none."
    )


def spec_changes(old: TrainingSpec, new: TrainingSpec) -> dict[str, JsonValue]:
    """The job fields that differ, named and valued as in the request body."""
    before, after = spec_to_dict(old), spec_to_dict(new)
    changed: dict[str, JsonValue] = {}
    for name, value in after.items():
        was = before[name]
        if value == was:
            continue
        if isinstance(value, dict) and isinstance(was, dict):
            changed[name] = {k: v for k, v in value.items() if was.get(k) != v}
        else:
            changed[name] = value
    return changed
