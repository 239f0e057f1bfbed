"""The model catalog: published config.json values per architecture, resolved by model id.

Each `models/<org>--<name>.json` holds one architecture: its Hub id, aliases, the config values
as published (with their URL) and the published parameter total (with its source).
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from importlib import resources
from importlib.resources.abc import Traversable
from types import MappingProxyType
from typing import Any, TypeVar

from service.core.arch import ModelArch
from service.core.arch.hf_config import from_hf_config
from service.core.errors import UnknownModelError

T = TypeVar("T")

SUGGESTION_COUNT = 3
# Fine-tuned variants that share their base's architecture: "-Instruct", "-Chat", "-it",
# also before a trailing "-hf" (meta-llama/Llama-2-7b-chat-hf -> meta-llama/Llama-2-7b-hf).
_VARIANT_SUFFIX = re.compile(r"-(?:instruct|chat|it)(?=(?:-hf)?$)")


class CatalogDataError(ValueError):
    """A catalog data file is malformed; the message names the file and the field."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CatalogEntry:
    """One architecture of the catalog, with where its numbers come from."""

    id: str
    aliases: tuple[str, ...]
    config: Mapping[str, Any]
    arch: ModelArch
    source: str
    published_params: int
    published_params_source: str

    def __post_init__(self) -> None:
        if "/" not in self.id:
            raise CatalogDataError(f"id {self.id!r} must be '<org>/<name>'")
        if self.published_params < 1:
            raise CatalogDataError(f"{self.id}: published_params must be positive")
        if not self.source or not self.published_params_source:
            raise CatalogDataError(f"{self.id}: source and published_params_source are required")


def arch_from_config(raw: Mapping[str, Any]) -> ModelArch:
    """The architecture of a raw config.json (as the API and CLI accept it)."""
    return from_hf_config(raw)


def _org_less(model_id: str) -> str:
    return model_id.rsplit("/", 1)[-1]


class ModelCatalog:
    """Resolves model ids (case-insensitive, with or without the organisation) to entries."""

    def __init__(self, entries: Iterable[CatalogEntry]) -> None:
        self._entries = tuple(sorted(entries, key=lambda e: e.id.lower()))
        self._by_key: dict[str, CatalogEntry] = {}
        for entry in self._entries:
            for key in (entry.id, *entry.aliases):
                self._add_key(key.lower(), entry)
        # Org-less names resolve only when exactly one entry claims them.
        org_less: dict[str, set[str]] = {}
        for entry in self._entries:
            for key in (entry.id, *entry.aliases):
                org_less.setdefault(_org_less(key).lower(), set()).add(entry.id)
        self._by_name = {
            name: self._by_key[ids.pop().lower()] for name, ids in org_less.items() if len(ids) == 1
        }

    def _add_key(self, key: str, entry: CatalogEntry) -> None:
        other = self._by_key.get(key)
        if other is not None and other is not entry:
            raise CatalogDataError(f"{key!r} names both {other.id} and {entry.id}")
        self._by_key[key] = entry

    def entries(self) -> tuple[CatalogEntry, ...]:
        return self._entries

    def resolve(self, model_id: str) -> CatalogEntry:
        """The entry for `model_id`; a fine-tuned "-Instruct"/"-Chat"/"-it" id falls back to
        its base. Raises UnknownModelError with the closest ids."""
        key = model_id.strip().lower()
        entry = self._lookup(key)
        if entry is None:
            base = _VARIANT_SUFFIX.sub("", key)
            if base != key:
                entry = self._lookup(base)
        if entry is None:
            raise UnknownModelError(model_id, self.suggestions(model_id))
        return entry

    def _lookup(self, key: str) -> CatalogEntry | None:
        if "/" in key:
            return self._by_key.get(key)
        return self._by_name.get(key)

    def suggestions(self, model_id: str) -> tuple[str, ...]:
        """The catalog ids closest to `model_id` (difflib ratio on full and org-less names)."""
        query = model_id.strip().lower()
        bare = _org_less(query)
        scores: dict[str, float] = {}
        for entry in self._entries:
            for key in (entry.id, *entry.aliases):
                low = key.lower()
                score = max(
                    difflib.SequenceMatcher(None, query, low).ratio(),
                    difflib.SequenceMatcher(None, bare, _org_less(low)).ratio(),
                )
                scores[entry.id] = max(score, scores.get(entry.id, 0.0))
        ranked = sorted(scores, key=lambda entry_id: (-scores[entry_id], entry_id))
        return tuple(ranked[:SUGGESTION_COUNT])

    @classmethod
    def from_directory(cls, directory: Traversable) -> ModelCatalog:
        """Load every `*.json` file of `directory` (a path or a package resource)."""
        files = sorted(
            (f for f in directory.iterdir() if f.name.endswith(".json")), key=lambda f: f.name
        )
        return cls(_load_entry(f.name, f.read_text(encoding="utf-8")) for f in files)


def _load_entry(filename: str, text: str) -> CatalogEntry:
    try:
        return _parse_entry(filename, text)
    except ValueError as exc:  # CatalogDataError, JSONDecodeError, the core's InvalidConfigError
        raise CatalogDataError(f"{filename}: {exc}") from exc


def _parse_entry(filename: str, text: str) -> CatalogEntry:
    doc = json.loads(text)
    if not isinstance(doc, dict):
        raise CatalogDataError("must hold a JSON object")
    model_id = _field(doc, "id", str)
    aliases = _field(doc, "aliases", list)
    config = _field(doc, "config", dict)
    if not all(isinstance(alias, str) for alias in aliases):
        raise CatalogDataError("'aliases' must be strings")
    expected_name = model_id.replace("/", "--") + ".json"
    if filename != expected_name:
        raise CatalogDataError(f"the entry for {model_id} belongs in {expected_name}")
    return CatalogEntry(
        id=model_id,
        aliases=tuple(aliases),
        config=MappingProxyType(config),
        arch=from_hf_config(config),
        source=_field(doc, "source", str),
        published_params=_field(doc, "published_params", int),
        published_params_source=_field(doc, "published_params_source", str),
    )


def _field(doc: Mapping[str, Any], name: str, kind: type[T]) -> T:
    value = doc.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise CatalogDataError(f"{name!r} must be a {kind.__name__}")
    return value


@cache
def default_catalog() -> ModelCatalog:
    """The catalog shipped with the package (`service/catalog/models/*.json`)."""
    return ModelCatalog.from_directory(resources.files("service.catalog") / "models")
