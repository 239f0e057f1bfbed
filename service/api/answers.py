"""Answers to repeated estimate requests, kept encoded.

A scheduler asks about the same pending jobs on every scheduling cycle, byte for byte. An
estimate is a pure function of the request body and the calibration factors in force, so the
encoded answer is kept, keyed by the body, and given again while the factors are the same
ones (`FactorProvider.generation`); a new factor table or state makes every kept answer stale.
Least recently used answers leave first. Errors are never kept: they are cheap to redo.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

# Bodies longer than this are answered but not kept (an inline config.json is about 1-2 KiB),
# so the cache holds at most `entries` x (this + an answer of about 2 KiB).
MAX_KEPT_BODY_BYTES = 8 * 1024


class Answer(NamedTuple):
    content: bytes  # the encoded response body
    model: str  # the metrics label of the estimate
    generation: object  # the calibration factors it was computed with


class AnswerCache:
    """Least-recently-used encoded answers; `entries` = 0 keeps none. Used from the event
    loop's thread only (async routes), so it takes no lock."""

    def __init__(self, entries: int) -> None:
        self.entries = entries
        self._answers: OrderedDict[bytes, Answer] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, body: bytes, generation: object) -> Answer | None:
        found = self._answers.get(body)
        if found is None or found.generation is not generation:
            self.misses += 1
            return None
        self._answers.move_to_end(body)
        self.hits += 1
        return found

    def put(self, body: bytes, answer: Answer) -> None:
        if self.entries <= 0 or len(body) > MAX_KEPT_BODY_BYTES:
            return
        self._answers[body] = answer
        self._answers.move_to_end(body)
        while len(self._answers) > self.entries:
            self._answers.popitem(last=False)

    def __len__(self) -> int:
        return len(self._answers)
