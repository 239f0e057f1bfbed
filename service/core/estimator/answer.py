"""An `Estimate` from a step's phase peaks and the levels above the allocated one."""

from __future__ import annotations

from service.core.overhead import AboveAllocated
from service.core.result import Estimate, ParamCounts, PhasePeak


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
