"""When and how long the client waits before trying a request again.

Only failures that a later attempt can fix are retried: no HTTP answer at all (refused,
reset, timed out) and 5xx answers. A 4xx says the request itself is wrong and is raised at
once. Every endpoint is safe to repeat: estimates and fit-checks are pure, and an upload
carries an Idempotency-Key that makes the service answer a repeat with the first response.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

import httpx

RETRY_STATUSES = frozenset({500, 502, 503, 504})


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    """Exponential backoff with full jitter: attempt n waits uniform(0, min(cap, base * 2**n)).

    A Retry-After header on a 5xx is honoured, up to `max_backoff_s`.
    """

    attempts: int = 3  # tries in all, the first included
    backoff_s: float = 0.25
    max_backoff_s: float = 5.0
    jitter: Callable[[float], float] = field(default=lambda high: random.uniform(0.0, high))

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("attempts must be at least 1")
        if self.backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError("backoff times must not be negative")

    def delay_s(self, attempt: int, retry_after_s: float | None = None) -> float:
        """Seconds to wait after failed attempt number `attempt` (1-based)."""
        if retry_after_s is not None:
            return min(max(retry_after_s, 0.0), self.max_backoff_s)
        return self.jitter(min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1)))


NO_RETRY = RetryPolicy(attempts=1)


def retryable_status(status: int) -> bool:
    return status in RETRY_STATUSES


def retry_after_s(response: httpx.Response) -> float | None:
    """The Retry-After header as seconds (delta-seconds or an HTTP date), if present."""
    value = response.headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        return None
    return max((when - datetime.now(UTC)).total_seconds(), 0.0)
