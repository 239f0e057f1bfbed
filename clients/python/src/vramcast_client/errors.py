"""What the client raises: one tree, rooted at `VramcastError`, each carrying what went wrong.

    VramcastError
    ├── ProblemError                 the service answered with an RFC 9457 problem (`problem`)
    │   ├── InvalidRequestError      422: `problem.errors` locates each invalid field
    │   ├── NotFoundError            404: unknown model or GPU (`problem.suggestions`)
    │   ├── AuthenticationError      401 / 403: the API key is missing, wrong or lacks a scope
    │   ├── RequestTooLargeError     413
    │   └── ServerError              5xx, after the retries ran out
    ├── ServiceUnreachableError      no HTTP answer (refused, reset, timed out), after retries
    └── UnexpectedResponseError      an answer that is not what the API documents

A problem that is not JSON (a proxy's HTML error page) still becomes a ProblemError, with a
problem built from the status line, so callers handle one shape.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError


class FieldProblem(BaseModel):
    """One invalid input of a 422, located by its path in the request."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    loc: list[str | int] = []
    pointer: str = ""
    detail: str = ""
    type: str = ""


class Problem(BaseModel):
    """An RFC 9457 problem detail; unknown extension members are kept in `extensions`."""

    # Extension members beyond the ones modelled here stay readable (model_extra).
    model_config = ConfigDict(extra="allow", frozen=True)

    type: str = "about:blank"
    title: str = ""
    status: int
    detail: str = ""
    instance: str | None = None
    errors: list[FieldProblem] | None = None
    suggestions: list[str] | None = None

    @property
    def extensions(self) -> dict[str, Any]:
        return dict(self.model_extra or {})

    @property
    def kind(self) -> str:
        """The type's last segment, e.g. 'unknown-model', or 'about:blank'."""
        return self.type.rsplit(":", 1)[-1] if self.type != "about:blank" else self.type

    @classmethod
    def from_body(cls, status: int, body: bytes, reason: str) -> Problem:
        """The problem in `body`, or one made from the status line when there is none."""
        try:
            problem = cls.model_validate_json(body) if body else None
        except ValidationError:
            problem = None
        if problem is None or problem.status != status:
            text = body[:200].decode("utf-8", "replace").strip()
            return cls(status=status, title=reason, detail=text or reason)
        return problem


class VramcastError(Exception):
    """Anything the client raises."""


class ProblemError(VramcastError):
    """The service answered with an error status; `problem` is its problem+json body."""

    def __init__(
        self,
        problem: Problem,
        *,
        method: str,
        url: str,
        attempts: int = 1,
        retry_after_s: float | None = None,
    ) -> None:
        self.problem = problem
        self.status = problem.status
        self.method = method
        self.url = url
        self.attempts = attempts
        self.retry_after_s = retry_after_s  # the Retry-After header, seconds, if any
        super().__init__(_describe(problem, method=method, url=url))


class InvalidRequestError(ProblemError, ValueError):
    """422: the request fails the schema or a spec check."""


class NotFoundError(ProblemError, LookupError):
    """404: an unknown model id or GPU name; `problem.suggestions` are the closest."""


class AuthenticationError(ProblemError, PermissionError):
    """401 or 403: the API key is missing, unknown, revoked, or lacks the scope."""


class RequestTooLargeError(ProblemError, ValueError):
    """413: the body is over the service's limit."""


class ServerError(ProblemError):
    """5xx: the service failed, and kept failing for every retry."""


class ServiceUnreachableError(VramcastError, ConnectionError):
    """No HTTP answer at all (refused, reset, timed out), for every attempt."""

    def __init__(self, message: str, *, method: str, url: str, attempts: int) -> None:
        self.method = method
        self.url = url
        self.attempts = attempts
        super().__init__(f"{method} {url}: {message} (after {attempts} attempt(s))")


class UnexpectedResponseError(VramcastError):
    """A 2xx answer whose body is not what the API documents for it."""

    def __init__(self, message: str, *, method: str, url: str, status: int) -> None:
        self.method = method
        self.url = url
        self.status = status
        super().__init__(f"{method} {url} answered {status}: {message}")


_BY_STATUS: dict[int, type[ProblemError]] = {
    401: AuthenticationError,
    403: AuthenticationError,
    404: NotFoundError,
    413: RequestTooLargeError,
    422: InvalidRequestError,
}


def problem_error(
    problem: Problem,
    *,
    method: str,
    url: str,
    attempts: int = 1,
    retry_after_s: float | None = None,
) -> ProblemError:
    """The ProblemError subclass for the problem's status."""
    cls = _BY_STATUS.get(problem.status)
    if cls is None:
        cls = ServerError if problem.status >= 500 else ProblemError
    return cls(problem, method=method, url=url, attempts=attempts, retry_after_s=retry_after_s)


def _describe(problem: Problem, *, method: str, url: str) -> str:
    text = f"{method} {url} answered {problem.status} {problem.title}".rstrip()
    if problem.detail and problem.detail != problem.title:
        text += f": {problem.detail}"
    where = [
        f"{'.'.join(str(p) for p in e.loc)}: {e.detail}" if e.loc else e.detail
        for e in problem.errors or []
    ]
    if where:
        text += " (" + "; ".join(where[:5]) + (", ..." if len(where) > 5 else "") + ")"
    return text
