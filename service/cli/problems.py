"""How the command line prints an error answer of the service (an RFC 9457 problem): its status
and title, its detail, each invalid field with the reason, and the names it suggests.

The problem is read by its members only, so any client's problem object prints.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class FieldProblemLike(Protocol):
    @property
    def loc(self) -> Sequence[str | int]: ...
    @property
    def pointer(self) -> str: ...
    @property
    def detail(self) -> str: ...


class ProblemLike(Protocol):
    @property
    def status(self) -> int: ...
    @property
    def title(self) -> str: ...
    @property
    def detail(self) -> str: ...
    @property
    def errors(self) -> Sequence[FieldProblemLike] | None: ...
    @property
    def suggestions(self) -> Sequence[str] | None: ...


def problem_lines(problem: ProblemLike) -> list[str]:
    """The first line names status, title and detail; one indented line per invalid field."""
    head = f"the service answered {problem.status} {problem.title}".rstrip()
    if problem.detail and problem.detail != problem.title:
        head += f": {problem.detail}"
    lines = [head]
    for error in problem.errors or []:
        where = ".".join(str(part) for part in error.loc) or error.pointer
        lines.append(f"  {where}: {error.detail}" if where else f"  {error.detail}")
    if problem.suggestions and not all(name in problem.detail for name in problem.suggestions):
        lines.append(f"  did you mean: {', '.join(problem.suggestions)}")
    return lines


def problem_text(problem: ProblemLike) -> str:
    return "\n".join(problem_lines(problem))
