"""A command that talks to the service prints an error answer whole: status, title, detail,
and each invalid field with its reason (the service on loopback answers for real)."""

from __future__ import annotations

import contextlib
import io

from service.cli.main import main
from service.cli.problems import problem_lines
from service.cli.server import EXIT_UNDECIDED

JOB = ["Qwen/Qwen2.5-0.5B", "-b", "2", "-s", "512"]


def fit_error(url: str, *argv: str) -> list[str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["fit", *JOB, *argv, "--url", url])
    assert code == EXIT_UNDECIDED
    assert out.getvalue() == ""
    return err.getvalue().splitlines()


def test_a_422_names_each_field_and_its_reason(live_url: str) -> None:
    # The GPUs are sent as named first, then by memory: L4, 1 MiB, 2 MiB.
    lines = fit_error(live_url, "--gpu-memory-mib", "1", "--gpu", "L4", "--gpu-memory-mib", "2")
    assert lines[0].startswith("vramcast fit: the service answered 422 The request is invalid: ")
    assert lines[1:] == [
        "  body.gpus.1.memory_mib: Input should be greater than or equal to 1024",
        "  body.gpus.2.memory_mib: Input should be greater than or equal to 1024",
    ]


def test_a_422_of_one_field(live_url: str) -> None:
    lines = fit_error(live_url, "--gpu", "L4", "--count", "0")
    assert lines[1:] == ["  body.gpus.0.count: Input should be greater than or equal to 1"]


def test_a_404_gives_the_title_detail_and_closest_names(live_url: str) -> None:
    lines = fit_error(live_url, "--gpu", "RTX4099")
    assert lines == [
        "vramcast fit: the service answered 404 Unknown GPU: unknown GPU 'RTX4099'; "
        "closest: RTX4090, RTX3090, RTX4080"
    ]


class _Field:
    def __init__(self, loc: list[str | int], pointer: str, detail: str) -> None:
        self.loc, self.pointer, self.detail = loc, pointer, detail


class _Problem:
    status = 422
    title = "The request is invalid"
    detail = "invalid input"
    errors = (_Field([], "/job/seq_len", "too long"), _Field([], "", "no place"))
    suggestions = ("a", "b")


def test_fields_without_a_location_and_suggestions_not_in_the_detail() -> None:
    assert problem_lines(_Problem()) == [
        "the service answered 422 The request is invalid: invalid input",
        "  /job/seq_len: too long",
        "  no place",
        "  did you mean: a, b",
    ]
