"""The estimator against real training steps measured on an H200 (tests/data/gpu/README.md): each
run's allocated, reserved and device peaks, and whether the safe bound held.

Measured levels: allocated and reserved are the highest `max_memory_allocated()` /
`max_memory_reserved()` of the two steps; device is NVML's used memory at the end of step 2 less
what the GPU used before the process started (`end_used`).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from service.catalog.models import default_catalog
from service.core.allocator import parse_alloc_conf
from service.core.estimator import estimate
from service.core.result import Estimate
from service.core.spec import (
    AttnImpl,
    LoraSpec,
    Method,
    Optim,
    QuantSpec,
    QuantType,
    TrainingSpec,
)
from service.core.units import DType

GPU_DIR = Path(__file__).resolve().parents[1] / "data" / "gpu"
H200_COMPUTE_CAPABILITY = "9.0"

ALLOCATED_WORST = 0.01
ALLOCATED_MEDIAN = 0.005
LEVEL_WORST = 0.05  # reserved and device
LEVEL_MEDIAN = 0.02

# Runs the estimator does not yet meet the bounds on, with the bound each level holds and why;
# a gap that grows fails, and one that closes fails too, so this list only shrinks.


@dataclass(frozen=True)
class Gap:
    allocated: float
    reserved: float
    device: float
    upper_holds: bool
    why: str


KNOWN_GAPS: dict[str, Gap] = {}

SET1_OPTIM = {
    "fused": Optim.ADAMW_TORCH_FUSED,
    "foreach": Optim.ADAMW_TORCH,
    "bnb8": Optim.ADAMW_BNB_8BIT,
    "paged8": Optim.PAGED_ADAMW_8BIT,
}


def _set1_spec(record: dict[str, Any]) -> TrainingSpec:
    """Set 1's runs as its README describes them (options b, s, gc, r, adapter, optim, attn,
    runner)."""
    options = record["options"]
    method = Method(record["method"])
    lora = None
    if method is not Method.FULL:
        lora = LoraSpec(
            r=options.get("r", 16),
            lora_alpha=32,
            lora_dropout=0.0,
            target_modules="all-linear",
            adapter_dtype=DType.BF16 if options.get("adapter") == "bf16" else None,
        )
    quant = None
    if method is Method.QLORA:
        quant = QuantSpec(type=QuantType.NF4, double_quant=True, prepare_kbit=True)
    return TrainingSpec(
        method=method,
        batch_size=options["b"],
        seq_len=options["s"],
        gradient_checkpointing=options["gc"],
        lora=lora,
        quantization=quant,
        optim=SET1_OPTIM[options.get("optim", "fused")],
        attn_implementation=AttnImpl(options.get("attn", "sdpa")),
        autocast=options.get("runner") == "trainer",
        # the loop clipped nothing; Trainer clips to its default max_grad_norm
        max_grad_norm=1.0 if options.get("runner") == "trainer" else 0.0,
    )


def _set2_spec(record: dict[str, Any]) -> TrainingSpec:
    from dataclasses import replace

    from service.trace.reference import spec_from_json

    spec = spec_from_json(record["spec"])
    # these probe runs' loop clipped nothing; Trainer clips to its default max_grad_norm
    clip = 1.0 if record["runner"] == "trainer" else 0.0
    return replace(
        spec, allocator=parse_alloc_conf(record.get("alloc_conf", "")), max_grad_norm=clip
    )


@dataclass(frozen=True)
class Run:
    name: str
    model: str
    spec: TrainingSpec
    allocated: int
    reserved: int
    device: int


def _runs() -> list[Run]:
    runs = []
    for line in (GPU_DIR / "h200_set1.jsonl").read_text().splitlines():
        record = json.loads(line)
        runs.append(_run("set1", record, record["model"].replace("--", "/"), _set1_spec(record)))
    for name in ("set2", "set3"):
        for line in (GPU_DIR / f"h200_{name}.jsonl").read_text().splitlines():
            record = json.loads(line)
            runs.append(_run(name, record, record["model"], _set2_spec(record)))
    return runs


def _run(prefix: str, record: dict[str, Any], model: str, spec: TrainingSpec) -> Run:
    return Run(
        name=f"{prefix}/{record['name']}",
        model=model,
        spec=spec,
        allocated=record["max_allocated"],
        reserved=record["max_reserved"],
        device=record["end_used"],
    )


@pytest.fixture(scope="module")
def compared() -> list[tuple[Run, Estimate]]:
    catalog = default_catalog()
    runs = _runs()
    assert len(runs) == 46, "the measured runs are missing"
    return [
        (
            run,
            estimate(
                catalog.resolve(run.model).arch,
                run.spec,
                compute_capability=H200_COMPUTE_CAPABILITY,
            ),
        )
        for run in runs
    ]


def _errors(run: Run, est: Estimate) -> tuple[float, float, float]:
    return (
        est.allocated_bytes / run.allocated - 1,
        est.reserved_bytes / run.reserved - 1,
        est.device_bytes / run.device - 1,
    )


def test_each_level_on_every_measured_run(
    compared: list[tuple[Run, Estimate]], capsys: pytest.CaptureFixture[str]
) -> None:
    lines = [
        f"{'run':<42}{'allocated':>10}{'reserved':>10}{'device':>10}  safe bound",
    ]
    misses: list[str] = []
    by_level: dict[str, list[float]] = {"allocated": [], "reserved": [], "device": []}
    for run, est in compared:
        errors = _errors(run, est)
        held = est.device_bytes_upper >= run.device
        gap = KNOWN_GAPS.get(run.name)
        lines.append(
            f"{run.name:<42}"
            + "".join(f"{e:>+10.2%}" for e in errors)
            + f"  {'held' if held else 'BELOW'}"
            + (f"  (known: {gap.why})" if gap else "")
        )
        if gap is None:
            for level, error in zip(by_level, errors, strict=True):
                by_level[level].append(abs(error))
            bounds = (ALLOCATED_WORST, LEVEL_WORST, LEVEL_WORST)
            if not held:
                misses.append(f"{run.name}: the safe bound is below the measured device level")
        else:
            bounds = (gap.allocated, gap.reserved, gap.device)
            within = all(
                abs(e) <= b
                for e, b in zip(errors, (ALLOCATED_WORST, LEVEL_WORST, LEVEL_WORST), strict=True)
            )
            if within and held:
                misses.append(f"{run.name}: now within the bounds; drop it from KNOWN_GAPS")
            if held != gap.upper_holds:
                now = "now holds" if held else "no longer holds"
                misses.append(f"{run.name}: the safe bound {now}; update KNOWN_GAPS")
        for level, error, bound in zip(by_level, errors, bounds, strict=True):
            if abs(error) > bound:
                misses.append(f"{run.name}: {level} {error:+.2%} (bound {bound:.1%})")
    medians = {level: statistics.median(values) for level, values in by_level.items()}
    lines.append(
        "median |error| (known gaps aside): "
        + ", ".join(f"{level} {value:.2%}" for level, value in medians.items())
    )
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    assert not misses, "\n".join(misses)
    assert medians["allocated"] <= ALLOCATED_MEDIAN
    assert medians["reserved"] <= LEVEL_MEDIAN
    assert medians["device"] <= LEVEL_MEDIAN


def test_the_safe_bound_is_exceeded_in_at_most_five_percent_of_runs(
    compared: list[tuple[Run, Estimate]],
) -> None:
    below = [run.name for run, est in compared if est.device_bytes_upper < run.device]
    assert len(below) <= 0.05 * len(compared), below
