"""What the estimate, batch and fit-check routes do: resolve, estimate, calibrate, map.

Core and catalog errors leave here as `ProblemError`s located in the request (`loc_prefix`),
so a batch can turn each into its own entry and the routes stay thin.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, TypeVar, cast

from service.api.batch_body import SharedJobs, SharedSpec
from service.api.metrics import CUSTOM_MODEL, Metrics
from service.api.problems import (
    Loc,
    ProblemError,
    field_error,
    from_exception,
    invalid_field,
    invalid_request,
)
from service.api.schemas import (
    EstimateOut,
    FitCheckIn,
    FitCheckOut,
    GpuOut,
    GpuRef,
    JobSpec,
    ModelRef,
    PlacementIn,
    PlacementOut,
    PlacementRefOut,
    PlacementsOut,
    RejectedJob,
    estimate_values,
    gpu_fit_values,
    suggestion_values,
)
from service.calibration.provider import CalibratedPeaks, FactorProvider
from service.catalog.gpus import Gpu, GpuCatalog, UnknownGpuError
from service.catalog.models import CatalogEntry, ModelCatalog
from service.core.arch import ModelArch
from service.core.arch.hf_config import from_hf_config
from service.core.cold import ColdWorkOverBudget
from service.core.errors import EstimatorError, InvalidSpecError, UnknownModelError
from service.core.estimator import (
    default_target_modules,
    estimate,
    peak_levels,
    shape_estimates,
    shape_levels,
)
from service.core.fit import GpuOffer, Requirement, Suggestion, check_fit, usable_bytes
from service.core.limits import MAX_BATCH_SIZE, MAX_SEQ_LEN
from service.core.placement import Placement, place
from service.core.result import Estimate, Levels
from service.core.spec import TrainingSpec
from service.core.units import MIB, DType

# Limits on a config.json given inline: the estimator walks layers and experts one by one, so
# an absurd config must be refused before it runs (the largest published models stay far
# below: Llama-3.1-405B has 126 layers, DeepSeek-V3 61 layers x 256 experts).
MAX_CONFIG_LAYERS = 1024
MAX_CONFIG_EXPERTS = 1024
MAX_CONFIG_LAYER_EXPERTS = 65_536  # layers x experts
MAX_CONFIG_WIDTH = 1 << 20  # hidden_size, intermediate_size, heads x head_dim
MAX_CONFIG_VOCAB = 1 << 24


T = TypeVar("T")
E = TypeVar("E", bound=Exception)


@dataclass(frozen=True, slots=True)
class _Job:
    spec: TrainingSpec
    model: str  # the catalog id, or CUSTOM_MODEL
    arch: ModelArch


@dataclass(frozen=True, slots=True, kw_only=True)
class _Shapes:
    """A batch's job as its copies at other shapes share it: resolved once, its spec's
    estimate at any shape (`shape_estimates`), and what its GPU says of its spec."""

    model: str  # the catalog id, or CUSTOM_MODEL
    method: str
    gpu: GpuOut | None
    warnings: tuple[str, ...]  # the GPU's (`_gpu_warnings`), which read no shape
    at: Callable[[int, int], Estimate]


@contextmanager
def _located(loc_prefix: Loc) -> Iterator[None]:
    """Turn core and catalog errors into problems located under `loc_prefix`."""
    try:
        yield
    except (EstimatorError, UnknownGpuError) as exc:
        raise ProblemError(from_exception(exc, loc_prefix)) from exc


@dataclass(frozen=True, slots=True, kw_only=True)
class Estimation:
    """The services one request's estimates use."""

    models: ModelCatalog
    gpus: GpuCatalog
    factors: FactorProvider
    metrics: Metrics
    # Lookups by name within one request (a batch repeats its models and GPUs; an unknown
    # name costs a search for the closest ones), outcomes and errors alike.
    _entries: dict[str, CatalogEntry | UnknownModelError] = field(default_factory=dict)
    _named_gpus: dict[str, Gpu | UnknownGpuError] = field(default_factory=dict)

    def values(
        self, job: JobSpec, loc_prefix: Loc = ("body",), shared: SharedSpec | None = None
    ) -> dict[str, Any]:
        """The job's estimate as the plain values of an `EstimateOut` (`estimate_values`),
        ready to encode; `shared` makes the job's spec when it copies another job at its own
        shape (`batch_body.SharedSpec`)."""
        if shared is not None:
            # A copy of a job read before: what the job resolves, resolved once for all of
            # them, then its estimate at the copy's shape; where resolving fails, each copy is
            # answered in full below.
            shapes = shared.resolved
            if shapes is None:
                shapes = shared.resolved = self._shapes(job, loc_prefix)
            if isinstance(shapes, _Shapes):
                return self._values_at(shapes, job.batch_size, job.seq_len, loc_prefix)
        # The core and catalog errors are caught here rather than by `_located`: a batch
        # asks once per job.
        try:
            spec = job.to_spec() if shared is None else shared.of(job)
            model, arch = self._model(job.model, loc_prefix)
            gpu = None if job.gpu is None else self._gpu(job.gpu)
            est = estimate(
                arch, spec, compute_capability=None if gpu is None else gpu.compute_capability
            )
        except (EstimatorError, UnknownGpuError) as exc:
            raise ProblemError(from_exception(exc, loc_prefix)) from exc
        peaks = self.factors.peaks(
            est, model=model, method=spec.method.value, gpu=None if gpu is None else gpu.name
        )
        summary: dict[str, Any] | None = None
        warnings: tuple[str, ...] = ()
        if gpu is not None:
            summary = _fit_summary(gpu, peaks)
            warnings = _gpu_warnings(gpu, spec)
        self.metrics.count_estimate(model)
        return estimate_values(model, est, peaks, summary, warnings)

    def _shapes(self, job: JobSpec, loc_prefix: Loc) -> _Shapes | None:
        """What a batch's job and its copies at other shapes share (`_Shapes`); None where
        the job's spec, model or GPU fails, each copy then answered on its own (`values`)."""
        try:
            spec = job.to_spec()
            model, arch = self._model(job.model, loc_prefix)
            gpu = None if job.gpu is None else self._gpu(job.gpu)
        except (EstimatorError, UnknownGpuError, ProblemError):
            return None
        capability = None if gpu is None else gpu.compute_capability
        return _Shapes(
            model=model,
            method=spec.method.value,
            gpu=gpu,
            warnings=() if gpu is None else _gpu_warnings(gpu, spec),
            at=shape_estimates(arch, spec, compute_capability=capability),
        )

    def _values_at(
        self, shapes: _Shapes, batch_size: int, seq_len: int, loc_prefix: Loc
    ) -> dict[str, Any]:
        """`values` of a copy of `shapes`' job at this shape."""
        try:
            est = shapes.at(batch_size, seq_len)
        except EstimatorError as exc:
            raise ProblemError(from_exception(exc, loc_prefix)) from exc
        gpu = shapes.gpu
        peaks = self.factors.peaks(
            est, model=shapes.model, method=shapes.method, gpu=None if gpu is None else gpu.name
        )
        summary = None if gpu is None else _fit_summary(gpu, peaks)
        self.metrics.count_estimate(shapes.model)
        return estimate_values(shapes.model, est, peaks, summary, shapes.warnings)

    def shared_results(self, jobs: SharedJobs) -> Iterator[dict[str, Any]]:
        """`batch`'s results, one at a time, of jobs read once per distinct job
        (`batch_body.SharedJobs`): a job's copies at other shapes share what it resolves
        (`_Shapes`), each estimated at its own shape; where the job's spec, model or GPU fails,
        each copy is answered on its own, as `batch` answers it. The route encodes each result
        as it comes (`routes.estimates.encode_batch`)."""
        shaped: dict[int, _Shapes | None] = {}
        specs: dict[int, SharedSpec] = {}
        for index, (first, (batch_size, seq_len)) in enumerate(
            zip(jobs.firsts, jobs.shapes, strict=True)
        ):
            loc: Loc = ("body", "jobs", index)
            if first not in shaped:
                shaped[first] = self._shapes(jobs.job(first), loc)
            shapes = shaped[first]
            try:
                if shapes is not None:
                    values = self._values_at(shapes, batch_size, seq_len, loc)
                else:
                    spec = specs.get(first)
                    if spec is None:
                        spec = specs[first] = SharedSpec()
                    values = self.values(jobs.job(index), loc, spec)
            except (ProblemError, ColdWorkOverBudget) as exc:  # (its time ran out: 503)
                problem = from_exception(exc, loc)
                status = problem.status
                yield {"index": index, "status": status, "estimate": None, "problem": problem}
            else:
                yield {"index": index, "status": 200, "estimate": values, "problem": None}

    def estimate(self, job: JobSpec, loc_prefix: Loc = ("body",)) -> EstimateOut:
        return EstimateOut.model_validate(self.values(job, loc_prefix))

    def batch(
        self, jobs: Sequence[JobSpec | RejectedJob], firsts: Sequence[int] | None = None
    ) -> dict[str, Any]:
        """A `BatchOut`'s plain values: each job's estimate, or the problem that stopped it.

        The batch's jobs share this request's model and GPU lookups, and the core's plans and
        the calibration's descriptions; the routes encode the whole answer in one pass. With
        `firsts` (`batch_body.SharedJobs`), a job that copies an earlier one at another shape
        shares that one's spec, at its own shape (`batch_body.SharedSpec`)."""
        results: list[dict[str, Any]] = []
        failed = 0
        shared: dict[int, SharedSpec] = {}
        for index, job in enumerate(jobs):
            loc: Loc = ("body", "jobs", index)
            try:
                if isinstance(job, RejectedJob):
                    raise _rejected(job, loc)
                spec = None
                if firsts is not None:
                    first = firsts[index]
                    spec = shared.get(first)
                    if spec is None:
                        spec = shared[first] = SharedSpec()
                values = self.values(job, loc, spec)
            except (ProblemError, ColdWorkOverBudget) as exc:  # (its time ran out: 503)
                problem = from_exception(exc, loc)
                failed += 1
                results.append(
                    {"index": index, "status": problem.status, "estimate": None, "problem": problem}
                )
            else:
                results.append({"index": index, "status": 200, "estimate": values, "problem": None})
        return {"results": results, "succeeded": len(results) - failed, "failed": failed}

    def fit_check(self, body: FitCheckIn) -> FitCheckOut:
        return FitCheckOut.model_validate(self.fit_check_values(body))

    def fit_check_values(self, body: FitCheckIn) -> dict[str, Any]:
        """The fit-check's answer as the plain values of a `FitCheckOut`, in its fields'
        order, ready to encode (as `values` is an estimate's)."""
        job_loc: Loc = ("body", "job")
        with _located(job_loc):
            resolved = self._job(body.job, job_loc)
            job_estimate = estimate(resolved.arch, resolved.spec)
        gpus: list[GpuOut] = []
        offers: list[GpuOffer] = []
        try:
            for entry in body.gpus:
                gpu = self._gpu(entry)
                gpus.append(gpu)
                offers.append(_offer(gpu.memory_bytes, entry.count, entry.price_per_hour))
        except (EstimatorError, UnknownGpuError) as exc:  # located at the GPU it stopped at
            raise ProblemError(from_exception(exc, ("body", "gpus", len(offers)))) from exc

        peaks = self._peaks(job_estimate, resolved, None)
        job_requirement = _requirement(peaks)

        def requirement(spec: TrainingSpec) -> Requirement:
            if spec is resolved.spec:
                return job_requirement  # the job as given: its levels are the estimate's
            levels = peak_levels(resolved.arch, spec)
            return _requirement(
                self.factors.peaks(levels, model=resolved.model, method=spec.method.value, gpu=None)
            )

        def shaped(spec: TrainingSpec) -> Callable[[int, int], Requirement]:
            levels_at = shape_levels(resolved.arch, spec)
            calibrated = self.factors.calibrated(
                model=resolved.model, method=spec.method.value, gpu=None
            )

            def at(batch_size: int, seq_len: int) -> Requirement:
                _, _, device, upper = calibrated(levels_at(batch_size, seq_len))
                return Requirement(device, upper)

            return at

        with _located(job_loc):
            report = check_fit(
                resolved.spec,
                offers,
                requirement,
                max_batch_size=MAX_BATCH_SIZE,
                max_seq_len=_seq_limit(resolved),
                narrower_target_modules=_narrower_targets(resolved.arch),
                shaped=shaped,
            )
        self.metrics.count_estimate(resolved.model)
        cheapest = None
        if report.cheapest is not None:
            best = report.gpus[report.cheapest]
            cheapest = {
                "index": report.cheapest,
                "name": gpus[report.cheapest].requested,
                "cost_per_hour": best.cost_per_hour or 0.0,
            }
        described: dict[Suggestion, dict[str, Any]] = {}

        def describe(suggestion: Suggestion) -> dict[str, Any]:
            found = described.get(suggestion)
            if found is None:
                found = described[suggestion] = suggestion_values(resolved.spec, suggestion)
            return found

        placement = None
        if body.placement is not None:
            placement = self._placements(body.placement, resolved, gpus, offers, requirement)
        return {
            "job": estimate_values(resolved.model, job_estimate, peaks),
            "results": [
                gpu_fit_values(_gpu_values(gpu), fit, describe)
                for gpu, fit in zip(gpus, report.gpus, strict=True)
            ],
            "cheapest": cheapest,
            # (a model among the values: its serialiser writes it, and validation takes it)
            "placement": placement,
        }

    def _placements(
        self,
        asked: PlacementIn,
        job: _Job,
        gpus: Sequence[GpuOut],
        offers: Sequence[GpuOffer],
        requirement: Callable[[TrainingSpec], Requirement],
    ) -> PlacementsOut:
        """The fewest GPUs per GPU type and strategy, each with the estimate of one GPU."""
        with _located(("body", "placement")):
            found = place(
                job.spec,
                offers,
                requirement,
                strategies=asked.strategies,
                max_gpus=asked.max_gpus,
                gpus_per_node=asked.gpus_per_node,
            )
        per_gpu: dict[TrainingSpec, EstimateOut] = {}  # GPU types share a strategy's counts

        def estimated(spec: TrainingSpec) -> EstimateOut:
            if spec not in per_gpu:
                with _located(("body", "job")):
                    est = estimate(job.arch, spec)
                peaks = self.factors.peaks(est, model=job.model, method=spec.method.value, gpu=None)
                per_gpu[spec] = EstimateOut.from_core(job.model, est, peaks)
            return per_gpu[spec]

        def out(p: Placement) -> PlacementOut:
            need = p.requirement
            previous = p.previous_requirement
            return PlacementOut(
                gpu_index=p.offer_index,
                gpu=gpus[p.offer_index].requested,
                strategy=p.strategy,
                outcome=p.outcome,
                count=p.count,
                nodes=p.nodes,
                cost_per_hour=p.cost_per_hour,
                usable_bytes=p.usable_bytes,
                required_bytes=None if need is None else need.device_bytes_upper,
                headroom_bytes=None if need is None else p.usable_bytes - need.device_bytes_upper,
                previous_count=p.previous_count,
                previous_required_bytes=None if previous is None else previous.device_bytes_upper,
                reason=p.reason,
                per_gpu=None if p.spec is None else estimated(p.spec),
            )

        def ref(index: int | None) -> PlacementRefOut | None:
            if index is None:
                return None
            p = found.placements[index]
            return PlacementRefOut(
                index=index,
                gpu=gpus[p.offer_index].requested,
                strategy=p.strategy,
                count=p.count or 1,
                cost_per_hour=p.cost_per_hour,
            )

        return PlacementsOut(
            strategies=list(found.strategies),
            max_gpus=asked.max_gpus,
            gpus_per_node=found.gpus_per_node,
            counts=list(found.counts),
            placements=[out(p) for p in found.placements],
            cheapest=ref(found.cheapest),
            fewest=ref(found.fewest),
            evaluations=found.evaluations,
        )

    def _job(self, job: JobSpec, loc_prefix: Loc) -> _Job:
        spec = job.to_spec()
        model, arch = self._model(job.model, loc_prefix)
        return _Job(spec, model, arch)

    def _model(self, ref: ModelRef, loc_prefix: Loc) -> tuple[str, ModelArch]:
        return resolve_model(ref, loc_prefix, self._entry)

    def _entry(self, model_id: str) -> CatalogEntry:
        return _remembered(self._entries, model_id, self.models.resolve, UnknownModelError)

    def _gpu(self, ref: GpuRef) -> GpuOut:
        if ref.name is not None:
            gpu = _remembered(self._named_gpus, ref.name, self.gpus.resolve, UnknownGpuError)
            return _gpu_out(ref.name, gpu, "name")
        memory_mib = ref.memory_mib or 0
        found = self.gpus.by_memory_mib(memory_mib)
        if found is not None:
            return _gpu_out(str(memory_mib), found, "memory_mib")
        return GpuOut(
            requested=str(memory_mib),
            name=None,
            driver_name=None,
            memory_mib=memory_mib,
            memory_bytes=memory_mib * MIB,
            matched_by="memory_mib",
            bf16=None,
            fp8=None,
        )

    def _peaks(self, est: Levels, job: _Job, gpu: str | None) -> CalibratedPeaks:
        return self.factors.peaks(est, model=job.model, method=job.spec.method.value, gpu=gpu)


def resolve_model(
    ref: ModelRef, loc_prefix: Loc, resolve: Callable[[str], CatalogEntry]
) -> tuple[str, ModelArch]:
    """The model a job names: its catalog id (`resolve` finds it) and architecture, or
    CUSTOM_MODEL and the architecture of the config.json it gives.

    Raises UnknownModelError and InvalidSpecError, and a 422 problem at `loc_prefix` for a
    config.json beyond this service's limits."""
    if ref.id is not None:
        entry = resolve(ref.id)
        return entry.id, entry.arch
    arch = from_hf_config(ref.hf_config or {})
    check_config_limits(arch, (*loc_prefix, "model", "hf_config"))
    return CUSTOM_MODEL, arch


def _remembered(memo: dict[str, T | E], key: str, lookup: Callable[[str], T], error: type[E]) -> T:
    """`lookup(key)`, or its error, computed once per request."""
    if key not in memo:
        try:
            memo[key] = lookup(key)
        except error as exc:
            memo[key] = exc
    found = memo[key]
    if isinstance(found, error):
        raise found
    return cast(T, found)  # not an error: the lookup's result


@lru_cache(maxsize=1024)
def _gpu_out(requested: str, gpu: Gpu, matched_by: str) -> GpuOut:
    """A catalog GPU as asked for; remembered (the model is frozen), as most requests name one
    of a few GPUs in one of a few spellings."""
    return GpuOut(
        requested=requested,
        name=gpu.name,
        driver_name=gpu.driver_name,
        memory_mib=gpu.memory_mib,
        memory_bytes=gpu.memory_bytes,
        matched_by="name" if matched_by == "name" else "memory_mib",
        bf16=gpu.bf16,
        fp8=gpu.fp8,
        compute_capability=gpu.compute_capability,
    )


@lru_cache(maxsize=1024)
def _gpu_values(gpu: GpuOut) -> dict[str, Any]:
    """A `GpuOut`'s values, remembered with it (answers only encode them)."""
    return gpu.model_dump(mode="json")


def _requirement(peaks: CalibratedPeaks) -> Requirement:
    return Requirement(device_bytes=peaks.device_bytes, device_bytes_upper=peaks.device_bytes_upper)


@lru_cache(maxsize=1024)
def _offer(memory_bytes: int, count: int | None, price_per_hour: float | None) -> GpuOffer:
    """A GPU as the core takes it; remembered (frozen), as most requests offer a few GPUs."""
    return GpuOffer(memory_bytes=memory_bytes, count=count, price_per_hour=price_per_hour)


def _fit_summary(gpu: GpuOut, peaks: CalibratedPeaks) -> dict[str, Any]:
    """A `GpuFitSummary`'s values."""
    usable = usable_bytes(gpu.memory_bytes)
    return {
        "name": gpu.name,
        "memory_bytes": gpu.memory_bytes,
        "usable_bytes": usable,
        "fits": peaks.device_bytes_upper <= usable,
        "headroom_bytes": usable - peaks.device_bytes_upper,
    }


def _gpu_warnings(gpu: GpuOut, spec: TrainingSpec) -> tuple[str, ...]:
    if gpu.bf16 is False and (spec.dtype is DType.BF16 or spec.autocast):
        return (f"{gpu.name} does not compute in bf16; use fp16 or fp32 on it",)
    return ()


def _rejected(job: RejectedJob, loc: Loc) -> ProblemError:
    errors = [field_error((*loc, *e.loc), e.detail, e.type) for e in job.errors]
    return ProblemError(invalid_request(errors))


def _seq_limit(job: _Job) -> int:
    context = job.arch.max_position_embeddings or MAX_SEQ_LEN
    return min(MAX_SEQ_LEN, max(job.spec.seq_len, context))


def _narrower_targets(arch: ModelArch) -> tuple[str, ...] | None:
    try:
        return default_target_modules(arch)
    except InvalidSpecError:
        return None


def check_config_limits(arch: ModelArch, loc: Loc) -> None:
    """A 422 problem at `loc` for a config.json beyond what this service estimates."""
    checks = (
        ("num_hidden_layers", arch.num_hidden_layers, MAX_CONFIG_LAYERS),
        ("num_experts", arch.num_experts, MAX_CONFIG_EXPERTS),
        ("hidden_size", arch.hidden_size, MAX_CONFIG_WIDTH),
        ("intermediate_size", arch.intermediate_size, MAX_CONFIG_WIDTH),
        ("num_attention_heads", arch.q_dim, MAX_CONFIG_WIDTH),
        ("vocab_size", arch.vocab_size, MAX_CONFIG_VOCAB),
        (
            "num_experts",
            arch.num_hidden_layers * max(1, arch.num_experts),
            MAX_CONFIG_LAYER_EXPERTS,
        ),
    )
    for name, value, limit in checks:
        if value > limit:
            raise ProblemError(
                invalid_field((*loc, name), f"{value} is over this service's limit of {limit}")
            )
