"""A batch body read once per distinct job.

A scheduler's batch asks about many shapes of few jobs: the same model, method and settings at
other micro-batch sizes and sequence lengths. Validating each job in full costs as much as its
estimate, so a body whose every job is valid is read here once per distinct job: the first job
with given fields besides `batch_size` and `seq_len` is validated as `JobSpec` from its JSON,
and the others with those fields are its copies at their own shapes, whose two integers are
checked against the same fields' bounds. Anything else (a job that is not an object, a shape
that is not a plain integer, any job or shape that fails) returns None, and the route reads the
body as before, each job failing on its own with its own errors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import TypeAdapter, ValidationError
from pydantic_core import from_json, to_json

from service.api.schemas import MAX_BATCH_JOBS, JobSpec

# The fields a job's copies differ in, each checked with JobSpec's own field (its bounds).
SHAPE_FIELDS = ("batch_size", "seq_len")
_SHAPES: dict[str, TypeAdapter[int]] = {
    name: TypeAdapter(Annotated[int, JobSpec.model_fields[name]]) for name in SHAPE_FIELDS
}


@dataclass(frozen=True, slots=True)
class SharedJobs:
    """A batch's valid jobs, and for each the index of the first job it copies (itself for a
    first): jobs with the same first differ only in their shape."""

    jobs: list[JobSpec]
    firsts: list[int]


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
    jobs: list[JobSpec] = []
    firsts: list[int] = []
    try:
        for index, entry in enumerate(entries):
            if not isinstance(entry, dict):
                return None
            shape = {name: entry.get(name) for name in SHAPE_FIELDS}
            if any(type(value) is not int for value in shape.values()):
                return None  # a boolean, text, a float or none: the full reading says which
            rest = to_json({k: v for k, v in entry.items() if k not in SHAPE_FIELDS})
            first = seen.setdefault(rest, index)
            if first == index:
                jobs.append(JobSpec.model_validate_json(to_json(entry)))
            else:
                for name, value in shape.items():
                    _SHAPES[name].validate_python(value)
                jobs.append(jobs[first].model_copy(update=shape))
            firsts.append(first)
    except ValidationError:
        return None
    return SharedJobs(jobs, firsts)
