"""Long work a caller may refuse to wait on, or allow for a while.

A warm estimate reads its job's compiled pieces and remembered allocator replays in
microseconds; a cold one runs the step itself (milliseconds: a new job, or a shape no piece
holds yet; every estimate of an encoder or encoder-decoder, whose steps are not compiled, and
of a preference objective) or replays the allocator (tens to hundreds of milliseconds per
shape), and a fit-check may do either dozens of times. The API answers on its event loop what
is warm and moves the rest to a worker thread: it asks under `refusing_cold_work()`, and where
such work would start (`starting_cold_work`), `ColdWorkRefused` is raised before anything is
computed or remembered; the caller then asks again where waiting is fine.

Where waiting is fine, it is bounded: under `allowing_cold_work(allowance)` each piece of long
work that starts is counted against the request's `ColdWorkAllowance`, and one that would start
after its time ran out raises `ColdWorkOverBudget` (a `ColdWorkRefused`) instead, again before
anything of it is computed or remembered. What the request finished before (each replay, each
recorded step) is remembered where it always is, so asking again continues from there. The
check is cooperative: a piece that started in time runs to its end, so a request overruns its
time by at most one piece (one step run and its recording, or one replay of the allocator).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

# Per thread and per asyncio task: a worker thread started from the event loop copies the
# context as it is then (not refusing, once the refused attempt has left its block).
_refusing: ContextVar[bool] = ContextVar("refusing_cold_work", default=False)
_allowance: ContextVar[ColdWorkAllowance | None] = ContextVar("cold_work_allowance", default=None)
_continuing: ContextVar[bool] = ContextVar("continuing_cold_work", default=False)


class ColdWorkRefused(Exception):
    """Long work was about to start where it is refused; nothing of it was done."""


class ColdWorkOverBudget(ColdWorkRefused):
    """Long work was about to start after its request's allowance ran out; nothing of it
    was done, and what the request did before is kept."""

    def __init__(self, what: str, seconds: float) -> None:
        super().__init__(f"{what}: the request's {seconds:g} s of long work are spent")
        self.what = what
        self.seconds = seconds


class ColdWorkAllowance:
    """How long one request may do long work, counted from when its first piece starts; and
    what is done before that first piece (`admit`: taking a slot, which may raise to refuse
    the request's long work altogether)."""

    __slots__ = ("_admit", "_clock", "deadline", "pieces", "refused", "seconds")

    def __init__(
        self,
        seconds: float,
        admit: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.seconds = seconds
        self._admit = admit
        self._clock = clock
        self.deadline: float | None = None  # set when the first piece starts
        self.pieces = 0  # pieces of long work started
        self.refused = 0  # pieces refused for want of time

    def starting(self, what: str) -> None:
        """Before a piece of long work: admits the request at its first, refuses one that
        would start past the deadline (`ColdWorkOverBudget`)."""
        if self.deadline is None:
            if self._admit is not None:
                self._admit()
            self.deadline = self._clock() + self.seconds
        elif self._clock() >= self.deadline:
            self.refused += 1
            raise ColdWorkOverBudget(what, self.seconds)
        self.pieces += 1


@contextmanager
def refusing_cold_work() -> Iterator[None]:
    """Within the block, long work raises `ColdWorkRefused` where it would start."""
    token = _refusing.set(True)
    try:
        yield
    finally:
        _refusing.reset(token)


@contextmanager
def allowing_cold_work(allowance: ColdWorkAllowance) -> Iterator[ColdWorkAllowance]:
    """Within the block, long work is counted against `allowance` where it starts."""
    token = _allowance.set(allowance)
    try:
        yield allowance
    finally:
        _allowance.reset(token)


@contextmanager
def continuing_cold_work() -> Iterator[None]:
    """Within the block, long work is part of the piece already started (a step's recording
    after its run): it is not counted apart, so the piece is finished or not started at all."""
    token = _continuing.set(True)
    try:
        yield
    finally:
        _continuing.reset(token)


def starting_cold_work(what: str) -> None:
    """Called where long work starts, before it changes anything: raises `ColdWorkRefused`
    (naming `what`) under `refusing_cold_work()`, and counts the piece against the allowance
    of `allowing_cold_work()` (`ColdWorkAllowance.starting`)."""
    if _refusing.get():
        raise ColdWorkRefused(what)
    allowance = _allowance.get()
    if allowance is not None and not _continuing.get():
        allowance.starting(what)
