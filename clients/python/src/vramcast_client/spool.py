"""Uploads that could not be delivered, kept on local disk until the next run sends them.

One JSON file per upload, named by its Idempotency-Key, written atomically (a temporary
file renamed into place), so a crash never leaves half an upload. Ranks of one node may
share the directory: the key makes a duplicate send harmless, and a file another rank
already removed is skipped. Uploads the service refuses for good move to `rejected/`.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SPOOL_DIR_ENV = "VRAMCAST_SPOOL_DIR"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def default_spool_dir() -> Path:
    """$VRAMCAST_SPOOL_DIR, else $XDG_CACHE_HOME/vramcast/pending (~/.cache by default)."""
    configured = os.environ.get(SPOOL_DIR_ENV)
    if configured:
        return Path(configured)
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "vramcast" / "pending"


@dataclass(frozen=True, slots=True, kw_only=True)
class PendingUpload:
    path: Path
    idempotency_key: str
    body: dict[str, Any]


class Spool:
    def __init__(self, directory: Path | str) -> None:
        self.directory = Path(directory)

    def put(self, idempotency_key: str, body: dict[str, Any]) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"{_UNSAFE.sub('_', idempotency_key)}.json"
        record = {"idempotency_key": idempotency_key, "body": body}
        _write_atomically(path, json.dumps(record, indent=1, sort_keys=True))
        return path

    def pending(self) -> Iterator[PendingUpload]:
        """The uploads waiting, oldest first; unreadable files are moved to `rejected/`."""
        if not self.directory.is_dir():
            return
        paths = sorted(self.directory.glob("*.json"), key=_mtime)
        for path in paths:
            try:
                record = json.loads(path.read_text())
                item = PendingUpload(
                    path=path, idempotency_key=str(record["idempotency_key"]), body=record["body"]
                )
            except FileNotFoundError:
                continue  # another rank sent it
            except (OSError, ValueError, KeyError, TypeError) as error:
                self.reject(path, f"unreadable: {error}")
                continue
            yield item

    def remove(self, path: Path) -> None:
        path.unlink(missing_ok=True)

    def reject(self, path: Path, reason: str) -> None:
        """Keep a refused upload aside, with the reason, instead of sending it again."""
        rejected = self.directory / "rejected"
        rejected.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(path, rejected / path.name)
        except FileNotFoundError:
            return
        (rejected / f"{path.name}.reason.txt").write_text(reason + "\n")


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _write_atomically(path: Path, text: str) -> None:
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
