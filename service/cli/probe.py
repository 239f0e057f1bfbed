"""`vramcast probe`: run a job's two training steps on the local GPU and set the peaks it
measured against the estimate; `--upload` sends them as a calibration sample, built as a
training node's reporter builds its upload.

It exits
    0  measured (and, with --upload, stored by the service);
    1  the run failed (out of memory included), or the upload was not stored;
    2  bad options, a job the probe cannot run, a missing extra, or no CUDA GPU.

Nothing heavy is imported until the command runs, so registering it costs `vramcast estimate`
nothing. The GPU is reached only through `open_readings`, the seam tests replace.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from service.cli.options import (
    CliError,
    add_spec_options,
    job_fields,
    load_model,
    option_error,
    spec_from_args,
)
from service.cli.problems import problem_text
from service.core.codec import spec_to_dict
from service.core.errors import InvalidSpecError
from service.core.units import GIB

if TYPE_CHECKING:
    from service.core.arch import ModelArch
    from service.core.result import Estimate
    from service.core.spec import TrainingSpec
    from service.trace.probe import DeviceReadings, ProbeRun, Runner
    from vramcast_client.measure import GpuPeaks
    from vramcast_client.models import CalibrationReceipt, CalibrationUpload
    from vramcast_client.reporter import Reporter

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
MIB = 1024**2
# The packages the run needs beyond torch, all from the [trace] extra; imported after the GPU
# is found (bitsandbytes talks on stderr when it finds no GPU).
_TRACE_PACKAGES = ("transformers", "peft", "bitsandbytes")
_INSTALL = "pip install 'vramcast[trace,node]'"


def register(sub: Any) -> None:
    """Add `probe` to the `vramcast` subcommands."""
    parser = sub.add_parser(
        "probe",
        help="measure a job's peaks on the local GPU (random weights) against the estimate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_spec_options(parser)
    add_probe_arguments(parser)
    parser.set_defaults(handler=_command)


def add_probe_arguments(parser: argparse.ArgumentParser) -> None:
    """The options only `probe` has."""
    group = parser.add_argument_group("probe")
    group.add_argument(
        "--runner",
        choices=["loop", "trainer"],
        help="the plain training loop, or HF Trainer (default: trainer with --autocast, else loop)",
    )
    group.add_argument("--device", default="cuda", help="the CUDA device (default: cuda)")
    group.add_argument("--json", action="store_true", help="print the measurement as JSON")
    group.add_argument(
        "--upload",
        action="store_true",
        help="send the peaks as a calibration sample ($VRAMCAST_API_KEY, an upload-scope key)",
    )
    group.add_argument("--url", help="the service, with --upload (default: $VRAMCAST_URL)")


def open_readings(device: str) -> DeviceReadings | None:
    """The local CUDA GPU's readings; None when torch sees no GPU. Tests replace this."""
    from service.trace.probe import open_cuda_readings

    return open_cuda_readings(device)


# -- the command ----------------------------------------------------------------------------


def _command(args: argparse.Namespace) -> int:
    from service.trace.probe import NotProbeableError, Runner, check_probeable, default_runner

    spec = spec_from_args(args)
    model_id, config, arch = load_model(args)
    runner = Runner(args.runner) if args.runner else default_runner(spec)
    try:
        check_probeable(spec, runner)
    except NotProbeableError as exc:
        raise CliError(str(exc)) from None
    est = _estimate(arch, spec)
    _require("torch")
    try:
        readings = open_readings(args.device)
    except ImportError as exc:
        raise CliError(
            f"reading the device level needs the [node] extra ({exc.name} is not installed): "
            f"{_INSTALL}"
        ) from None
    if readings is None:
        raise CliError(
            "no CUDA GPU is visible (torch.cuda.is_available() is False); "
            "the probe measures on a GPU"
        )
    for package in _TRACE_PACKAGES:
        _require(package)
    probe = Probe(
        model_id=model_id,
        catalog_id=model_id if args.config is None else None,
        config=config,
        spec=spec,
        runner=runner,
    )
    return probe.run(readings, est, args)


def _estimate(arch: ModelArch, spec: TrainingSpec) -> Estimate:
    from service.core.estimator import estimate

    try:
        return estimate(arch, spec)
    except InvalidSpecError as exc:
        raise option_error(exc) from None


def _require(package: str) -> None:
    """Import `package`, a dependency of the [trace] extra, or say how to install it."""
    try:
        importlib.import_module(package)
    except ImportError:
        raise CliError(
            f"the probe needs the [trace] extra ({package} is not installed): {_INSTALL}"
        ) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class Probe:
    """One job to measure: what it is, and how its run is reported."""

    model_id: str
    catalog_id: str | None  # the catalog id the upload names, None for a --config model
    config: Mapping[str, Any]
    spec: TrainingSpec
    runner: Runner

    def run(self, readings: DeviceReadings, est: Estimate, args: argparse.Namespace) -> int:
        """Measure, print, and upload if asked; the exit status."""
        from service.trace.probe import ProbeCase, new_record, run_case

        case = ProbeCase(
            name=self.model_id, model_id=self.model_id, spec=self.spec, runner=self.runner.value
        )
        record = new_record(case, base_used=readings.used())
        try:
            run = run_case(case, self.config, record, readings)
        except Exception as error:  # the run's failure is the result: reported, not raised
            from vramcast_client.measure import is_out_of_memory

            record["error"] = f"{type(error).__name__}: {error}"[:600]
            return self._failed(record, est, args, out_of_memory=is_out_of_memory(error))
        comparison = compare(est, record)
        document = self._document(est, comparison, record)
        code = EXIT_OK
        if args.upload:
            upload, code = self._upload(run, args)
            document["upload"] = upload
        if args.json:
            print(json.dumps(document, indent=1))
        else:
            print(format_probe(self.model_id, self.runner.value, comparison, record))
            if args.upload and "id" in document["upload"]:
                print(format_upload(document["upload"]))
        return code

    def _failed(
        self,
        record: dict[str, Any],
        est: Estimate,
        args: argparse.Namespace,
        *,
        out_of_memory: bool,
    ) -> int:
        if args.json:
            print(json.dumps({**self._head(est), "run": record}, indent=1))
        what = "ran out of GPU memory" if out_of_memory else "failed"
        upload = "; nothing uploaded" if args.upload else ""
        print(f"vramcast probe: the run {what}: {record['error']}{upload}", file=sys.stderr)
        return EXIT_FAILED

    def _head(self, est: Estimate) -> dict[str, Any]:
        return {
            "model": self.model_id,
            "runner": self.runner.value,
            "estimate": {
                "allocated_bytes": est.allocated_bytes,
                "reserved_bytes": est.reserved_bytes,
                "device_bytes": est.device_bytes,
                "device_bytes_upper": est.device_bytes_upper,
            },
        }

    def _document(
        self, est: Estimate, comparison: Comparison, record: Mapping[str, Any]
    ) -> dict[str, Any]:
        versions = record.get("versions", {})
        return {
            **self._head(est),
            "measured": {
                "allocated_bytes": record["max_allocated"],
                "reserved_bytes": record["max_reserved"],
                "device_bytes": record["end_used"],
                "device_peak_bytes": comparison.device_peak_bytes,
                "context_bytes": record["context_used"],
            },
            "error": {level.name: level.error for level in comparison.levels},
            "safe_bound_held": comparison.bound_held,
            "gpu": {
                "name": versions.get("gpu"),
                "memory_total_bytes": versions.get("gpu_total"),
                "driver": versions.get("driver"),
                "cuda": versions.get("cuda"),
            },
            "run": dict(record),
        }

    # Uploading ----------------------------------------------------------------------------

    def _upload(self, run: ProbeRun, args: argparse.Namespace) -> tuple[dict[str, Any], int]:
        """Send the run as a training node's reporter would; (what became of it, exit status).
        Refused, before anything is sent, when the job the node's derivation reads from the
        model is not estimated as the job that ran: it would calibrate the wrong estimate."""
        from vramcast_client.derive import UndescribableJobError
        from vramcast_client.errors import ProblemError, VramcastError
        from vramcast_client.reporter import Reporter

        reporter = Reporter(args.url, model_id=self.catalog_id, seq_len=self.spec.seq_len)
        try:
            try:
                upload = node_upload(reporter, run)
            except UndescribableJobError as exc:
                return self._not_uploaded(f"the job cannot be described: {exc.reason}")
            mismatch = self.derivation_mismatch(upload)
            if mismatch is not None:
                return self._not_uploaded(mismatch)
            try:
                receipt = reporter.client.upload_calibration(
                    upload, idempotency_key=reporter.idempotency_key
                )
            except ProblemError as exc:
                reason = problem_text(exc.problem)
                return self._not_uploaded(f"the service did not store it: {reason}")
            except VramcastError as exc:
                return self._not_uploaded(f"the service did not store it: {exc}")
        finally:
            reporter.close()
        return upload_summary(reporter, upload, receipt), EXIT_OK

    def _not_uploaded(self, reason: str) -> tuple[dict[str, Any], int]:
        print(f"vramcast probe: not uploaded: {reason}", file=sys.stderr)
        return {"error": reason}, EXIT_FAILED

    def derivation_mismatch(self, upload: CalibrationUpload) -> str | None:
        """None when the service estimates the uploaded job as the job that ran; else why not."""
        from service.api.schemas import JobSpec
        from service.api.uploads import job_estimator
        from service.catalog.models import default_catalog
        from service.core.errors import EstimatorError

        job = upload.job.to_json()
        estimate_job = job_estimator(default_catalog())  # as the service estimates an upload
        try:
            derived = estimate_job(job)
            ran = estimate_job({**job, **job_fields(self.spec)})
        except EstimatorError as exc:
            return f"the job a training node reports for this run is not estimable: {exc}"
        levels = ("allocated_bytes", "reserved_bytes", "device_bytes", "device_bytes_upper")
        if all(getattr(derived, n) == getattr(ran, n) for n in levels):
            return None
        differing = _differences(
            _described(JobSpec.model_validate(job).to_spec()), _described(self.spec)
        )
        return (
            "the job a training node reports for this run is estimated differently "
            f"(allocated {derived.allocated_bytes:,} B, not {ran.allocated_bytes:,} B): "
            + "; ".join(differing)
        )


def node_upload(reporter: Reporter, run: ProbeRun) -> CalibrationUpload:
    """The upload a training node's reporter makes of `run`: the job read from the trained
    model and its TrainingArguments (`Reporter.hf_job`), the peaks as `GpuPeaks`."""
    job = reporter.hf_job(run.model, run.arguments)()
    return reporter.upload_for(job, measured_peaks(run.record), "completed")


def measured_peaks(record: Mapping[str, Any]) -> GpuPeaks:
    """The record's peaks as a node's probe reads them; device: NVML used at the end of step 2
    (the reserved peak still held), less what the GPU held before this process."""
    from vramcast_client.measure import GpuPeaks

    versions = record["versions"]
    return GpuPeaks(
        gpu_name=str(versions["gpu"]),
        memory_total_bytes=int(versions["gpu_total"]),
        allocated_bytes=int(record["max_allocated"]) or None,
        reserved_bytes=int(record["max_reserved"]) or None,
        device_bytes=int(record["end_used"]) or None,
        driver=versions.get("driver"),
    )


def upload_summary(
    reporter: Reporter, upload: CalibrationUpload, receipt: CalibrationReceipt
) -> dict[str, Any]:
    """What was stored, under which node, run and job, and the service's ratios."""
    return {
        "id": receipt.id,
        "replayed": receipt.replayed,
        "node_id": reporter.node_id,
        "run_id": reporter.run_id,
        "idempotency_key": reporter.idempotency_key,
        "job": upload.job.to_json(),
        "ratios": [
            {"level": r.level, "measured_over_estimated": r.ratio, "outlier": r.outlier}
            for r in receipt.ratios
        ],
        "estimate_error": receipt.estimate_error,
    }


def _described(spec: TrainingSpec) -> dict[str, Any]:
    """The spec's fields by dotted name, with the defaults `resolve` fills in."""
    from dataclasses import replace

    from service.core.spec import resolve

    resolved = resolve(spec)
    lora = resolved.lora
    if lora is not None:
        targets = lora.target_modules
        lora = replace(
            lora,
            adapter_dtype=resolved.adapter_dtype,
            lora_dropout=resolved.lora_dropout,
            target_modules=tuple(sorted(targets)) if isinstance(targets, tuple) else targets,
        )
    quantization = resolved.quantization
    if quantization is not None:
        quantization = replace(quantization, compute_dtype=resolved.compute_dtype)
    filled = replace(spec, lora=lora, quantization=quantization, loss=resolved.loss)
    return dict(_flatten(spec_to_dict(filled)))


def _flatten(value: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, item in value.items():
        if isinstance(item, Mapping):
            yield from _flatten(item, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", item


def _differences(reported: Mapping[str, Any], probed: Mapping[str, Any]) -> list[str]:
    keys = sorted(set(reported) | set(probed))
    return [
        f"{key}: {reported.get(key)!r} reported, {probed.get(key)!r} probed"
        for key in keys
        if reported.get(key) != probed.get(key)
    ]


# -- comparing and printing -----------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class LevelError:
    """One level: the estimate, the measurement, and estimate / measured - 1."""

    name: str
    estimated_bytes: int
    measured_bytes: int

    @property
    def error(self) -> float:
        return self.estimated_bytes / self.measured_bytes - 1 if self.measured_bytes else 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Comparison:
    """The estimate against a run's record at the three levels, and the safe bound."""

    levels: tuple[LevelError, ...]
    device_bytes_upper: int
    device_peak_bytes: int  # the highest device reading: end of step 2, or polled

    @property
    def bound_held(self) -> bool:
        return self.device_peak_bytes <= self.device_bytes_upper


def compare(est: Estimate, record: Mapping[str, Any]) -> Comparison:
    """`est` against the peaks `record` holds (allocated, reserved, device = `end_used`)."""
    measured = (record["max_allocated"], record["max_reserved"], record["end_used"])
    estimated = (est.allocated_bytes, est.reserved_bytes, est.device_bytes)
    return Comparison(
        levels=tuple(
            LevelError(name=name, estimated_bytes=e, measured_bytes=int(m))
            for name, e, m in zip(
                ("allocated", "reserved", "device"), estimated, measured, strict=True
            )
        ),
        device_bytes_upper=est.device_bytes_upper,
        device_peak_bytes=max(int(record["end_used"]), int(record.get("device_peak", 0))),
    )


def format_probe(
    model_id: str, runner: str, comparison: Comparison, record: Mapping[str, Any]
) -> str:
    """The three levels, estimate against measurement, and the safe bound's verdict."""
    versions = record.get("versions", {})
    values = [lv.estimated_bytes for lv in comparison.levels] + [comparison.device_bytes_upper]
    unit, size = ("GiB", GIB) if max(values) >= GIB else ("MiB", MIB)
    gpu = versions.get("gpu") or "the GPU"
    total = versions.get("gpu_total")
    software = ", ".join(
        f"{name} {versions[key]}"
        for name, key in (("driver", "driver"), ("CUDA", "cuda"), ("torch", "torch"))
        if versions.get(key)
    )
    lines = [
        f"{model_id}: 2 training steps ({runner}) on {gpu}"
        + (f", {total / GIB:.1f} GiB" if total else "")
        + (f" ({software})" if software else ""),
        "",
        f"  {'level':<22}{'estimate':>10}{'measured':>10}{'error':>10}",
    ]
    for level in comparison.levels:
        lines.append(
            f"  {level.name:<22}{level.estimated_bytes / size:>10.2f}"
            f"{level.measured_bytes / size:>10.2f}{level.error:>+10.1%}"
        )
    verdict = "held" if comparison.bound_held else "EXCEEDED"
    lines.append(
        f"  {'device, safe bound':<22}{comparison.device_bytes_upper / size:>10.2f}"
        f"{comparison.device_peak_bytes / size:>10.2f}{verdict:>10}"
    )
    steps = "; ".join(
        f"step {s['step']}: allocated {s['max_allocated'] / size:.2f}, "
        f"reserved {s['max_reserved'] / size:.2f}"
        for s in record["steps"]
    )
    lines += [
        "",
        f"  {unit}; error = estimate / measured - 1 (+: the estimate is higher)",
        "  allocated, reserved: torch.cuda.max_memory_allocated() / max_memory_reserved()",
        "  device: NVML used at the end of step 2 less before this process "
        f"(its CUDA context {record['context_used'] / size:.2f})",
        f"  safe bound: device_bytes_upper against the highest device reading; {verdict}",
        f"  {steps}",
    ]
    return "\n".join(lines)


def format_upload(upload: Mapping[str, Any]) -> str:
    ratios = ", ".join(f"{r['level']} {r['measured_over_estimated']:.3f}" for r in upload["ratios"])
    line = (
        f"uploaded: calibration upload {upload['id']}"
        f"{' (already stored)' if upload['replayed'] else ''}, "
        f"node {upload['node_id']}, run {upload['run_id']}"
    )
    if ratios:
        line += f"; measured / the service's estimate: {ratios}"
    if upload.get("estimate_error"):
        line += f"; the service could not estimate it: {upload['estimate_error']}"
    return line
