"""The GPU catalog: total memory as the driver reports it, and what each GPU computes in.

`gpus.csv` holds one row per GPU with the source of its numbers. A GPU resolves by catalog
name ("H100-SXM"), by the name nvidia-smi prints ("NVIDIA H100 80GB HBM3"), or by the total
memory the node reports (MiB, as nvidia-smi and NVML print it).
"""

from __future__ import annotations

import csv
import difflib
import io
import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from importlib import resources

from service.core.units import MIB

SUGGESTION_COUNT = 3
_VENDOR_PREFIX = "nvidia "
_COMPUTE_CAPABILITY = re.compile(r"\d+\.\d+")
_NON_ALNUM = re.compile(r"[^a-z0-9]")
_COLUMNS = (
    "name",
    "driver_name",
    "memory_mib",
    "memory_bytes",
    "bf16",
    "fp8",
    "source",
    "compute_capability",
    "notes",
)


class GpuCatalogDataError(ValueError):
    """The GPU catalog file is malformed; the message names the row and the field."""


class UnknownGpuError(LookupError):
    """A GPU name matches nothing in the catalog; `suggestions` are the closest names."""

    def __init__(self, name: str, suggestions: tuple[str, ...] = ()) -> None:
        hint = f"; closest: {', '.join(suggestions)}" if suggestions else ""
        super().__init__(f"unknown GPU {name!r}{hint}")
        self.name = name
        self.suggestions = suggestions


@dataclass(frozen=True, slots=True, kw_only=True)
class Gpu:
    """One GPU model; `memory_mib`/`memory_bytes` are the total the driver reports."""

    name: str
    driver_name: str
    memory_mib: int
    memory_bytes: int
    bf16: bool
    fp8: bool
    compute_capability: str  # "major.minor", e.g. "9.0"
    source: str
    notes: str = ""

    def __post_init__(self) -> None:
        if not self.name or not self.driver_name:
            raise GpuCatalogDataError("name and driver_name are required")
        if self.memory_mib < 1:
            raise GpuCatalogDataError(f"{self.name}: memory_mib must be positive")
        if self.memory_bytes != self.memory_mib * MIB:
            raise GpuCatalogDataError(f"{self.name}: memory_bytes must equal memory_mib * MiB")
        if not _COMPUTE_CAPABILITY.fullmatch(self.compute_capability):
            raise GpuCatalogDataError(f"{self.name}: compute_capability must be 'major.minor'")
        if not self.source:
            raise GpuCatalogDataError(f"{self.name}: source is required")


def _normalize(name: str) -> str:
    """Case-, spacing- and vendor-prefix-insensitive form of a GPU name."""
    key = " ".join(name.split()).lower()
    return key.removeprefix(_VENDOR_PREFIX)


def _compact(name: str) -> str:
    """`_normalize` without separators: "RTX 4090" and "RTX4090" meet here."""
    return _NON_ALNUM.sub("", _normalize(name))


class GpuCatalog:
    """Resolves GPUs by catalog name, driver name or reported memory."""

    def __init__(self, gpus: Iterable[Gpu]) -> None:
        self._gpus = tuple(gpus)
        self._by_name: dict[str, Gpu] = {}
        for gpu in self._gpus:
            for key in {_normalize(gpu.name), _normalize(gpu.driver_name)}:
                other = self._by_name.get(key)
                if other is not None:
                    raise GpuCatalogDataError(f"{key!r} names both {other.name} and {gpu.name}")
                self._by_name[key] = gpu
        # Separator-free names are a fallback; one that two GPUs share resolves to neither.
        claims: dict[str, set[str]] = {}
        for gpu in self._gpus:
            for candidate in (gpu.name, gpu.driver_name):
                claims.setdefault(_compact(candidate), set()).add(gpu.name)
        by_catalog_name = {gpu.name: gpu for gpu in self._gpus}
        self._by_compact = {
            key: by_catalog_name[names.pop()] for key, names in claims.items() if len(names) == 1
        }

    def gpus(self) -> tuple[Gpu, ...]:
        return self._gpus

    def resolve(self, name: str) -> Gpu:
        """The GPU named `name`: catalog or nvidia-smi name, case-insensitive, "NVIDIA " prefix
        optional, spaces and hyphens optional."""
        gpu = self._by_name.get(_normalize(name)) or self._by_compact.get(_compact(name))
        if gpu is None:
            raise UnknownGpuError(name, self._suggestions(name))
        return gpu

    def by_memory_mib(self, memory_mib: int) -> Gpu | None:
        """The first catalog GPU whose reported total is exactly `memory_mib`, else None.

        Several GPUs report the same total (H100 SXM, H100 PCIe and H800 all report 81559 MiB;
        A40, L40 and L40S 46068 MiB): use `matching_memory_mib` or the driver name when the
        difference matters (fp8, compute capability).
        """
        matches = self.matching_memory_mib(memory_mib)
        return matches[0] if matches else None

    def matching_memory_mib(self, memory_mib: int) -> tuple[Gpu, ...]:
        """Every catalog GPU whose reported total is exactly `memory_mib`, in catalog order."""
        return tuple(gpu for gpu in self._gpus if gpu.memory_mib == memory_mib)

    def _suggestions(self, name: str) -> tuple[str, ...]:
        query = _normalize(name)
        scores: dict[str, float] = {}
        for gpu in self._gpus:
            scores[gpu.name] = max(
                difflib.SequenceMatcher(None, query, _normalize(candidate)).ratio()
                for candidate in (gpu.name, gpu.driver_name)
            )
        ranked = sorted(scores, key=lambda gpu_name: (-scores[gpu_name], gpu_name))
        return tuple(ranked[:SUGGESTION_COUNT])

    @classmethod
    def from_csv(cls, text: str) -> GpuCatalog:
        """Parse the catalog CSV (the columns of `gpus.csv`)."""
        reader = csv.DictReader(io.StringIO(text))
        missing = set(_COLUMNS) - set(reader.fieldnames or ())
        if missing:
            raise GpuCatalogDataError(f"gpus.csv lacks columns {sorted(missing)}")
        return cls(_parse_row(line, row) for line, row in enumerate(reader, start=2))


def _parse_row(line: int, row: dict[str, str]) -> Gpu:
    try:
        return Gpu(
            name=row["name"].strip(),
            driver_name=row["driver_name"].strip(),
            memory_mib=int(row["memory_mib"]),
            memory_bytes=int(row["memory_bytes"]),
            bf16=_parse_bool(row["bf16"]),
            fp8=_parse_bool(row["fp8"]),
            compute_capability=row["compute_capability"].strip(),
            source=row["source"].strip(),
            notes=row["notes"].strip(),
        )
    except ValueError as exc:
        raise GpuCatalogDataError(f"gpus.csv line {line}: {exc}") from exc


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value not in ("true", "false"):
        raise ValueError(f"expected true or false, got {text!r}")
    return value == "true"


@cache
def default_gpu_catalog() -> GpuCatalog:
    """The catalog shipped with the package (`service/catalog/gpus.csv`)."""
    text = (resources.files("service.catalog") / "gpus.csv").read_text(encoding="utf-8")
    return GpuCatalog.from_csv(text)
