"""An `Estimate` from a step's phase peaks and the levels above the allocated one."""

from __future__ import annotations

from service.core.arch import ModelArch
from service.core.device import device_row
from service.core.estimator.uncertainty import _uncertainty
from service.core.overhead import AboveAllocated, levels
from service.core.result import Estimate, ParamCounts, PhasePeak
from service.core.spec import TrainingSpec


def estimate_from(
    phases: tuple[PhasePeak, ...],
    peak: PhasePeak,
    over: AboveAllocated,
    *,
    params: ParamCounts,
    assumptions: tuple[str, ...],
    warnings: tuple[str, ...],
    version: str,
    host: tuple[int, int] = (0, 0),
) -> Estimate:
    """The estimate peaking at `peak` with the levels `over` it, its notes in order; `host`:
    the host memory per rank and its pinned part."""
    return Estimate(
        allocated_bytes=peak.allocated_bytes,
        reserved_bytes=over.reserved,
        device_bytes=over.device,
        device_bytes_upper=over.device_upper,
        components=peak.components,
        overheads=over.overheads,
        peak_step=peak.step,
        peak_phase=peak.phase,
        phases=phases,
        params=params,
        upper_margin=over.upper_margin,
        assumptions=assumptions,
        warnings=warnings,
        estimator_version=version,
        host_bytes=host[0],
        host_pinned_bytes=host[1],
    )


def job_levels(
    arch: ModelArch,
    spec: TrainingSpec,
    *,
    allocated: int,
    reserved: int,
    paged_state: int,
    fused_attention: bool,
    compute_capability: str | None,
    reserved_note: str = "",
) -> AboveAllocated:
    """The levels above `allocated` for `spec`'s job: over its GPUs, on the device row of
    `compute_capability` (with the attention kernel's and the stack's module loading), with
    the job's uncertainty."""
    return levels(
        allocated=allocated,
        reserved=reserved,
        paged_state=paged_state,
        gpus=spec.parallel.gpus,
        row=device_row(
            compute_capability,
            fused_attention=fused_attention,
            eager_loading=spec.stack.eager_module_loading,
        ),
        uncertainty=_uncertainty(arch, spec),
        reserved_note=reserved_note,
    )
