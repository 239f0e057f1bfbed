"""Progress of long commands (`vramcast trace --matrix`): a tqdm bar on stderr while stderr is
a terminal, nothing at all otherwise, so logs and pipes get only the command's own lines.
"""

from __future__ import annotations

import sys
from types import TracebackType
from typing import TextIO

from tqdm import tqdm


class Progress:
    """A bar of `total` steps; `echo` prints a line above it (or alone, with no bar)."""

    def __init__(self, total: int, description: str, *, unit: str = "it") -> None:
        stream: TextIO = sys.stderr
        self.shown = stream.isatty()
        self._bar = tqdm(
            total=total,
            desc=description,
            unit=unit,
            file=stream,
            disable=not self.shown,
            dynamic_ncols=True,
            leave=False,
        )

    def step(self) -> None:
        """One step done."""
        self._bar.update()

    def now(self, name: str) -> None:
        """Show what runs now beside the bar."""
        self._bar.set_postfix_str(name, refresh=True)

    def echo(self, line: str) -> None:
        """Print a line to stdout; with a bar, above it."""
        if self.shown:
            tqdm.write(line, file=sys.stdout)
        else:
            print(line)
        sys.stdout.flush()

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
