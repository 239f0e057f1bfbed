"""Cold work's slots and time: how many requests run jobs' steps or replay the allocator model
at once, who may, and for how long each (`core.cold`).

Warm estimates and fit-checks never come here: a request takes its claim only once the event
loop's attempt was refused (`refusing_cold_work`), or, for a batch, which always runs in the
thread pool, when its first piece of cold work starts. Then the caller is identified (a live
API key in `Authorization: Bearer`, checked through the app's key cache,
`auth.require_cached_key`; none, an unknown one or an unreachable store that never verified it
make it anonymous) and waits, at most `cold_work_wait_s` in all, for one
of `cold_work_slots` slots; keyless callers hold at most `cold_work_anonymous_slots` of them
together, so a keyed caller always has one left. Waiting happens on the event loop, never in
a worker thread (but for a batch's, which is already in one). Once admitted, the request may
do `cold_work_budget_s` of cold work (`core.cold.ColdWorkAllowance`); its slot is held until
its answer is made.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Iterable
from enum import StrEnum
from http import HTTPStatus
from types import TracebackType
from typing import ParamSpec, TypeVar

import anyio
import anyio.from_thread
import anyio.to_thread
from fastapi.security import HTTPAuthorizationCredentials
from fastapi.security.utils import get_authorization_scheme_param
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from service.api import problems
from service.api.auth import KeyCache, require_cached_key
from service.api.metrics import Metrics
from service.api.problems import Problem, ProblemError
from service.api.settings import Settings
from service.core.cold import ColdWorkAllowance, allowing_cold_work
from service.store.keys import KeyScope

P = ParamSpec("P")
T = TypeVar("T")

logger = logging.getLogger(__name__)


class Caller(StrEnum):
    KEYED = "keyed"
    ANONYMOUS = "anonymous"


class Refusal(StrEnum):
    BUSY = "busy"  # no slot freed within the wait
    ANONYMOUS_SHARE = "anonymous_share"  # the keyless callers' slots stayed taken
    BUDGET = "budget"  # the request's time for cold work ran out


class ColdWorkSlots:
    """The process's slots for cold work, handed out in the order they are asked for (a
    request that cannot use a free slot, a keyless one past its share, lets the next have
    it). Used on the event loop only: no lock."""

    def __init__(self, slots: int, anonymous_slots: int) -> None:
        self.slots = slots
        self.anonymous_slots = anonymous_slots
        self.held = 0
        self.held_anonymous = 0
        self.asked = 0  # requests that asked for a slot (warm ones never do)
        self._waiting: deque[tuple[Caller, asyncio.Future[None]]] = deque()

    async def acquire(self, caller: Caller, wait_s: float) -> Refusal | None:
        """Takes a slot for `caller`, waiting at most `wait_s` seconds; the refusal's reason
        when none came in time."""
        self.asked += 1
        if not self._waiting and self._free_for(caller):
            self._take(caller)
            return None
        entry = (caller, asyncio.get_running_loop().create_future())
        granted = entry[1]
        self._waiting.append(entry)
        self._hand_over()
        try:
            if not granted.done():
                # (shielded: a timeout leaves the future to be removed below, not cancelled)
                await asyncio.wait_for(asyncio.shield(granted), wait_s)
        except TimeoutError:
            pass
        except BaseException:  # the request went away while waiting
            self._leave(entry)
            raise
        if granted.done():
            return None
        self._waiting.remove(entry)
        if caller is Caller.ANONYMOUS and self.held_anonymous >= self.anonymous_slots:
            return Refusal.ANONYMOUS_SHARE
        return Refusal.BUSY

    def release(self, caller: Caller) -> None:
        self.held -= 1
        if caller is Caller.ANONYMOUS:
            self.held_anonymous -= 1
        self._hand_over()

    def _leave(self, entry: tuple[Caller, asyncio.Future[None]]) -> None:
        """A waiter gone: its slot given back if it had been handed one, else its place."""
        if entry[1].done():
            self.release(entry[0])
        else:
            self._waiting.remove(entry)

    def _free_for(self, caller: Caller) -> bool:
        return self.held < self.slots and (
            caller is Caller.KEYED or self.held_anonymous < self.anonymous_slots
        )

    def _hand_over(self) -> None:
        """Free slots to the waiters that can use them, first come first served."""
        for entry in list(self._waiting):
            if self.held >= self.slots:
                return
            caller, granted = entry
            if self._free_for(caller):
                self._waiting.remove(entry)
                self._take(caller)
                granted.set_result(None)

    def _take(self, caller: Caller) -> None:
        self.held += 1
        if caller is Caller.ANONYMOUS:
            self.held_anonymous += 1


class ColdWork:
    """The app's cold work: its slots, its settings, and how a caller's key is checked."""

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        sessions: sessionmaker[Session],
        keys: KeyCache,
    ) -> None:
        self.slots = ColdWorkSlots(settings.cold_work_slots, settings.cold_work_anonymous_slots)
        self.wait_s = settings.cold_work_wait_s
        self.budget_s = settings.cold_work_budget_s
        self.sessions = sessions
        self.keys = keys
        metrics.cold_work_slots_held.set_function(lambda: self.slots.held)
        # the labelled counters made once (listed from the start, at 0)
        self.refusals = {r: metrics.cold_work_refusals.labels(reason=r.value) for r in Refusal}
        self.admissions = {c: metrics.cold_work_admissions.labels(caller=c.value) for c in Caller}

    def claim(self, authorization: str | None) -> ColdWorkClaim:
        """A request's claim, `authorization` its Authorization header (checked only if the
        request is admitted: `ColdWorkClaim.admit`)."""
        return ColdWorkClaim(self, authorization)

    async def caller(self, authorization: str | None, wait_s: float) -> Caller:
        """Keyed for a live API key (any scope), checked in a worker thread for at most
        `wait_s` seconds; anonymous otherwise."""
        scheme, token = get_authorization_scheme_param(authorization)
        if not token or scheme.lower() != "bearer":
            return Caller.ANONYMOUS
        credentials = HTTPAuthorizationCredentials(scheme=scheme, credentials=token)
        with anyio.move_on_after(wait_s):
            live = await anyio.to_thread.run_sync(
                self._live_key, credentials, abandon_on_cancel=True
            )
            return Caller.KEYED if live else Caller.ANONYMOUS
        return Caller.ANONYMOUS

    def _live_key(self, credentials: HTTPAuthorizationCredentials) -> bool:
        try:
            with self.sessions() as session:
                require_cached_key(self.keys, session, credentials, KeyScope.READ)
        except ProblemError as exc:
            # a live key without the read scope is refused as forbidden: still a key
            return exc.problem.status == HTTPStatus.FORBIDDEN
        except SQLAlchemyError as exc:
            logger.warning("store unreachable: a cold request's caller counts as keyless: %s", exc)
            return False
        return True


class ColdWorkClaim:
    """One request's cold work: admitted once (its caller identified, a slot taken or the
    request refused), then allowed `cold_work_budget_s` (`run`); its slot given back when the
    claim closes (`async with`)."""

    def __init__(self, work: ColdWork, authorization: str | None) -> None:
        self._work = work
        self._authorization = authorization
        self._caller: Caller | None = None  # once admitted
        self._refused: Problem | None = None
        self.allowance = ColdWorkAllowance(work.budget_s, admit=self._admit_from_thread)

    async def admit(self) -> None:
        """Takes a slot, or raises the refusal's problem (429 or 503); once per request."""
        if self._caller is not None:
            return
        if self._refused is not None:
            raise ProblemError(self._refused)
        work = self._work
        loop = asyncio.get_running_loop()
        deadline = loop.time() + work.wait_s
        caller = await work.caller(self._authorization, work.wait_s)
        refusal = await work.slots.acquire(caller, max(0.0, deadline - loop.time()))
        if refusal is not None:
            self._refused = (
                problems.anonymous_share_taken(work.wait_s)
                if refusal is Refusal.ANONYMOUS_SHARE
                else problems.busy(work.wait_s)
            )
            work.refusals[refusal].inc()
            raise ProblemError(self._refused)
        self._caller = caller
        work.admissions[caller].inc()

    def _admit_from_thread(self) -> None:
        """`admit`, from the worker thread where the first piece of cold work starts (a
        batch's); a refused request is refused again without asking."""
        if self._caller is not None:
            return
        if self._refused is not None:
            raise ProblemError(self._refused)
        anyio.from_thread.run(self.admit)

    def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`fn(*args, **kwargs)` in the worker thread, its cold work counted against the
        request's allowance."""
        with allowing_cold_work(self.allowance):
            return fn(*args, **kwargs)

    async def __aenter__(self) -> ColdWorkClaim:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self.allowance.refused:
            self._work.refusals[Refusal.BUDGET].inc()
        if self._caller is not None:
            self._work.slots.release(self._caller)


def authorization(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The first Authorization header of an ASGI scope's `headers`."""
    for name, value in headers:
        if name == b"authorization":
            found: str = value.decode("latin-1")
            return found
    return None
