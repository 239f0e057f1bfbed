"""`make bench`: the API and core benchmark, then the tracer's and the store's where present.

Each part prints its own table; a part whose module or dependencies are missing is skipped
with a note.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any


def _optional(module: str, needs: tuple[str, ...] = ()) -> Any | None:
    """`module`'s run(), or None (with the reason printed) when it or what it needs is absent."""
    if importlib.util.find_spec(module) is None:
        return None
    missing = [name for name in needs if importlib.util.find_spec(name) is None]
    if missing:
        print(f"\n{module}: skipped ({', '.join(missing)} not installed)")
        return None
    return importlib.import_module(module).run


def _show(title: str, result: Any) -> None:
    print(f"\n{title}")
    if isinstance(result, dict):
        for key, value in result.items():
            print(f"  {key:<28}{value}")
    elif isinstance(result, list | tuple):
        for line in result:
            print(line if isinstance(line, str) else f"  {line}")
    elif result is not None:
        print(f"  {result}")


def main() -> None:
    from bench import api_bench

    print("\n".join(api_bench.run()))
    for module, needs, title in (
        ("bench.trace_bench", ("torch",), "Reference tracer"),
        ("bench.store_bench", (), "Store"),
        ("bench.allocator_bench", (), "Allocator model"),
    ):
        run = _optional(module, needs)
        if run is not None:
            _show(title, run())


if __name__ == "__main__":
    main()
