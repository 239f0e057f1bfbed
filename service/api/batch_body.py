"""Bodies read once per distinct job: a batch's, and POST /v1/estimates' across requests.

A scheduler asks about many shapes of few jobs: the same model, method and settings at other
micro-batch sizes and sequence lengths. Validating each job in full costs as much as its
estimate, so a job is read once per distinct job: the first body or batch entry with given
fields besides `batch_size` and `seq_len` is validated as `JobSpec` from its JSON, and the
others with those fields are its copies at their own shapes, whose two integers are checked
against the same fields' bounds. A copy's core spec is its job's at the copy's shape
(`TrainingSpec.with_shape`), which checks again what depends on the shape. Anything else (a job
that is not an object, a shape that is not a plain integer, any shape that fails) is read in
full, as before, each job failing on its own with its own errors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, NamedTuple

from pydantic import TypeAdapter, ValidationError
from pydantic_core import from_json, to_json

from service.api.answers import MAX_KEPT_BODY_BYTES
from service.api.schemas import MAX_BATCH_JOBS, JobSpec
from service.core.spec import TrainingSpec

# The fields a job's copies differ in, each checked with JobSpec's own field (its bounds).
SHAPE_FIELDS = ("batch_size", "seq_len")
_BATCH_SIZE = TypeAdapter(Annotated[int, JobSpec.model_fields["batch_size"]])
_SEQ_LEN = TypeAdapter(Annotated[int, JobSpec.model_fields["seq_len"]])
# Single bodies' jobs remembered across requests, by their JSON less the shape: forgotten
# whole when full. A body longer than the answer cache keeps is not remembered either, so the
# memo holds at most this many x (MAX_KEPT_BODY_BYTES + a job and its spec), plus what each
# job resolved (`SharedSpec.resolved`), whose estimate at any shape keeps the job's compiled
# pieces alive even once the estimator has let them go: at most MAX_PIECES (8) a job.
MAX_KNOWN_JOBS = 1024


class SharedSpec:
    """The core spec of a job and its copies at other shapes: the first spec made of any of
    them, taken to each one's own shape. Whichever job makes it first, the base is the same
    job's frozen spec, so threads may share it."""

    __slots__ = ("_base", "resolved")

    def __init__(self) -> None:
        self._base: TrainingSpec | None = None
        # What the estimation resolves of the job once for all its copies (its model, GPU and
        # estimate at any shape: `Estimation.values`); None until then, or where it fails.
        self.resolved: Any = None

    def of(self, job: JobSpec) -> TrainingSpec:
        """`job.to_spec()` for `job`, one of the jobs this spec is shared by; raises its
        InvalidSpecError."""
        base = self._base
        if base is None:
            spec = self._base = job.to_spec()
            return spec
        return base.with_shape(job.batch_size, job.seq_len)


@dataclass(frozen=True, slots=True)
class SharedJobs:
    """A batch's valid jobs: for each the index of the first job it copies (itself for a
    first) and its shape. Jobs with the same first differ only in their shape: a copy is made
    as a `JobSpec` only where it is asked for (`job`)."""

    firsts: list[int]
    shapes: list[tuple[int, int]]  # each job's batch_size and seq_len
    read: dict[int, JobSpec]  # each first's job, as read

    def job(self, index: int) -> JobSpec:
        """The job at `index`: a first as read, a copy as its first at its own shape."""
        first = self.firsts[index]
        job = self.read[first]
        if first == index:
            return job
        batch_size, seq_len = self.shapes[index]
        return job.model_copy(update={"batch_size": batch_size, "seq_len": seq_len})

    @property
    def jobs(self) -> list[JobSpec]:
        """Every job, in the batch's order."""
        return [self.job(index) for index in range(len(self.firsts))]


def read_shared(body: bytes) -> SharedJobs | None:
    """`body`'s jobs when it is a batch whose every job is valid, else None."""
    try:
        data: Any = from_json(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or data.keys() != {"jobs"}:
        return None
    entries = data["jobs"]
    if not isinstance(entries, list) or not 1 <= len(entries) <= MAX_BATCH_JOBS:
        return None
    seen: dict[bytes, int] = {}
    read: dict[int, JobSpec] = {}
    firsts: list[int] = []
    shapes: list[tuple[int, int]] = []
    try:
        for index, entry in enumerate(entries):
            split = _split(entry)
            if split is None:
                return None  # a boolean, text, a float or none: the full reading says which
            rest, batch_size, seq_len = split
            first = seen.setdefault(to_json(rest), index)
            if first == index:
                read[index] = JobSpec.model_validate_json(to_json(entry))
            else:
                _check_shape(batch_size, seq_len)
            firsts.append(first)
            shapes.append((batch_size, seq_len))
    except ValidationError:
        return None
    return SharedJobs(firsts, shapes, read)


@dataclass(frozen=True, slots=True)
class KnownJob:
    """A single body's job as first read, and the spec it shares with its copies."""

    job: JobSpec
    spec: SharedSpec


_known: dict[bytes, KnownJob] = {}


class KnownKey(NamedTuple):
    """A single body's JSON less its shape, and its shape."""

    rest: bytes
    batch_size: int
    seq_len: int


def known_key(body: bytes) -> KnownKey | None:
    """The key a single body's job is remembered by; None for one that is not remembered (not
    a JSON object with plain integers for its shape, or too long)."""
    if len(body) > MAX_KEPT_BODY_BYTES:
        return None
    try:
        data: Any = from_json(body)
    except ValueError:
        return None
    split = _split(data)
    if split is None:
        return None
    rest, batch_size, seq_len = split
    return KnownKey(to_json(rest), batch_size, seq_len)


def read_known(key: KnownKey) -> tuple[JobSpec, SharedSpec] | None:
    """The job of a body that copies one read before (`remember`) at its own valid shape,
    and the spec they share; else None (the body is read in full)."""
    known = _known.get(key.rest)
    if known is None:
        return None
    try:
        return _copy(known.job, key.batch_size, key.seq_len), known.spec
    except ValidationError:
        return None  # the full reading says what is wrong with the shape


def remember(key: KnownKey, job: JobSpec) -> SharedSpec:
    """The spec `job`, read in full from the body of `key`, shares with the bodies that copy
    it at other shapes (`read_known` finds it from now on)."""
    spec = SharedSpec()
    if len(_known) >= MAX_KNOWN_JOBS:
        _known.clear()
    _known[key.rest] = KnownJob(job, spec)
    return spec


def _split(entry: Any) -> tuple[dict[str, Any], int, int] | None:
    """A job's fields less its shape, and its shape, when both are plain integers."""
    if not isinstance(entry, dict):
        return None
    batch_size = entry.get("batch_size")
    seq_len = entry.get("seq_len")
    if type(batch_size) is not int or type(seq_len) is not int:
        return None
    rest = {k: v for k, v in entry.items() if k not in SHAPE_FIELDS}
    return rest, batch_size, seq_len


def _copy(job: JobSpec, batch_size: int, seq_len: int) -> JobSpec:
    """`job` at this shape, the shape checked as JobSpec checks it (a ValidationError)."""
    _check_shape(batch_size, seq_len)
    return job.model_copy(update={"batch_size": batch_size, "seq_len": seq_len})


def _check_shape(batch_size: int, seq_len: int) -> None:
    """A ValidationError unless JobSpec takes this shape."""
    _BATCH_SIZE.validate_python(batch_size)
    _SEQ_LEN.validate_python(seq_len)
