"""Service settings, read from the environment (`VRAMCAST_` prefix) or passed to `create_app`.

`python -m service.api.settings --markdown` prints them as the table the manual lists
(docs/settings.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pydantic import Field, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.core.units import MIB
from service.store.db import DEFAULT_DATABASE_URL, STORE_ANSWER_S


class Settings(BaseSettings):
    """Everything an operator may change; the defaults run one process on loopback."""

    model_config = SettingsConfigDict(env_prefix="VRAMCAST_", extra="forbid", frozen=True)

    database_url: str = Field(
        default=DEFAULT_DATABASE_URL,
        min_length=1,
        description="SQLAlchemy URL of the store: embedded SQLite by default, or PostgreSQL.",
    )
    max_body_bytes: int = Field(
        default=1 * MIB,
        ge=1024,
        le=64 * MIB,
        description="Largest request body accepted; larger ones get 413.",
    )
    host: str = Field(default="127.0.0.1", min_length=1, description="Address to listen on.")
    port: int = Field(default=8000, ge=1, le=65535, description="TCP port to listen on.")
    estimate_cache_entries: int = Field(
        default=4096,
        ge=0,
        le=1_000_000,
        description="Answers to repeated POST /v1/estimates bodies kept (least recently used "
        "leave first; new calibration factors make them stale); 0 keeps none.",
    )
    store_timeout_s: float = Field(
        default=STORE_ANSWER_S,
        ge=0.5,
        le=60.0,
        description="Seconds the service waits for one answer of PostgreSQL (a statement, a "
        "commit, a ping) before giving up on it: with the default, a request that needs the "
        "store answers within 5 s (503 with Retry-After) even when the database hangs. The "
        "server cancels a statement at 3/4 of it (`statement_timeout`).",
    )
    require_read_key: bool = Field(
        default=True,
        description="GET /v1/calibrations and /v1/factors need a key with the read scope "
        "(they list node and run ids); false opens them. Estimates, fit-checks and the "
        "catalogs stay open: they must answer while the store is down. A read key the store "
        "verified is taken for 30 s without asking it again, and for 15 min while it cannot "
        "be reached, so GET /v1/factors answers during an outage (an unknown key: 503).",
    )
    cold_work_slots: int = Field(
        default=2,
        ge=1,
        le=64,
        description="Requests doing cold work (running a job's step or replaying the allocator "
        "model: estimates, fit-checks and batches not answered from what is kept) at once in "
        "the process; warm requests take no slot.",
    )
    cold_work_anonymous_slots: int = Field(
        default=1,
        ge=0,
        le=63,
        description="Of those slots, how many requests without a live API key (Authorization: "
        "Bearer) may hold together; below cold_work_slots, so that keyed callers always have "
        "one. 0 keeps cold work to keyed callers.",
    )
    cold_work_wait_s: float = Field(
        default=2.0,
        ge=0.0,
        le=60.0,
        description="Longest a request waits for a slot (its key checked included); then 503 "
        "busy, or 429 anonymous-share-taken when it is the keyless callers' share that is taken.",
    )
    cold_work_budget_s: float = Field(
        default=20.0,
        ge=0.1,
        le=600.0,
        description="Seconds of cold work a request may do once it starts; work that would "
        "start later gets 503 budget-exceeded (a batch's job: its own entry), what was computed "
        "is kept and a retry continues. A piece already started ends first (one step's run or "
        "allocator replay).",
    )
    manual_dir: Path | None = Field(
        default=None,
        description="Directory of the built manual, served at /manual/ (`make docs` builds it); "
        "unset: service/web/manual/ in the package.",
    )

    @model_validator(mode="after")
    def _keyed_callers_keep_a_slot(self) -> Settings:
        if self.cold_work_anonymous_slots >= self.cold_work_slots:
            raise ValueError(
                f"cold_work_anonymous_slots ({self.cold_work_anonymous_slots}) must be below "
                f"cold_work_slots ({self.cold_work_slots}): keyed callers keep a slot"
            )
        return self


def _default(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _bounds(field: FieldInfo) -> str:
    low = high = None
    for constraint in field.metadata:
        low = getattr(constraint, "ge", None) if low is None else low
        high = getattr(constraint, "le", None) if high is None else high
    if low is not None and high is not None:
        return f"{low} to {high}"
    return ""


def settings_table() -> str:
    """The settings as a Markdown table: variable, default, range, what it does (the manual's
    docs/settings.md lists it)."""
    prefix = Settings.model_config.get("env_prefix", "")
    lines = ["| variable | default | range | what |", "|---|---|---|---|"]
    for name, field in Settings.model_fields.items():
        description = (field.description or "").replace("|", "\\|")
        lines.append(
            f"| `{prefix}{name.upper()}` | `{_default(field.default)}` | {_bounds(field)} "
            f"| {description} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m service.api.settings", description="The service's settings."
    )
    parser.add_argument(
        "--markdown", action="store_true", help="print them as the manual's Markdown table"
    )
    args = parser.parse_args(argv)
    if not args.markdown:
        parser.print_help()
        return 2
    sys.stdout.write(settings_table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
