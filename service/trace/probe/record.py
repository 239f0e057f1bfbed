"""Measuring one case: a record of its peaks, and the allocator's history."""

from __future__ import annotations

import gzip
import json
import os
import tempfile
import time
import traceback
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.trace.probe.cases import ProbeCase, Runner, check_probeable
from service.trace.probe.readings import CudaReadings, DeviceReadings
from service.trace.probe.steps import build_on_device, run_loop, run_trainer, training_arguments

# The allocator's event kinds (TraceEntry::Action, c10/cuda/CUDACachingAllocator.h), coded.
TRACE_ACTIONS = {
    "alloc": 0,
    "free_requested": 1,
    "free_completed": 2,
    "segment_alloc": 3,
    "segment_free": 4,
    "segment_map": 5,
    "segment_unmap": 6,
    "snapshot": 7,
    "oom": 8,
}


# -- measuring ------------------------------------------------------------------------------


@dataclass(slots=True)
class ProbeRun:
    """A finished run: its record, the trained model (still on the device) and the
    TrainingArguments that describe the run, for the reporter's derivation of the job."""

    record: dict[str, Any]
    model: Any
    arguments: Any


def new_record(case: ProbeCase, *, base_used: int) -> dict[str, Any]:
    """The record of `case` before it runs."""
    from service.trace.reference import spec_to_json

    return {
        "name": case.name,
        "model": case.model_id,
        "spec": spec_to_json(case.spec),
        "runner": case.runner,
        "alloc_conf": case.alloc_conf,
        "base_used": base_used,
    }


def run_case(
    case: ProbeCase,
    config: Mapping[str, Any],
    record: dict[str, Any],
    readings: DeviceReadings,
    *,
    trace_dir: Path | None = None,
) -> ProbeRun:
    """Build and run `case` in this process (CUDA not yet initialised), filling `record` as it
    goes; raises what the run raises (an OOM included), leaving in `record` what was read."""
    base_used = int(record["base_used"])
    if case.alloc_conf:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = case.alloc_conf
    runner = Runner(case.runner)
    check_probeable(case.spec, runner)
    readings.start()
    try:
        record["context_used"] = readings.used() - base_used
        if trace_dir is not None:
            _start_allocator_history()
        t0 = time.time()
        built = build_on_device(case.spec, config, readings.device)
        readings.synchronize()
        record["build_seconds"] = round(time.time() - t0, 2)
        model = built.model
        record["params_total"] = sum(p.numel() for p in model.parameters())
        record["params_trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        record["weights_allocated"] = readings.allocated()
        record["weights_reserved"] = readings.reserved()
        record["weights_used"] = readings.used() - base_used
        with tempfile.TemporaryDirectory(prefix="vramcast-probe-") as output_dir:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the libraries' deprecation notices
                if runner is Runner.TRAINER:
                    arguments = training_arguments(case.spec, readings.device, output_dir)
                    run_trainer(model, case.spec, record, arguments, readings)
                else:
                    run_loop(model, case.spec, record, readings)
            readings.synchronize()
            record["end_used"] = readings.used() - base_used
            record["end_reserved"] = readings.reserved()
            if runner is Runner.LOOP:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    arguments = training_arguments(case.spec, readings.device, output_dir)
    finally:
        readings.stop()
    stats = readings.stats()
    record["device_peak"] = readings.used_peak() - base_used
    record["max_allocated"] = max(s["max_allocated"] for s in record["steps"])
    record["max_reserved"] = max(s["max_reserved"] for s in record["steps"])
    record["alloc_retries"] = int(stats.get("num_alloc_retries", 0))
    record["ooms"] = int(stats.get("num_ooms", 0))
    record["segments"] = int(stats.get("segment.all.current", 0))
    record["versions"] = readings.versions()
    if trace_dir is not None:
        _dump_allocator_trace(trace_dir / f"{case.name}.json.gz")
    return ProbeRun(record=record, model=model, arguments=arguments)


def measure(
    case: ProbeCase,
    config: Mapping[str, Any],
    *,
    base_used: int,
    trace_dir: Path | None = None,
    readings: DeviceReadings | None = None,
) -> dict[str, Any]:
    """Build and run `case` in this process (CUDA not yet initialised); its record, with
    `error` and `trace` when it failed. Without `readings`, the local CUDA GPU's."""
    record = new_record(case, base_used=base_used)
    try:
        run_case(case, config, record, readings or CudaReadings(), trace_dir=trace_dir)
    except BaseException as error:  # every failure is data
        record["error"] = f"{type(error).__name__}: {error}"[:600]
        record["trace"] = traceback.format_exc()[-2500:]
    return record


def _start_allocator_history() -> None:
    import torch

    torch.cuda.memory._record_memory_history(
        enabled="all", context=None, stacks="python", max_entries=10_000_000
    )


def _dump_allocator_trace(path: Path) -> None:
    """The allocator's events as [action code, address, size] rows, gzipped JSON."""
    import torch

    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    events = snapshot["device_traces"][0]
    rows = [
        [TRACE_ACTIONS.get(e["action"], -1), int(e.get("addr", 0)), int(e.get("size", 0))]
        for e in events
    ]
    segments = [
        [int(s.get("address", 0)), int(s.get("total_size", 0)), int(s.get("allocated_size", 0))]
        for s in snapshot["segments"]
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        json.dump({"actions": TRACE_ACTIONS, "events": rows, "segments": segments}, f)
