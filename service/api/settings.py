"""Service settings, read from the environment (`VRAMCAST_` prefix) or passed to `create_app`.

`python -m service.api.settings --markdown` prints them as the table README.md lists.
"""

from __future__ import annotations

import argparse
import sys

from pydantic import Field
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
    """The settings as a Markdown table: variable, default, range, what it does (README lists
    it)."""
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
        "--markdown", action="store_true", help="print them as README's Markdown table"
    )
    args = parser.parse_args(argv)
    if not args.markdown:
        parser.print_help()
        return 2
    sys.stdout.write(settings_table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
