"""How far each level of an estimate may be off."""

from __future__ import annotations

import math
from enum import Enum
from functools import lru_cache

from service.core.arch import Linear, ModelArch
from service.core.overhead import Uncertainty
from service.core.spec import ZERO_STAGES, Framework, Method, Strategy, TrainingSpec
from service.core.units import DTYPE_BYTES, DType

# The estimate's stated uncertainty (relative standard deviations; the safe bound adds 1.645 of
# them, `service.core.overhead`). Allocated level: the traced HF + PEFT step (HF Trainer's mixed
# precision included), where every reference trace is matched within 1 %
# (tests/core/test_references.py) and the measured H200 runs within about that
# (tests/data/gpu/); steps no trace checks: framework presets and DeepSpeed's ZeRO (modelled
# from its source; published ZeRO rows are off by tens of percent). DDP, FSDP and FSDP2 are
# traced on a fake process group (tests/data/traces_parallel/, matched within 1 %), but no
# multi-GPU run was measured on GPUs: NCCL, streams and the real collectives are not in them.
ALLOCATED_SIGMA_TRACED = 0.01
ALLOCATED_SIGMA_PRESET = 0.05
ALLOCATED_SIGMA_PARALLEL_TRACED = 0.02
# DeepSpeed ZeRO: the published rows it answers are off by a median 8-10 % (tier B and C rows
# of tests/data/published_peaks.csv, docs/parallel.md), none traced.
ALLOCATED_SIGMA_PARALLEL = 0.10
# Reserved level, as a share of reserved - allocated: the schedule replayed through the
# allocator model matches the tracer's replay within 2 % of reserved on the reference traces of
# the families it schedules op by op (about a quarter of the allocator's share), and coarser
# elsewhere (MoE experts as one wide MLP, untraced steps).
RESERVED_SIGMA_TRACED = 0.25
RESERVED_SIGMA_APPROXIMATE = 0.5
SCHEDULED_FAMILIES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "phi", "gemma3_text"}
)
# A 4-bit base is quantized on the GPU as it loads: each linear's bf16 weight is freed once
# packed, and where the packed tensors land among those freed blocks depends on the loader
# (from_pretrained quantizes one weight at a time; a model built on the GPU and quantized layer
# by layer holds every bf16 weight first). The estimate replays the weights as if allocated in
# their final form. The same Qwen2.5-7B QLoRA job reserved 1.27 GiB more after a
# build-then-quantize load (tests/data/gpu/h200_set1.jsonl, q7-qlora-b4s2048-gc) than after the
# probe's direct build (h200_set2.jsonl): 9.7 % of the quantized weights' bf16 bytes. One
# standard deviation of reserved: this share of those bytes.
QUANTIZED_LOAD_SIGMA = 0.08


def _uncertainty(arch: ModelArch, spec: TrainingSpec) -> Uncertainty:
    """How far each level may be off, by how the configuration was checked."""
    par = spec.parallel
    # The tracer runs neither DeepSpeed nor FSDP's own mixed precision.
    fsdp_mixed = spec.autocast and par.strategy in (Strategy.FSDP, Strategy.FSDP2)
    if par.strategy in ZERO_STAGES or (par.gpus > 1 and fsdp_mixed):
        how = _Parallel.MODELLED
    elif par.gpus > 1:
        how = _Parallel.TRACED
    else:
        how = _Parallel.NONE
    return _uncertainty_of(arch, spec.method, spec.framework, how)


class _Parallel(Enum):
    NONE = "one GPU"
    TRACED = "traced on a fake process group"
    MODELLED = "modelled from the library's source"


@lru_cache(maxsize=1024)
def _uncertainty_of(
    arch: ModelArch, method: Method, framework: Framework, parallel: _Parallel
) -> Uncertainty:
    notes: list[str] = []
    allocated, reserved = ALLOCATED_SIGMA_TRACED, RESERVED_SIGMA_TRACED
    if framework is not Framework.HF:
        allocated, reserved = ALLOCATED_SIGMA_PRESET, RESERVED_SIGMA_APPROXIMATE
        notes.append(f"the {framework} preset's step is not traced: wider uncertainty")
    if parallel is _Parallel.MODELLED:
        allocated, reserved = ALLOCATED_SIGMA_PARALLEL, RESERVED_SIGMA_APPROXIMATE
        notes.append(
            "the strategy is modelled from its library's source, not traced: wide uncertainty"
        )
    elif parallel is _Parallel.TRACED:
        allocated = max(allocated, ALLOCATED_SIGMA_PARALLEL_TRACED)
        reserved = RESERVED_SIGMA_APPROXIMATE
        notes.append(
            "the strategy is traced on a fake process group, not measured on GPUs: the "
            "collectives' streams and the allocator's gathered blocks widen the uncertainty"
        )
    if arch.is_moe or arch.model_type not in SCHEDULED_FAMILIES:
        reserved = RESERVED_SIGMA_APPROXIMATE
    loading = 0
    if method is Method.QLORA:

        def quantized(linears: tuple[Linear, ...]) -> int:
            return sum(lin.weight_elements for lin in linears if lin.nn_linear)

        # (DeepSeek's first layers hold a dense MLP in place of the MoE block's linears)
        layers = arch.num_hidden_layers - arch.dense_layers
        elements = layers * quantized(arch.linears) + arch.dense_layers * quantized(
            arch.dense_linears
        )
        loading = math.ceil(QUANTIZED_LOAD_SIGMA * elements * DTYPE_BYTES[DType.BF16])
        notes.append(
            "a quantized base leaves cached blocks where its bf16 weights were quantized, laid out "
            "by the loader: reserved is uncertain by that"
        )
    return Uncertainty(
        allocated=allocated, reserved=reserved, loading_bytes=loading, notes=tuple(notes)
    )
