"""Long work a caller may refuse to wait on.

A warm estimate reads its job's compiled pieces and remembered allocator replays in
microseconds; a cold one runs the step itself (milliseconds: a new job, or a shape no piece
holds yet; every estimate of an encoder or encoder-decoder, whose steps are not compiled, and
of a preference objective) or replays the allocator (tens to hundreds of milliseconds per
shape), and a fit-check may do either dozens of times. The API answers on its event loop what
is warm and moves the rest to a worker thread: it asks under `refusing_cold_work()`, and where
such work would start (`starting_cold_work`), `ColdWorkRefused` is raised before anything is
computed or remembered; the caller then asks again where waiting is fine.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

# Per thread and per asyncio task: a worker thread started from the event loop copies the
# context as it is then (not refusing, once the refused attempt has left its block).
_refusing: ContextVar[bool] = ContextVar("refusing_cold_work", default=False)


class ColdWorkRefused(Exception):
    """Long work was about to start under `refusing_cold_work()`; nothing of it was done."""


@contextmanager
def refusing_cold_work() -> Iterator[None]:
    """Within the block, long work raises `ColdWorkRefused` where it would start."""
    token = _refusing.set(True)
    try:
        yield
    finally:
        _refusing.reset(token)


def starting_cold_work(what: str) -> None:
    """Called where long work starts, before it changes anything: raises `ColdWorkRefused`
    (naming `what`) under `refusing_cold_work()`."""
    if _refusing.get():
        raise ColdWorkRefused(what)
