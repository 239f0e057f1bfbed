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

`vramcast probe` (service/trace/probe_cli.py) measures one job and sets it against the estimate.
`python -m service.trace.probe --matrix` runs `MATRIX`, each case in a fresh process (its own CUDA
context), one JSON line per case as it finishes; `--allocator-trace DIR` also keeps the caching
allocator's own event history (torch.cuda.memory._record_memory_history) per case, compact.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

from service.core.spec import (
    ALL_LINEAR,
    AttnImpl,
    Framework,
    LoraSpec,
    LossImpl,
    Method,
    Optim,
    QuantSpec,
    QuantType,
    SdpaKernel,
    TrainingSpec,
    resolve,
)
from service.core.units import DType

# NVML's used memory is polled this often (seconds) for the device peak.
POLL_S = 0.002
STEPS = 2
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


class Runner(StrEnum):
    """How the two steps run."""

    LOOP = "loop"  # the plain loop the references trace, no autocast
    TRAINER = "trainer"  # HF Trainer, with bf16/fp16 mixed precision when the spec has autocast


class NotProbeableError(ValueError):
    """The job has an option the probe cannot run; the message says which."""


def default_runner(spec: TrainingSpec) -> Runner:
    """HF Trainer for autocast jobs (the loop has no autocast), else the plain loop."""
    return Runner.TRAINER if spec.autocast else Runner.LOOP


def check_probeable(spec: TrainingSpec, runner: Runner) -> None:
    """Raise `NotProbeableError` for a job the probe cannot run as `runner`."""
    if spec.parallel.gpus != 1:
        raise NotProbeableError("the probe runs one GPU; multi-GPU strategies are not probed")
    if spec.framework is not Framework.HF:
        raise NotProbeableError(f"framework {spec.framework.value} is not probed, only hf")
    resolved = resolve(spec)
    if resolved.quantization is not None and resolved.quantization.type is QuantType.INT8:
        raise NotProbeableError("int8 (LLM.int8) bases are not probed; use nf4 or fp4")
    loss = resolved.loss
    if loss not in (LossImpl.HF, LossImpl.PLAIN):
        raise NotProbeableError(f"loss {loss.value} is not probed (hf and plain are)")
    if runner is Runner.LOOP:
        if spec.autocast:
            raise NotProbeableError("the loop runner has no autocast; use --runner trainer")
        if spec.gradient_accumulation_steps != 1:
            raise NotProbeableError(
                "the loop runner takes one micro-batch per step; use --runner trainer"
            )
        if spec.optim is Optim.ADAFACTOR:
            raise NotProbeableError("the loop runner has no adafactor; use --runner trainer")


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeCase:
    """One job to measure: the spec, how the step runs, and the allocator's settings."""

    name: str
    model_id: str
    spec: TrainingSpec
    runner: str = Runner.LOOP.value  # loop | trainer
    alloc_conf: str = ""  # PYTORCH_CUDA_ALLOC_CONF
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        Runner(self.runner)  # raises ValueError for an unknown runner


def _lora(r: int = 16, adapter: DType | None = None, targets: Any = ALL_LINEAR) -> LoraSpec:
    # As the H200 set was made: lora_alpha 32, no dropout.
    return LoraSpec(
        r=r, lora_alpha=32, lora_dropout=0.0, target_modules=targets, adapter_dtype=adapter
    )


def _job(method: Method, b: int, s: int, gc: bool, **kw: Any) -> TrainingSpec:
    if method is not Method.FULL:
        kw.setdefault("lora", _lora())
    if method is Method.QLORA:
        kw.setdefault("quantization", QuantSpec(type=QuantType.NF4, double_quant=True))
    return TrainingSpec(method=method, batch_size=b, seq_len=s, gradient_checkpointing=gc, **kw)


LORA, QLORA, FULL = Method.LORA, Method.QLORA, Method.FULL
QWEN_05, QWEN_15, QWEN_3, QWEN_7, QWEN_14 = (
    "Qwen/Qwen2.5-0.5B",
    "Qwen/Qwen2.5-1.5B",
    "Qwen/Qwen2.5-3B",
    "Qwen/Qwen2.5-7B",
    "Qwen/Qwen2.5-14B",
)
LLAMA_1, LLAMA_3, LLAMA_8 = (
    "meta-llama/Llama-3.2-1B",
    "meta-llama/Llama-3.2-3B",
    "meta-llama/Llama-3.1-8B",
)

# Cases measured on a GPU, committed in tests/data/gpu/ with the runs they produced.
MATRIX: tuple[ProbeCase, ...] = (
    # Three H200 set-1 cases again (the allocator history kept), then new configurations,
    # the most informative first.
    ProbeCase(
        name="q15-full-b4s1024-foreach",
        model_id=QWEN_15,
        spec=_job(FULL, 4, 1024, False, optim=Optim.ADAMW_TORCH),
    ),
    ProbeCase(name="q7-qlora-b4s2048-gc", model_id=QWEN_7, spec=_job(QLORA, 4, 2048, True)),
    ProbeCase(name="l8-lora-b4s2048-gc", model_id=LLAMA_8, spec=_job(LORA, 4, 2048, True)),
    ProbeCase(name="q05-full-b8s1024", model_id=QWEN_05, spec=_job(FULL, 8, 1024, False)),
    ProbeCase(name="q3-qlora-b4s1024", model_id=QWEN_3, spec=_job(QLORA, 4, 1024, False)),
    ProbeCase(name="q3-lora-b2s4096-gc", model_id=QWEN_3, spec=_job(LORA, 2, 4096, True)),
    ProbeCase(
        name="q7-lora-b2s4096-gc-expandable",
        model_id=QWEN_7,
        spec=_job(LORA, 2, 4096, True),
        alloc_conf="expandable_segments:True",
    ),
    ProbeCase(
        name="q7-lora-b4s2048-gc-split256",
        model_id=QWEN_7,
        spec=_job(LORA, 4, 2048, True),
        alloc_conf="max_split_size_mb:256",
    ),
    ProbeCase(name="ll1-full-b8s1024", model_id=LLAMA_1, spec=_job(FULL, 8, 1024, False)),
    ProbeCase(
        name="q3-lora-b4s2048-gc-trainer",
        model_id=QWEN_3,
        spec=_job(LORA, 4, 2048, True, autocast=True),
        runner="trainer",
    ),
    ProbeCase(
        name="q7-qlora-b2s2048-gc-paged8",
        model_id=QWEN_7,
        spec=_job(QLORA, 2, 2048, True, optim=Optim.PAGED_ADAMW_8BIT),
    ),
    ProbeCase(
        name="p3-qlora-b2s2048-gc",
        model_id="microsoft/Phi-3-mini-4k-instruct",
        spec=_job(QLORA, 2, 2048, True),
    ),
    ProbeCase(
        name="ll3-lora-r64qv-b8s1024-gc",
        model_id=LLAMA_3,
        spec=_job(LORA, 8, 1024, True, lora=_lora(64, targets=("q_proj", "v_proj"))),
    ),
    ProbeCase(
        name="q15-full-b2s2048-gc-bnb8",
        model_id=QWEN_15,
        spec=_job(FULL, 2, 2048, True, optim=Optim.ADAMW_BNB_8BIT),
    ),
    ProbeCase(
        name="m03-qlora-b8s1024-gc",
        model_id="mistralai/Mistral-7B-v0.3",
        spec=_job(QLORA, 8, 1024, True),
    ),
    ProbeCase(
        name="ll3-qlora-b4s2048-gc-trainer",
        model_id=LLAMA_3,
        spec=_job(QLORA, 4, 2048, True, autocast=True),
        runner="trainer",
    ),
    ProbeCase(
        name="g9-lora-b2s2048-gc-eager",
        model_id="google/gemma-2-9b",
        spec=_job(LORA, 2, 2048, True, attn_implementation=AttnImpl.EAGER),
    ),
    ProbeCase(
        name="q3-8-qlora-b1s4096-gc", model_id="Qwen/Qwen3-8B", spec=_job(QLORA, 1, 4096, True)
    ),
    ProbeCase(
        name="l8-lora-bf16ad-b8s1024-gc",
        model_id=LLAMA_8,
        spec=_job(LORA, 8, 1024, True, lora=_lora(adapter=DType.BF16)),
    ),
    ProbeCase(name="q14-qlora-b2s2048-gc", model_id=QWEN_14, spec=_job(QLORA, 2, 2048, True)),
    ProbeCase(name="q05-lora-b16s1024", model_id=QWEN_05, spec=_job(LORA, 16, 1024, False)),
    ProbeCase(
        name="m7-lora-b1s4096",
        model_id="mistralai/Mistral-7B-v0.1",
        spec=_job(LORA, 1, 4096, False),
    ),
    ProbeCase(name="l8-lora-b1s8192-gc", model_id=LLAMA_8, spec=_job(LORA, 1, 8192, True)),
    ProbeCase(
        name="q7-full-b2s1024-gc-sgd",
        model_id=QWEN_7,
        spec=_job(FULL, 2, 1024, True, optim=Optim.SGD),
    ),
)


# -- reading the device ---------------------------------------------------------------------


class DeviceReadings(Protocol):
    """What a measurement reads: the caching allocator's counters and the GPU's used memory.

    `device` is where the model and batches are made. `CudaReadings` reads a CUDA GPU through
    torch.cuda and NVML; a test passes readings of its own, with `device` "cpu", so the steps
    run for real on CPU tensors while the readings come from the test.
    """

    device: str

    def used(self) -> int:
        """The GPU's used memory now (NVML, every process on it), bytes."""
        ...

    def used_peak(self) -> int:
        """The highest used memory seen since `start`, bytes."""
        ...

    def start(self) -> None:
        """Start watching the used memory, then make this process's CUDA context."""
        ...

    def stop(self) -> None: ...

    def synchronize(self) -> None: ...

    def reset_peaks(self) -> None:
        """`torch.cuda.reset_peak_memory_stats()`."""
        ...

    def allocated(self) -> int: ...

    def max_allocated(self) -> int: ...

    def reserved(self) -> int: ...

    def max_reserved(self) -> int: ...

    def stats(self) -> Mapping[str, Any]:
        """`torch.cuda.memory_stats()`."""
        ...

    def versions(self) -> dict[str, Any]:
        """The software and the GPU: as `versions()` (gpu, gpu_total, driver, cuda, ...)."""
        ...


class NvmlPoller:
    """The highest NVML used memory of GPU `index` (NVML's numbering), polled in a thread."""

    def __init__(self, index: int = 0, period_s: float = POLL_S) -> None:
        import pynvml

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        self._period_s = period_s
        self.peak = self.used()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def used(self) -> int:
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.used())
            time.sleep(self._period_s)

    def __enter__(self) -> NvmlPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.peak = max(self.peak, self.used())


class CudaReadings:
    """A CUDA GPU: torch.cuda's allocator counters, and NVML's used memory of the whole GPU.

    Making one touches neither CUDA nor the GPU's memory: `used()` before `start()` is what
    the GPU held before this process's CUDA context.
    """

    def __init__(self, device: str = "cuda", period_s: float = POLL_S) -> None:
        import torch

        self._torch = torch
        target = torch.device(device)
        index = target.index if target.index is not None else 0
        self.device = str(torch.device("cuda", index))
        self._poller = NvmlPoller(_nvml_index(torch, index), period_s)

    def used(self) -> int:
        return self._poller.used()

    def used_peak(self) -> int:
        return self._poller.peak

    def start(self) -> None:
        self._poller.__enter__()
        torch = self._torch
        torch.cuda.init()
        torch.cuda.set_device(self.device)
        torch.empty(1, device=self.device)
        torch.cuda.synchronize()
        time.sleep(0.05)  # NVML's reading catches up with the new context

    def stop(self) -> None:
        self._poller.__exit__()

    def synchronize(self) -> None:
        self._torch.cuda.synchronize()

    def reset_peaks(self) -> None:
        self._torch.cuda.reset_peak_memory_stats()

    def allocated(self) -> int:
        return int(self._torch.cuda.memory_allocated())

    def max_allocated(self) -> int:
        return int(self._torch.cuda.max_memory_allocated())

    def reserved(self) -> int:
        return int(self._torch.cuda.memory_reserved())

    def max_reserved(self) -> int:
        return int(self._torch.cuda.max_memory_reserved())

    def stats(self) -> Mapping[str, Any]:
        stats: Mapping[str, Any] = self._torch.cuda.memory_stats()
        return stats

    def versions(self) -> dict[str, Any]:
        return versions(self._torch.device(self.device).index or 0)


def _nvml_index(torch: Any, index: int) -> int:
    """NVML's number of CUDA device `index` (CUDA_VISIBLE_DEVICES renumbers), without
    initialising CUDA."""
    try:
        return int(torch.cuda._get_nvml_device_index(torch.device("cuda", index)))
    except Exception:  # a private helper; NVML's order is the usual fallback
        return index


def open_cuda_readings(device: str = "cuda") -> CudaReadings | None:
    """Readings of the local CUDA GPU; None when torch sees none. Needs nvidia-ml-py."""
    import torch

    if not torch.cuda.is_available():
        return None
    return CudaReadings(device)


# -- building the model on the device -------------------------------------------------------


def build_on_device(spec: TrainingSpec, config: Mapping[str, Any], device: str) -> Any:
    """The tracer's model of `spec`, every tensor real on `device` with random values.

    A 4-bit base's config gets the `quantization_config` that `from_pretrained` would leave
    on it, so that the model describes itself as a loaded QLoRA model does.
    """
    import torch

    from service.trace.model import build_meta_model, materialize

    resolved = resolve(spec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the libraries' deprecation notices
        built = build_meta_model(resolved, config)
    owned = materialize(built.model, fake_device=device)
    with torch.no_grad():
        for tensor, _component in owned:
            _randomize(tensor)
    if resolved.quantization is not None:
        from transformers import BitsAndBytesConfig

        from service.trace.model import TORCH_DTYPES

        base = _base_model(built.model)
        base.config.quantization_config = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=resolved.quantization.type.value,
            bnb_4bit_use_double_quant=resolved.quantization.double_quant,
            bnb_4bit_compute_dtype=TORCH_DTYPES[resolved.compute_dtype],
        )
    if resolved.loss is LossImpl.PLAIN:
        from service.trace.runner import plain_causal_lm_loss

        base = _base_model(built.model)
        base.loss_function = plain_causal_lm_loss
    return built


def _base_model(model: Any) -> Any:
    """The transformers model inside a PEFT model (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _randomize(tensor: Any) -> None:
    import torch

    if tensor.is_floating_point():
        tensor.normal_(0.0, 0.02)
    elif tensor.dtype == torch.uint8:
        tensor.random_(0, 256)
    else:
        tensor.zero_()


# -- running the steps ----------------------------------------------------------------------


def make_probe_optimizer(params: list[Any], optim: Optim) -> Any:
    """The optimizer HF Trainer builds for `optim`, on real tensors."""
    if optim in (Optim.PAGED_ADAMW_8BIT, Optim.PAGED_ADAMW_32BIT):
        import bitsandbytes as bnb

        from service.trace.model import LEARNING_RATE

        cls = bnb.optim.PagedAdamW8bit if optim is Optim.PAGED_ADAMW_8BIT else bnb.optim.PagedAdamW
        return cls(params, lr=LEARNING_RATE)
    from service.trace.runner import make_optimizer

    return make_optimizer(params, optim, fake=False)


@contextmanager
def attention_kernel(kernel: SdpaKernel) -> Iterator[None]:
    """Force SDPA's backend as the spec says; `auto` leaves PyTorch's choice."""
    if kernel is SdpaKernel.AUTO:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {
        SdpaKernel.FLASH: SDPBackend.FLASH_ATTENTION,
        SdpaKernel.EFFICIENT: SDPBackend.EFFICIENT_ATTENTION,
        SdpaKernel.MATH: SDPBackend.MATH,
    }[kernel]
    with sdpa_kernel(backend):
        yield


def _counts(readings: DeviceReadings) -> tuple[int, int]:
    """Allocations and frees the allocator made so far (the allocator history's indices)."""
    stats = readings.stats()
    return int(stats.get("allocation.all.allocated", 0)), int(stats.get("allocation.all.freed", 0))


def run_loop(
    model: Any, spec: TrainingSpec, record: dict[str, Any], readings: DeviceReadings
) -> None:
    """`STEPS` steps of the plain loop; each step's peaks into `record["steps"]`."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_probe_optimizer(params, spec.optim)
    vocab = int(model.config.vocab_size)
    device = next(model.parameters()).device
    ids = torch.randint(0, vocab, (spec.batch_size, spec.seq_len), device=device)
    labels = ids.clone()
    readings.synchronize()
    record["before_steps_allocated"] = readings.allocated()
    steps = []
    with attention_kernel(spec.sdpa_kernel):
        for step in range(1, STEPS + 1):
            readings.reset_peaks()
            marks = {"start": _counts(readings)}
            t0 = time.time()
            loss = model(input_ids=ids, labels=labels).loss
            forward_end = readings.allocated()
            forward_peak = readings.max_allocated()
            forward_reserved = readings.max_reserved()
            marks["forward_end"] = _counts(readings)
            loss.backward()
            del loss
            readings.synchronize()
            backward_peak = readings.max_allocated()
            marks["backward_end"] = _counts(readings)
            if spec.max_grad_norm > 0:  # as HF Trainer clips (accelerate's clip_grad_norm_)
                torch.nn.utils.clip_grad_norm_(params, spec.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            readings.synchronize()
            marks["step_end"] = _counts(readings)
            steps.append(
                {
                    "step": step,
                    "forward_end": forward_end,
                    "forward_peak": forward_peak,
                    "forward_reserved": forward_reserved,
                    "backward_peak": backward_peak,
                    "max_allocated": readings.max_allocated(),
                    "max_reserved": readings.max_reserved(),
                    "seconds": round(time.time() - t0, 3),
                    "allocator_counts": marks,
                }
            )
    record["steps"] = steps


def training_arguments(spec: TrainingSpec, device: str, output_dir: str) -> Any:
    """The HF TrainingArguments of the job: what `run_trainer` trains with, and what describes
    a loop run to the reporter's derivation as a Trainer run of the same job would."""
    from transformers import TrainingArguments

    half = spec.autocast and spec.dtype is DType.FP16
    return TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=spec.batch_size,
        gradient_accumulation_steps=spec.gradient_accumulation_steps,
        max_grad_norm=spec.max_grad_norm,
        max_steps=STEPS,
        bf16=spec.autocast and not half,
        fp16=half,
        use_cpu=device == "cpu",
        # transformers 5's names for gradient_checkpointing(_kwargs), which mirror them.
        activation_checkpointing=spec.gradient_checkpointing,
        activation_checkpointing_kwargs={"use_reentrant": False},
        optim=spec.optim.value,
        learning_rate=1e-4,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        dataloader_num_workers=0,
        remove_unused_columns=False,
        disable_tqdm=True,
    )


def run_trainer(
    model: Any, spec: TrainingSpec, record: dict[str, Any], arguments: Any, readings: DeviceReadings
) -> None:
    """HF Trainer with `arguments` (`training_arguments`), `STEPS` optimizer steps."""
    import torch
    from transformers import PrinterCallback, Trainer

    b, s = spec.batch_size, spec.seq_len
    vocab = int(model.config.vocab_size)
    generator = torch.Generator().manual_seed(0)
    rows = STEPS * b * spec.gradient_accumulation_steps
    data = [
        {"input_ids": ids, "labels": ids.clone()}
        for ids in torch.randint(0, vocab, (rows, s), generator=generator)
    ]
    base = _base_model(model)
    if getattr(base, "is_quantized", False) and getattr(base, "hf_quantizer", None) is None:
        # Trainer refuses a quantized model it did not load unless it is a PEFT model loaded
        # by from_pretrained; the 4-bit layers are marked through is_loaded_in_4bit alone.
        base.is_quantized = False
    trainer = Trainer(model=model, args=arguments, train_dataset=data)
    trainer.remove_callback(PrinterCallback)  # its end-of-training metrics would go to stdout
    readings.reset_peaks()
    t0 = time.time()
    with attention_kernel(spec.sdpa_kernel):
        trainer.train()
    readings.synchronize()
    record["steps"] = [
        {
            "step": "1-2",
            "max_allocated": readings.max_allocated(),
            "max_reserved": readings.max_reserved(),
            "seconds": round(time.time() - t0, 3),
        }
    ]


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


def software_versions() -> dict[str, Any]:
    """The versions of the packages a run depends on (None: not installed)."""
    import importlib.metadata as md

    found: dict[str, Any] = {}
    for package in ("torch", "transformers", "peft", "bitsandbytes", "accelerate"):
        try:
            found[package] = md.version(package)
        except md.PackageNotFoundError:
            found[package] = None
    return found


def versions(index: int = 0) -> dict[str, Any]:
    """The software, CUDA, the driver, and CUDA device `index`'s name and total memory."""
    import torch

    found = software_versions()
    found["cuda"] = torch.version.cuda
    found["gpu"] = torch.cuda.get_device_name(index)
    found["gpu_total"] = int(torch.cuda.get_device_properties(index).total_memory)
    found["driver"] = _driver()
    return found


def _driver() -> str | None:
    try:
        import pynvml

        value = pynvml.nvmlSystemGetDriverVersion()
        return value.decode() if isinstance(value, bytes) else str(value)
    except Exception:  # the driver version is a nicety
        return None


def nvml_used(index: int = 0) -> int:
    import pynvml

    pynvml.nvmlInit()
    return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).used)


# -- the matrix -----------------------------------------------------------------------------


def _model_config(model_id: str) -> Mapping[str, Any]:
    from service.catalog.models import default_catalog

    return default_catalog().resolve(model_id).config


def _run_case(
    case: ProbeCase, out: str, base_used: int, trace_dir: Path | None, device: str
) -> None:
    record = measure(
        case,
        _model_config(case.model_id),
        base_used=base_used,
        trace_dir=trace_dir,
        readings=CudaReadings(device),
    )
    with open(out, "a") as f:
        f.write(json.dumps(record) + "\n")
    gib = 1 << 30
    levels = " ".join(
        f"{key} {record[key] / gib:7.2f}"
        for key in ("max_allocated", "max_reserved", "end_used")
        if isinstance(record.get(key), int)
    )
    print(f"{case.name:36s} {levels} {record.get('error', '')[:300]}", flush=True)


def _in_child(target: Any, *args: Any, timeout: float) -> bool:
    """Run `target(*args)` in a fresh process (its own CUDA context); False on timeout. Forked
    while CUDA is untouched here (the imports are inherited), else spawned."""
    import multiprocessing

    import torch

    method = "spawn" if torch.cuda.is_initialized() else "fork"
    process = multiprocessing.get_context(method).Process(target=target, args=args)
    process.start()
    process.join(timeout)
    if process.is_alive():
        process.kill()
        process.join()
        return False
    return True


def run_matrix(args: argparse.Namespace) -> int:
    """Each case of MATRIX in a fresh process, within `--budget-s` seconds."""
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # nothing touches CUDA before the fork
    t_start = time.time()
    # Imported once here and inherited by every forked child.
    import peft  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    trace_dir = Path(args.allocator_trace) if args.allocator_trace else None
    print(f"imports {time.time() - t_start:.1f} s", flush=True)
    if args.environment:
        _in_child(_environment_child, args.environment, timeout=60)
    for case in MATRIX:
        if args.only and not any(part in case.name for part in args.only.split(",")):
            continue
        left = args.budget_s - (time.time() - t_start)
        if left < args.min_left_s:
            print(f"{case.name}: skipped, budget spent", flush=True)
            continue
        finished = _in_child(
            _run_case,
            case,
            args.out,
            nvml_used(),
            trace_dir,
            args.device,
            timeout=min(args.per_case_s, left),
        )
        if not finished:
            with open(args.out, "a") as f:
                f.write(json.dumps({"name": case.name, "error": "timeout"}) + "\n")
            print(f"{case.name}: timeout", flush=True)
    print(f"total {time.time() - t_start:.1f} s", flush=True)
    return 0


def _environment_child(out: str) -> None:
    with open(out, "w") as f:
        json.dump(environment_facts(), f, indent=1)


def environment_facts() -> dict[str, Any]:
    """What lies outside the shapes on this GPU: the CUDA context, the cuBLAS and cuBLASLt
    workspaces the first matmuls take from the caching allocator, and the SDPA backend PyTorch
    selects for each dtype, mask, GQA and head size."""
    import torch
    import torch.nn.functional as F

    base = nvml_used()
    facts: dict[str, Any] = {"versions": None, "base_used": base}
    torch.cuda.init()
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    facts["context_used"] = nvml_used() - base
    facts["alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    facts["cublas_workspace_config"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG", "")
    workspaces = []
    for dtype, op in (
        (torch.bfloat16, "mm"),
        (torch.bfloat16, "linear_bias"),
        (torch.float32, "mm"),
        (torch.bfloat16, "mm_backward"),
        (torch.float16, "mm"),
        (torch.float32, "linear_bias"),
    ):
        a = torch.randn(2048, 2048, device="cuda", dtype=dtype, requires_grad=op == "mm_backward")
        b = torch.randn(2048, 2048, device="cuda", dtype=dtype)
        bias = torch.randn(2048, device="cuda", dtype=dtype)
        torch.cuda.synchronize()
        before, used_before = torch.cuda.memory_allocated(), nvml_used()
        if op == "mm":
            c = a @ b
        elif op == "linear_bias":
            c = F.linear(a, b, bias)
        else:
            c = a @ b
            c.sum().backward()
        torch.cuda.synchronize()
        kept = torch.cuda.memory_allocated() - before
        workspaces.append(
            {
                "dtype": str(dtype),
                "op": op,
                "allocated_delta": int(kept),
                "output_bytes": int(c.numel() * c.element_size()),
                "used_delta": nvml_used() - used_before,
            }
        )
        del a, b, c, bias
    facts["matmul_workspaces"] = workspaces
    facts["after_matmuls"] = {
        "allocated": int(torch.cuda.memory_allocated()),
        "reserved": int(torch.cuda.memory_reserved()),
        "used": nvml_used() - base,
    }
    facts["sdpa_choices"] = _sdpa_choices(torch)
    facts["versions"] = versions()
    return facts


def _sdpa_choices(torch: Any) -> list[dict[str, Any]]:
    """torch._fused_sdp_choice for training-shaped inputs: 0 math, 1 flash, 2 efficient, ..."""
    choices = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for head_dim in (64, 80, 96, 128, 256):
            for heads, kv_heads in ((8, 8), (8, 2)):
                for mask in ("none", "bool", "additive"):
                    for causal in (True, False):
                        if mask != "none" and causal:
                            continue
                        q = torch.empty(
                            2, heads, 256, head_dim, device="cuda", dtype=dtype, requires_grad=True
                        )
                        k = torch.empty(
                            2,
                            kv_heads,
                            256,
                            head_dim,
                            device="cuda",
                            dtype=dtype,
                            requires_grad=True,
                        )
                        v = torch.empty_like(k, requires_grad=True)
                        attn_mask = None
                        if mask == "bool":
                            attn_mask = torch.ones(2, 1, 256, 256, device="cuda", dtype=torch.bool)
                        elif mask == "additive":
                            attn_mask = torch.zeros(2, 1, 256, 256, device="cuda", dtype=dtype)
                        gqa = heads != kv_heads
                        try:
                            choice = int(
                                torch._fused_sdp_choice(
                                    q, k, v, attn_mask, 0.0, causal, scale=None, enable_gqa=gqa
                                )
                            )
                        except Exception as error:  # the failure is the fact
                            choice = f"{type(error).__name__}: {error}"[:200]
                        choices.append(
                            {
                                "dtype": str(dtype),
                                "head_dim": head_dim,
                                "heads": heads,
                                "kv_heads": kv_heads,
                                "mask": mask,
                                "is_causal": causal,
                                "enable_gqa": gqa,
                                "choice": choice,
                            }
                        )
    return choices


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service.trace.probe")
    parser.add_argument("--matrix", action="store_true", help="measure every case of MATRIX")
    parser.add_argument("--only", default="", help="comma-separated substrings of case names")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--environment", default="", help="also write environment facts here")
    parser.add_argument("--out", default="gpu_peaks.jsonl")
    parser.add_argument("--allocator-trace", default="")
    parser.add_argument("--budget-s", type=float, default=480.0)
    parser.add_argument("--per-case-s", type=float, default=150.0)
    parser.add_argument("--min-left-s", type=float, default=25.0)
    args = parser.parse_args(argv)
    if args.matrix:
        return run_matrix(args)
    parser.error("--matrix is required")
    return 2


if __name__ == "__main__":
    sys.exit(main())
