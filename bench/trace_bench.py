"""How long one 7B reference trace takes on this machine, and how much host memory it needs."""

from __future__ import annotations

import resource
import sys
import time
from typing import Any

from service.core.spec import LoraSpec, Method, TrainingSpec

BENCH_MODEL = "Qwen/Qwen2.5-7B"
# The first case of tests/trace/test_references.py's table of recorded peaks.
BENCH_SPEC = TrainingSpec(
    method=Method.LORA,
    batch_size=1,
    seq_len=512,
    gradient_checkpointing=True,
    lora=LoraSpec(r=16, lora_alpha=32, target_modules="all-linear"),
)
# ru_maxrss is in KiB on Linux and in bytes on macOS (getrusage(2)).
_MAXRSS_UNIT = 1 if sys.platform == "darwin" else 1024


def run() -> dict[str, Any]:
    """Trace one 7B LoRA step pair; wall time of the trace and the process's peak RSS."""
    from service.catalog.models import default_catalog
    from service.trace.runner import trace

    entry = default_catalog().resolve(BENCH_MODEL)
    started = time.perf_counter()
    result = trace(BENCH_SPEC, entry.config, entry.id)
    seconds = time.perf_counter() - started
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * _MAXRSS_UNIT
    return {
        "name": "trace_7b_lora",
        "model": entry.id,
        "seconds": round(seconds, 2),
        "peak_rss_bytes": rss,
        "traced_peak_bytes": result.peak.allocated_bytes,
    }


if __name__ == "__main__":
    print(run())
