"""A decoder's step compiled per job, one piece per branch of the step (symbolic.py).

A fit-check asks for the same job's peak at dozens of batch sizes and sequence lengths, and a
scheduler's jobs differ mostly in their shape. The step's allocated peak is worked out once
per job and branch as a function of (b, s): a shape where no piece's guards hold runs the step
itself, and that run, made again on symbolic b and s, adds the piece for its branch (from the
job's second such shape on: `RECORD_AFTER_RUNS`). A job
whose step cannot be recorded (its arithmetic leaves the integers: a power-of-two rounding,
a true division) keeps running the step itself; so does a job past `MAX_PIECES` branches.
Each piece is checked against the run that made it before it is kept.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from service.core.arch import ModelArch
from service.core.cold import ColdWorkRefused, continuing_cold_work
from service.core.estimator.plan import _Plan
from service.core.estimator.symbolic import Compiled, Trace, compile_record, is_shape
from service.core.spec import TrainingSpec, shape_free_fields

# Branches kept per job: a fit-check's curves cross a handful (the phase that peaks, the
# attention kernel, a batch of one); past this many the job's step simply runs each time.
MAX_PIECES = 8
# Jobs kept, and pieces kept over all jobs (about 11 KiB each, two compiled functions: 2048
# of them hold about 22 MiB); the oldest jobs leave first.
MAX_JOBS = 4096
MAX_PIECES_KEPT = 2048
# A job's step is recorded at its second shape that no piece holds: recording costs a few
# milliseconds, about twenty runs of the step, which a job asked about once never repays.
RECORD_AFTER_RUNS = 2


class DecoderStep(NamedTuple):
    """A decoder's SFT step at one shape, as the estimate and its levels read it."""

    arch: ModelArch  # as the framework builds it
    spec: TrainingSpec  # as the model runs it: a packed row, prompt tuning's longer sequence
    plan: _Plan
    paged_state: int
    allocated: int  # the largest phase's
    parts: tuple[tuple[int, ...], ...]  # each phase's parts (`step.PHASES`, COMPONENT_ORDER)
    host: int
    host_pinned: int
    assumptions: tuple[str, ...]
    warnings: tuple[str, ...]


# The decoder's step at a spec.
DecoderRun = Callable[[ModelArch, TrainingSpec, str | None], DecoderStep]


class Piece(NamedTuple):
    peak: Compiled  # (b, s) -> allocated, the model's b and s
    step: Compiled  # (b, s) -> those, host, host_pinned, every phase's parts in a row
    phases: int
    arch: ModelArch
    plan: _Plan
    paged_state: int
    # the step's notes where they do not depend on the shape; None where they name it
    notes: tuple[tuple[str, ...], tuple[str, ...]] | None


class _Key:
    """A job's key: the model, the GPU's row and the spec but its shape, hashed from the
    spec's shape-free hash (kept by `TrainingSpec.with_shape`, so made once per job)."""

    __slots__ = ("_hash", "arch", "compute_capability", "spec")

    def __init__(self, arch: ModelArch, compute_capability: str | None, spec: TrainingSpec) -> None:
        self.arch = arch
        self.compute_capability = compute_capability
        self.spec = spec
        self._hash = hash((arch, compute_capability, spec.shape_free_hash()))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, _Key)
            and self._hash == other._hash
            and self.arch == other.arch
            and self.compute_capability == other.compute_capability
            and (
                self.spec is other.spec
                or shape_free_fields(self.spec) == shape_free_fields(other.spec)
            )
        )


@dataclass(slots=True)
class CompiledJob:
    pieces: list[Piece] = field(default_factory=list)
    closed: bool = False  # no more pieces: not recordable, or MAX_PIECES reached
    runs: int = 0  # shapes no piece held
    # what a reader works out once per piece (by id: the job holds its pieces for good)
    derived: dict[int, Any] = field(default_factory=dict)


class Pieces:
    """Compiled pieces of the decoder's step, by job (model, GPU row and spec less its shape)."""

    def __init__(self, run: DecoderRun, jobs: int = MAX_JOBS, kept: int = MAX_PIECES_KEPT) -> None:
        self._run = run
        self._limit = jobs
        self._kept_limit = kept
        self._jobs: dict[_Key, CompiledJob] = {}
        self._kept = 0  # pieces over all jobs
        self._lock = threading.Lock()
        self.runs = 0  # the step run itself (no piece held)

    def step(
        self,
        arch: ModelArch,
        spec: TrainingSpec,
        compute_capability: str | None,
        *,
        notes: bool = True,
    ) -> DecoderStep:
        """The step at `spec` from a piece of the job where one holds, else from the step
        itself (adding its piece); without `notes`, for its numbers alone (its assumptions
        and warnings empty)."""
        job = self.job(arch, spec, compute_capability)
        with self._lock:
            pieces = tuple(job.pieces)
        b, s = spec.batch_size, spec.seq_len
        for piece in pieces:
            found = (piece.step if notes else piece.peak)(b, s)
            if found is None:
                continue
            if notes and piece.notes is None:
                self.runs += 1
                return self._run(arch, spec, compute_capability)  # its notes name the shape
            return _from_piece(piece, spec, found, notes)
        self.runs += 1
        made = self._run(arch, spec, compute_capability)
        with self._lock:
            job.runs += 1
            record = job.runs >= RECORD_AFTER_RUNS and not job.closed
        if record:
            recorded = self._record(arch, spec, compute_capability, made)
            with self._lock:
                if recorded is None or len(job.pieces) >= MAX_PIECES:
                    job.closed = True
                else:
                    job.pieces.append(recorded)
                    self._kept += 1
                    while self._kept > self._kept_limit and len(self._jobs) > 1:
                        self._forget_oldest()
        return made

    def job(
        self, arch: ModelArch, spec: TrainingSpec, compute_capability: str | None
    ) -> CompiledJob:
        """`spec`'s job (its pieces so far, a list that grows as shapes are recorded)."""
        key = _Key(arch, compute_capability, spec)
        with self._lock:
            job = self._jobs.get(key)
            if job is None:
                job = self._jobs[key] = CompiledJob()
                if len(self._jobs) > self._limit:
                    self._forget_oldest()
        return job

    def _forget_oldest(self) -> None:
        """Drop the oldest job and its pieces (the lock held)."""
        oldest = next(iter(self._jobs))
        self._kept -= len(self._jobs.pop(oldest).pieces)

    def _record(
        self, arch: ModelArch, spec: TrainingSpec, compute_capability: str | None, made: DecoderStep
    ) -> Piece | None:
        """The piece of `spec`'s branch, or None where the step cannot be recorded."""
        trace = Trace(spec.batch_size, spec.seq_len)
        b, s = trace.shape()
        try:
            symbolic = spec.with_shape(b, s)  # type: ignore[arg-type]
            # (part of the run just made: never stopped halfway by the request's allowance)
            with continuing_cold_work():
                step = self._run(arch, symbolic, compute_capability)
        except ColdWorkRefused:
            raise  # not a step that cannot be recorded: the job stays open
        except Exception:
            return None  # arithmetic the record does not take (symbolic.py)
        ran = step.spec
        if is_shape(step.paged_state) or shape_free_fields(ran) != shape_free_fields(spec):
            return None  # the model runs more than another shape of the job
        head = [step.allocated, ran.batch_size, ran.seq_len]
        rows = [value for parts in step.parts for value in parts]
        peak = compile_record(trace, head)
        whole = compile_record(trace, [*head, step.host, step.host_pinned, *rows])
        notes = None if trace.formatted else (step.assumptions, step.warnings)
        piece = Piece(peak, whole, len(step.parts), step.arch, step.plan, step.paged_state, notes)
        if _from_piece(piece, spec, whole(spec.batch_size, spec.seq_len), True) != (
            made if notes is not None else made._replace(assumptions=(), warnings=())
        ):
            return None  # (never seen: the record and the run differ)
        return piece

    def clear(self) -> None:
        with self._lock:
            self._jobs.clear()
            self._kept = 0

    @property
    def kept(self) -> int:
        """Pieces kept over all jobs."""
        return self._kept


def _from_piece(
    piece: Piece, spec: TrainingSpec, found: tuple[int, ...] | None, notes: bool
) -> DecoderStep:
    """The step a piece's compiled function found at `spec`'s shape."""
    assert found is not None  # (the caller checked the piece's guards held)
    allocated, run_b, run_s = found[:3]
    ran = (
        spec
        if run_b == spec.batch_size and run_s == spec.seq_len
        else spec.with_shape(run_b, run_s)
    )
    if not notes:
        return DecoderStep(
            piece.arch, ran, piece.plan, piece.paged_state, allocated, (), 0, 0, (), ()
        )
    host, host_pinned = found[3], found[4]
    width = (len(found) - 5) // piece.phases
    parts = tuple(found[5 + i * width : 5 + (i + 1) * width] for i in range(piece.phases))
    assumptions, warnings = piece.notes or ((), ())
    return DecoderStep(
        piece.arch,
        ran,
        piece.plan,
        piece.paged_state,
        allocated,
        parts,
        host,
        host_pinned,
        assumptions,
        warnings,
    )
