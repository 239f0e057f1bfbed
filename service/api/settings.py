"""Service settings, read from the environment (`VRAMCAST_` prefix) or passed to `create_app`."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.core.units import MIB
from service.store.db import DEFAULT_DATABASE_URL


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
    require_read_key: bool = Field(
        default=False,
        description="GET /v1/calibrations and /v1/factors need a key with the read scope. "
        "Estimates and fit-checks stay open: they must answer while the store is down.",
    )
