"""The jobs a probe measures: what it can run, and the cases of the measured runs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

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
    TrainingSpec,
    resolve,
)
from service.core.units import DType


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
    if resolved.quantization is not None and resolved.quantization.type.packed:
        raise NotProbeableError(
            f"{resolved.quantization.type.value} bases are not probed (the probe quantizes with "
            "bitsandbytes); use nf4 or fp4"
        )
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
