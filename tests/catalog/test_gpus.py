from __future__ import annotations

import csv
import io
from importlib import resources

import pytest

from service.catalog.gpus import (
    Gpu,
    GpuCatalog,
    GpuCatalogDataError,
    UnknownGpuError,
    default_gpu_catalog,
)
from service.core.units import MIB


def test_every_row_of_the_packaged_csv_loads() -> None:
    text = (resources.files("service.catalog") / "gpus.csv").read_text(encoding="utf-8")
    rows = list(csv.DictReader(io.StringIO(text)))
    catalog = default_gpu_catalog()
    assert [gpu.name for gpu in catalog.gpus()] == [row["name"] for row in rows]
    assert all(gpu.source for gpu in catalog.gpus())


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("H100-SXM", "H100-SXM"),
        ("h100-sxm", "H100-SXM"),
        ("NVIDIA H100 80GB HBM3", "H100-SXM"),
        ("nvidia h100 80gb hbm3", "H100-SXM"),
        ("H100 80GB HBM3", "H100-SXM"),
        ("NVIDIA  H100   80GB HBM3 ", "H100-SXM"),
        ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
        ("A100-SXM4-80GB", "A100-80GB"),
        ("NVIDIA H200 NVL", "H200-NVL"),
        ("Tesla T4", "T4"),
        ("T4", "T4"),
        ("NVIDIA GeForce RTX 4090", "RTX4090"),
        ("RTX 4090", "RTX4090"),
        ("H100 SXM", "H100-SXM"),
    ],
)
def test_resolve_by_catalog_or_driver_name(query: str, expected: str) -> None:
    assert default_gpu_catalog().resolve(query).name == expected


def test_unknown_gpu_suggests_the_closest_names() -> None:
    with pytest.raises(UnknownGpuError) as caught:
        default_gpu_catalog().resolve("H300")
    error = caught.value
    assert isinstance(error, LookupError)
    assert len(error.suggestions) == 3
    assert "H200" in error.suggestions
    assert "H300" in str(error)


def test_by_memory_mib_matches_the_reported_total_exactly() -> None:
    catalog = default_gpu_catalog()
    gpu = catalog.by_memory_mib(23034)
    assert gpu is not None
    assert gpu.name == "L4"
    assert catalog.by_memory_mib(23035) is None
    assert catalog.by_memory_mib(0) is None


def test_a_total_several_gpus_report_returns_the_first_and_lists_all() -> None:
    catalog = default_gpu_catalog()
    assert {gpu.name for gpu in catalog.matching_memory_mib(81559)} == {
        "H100-SXM",
        "H100-PCIe",
        "H800",
    }
    first = catalog.by_memory_mib(81559)
    assert first is not None
    assert first.name == "H100-SXM"


def test_memory_bytes_are_the_mib_total() -> None:
    for gpu in default_gpu_catalog().gpus():
        assert gpu.memory_bytes == gpu.memory_mib * MIB


def _gpu(**overrides: object) -> Gpu:
    fields: dict[str, object] = {
        "name": "X1",
        "driver_name": "NVIDIA X1",
        "memory_mib": 1024,
        "memory_bytes": 1024 * MIB,
        "bf16": True,
        "fp8": False,
        "compute_capability": "9.0",
        "source": "test",
    }
    return Gpu(**{**fields, **overrides})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "overrides",
    [
        {"memory_bytes": 1024 * MIB + 1},
        {"memory_mib": 0, "memory_bytes": 0},
        {"compute_capability": "9"},
        {"source": ""},
        {"driver_name": ""},
    ],
)
def test_invalid_gpus_are_refused(overrides: dict[str, object]) -> None:
    with pytest.raises(GpuCatalogDataError):
        _gpu(**overrides)


def test_a_name_two_gpus_claim_is_refused() -> None:
    with pytest.raises(GpuCatalogDataError, match="names both"):
        GpuCatalog([_gpu(), _gpu(name="X1-bis")])


HEADER = "name,driver_name,memory_mib,memory_bytes,bf16,fp8,source,compute_capability,notes\n"


def test_from_csv_reports_the_line_of_a_bad_row() -> None:
    text = HEADER + f"X1,NVIDIA X1,1024,{1024 * MIB},yes,false,test,9.0,\n"
    with pytest.raises(GpuCatalogDataError, match="line 2"):
        GpuCatalog.from_csv(text)


def test_from_csv_needs_every_column() -> None:
    with pytest.raises(GpuCatalogDataError, match="source"):
        GpuCatalog.from_csv("name,driver_name,memory_mib,memory_bytes,bf16,fp8\n")
