"""Measure a job's peaks on the local GPU: two real training steps on random weights.

The model is the one the tracer builds (`service.trace.model`: transformers' model from its
config.json, bitsandbytes' 4-bit layers, PEFT's preparation and adapters), made real on the GPU
with random values instead of fake tensors; memory depends on shapes and dtypes, not on values.
Each step is the plain loop (`loss = model(...).loss`, `backward`, gradient clipping when the
spec's `max_grad_norm` is above 0 as HF Trainer clips, `optimizer.step`,
`zero_grad(set_to_none=True)`), or HF `Trainer` itself (with bf16 or fp16 mixed precision when
the spec has autocast).

It reads the three levels a node measures, through a `DeviceReadings` (`CudaReadings` on a GPU;
tests pass their own and run the steps on CPU tensors):
- allocated and reserved: `torch.cuda.max_memory_allocated()` / `max_memory_reserved()`, per step
  (reset before each) and overall;
- device: NVML's used memory of the GPU, polled every `POLL_S` seconds from before the process
  touched CUDA, minus what was used then; `end_used` is the same reading at the end of step 2,
  when the reserved peak is still held (nothing is released without an allocator retry).

`vramcast probe` (service/cli/probe.py) measures one job and sets it against the estimate.
`python -m service.trace.probe --matrix` runs `MATRIX`, each case in a fresh process (its own CUDA
context), one JSON line per case as it finishes; `--allocator-trace DIR` also keeps the caching
allocator's own event history (torch.cuda.memory._record_memory_history) per case, compact.
"""

from service.trace.probe.cases import (
    MATRIX,
    NotProbeableError,
    ProbeCase,
    Runner,
    check_probeable,
    default_runner,
)
from service.trace.probe.matrix import environment_facts, main, run_matrix
from service.trace.probe.readings import (
    POLL_S,
    CudaReadings,
    DeviceReadings,
    NvmlPoller,
    nvml_used,
    open_cuda_readings,
    software_versions,
    versions,
)
from service.trace.probe.record import TRACE_ACTIONS, ProbeRun, measure, new_record, run_case
from service.trace.probe.steps import (
    STEPS,
    attention_kernel,
    build_on_device,
    make_probe_optimizer,
    run_loop,
    run_trainer,
    training_arguments,
)

__all__ = [
    "MATRIX",
    "POLL_S",
    "STEPS",
    "TRACE_ACTIONS",
    "CudaReadings",
    "DeviceReadings",
    "NotProbeableError",
    "NvmlPoller",
    "ProbeCase",
    "ProbeRun",
    "Runner",
    "attention_kernel",
    "build_on_device",
    "check_probeable",
    "default_runner",
    "environment_facts",
    "main",
    "make_probe_optimizer",
    "measure",
    "new_record",
    "nvml_used",
    "open_cuda_readings",
    "run_case",
    "run_loop",
    "run_matrix",
    "run_trainer",
    "software_versions",
    "training_arguments",
    "versions",
]
