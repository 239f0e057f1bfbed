"""Committed reference traces: their JSON form, the matrix of cases, and its regeneration.

Each reference is `tests/data/traces/<name>.json`: the spec, the model id, the peak (bytes, step,
phase, op, breakdown), the snapshot at each phase of each step, parameter counts, the notes the
trace made, and the library versions it ran with. The estimator's tests compare against these.
Rank 0 of multi-GPU jobs (DDP, FSDP1, FSDP2; service/trace/parallel.py) is kept apart, in
`tests/data/traces_parallel/<name>.json` (`parallel_matrix()`), its spec carrying the strategy,
the GPU count and the strategy's settings, its name ending in them (`__fsdp2-8gpu`).
"""

from __future__ import annotations

import dataclasses
import json
import typing
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from service.core.codec import spec_from_dict, spec_to_dict
from service.core.result import Component
from service.core.spec import (
    DELTA_OPTIONS,
    AttnImpl,
    Framework,
    FsdpBackwardPrefetch,
    FsdpSharding,
    Method,
    Objective,
    Offload,
    Optim,
    ParallelSpec,
    SdpaKernel,
    Strategy,
    TrainingSpec,
)
from service.core.spec.vision import VisionInputs
from service.core.stack import PINNED_STACK
from service.core.units import DType
from service.trace.delta_cases import peft_delta_cases
from service.trace.families import (
    BERT_BASE,
    GEMMA_2B,
    LLAMA_1B,
    PHI_3,
    QWEN_05B,
    case_spec,
    dora_cases,
    dpo_cases,
    falcon_bloom_cases,
    grpo_cases,
    int8_cases,
    kto_cases,
    liger_cases,
    lora_spec,
    mixed_precision_objective_cases,
    orpo_cases,
    packing_cases,
    reward_cases,
    t5_cases,
    train_feature_cases,
    tuner_cases,
    vision_cases,
)
from service.trace.matrix_cases import (
    Cases,
    bert_cases,
    lora_grid_cases,
    mixed_precision_cases,
    mlp_only_cases,
    moe_cases,
    qwen_05b_cases,
    qwen_7b_cases,
    seven_b_family_cases,
    small_family_cases,
    transformers4_moe_cases,
)

if typing.TYPE_CHECKING:  # the JSON helpers need no torch
    from service.trace.runner import TraceResult
    from service.trace.tracker import PhaseSnapshot, Snapshot

REFERENCE_DIR = Path(__file__).resolve().parents[2] / "tests" / "data" / "traces"
# Rank 0 of multi-GPU jobs (DDP, FSDP1, FSDP2 under a fake process group): `parallel_matrix()`.
PARALLEL_REFERENCE_DIR = REFERENCE_DIR.parent / "traces_parallel"
# Bumped whenever a change to the tracer changes what a trace measures.
TRACER_VERSION = "2"
TRACED_LIBRARIES = ("torch", "transformers", "peft", "bitsandbytes")


# -- spec <-> JSON --------------------------------------------------------------------------


def spec_to_json(spec: TrainingSpec) -> dict[str, Any]:
    """The spec as plain JSON values (enums by value, tuples as lists), every field included
    but the stack (the tracer runs only the installed one, which a reference records apart,
    `libraries`) and LoRA's DoRA and rsLoRA switches while they are off."""
    data = spec_to_dict(spec)
    if spec.stack == PINNED_STACK:
        del data["stack"]  # (written only when another stack is emulated)
    lora = data.get("lora")
    for option in ("use_dora", "use_rslora"):  # written when on, as references before them
        if lora is not None and not lora.get(option):
            lora.pop(option, None)
    for name in DELTA_OPTIONS.values():  # written for their method, as references before them
        if data.get(name) is None:
            data.pop(name, None)
    return data


def spec_from_json(data: Mapping[str, Any]) -> TrainingSpec:
    """Inverse of `spec_to_json`; fields the JSON lacks take their defaults."""
    return spec_from_dict(data)


# -- result <-> JSON ------------------------------------------------------------------------


def library_versions() -> dict[str, str]:
    from importlib.metadata import version

    return {name: version(name) for name in TRACED_LIBRARIES} | {"tracer": TRACER_VERSION}


def _snapshot_json(snapshot: Snapshot) -> dict[str, Any]:
    return {
        "allocated_bytes": snapshot.allocated_bytes,
        "op": snapshot.op,
        # the reference model's part and the generation's KV cache only where there is one
        # (DPO full fine-tuning; GRPO's generation), as references written before them
        "components": {
            c.value: n
            for c, n in snapshot.components.items()
            if n or c not in (Component.REFERENCE_MODEL, Component.GENERATION_KV_CACHE)
        },
    }


def _phase_json(entry: PhaseSnapshot, reserved: Mapping[Any, int]) -> dict[str, Any]:
    return {
        "step": entry.step,
        "phase": entry.phase.value,
        **_snapshot_json(entry.snapshot),
        "reserved_bytes": reserved.get((entry.step, entry.phase), 0),
    }


def _reserved_json(result: TraceResult) -> dict[str, Any]:
    """The caching allocator model's reserved peak and where it was first reached."""
    reached = min(
        (key for key, value in result.phase_reserved.items() if value == result.reserved_bytes),
        key=lambda key: (key[0], list(type(key[1])).index(key[1])),
        default=None,
    )
    return {
        "bytes": result.reserved_bytes,
        "step": reached[0] if reached else None,
        "phase": reached[1].value if reached else None,
        "allocator_allocated_bytes": result.allocator_allocated_bytes,
    }


def result_to_json(name: str, result: TraceResult) -> dict[str, Any]:
    reserved = result.phase_reserved
    return {
        "name": name,
        "model_id": result.model_id,
        "spec": spec_to_json(result.spec),
        "peak": {
            "step": result.peak_step,
            "phase": result.peak_phase.value,
            **_snapshot_json(result.peak),
        },
        "reserved": _reserved_json(result),
        "steps": [_phase_json(p, reserved) for p in result.steps],
        "phases": [_phase_json(p, reserved) for p in result.phases],
        "params": {"total": result.params_total, "trainable": result.params_trainable},
        # pinned host memory only where activations are offloaded, as references before it
        **({"host_pinned_bytes": result.host_pinned_bytes} if result.host_pinned_bytes else {}),
        "assumptions": list(result.assumptions),
        "versions": library_versions(),
    }


def measured_part(document: Mapping[str, Any]) -> dict[str, Any]:
    """What a re-trace must reproduce exactly (everything but the versions)."""
    return {k: v for k, v in document.items() if k != "versions"}


# -- the matrix -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Case:
    """One reference: a model from the catalog and a spec."""

    model_id: str
    spec: TrainingSpec

    @property
    def name(self) -> str:
        return reference_name(self.model_id, self.spec)


def reference_name(model_id: str, spec: TrainingSpec) -> str:
    """A file-safe name that spells out every option differing from the defaults."""
    parts = [model_id.split("/")[-1].lower(), spec.method.value]
    parts += _objective_name(spec)
    parts += _adapter_name(spec)
    parts.append(f"b{spec.batch_size}-s{spec.seq_len}")
    parts += _run_name(spec)
    return "__".join(parts).replace(".", "_")


def _objective_name(spec: TrainingSpec) -> list[str]:
    """The objective beyond SFT and its settings."""
    parts: list[str] = []
    if spec.objective is not Objective.SFT:
        parts.append(spec.objective.value)
        dpo = spec.dpo_settings
        if dpo.precompute_ref_log_probs:
            parts.append("precomputed-ref")
        if dpo.max_completion_length is not None:
            parts.append(f"completion{dpo.max_completion_length}")
        kto_settings = spec.kto_settings
        if spec.objective is Objective.KTO and kto_settings.precompute_ref_log_probs:
            parts.append("precomputed-ref")
        if spec.objective is Objective.KTO and not kto_settings.calculate_kl:
            parts.append(kto_settings.loss_type.value.replace("_", "-"))
        if spec.objective is Objective.GRPO:
            g = spec.grpo_settings
            parts.append(f"g{g.num_generations}-p{g.prompt_length(spec.seq_len)}")
        if spec.objective is Objective.ORPO and not spec.orpo_settings.disable_dropout:
            parts.append("dropout-kept")
    return parts


def _adapter_name(spec: TrainingSpec) -> list[str]:
    """The PEFT method's settings and the quantization."""
    parts: list[str] = []
    options = spec.vera or spec.loha or spec.lokr or spec.adalora or spec.oft or spec.boft
    if options is not None:
        target = options.target_modules
        targets = (
            "default" if target is None else target if isinstance(target, str) else "+".join(target)
        )
        parts.append(f"r{options.r}-{targets}")
        if spec.lokr is not None and spec.lokr.decompose_factor != -1:
            parts.append(f"factor{spec.lokr.decompose_factor}")
        if spec.lokr is not None and spec.lokr.decompose_both:
            parts.append("decompose-both")
        if spec.oft is not None and spec.oft.oft_block_size:
            parts.append(f"block{spec.oft.oft_block_size}")
        if spec.boft is not None:
            boft = spec.boft
            blocks = f"block{boft.boft_block_size}" if boft.boft_block_size else ""
            parts.append(blocks or f"num{boft.boft_block_num}")
            parts.append(f"butterfly{boft.boft_n_butterfly_factor}")
        if spec.adalora is not None:
            parts.append(f"target{spec.adalora.target_r}-tinit{spec.adalora.tinit}")
    lora = spec.lora
    if lora is not None:
        target = lora.target_modules
        targets = (
            "default" if target is None else target if isinstance(target, str) else "+".join(target)
        )
        parts.append(f"r{lora.r}-{targets}")
        if lora.adapter_dtype is not None:
            parts.append(f"{lora.adapter_dtype.value}-adapters")
        if lora.lora_dropout:
            parts.append(f"dropout{lora.lora_dropout}")
        if lora.modules_to_save:
            parts.append("save-" + "+".join(lora.modules_to_save))
        if lora.use_dora:
            parts.append("dora")
        if lora.use_rslora:
            parts.append("rslora")
    for options in (spec.ia3, spec.ln_tuning):
        if options is not None and options.target_modules is not None:
            parts.append("+".join(options.target_modules))
    if spec.prompt_tuning is not None:
        parts.append(f"{spec.prompt_tuning.num_virtual_tokens}-virtual")
    prefix = spec.prefix_tuning
    if prefix is not None:
        parts.append(f"{prefix.num_virtual_tokens}-virtual")
        if prefix.prefix_projection:
            parts.append(f"projection{prefix.encoder_hidden_size or ''}")
    if spec.ia3 is not None and spec.ia3.feedforward_modules is not None:
        parts.append("ff-" + "+".join(spec.ia3.feedforward_modules))
    quant = spec.quantization
    if quant is not None:
        parts.append(quant.type.value + ("-dq" if quant.double_quant else ""))
        if not quant.prepare_kbit:
            parts.append("no-kbit-prep")
    return parts


def _run_name(spec: TrainingSpec) -> list[str]:
    """Inputs, attention, optimizer, precision, parallelism and stack beyond the defaults."""
    parts: list[str] = []
    if spec.vision is not None:
        parts.append(_vision_name(spec.vision))
    if spec.target_length is not None:
        parts.append(f"t{spec.target_length}")
    if spec.gradient_checkpointing:
        parts.append("ckpt")
    if spec.packing:
        parts.append("packed")
    if spec.attn_implementation is not AttnImpl.SDPA:
        parts.append(spec.attn_implementation.value)
    if spec.sdpa_kernel is not SdpaKernel.AUTO:
        parts.append(f"sdpa-{spec.sdpa_kernel.value}")
    if spec.optim is not Optim.ADAMW_TORCH_FUSED:
        parts.append(spec.optim.value)
    if spec.liger_kernel:
        parts.append("liger")
    if spec.loss is not None:
        parts.append(f"loss-{spec.loss.value}")
    if spec.dtype is not DType.BF16:
        parts.append(spec.dtype.value)
    if spec.autocast:
        parts.append("autocast")
    if spec.gradient_accumulation_steps != 1:
        parts.append(f"ga{spec.gradient_accumulation_steps}")
    if spec.max_grad_norm != 1.0:
        parts.append(f"clip{spec.max_grad_norm:g}")
    if spec.framework is Framework.TORCHTUNE:
        parts.append("torchtune")
    if spec.optimizer_in_backward:
        parts.append("optim-in-bwd")
    if spec.activation_offloading:
        parts.append("offload-acts")
    if spec.parallel.gpus != 1:
        parts.append(_parallel_name(spec.parallel))
    if spec.stack != PINNED_STACK:
        parts.append(f"transformers{spec.stack.transformers}")
    return parts


def _vision_name(vision: VisionInputs) -> str:
    """Images per sample and their size (pixels, or tokens given directly)."""
    size = (
        f"t{vision.image_tokens}"
        if vision.image_tokens is not None
        else f"{vision.image_height}x{vision.image_width}"
    )
    bounds = "".join(
        f"-{name}{value}"
        for name, value in (("min", vision.min_pixels), ("max", vision.max_pixels))
        if value is not None
    )
    return f"img{vision.images_per_sample}-{size}{bounds}"


def _parallel_name(parallel: ParallelSpec) -> str:
    """The strategy, the GPU count, and the strategy's settings that differ from the defaults
    (FSDP1's sharding strategy always)."""
    default = ParallelSpec()
    parts = [f"{parallel.strategy.value}-{parallel.gpus}gpu"]
    if parallel.strategy is Strategy.DDP:
        if parallel.bucket_cap_mb != default.bucket_cap_mb:
            parts.append(f"bucket{parallel.bucket_cap_mb}mb")
        if parallel.gradient_as_bucket_view:
            parts.append("bucket-view")
    elif parallel.strategy is Strategy.FSDP:
        parts.append(parallel.sharding_strategy.value.lower().replace("_", "-"))
        if not parallel.use_orig_params:
            parts.append("flat-params")
        if not parallel.limit_all_gathers:
            parts.append("unlimited-gathers")
        if parallel.forward_prefetch:
            parts.append("forward-prefetch")
        if parallel.backward_prefetch is not default.backward_prefetch:
            parts.append(parallel.backward_prefetch.value.lower().replace("_", "-"))
    elif parallel.strategy is Strategy.FSDP2 and not parallel.reshard_after_forward:
        parts.append("no-reshard")
    if parallel.offload is not Offload.NONE:
        parts.append(f"offload-{parallel.offload.value}")
    return "-".join(parts)


def matrix() -> list[Case]:
    """Every committed reference, most important first (7B LoRA/QLoRA, checkpointing on/off)."""
    cases: Cases = []
    for group in (
        qwen_7b_cases,
        seven_b_family_cases,
        moe_cases,
        qwen_05b_cases,
        mixed_precision_cases,
        small_family_cases,
        transformers4_moe_cases,
    ):
        cases += group()
    cases += lora_grid_cases(cases)
    for group in (
        mlp_only_cases,
        falcon_bloom_cases,
        dora_cases,
        dpo_cases,
        reward_cases,
        mixed_precision_objective_cases,
        kto_cases,
        grpo_cases,
        orpo_cases,
        t5_cases,
        tuner_cases,
        int8_cases,
        vision_cases,
        packing_cases,
        liger_cases,
        peft_delta_cases,
        train_feature_cases,
        bert_cases,
    ):
        cases += group()
    return [Case(model_id=m, spec=s) for m, s in cases]


def parallel_matrix() -> list[Case]:
    """Rank 0 of multi-GPU jobs (tests/data/traces_parallel/): DDP, FSDP1 FULL_SHARD and
    SHARD_GRAD_OP, FSDP2, on 2 and 8 GPUs, full fine-tuning and LoRA, over three families."""
    lora, full = Method.LORA, Method.FULL
    setups = (
        ParallelSpec(strategy=Strategy.DDP),
        ParallelSpec(strategy=Strategy.FSDP, sharding_strategy=FsdpSharding.FULL_SHARD),
        ParallelSpec(strategy=Strategy.FSDP, sharding_strategy=FsdpSharding.SHARD_GRAD_OP),
        ParallelSpec(strategy=Strategy.FSDP2),
    )
    cases: list[tuple[str, TrainingSpec]] = []

    def add(model_id: str, spec: TrainingSpec, setup: ParallelSpec, gpus: int) -> None:
        cases.append((model_id, dataclasses.replace(spec, parallel=_gpus(setup, gpus))))

    eager = {"attn_implementation": AttnImpl.EAGER}
    families = (
        (QWEN_05B, 2, 1024, {}),
        (LLAMA_1B, 1, 1024, {}),
        (GEMMA_2B, 1, 512, eager),  # transformers runs Gemma-2 with eager attention only
    )
    for model_id, b, s, extra in families:
        for setup in setups:
            for gpus in (2, 8):
                for method in (full, lora):
                    add(model_id, case_spec(method, b, s, ckpt=True, **extra), setup, gpus)
    # Checkpointing off: every strategy once, on Qwen2.5-0.5B.
    for setup in setups:
        add(QWEN_05B, case_spec(full, 1, 512), setup, 2)
        add(QWEN_05B, case_spec(lora, 1, 512), setup, 8)
    # An LM head not tied to the embedding: FSDP2 gives the embedding a group of its own.
    for setup in (setups[1], setups[3]):
        for method in (full, lora):
            add(PHI_3, case_spec(method, 1, 512, ckpt=True), setup, 2)
    # The settings each strategy honours, beyond its defaults.
    base = case_spec(full, 1, 512, ckpt=True)
    for setup in (
        ParallelSpec(strategy=Strategy.DDP, gradient_as_bucket_view=True),
        ParallelSpec(strategy=Strategy.DDP, bucket_cap_mb=100),
        ParallelSpec(strategy=Strategy.FSDP, use_orig_params=False),
        ParallelSpec(strategy=Strategy.FSDP, limit_all_gathers=False),
        ParallelSpec(strategy=Strategy.FSDP, backward_prefetch=FsdpBackwardPrefetch.NO_PREFETCH),
        ParallelSpec(strategy=Strategy.FSDP2, reshard_after_forward=False),
    ):
        add(QWEN_05B, base, setup, 4)
    # TRL's DPO, KTO and reward steps under DDP: each rank the one-GPU step with DDP's buckets
    # (and for full fine-tuning the frozen reference copy, held whole on every rank).
    ddp = setups[0]
    dpo = {"objective": Objective.DPO}
    reward = {"objective": Objective.REWARD}
    kto = {"objective": Objective.KTO}
    orpo = {"objective": Objective.ORPO}
    for model_id, spec, gpus in (
        (QWEN_05B, case_spec(lora, 1, 512, **dpo), 2),
        (QWEN_05B, case_spec(full, 1, 512, ckpt=True, **dpo), 2),
        (LLAMA_1B, case_spec(lora, 2, 512, ckpt=True, autocast=True, **dpo), 4),
        (GEMMA_2B, case_spec(lora, 1, 512, ckpt=True, **eager, **dpo), 2),
        (QWEN_05B, case_spec(lora, 2, 512, **reward), 2),
        (LLAMA_1B, case_spec(full, 1, 512, ckpt=True, autocast=True, **reward), 2),
        (QWEN_05B, case_spec(lora, 2, 512, **kto), 2),
        (QWEN_05B, case_spec(lora, 2, 512, **orpo), 2),
        (QWEN_05B, case_spec(full, 1, 512, ckpt=True, **orpo), 2),
        (LLAMA_1B, case_spec(lora, 2, 512, ckpt=True, autocast=True, **orpo), 4),
        (QWEN_05B, case_spec(full, 2, 512, ckpt=True, **kto), 2),
        (LLAMA_1B, case_spec(lora, 2, 512, ckpt=True, autocast=True, **kto), 4),
    ):
        add(model_id, spec, ddp, gpus)
    # An encoder (BERT sequence classification) under DDP.
    fp32 = DType.FP32
    add(BERT_BASE, case_spec(full, 4, 512, dtype=fp32), ddp, 2)
    add(BERT_BASE, case_spec(lora, 4, 512, lora=lora_spec(r=8, targets=None)), ddp, 2)
    bucket_view = ParallelSpec(strategy=Strategy.DDP, gradient_as_bucket_view=True)
    add(BERT_BASE, case_spec(full, 2, 512, ckpt=True, dtype=fp32), bucket_view, 4)
    return [Case(model_id=m, spec=s) for m, s in cases]


def _gpus(setup: ParallelSpec, gpus: int) -> ParallelSpec:
    return dataclasses.replace(setup, gpus=gpus)


def iter_references(directory: Path = REFERENCE_DIR) -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in sorted(directory.glob("*.json")):
        yield path, json.loads(path.read_text())


def write_reference(document: Mapping[str, Any], directory: Path = REFERENCE_DIR) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{document['name']}.json"
    path.write_text(json.dumps(document, indent=1) + "\n")
    return path
