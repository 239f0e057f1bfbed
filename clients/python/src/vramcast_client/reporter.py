"""The training-node reporter: measure this rank's peaks and upload them, never breaking training.

    reporter = Reporter()                          # $VRAMCAST_URL, $VRAMCAST_API_KEY
    with reporter.track(model=model, args=training_args):
        trainer.train()                            # an OOM here is reported as "oom"

or, at any point, `report_peaks(job)`. The framework callbacks (`hf_callback`,
`lightning_callback`) drive the same calls from the training loop's events.

Every rank reports its own GPU: the run id carries the rank, and the Idempotency-Key is
derived from node and run, so a repeated send is stored once. Nothing here raises into the
caller: a network failure is logged once and the upload is kept on disk (`Spool`) to be sent
when the next run starts; an upload the service refuses for good is logged and set aside.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import Any

from vramcast_client.client import VramcastClient
from vramcast_client.derive import (
    InputShapes,
    UndescribableJobError,
    job_from_hf,
    name_or_path,
    world_size,
)
from vramcast_client.environment import collect_environment
from vramcast_client.errors import (
    AuthenticationError,
    ProblemError,
    ServerError,
    ServiceUnreachableError,
    UnexpectedResponseError,
    VramcastError,
)
from vramcast_client.measure import CudaProbe, GpuPeaks, MemoryProbe, is_out_of_memory
from vramcast_client.models import (
    CalibrationUpload,
    Job,
    MeasuredPeaks,
    OutcomeName,
    UploadGpu,
)
from vramcast_client.retry import RetryPolicy
from vramcast_client.spool import Spool, default_spool_dir

logger = logging.getLogger("vramcast.reporter")

NODE_ID_ENV = "VRAMCAST_NODE_ID"
RUN_ID_ENV = "VRAMCAST_RUN_ID"
# An upload happens once, at the end of a run: a few seconds of patience, then the disk.
UPLOAD_TIMEOUT_S = 5.0
UPLOAD_RETRY = RetryPolicy(attempts=3, backoff_s=0.5, max_backoff_s=4.0)
# How long the end of a run waits for the previous runs' uploads still being sent.
PENDING_JOIN_S = 30.0
# Statuses after which a later send may succeed (the key may be fixed, the limit may pass).
_TRANSIENT_STATUSES = frozenset({401, 403, 408, 425, 429})

JobSource = Job | Mapping[str, Any] | Callable[[], Job]


class Delivery(StrEnum):
    """What became of one upload."""

    UPLOADED = "uploaded"  # the service stored it (or had stored it: a replay)
    SPOOLED = "spooled"  # kept on disk; the next run sends it
    REJECTED = "rejected"  # the service refused it for good (e.g. 422); set aside
    SKIPPED = "skipped"  # nothing to send: no GPU, no job spec, or already reported


def default_node_id() -> str:
    return os.environ.get(NODE_ID_ENV) or socket.gethostname() or "unknown-node"


def default_run_id() -> str:
    """This run and rank: $VRAMCAST_RUN_ID, Slurm's job (and restart), torchrun's run id, or
    a fresh random id; `-rank<N>` added from $RANK."""
    run = os.environ.get(RUN_ID_ENV)
    if not run and os.environ.get("SLURM_JOB_ID"):
        run = f"slurm-{os.environ['SLURM_JOB_ID']}"
        step = os.environ.get("SLURM_STEP_ID")
        restart = os.environ.get("SLURM_RESTART_COUNT")
        run += f".{step}" if step else ""
        run += f"-restart{restart}" if restart and restart != "0" else ""
    elastic = os.environ.get("TORCHELASTIC_RUN_ID")
    if not run and elastic and elastic != "none":
        run = f"torchrun-{elastic}"
    run = run or uuid.uuid4().hex
    return f"{run}-rank{os.environ.get('RANK', '0')}"


def idempotency_key(node_id: str, run_id: str) -> str:
    """The Idempotency-Key of a run's upload: the same for every send of it."""
    digest = hashlib.sha256(f"{node_id}\n{run_id}".encode()).hexdigest()
    return f"vramcast-{digest[:40]}"


class Reporter:
    """Measures one rank's peaks and uploads them once per run.

    `probe` is where peaks come from (default: `CudaProbe`, this process's CUDA device);
    `client` replaces the HTTP client built from `url`, `api_key` (or their environment
    variables). `model_id` names the model by catalog id instead of its config.json;
    `seq_len` overrides the sequence length read from the job.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        api_key: str | None = None,
        probe: MemoryProbe | None = None,
        client: VramcastClient | None = None,
        node_id: str | None = None,
        run_id: str | None = None,
        spool_dir: Path | str | None = None,
        model_id: str | None = None,
        seq_len: int | None = None,
        timeout: float = UPLOAD_TIMEOUT_S,
        retry: RetryPolicy = UPLOAD_RETRY,
    ) -> None:
        self.probe: MemoryProbe = probe if probe is not None else CudaProbe()
        self._client = client
        self._owns_client = client is None
        self._client_options: dict[str, Any] = {
            "base_url": url,
            "api_key": api_key,
            "timeout": timeout,
            "retry": retry,
        }
        self.node_id = node_id or default_node_id()
        self.run_id = run_id or default_run_id()
        self.spool = Spool(spool_dir if spool_dir is not None else default_spool_dir())
        self.model_id = model_id
        self.seq_len = seq_len
        self.shapes = InputShapes()
        self.last_delivery: Delivery | None = None
        self._started = False
        self._stopped = False
        self._reported = False
        self._pending_thread: threading.Thread | None = None
        self._logged: set[str] = set()

    @property
    def idempotency_key(self) -> str:
        return idempotency_key(self.node_id, self.run_id)

    @property
    def client(self) -> VramcastClient:
        if self._client is None:
            self._client = VramcastClient(**self._client_options)
        return self._client

    # The run's events -------------------------------------------------------------------

    def start(self, model: Any = None) -> None:
        """Training begins: start the probe, watch `model`'s inputs, and send in the
        background what earlier runs could not."""
        if self._started:
            return
        self._started = True
        self._guard("start the GPU probe", self.probe.start)
        if model is not None:
            self._guard("watch the model's inputs", lambda: self.shapes.watch(model))
        self._guard("send pending uploads", self._send_pending_in_background)

    def _send_pending_in_background(self) -> None:
        thread = threading.Thread(
            target=self._guard,
            args=("send pending uploads", self.send_pending),
            name="vramcast-pending",
            daemon=True,
        )
        thread.start()
        self._pending_thread = thread

    def finish(self, job: JobSource, outcome: OutcomeName = "completed") -> Delivery:
        """Training ended (or died of OOM): read the peaks and upload them, once per run."""
        if self._reported:
            return Delivery.SKIPPED
        self._reported = True
        try:
            if self._pending_thread is not None:
                self._pending_thread.join(PENDING_JOIN_S)
            return self._deliver(self._report(job, outcome))
        except Exception as error:  # a bug here must not end the training process
            self._log_once("finish", "vramcast: could not report the run's peaks: %r", error)
            return self._delivered(Delivery.SKIPPED)
        finally:
            self.close()

    def close(self) -> None:
        """Stop the probe and watching inputs, and close the client this reporter made."""
        self._stop_watching()
        if self._owns_client and self._client is not None:
            self._client.close()
            self._client = None

    def _stop_watching(self) -> None:
        self.shapes.close()
        if self._started and not self._stopped:
            self._stopped = True
            self._guard("stop the GPU probe", self.probe.stop)

    @contextmanager
    def track(
        self,
        job: JobSource | None = None,
        *,
        model: Any = None,
        args: Any = None,
    ) -> Iterator[Reporter]:
        """Report the peaks of the block: "completed" when it returns, "oom" when it dies of
        CUDA out-of-memory (re-raised). Other errors are re-raised and not reported. Without
        `job`, the spec is read from `model` and its TrainingArguments `args`."""
        source: JobSource
        if job is not None:
            source = job
        elif model is not None:
            source = self.hf_job(model, args)
        else:
            raise ValueError("track() needs a job, or the model (and TrainingArguments)")
        self.start(model)
        try:
            yield self
        except BaseException as error:
            if is_out_of_memory(error):
                self.finish(source, "oom")
            else:
                self._stop_watching()
            raise
        self.finish(source, "completed")

    def hf_job(self, model: Any, args: Any) -> Callable[[], Job]:
        """The job of an HF model and TrainingArguments, read when the run ends (when the
        inputs it took are known)."""
        return lambda: job_from_hf(
            model, args, seq_len=self.seq_len, shapes=self.shapes, model_id=self.model_id_for(model)
        )

    def model_id_for(self, model: Any) -> str | None:
        """The catalog id to report the model under, if the service's catalog knows the Hub id
        it was loaded from; else None (its config.json is sent)."""
        if self.model_id is not None:
            return self.model_id
        hub_id = name_or_path(model)
        if hub_id is None:
            return None
        try:
            return self.client.model(hub_id).id
        except VramcastError:
            # Not in the catalog, or the catalog cannot be asked now: the config.json is
            # sent, which the service can always estimate.
            return None

    # Sending ----------------------------------------------------------------------------

    def send_pending(self) -> int:
        """Send the uploads earlier runs kept on disk; returns how many were delivered."""
        delivered = 0
        for item in self.spool.pending():
            outcome = self._send(item.body, item.idempotency_key)
            if outcome is Delivery.UPLOADED:
                self.spool.remove(item.path)
                delivered += 1
            elif isinstance(outcome, ProblemError):
                self.spool.reject(item.path, str(outcome))
            else:
                break  # the service is still unreachable: keep the rest for the next run
        return delivered

    def _report(self, job: JobSource, outcome: OutcomeName) -> CalibrationUpload | None:
        peaks = self.probe.read()
        if peaks is None:
            logger.info("vramcast: no GPU to measure on this rank; nothing reported")
            return None
        try:
            spec = job() if callable(job) else job
            spec = spec if isinstance(spec, Job) else Job.model_validate(spec)
        except UndescribableJobError as error:
            self._log_once("job", "vramcast: not reported, the job spec is unknown: %s", error)
            return None
        return self.upload_for(spec, peaks, outcome)

    def upload_for(self, job: Job, peaks: GpuPeaks, outcome: OutcomeName) -> CalibrationUpload:
        """The upload body for this rank's `peaks` of `job`."""
        parallel = job.parallel
        ranks = parallel.gpus if parallel is not None and parallel.gpus else world_size()
        return CalibrationUpload(
            job=job,
            gpu=UploadGpu(name=peaks.gpu_name, memory_total_bytes=peaks.memory_total_bytes),
            measured=MeasuredPeaks(
                allocated_bytes=peaks.allocated_bytes,
                reserved_bytes=peaks.reserved_bytes,
                device_bytes=peaks.device_bytes,
            ),
            outcome=outcome,
            environment=collect_environment(driver=peaks.driver, world_size=ranks),
            node_id=self.node_id,
            run_id=self.run_id,
        )

    def _deliver(self, upload: CalibrationUpload | None) -> Delivery:
        if upload is None:
            return self._delivered(Delivery.SKIPPED)
        body = upload.to_json()
        result = self._send(body, self.idempotency_key)
        if isinstance(result, ProblemError):
            return self._delivered(Delivery.REJECTED)
        if result is Delivery.SPOOLED:
            path = self.spool.put(self.idempotency_key, body)
            logger.info("vramcast: upload kept at %s; the next run sends it", path)
        return self._delivered(result)

    def _send(self, body: dict[str, Any], key: str) -> Delivery | ProblemError:
        """UPLOADED, SPOOLED (try again later) or the ProblemError that refused it for good."""
        try:
            self.client.upload_calibration(body, idempotency_key=key)
        except (ServiceUnreachableError, ServerError) as error:
            self._log_once("network", "vramcast: upload failed, kept for later: %s", error)
            return Delivery.SPOOLED
        except ProblemError as error:
            if isinstance(error, AuthenticationError) or error.status in _TRANSIENT_STATUSES:
                self._log_once("auth", "vramcast: upload refused, kept for later: %s", error)
                return Delivery.SPOOLED
            self._log_once("rejected", "vramcast: upload rejected: %s", error)
            return error
        except UnexpectedResponseError as error:
            # A 2xx: the service stored it, whatever its answer says.
            self._log_once("answer", "vramcast: upload stored; odd answer: %s", error)
        except Exception as error:  # anything else: keep it, the next run tries again
            self._log_once("network", "vramcast: upload failed, kept for later: %s", error)
            return Delivery.SPOOLED
        return Delivery.UPLOADED

    # Never raising ----------------------------------------------------------------------

    def _delivered(self, delivery: Delivery) -> Delivery:
        self.last_delivery = delivery
        return delivery

    def _guard(self, what: str, action: Callable[[], Any]) -> None:
        try:
            action()
        except Exception as error:
            self._log_once(what, "vramcast: could not %s: %r", what, error)

    def _log_once(self, kind: str, message: str, *args: Any) -> None:
        """Warn the first time something goes wrong in a run; later, only at debug level."""
        level = logging.DEBUG if kind in self._logged else logging.WARNING
        self._logged.add(kind)
        logger.log(level, message, *args)


def report_peaks(
    job: JobSource,
    *,
    outcome: OutcomeName = "completed",
    reporter: Reporter | None = None,
    **options: Any,
) -> Delivery:
    """Read this rank's peaks now and upload them for `job`; `options` go to `Reporter`."""
    owned = reporter is None
    active = reporter if reporter is not None else Reporter(**options)
    try:
        active.start()
        return active.finish(job, outcome)
    finally:
        if owned:
            active.close()
