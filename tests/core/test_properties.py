"""Properties every estimate must keep, over generated specs (hypothesis)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from service.catalog.models import default_catalog
from service.core.device import CUBLASLT_WORKSPACE
from service.core.estimator import estimate, peak_levels
from service.core.result import Component
from service.core.spec import (
    ADAPTER_METHODS,
    ALL_LINEAR,
    DELTA_OPTIONS,
    LORA_METHODS,
    METHOD_OPTIONS,
    AttnImpl,
    Framework,
    LoraSpec,
    Method,
    Optim,
    QuantSpec,
    TrainingSpec,
)
from service.core.spec.delta import AdaLoraSpec, BoftSpec, LohaSpec, LokrSpec, OftSpec, VeraSpec
from service.core.spec.prompt import PrefixTuningSpec, PromptTuningSpec
from service.core.units import DType

MODELS = (
    "Qwen/Qwen2.5-0.5B",
    "meta-llama/Llama-3.1-8B",
    "google/gemma-2-2b",
    "microsoft/Phi-3-mini-4k-instruct",
)


@st.composite
def specs(draw: st.DrawFn) -> tuple[str, TrainingSpec]:
    # LitGPT's adapters run under their own preset only (tests/core/test_litgpt_adapter.py
    # holds their estimates monotone in batch and sequence)
    method = draw(st.sampled_from([m for m in Method if m not in ADAPTER_METHODS]))
    other = method in METHOD_OPTIONS  # modelled on Llama-style decoders, without autocast
    # PEFT's weight-side methods run PEFT's own step without autocast, LoRA-FA with its own
    # AdamW (TrainingSpec refuses the rest)
    delta = method is Method.LORA_FA or method in DELTA_OPTIONS
    model = draw(st.sampled_from(MODELS[:2] if other else MODELS))
    lora = None
    quant = None
    if method in LORA_METHODS:
        lora = LoraSpec(
            r=draw(st.sampled_from([4, 8, 16, 64])),
            target_modules=ALL_LINEAR,
            lora_dropout=draw(st.sampled_from([0.0, 0.05])),
            adapter_dtype=draw(st.sampled_from([None, DType.BF16])),
        )
    if method is Method.QLORA:
        quant = QuantSpec(double_quant=draw(st.booleans()), prepare_kbit=draw(st.booleans()))
    options = {
        Method.VERA: {"vera": VeraSpec(target_modules=ALL_LINEAR)},
        Method.LOHA: {"loha": LohaSpec(r=8, target_modules=ALL_LINEAR)},
        Method.LOKR: {"lokr": LokrSpec(r=8, target_modules=ALL_LINEAR)},
        Method.ADALORA: {"adalora": AdaLoraSpec(init_r=8, target_r=4, target_modules=ALL_LINEAR)},
        Method.OFT: {"oft": OftSpec(target_modules=ALL_LINEAR)},
        Method.BOFT: {"boft": BoftSpec(target_modules=ALL_LINEAR)},
    }.get(method, {})
    # torchtune's optimizer in backward: full fine-tuning, fused AdamW, no clipping
    in_backward = method is Method.FULL and draw(st.booleans())
    tune: dict[str, Any] = (
        {"framework": Framework.TORCHTUNE, "optimizer_in_backward": True, "max_grad_norm": 0.0}
        if in_backward
        else {}
    )
    spec = TrainingSpec(
        **options,  # type: ignore[arg-type]
        **tune,
        method=method,
        lora=lora,
        quantization=quant,
        batch_size=draw(st.integers(1, 16)),
        seq_len=draw(st.integers(1, 8192)),
        # (PEFT's prefix tuning does not run under checkpointing)
        gradient_checkpointing=method is not Method.PREFIX_TUNING and draw(st.booleans()),
        # (prefix tuning is modelled on SDPA: its mask runs the mem-efficient kernel)
        attn_implementation=AttnImpl.SDPA
        if method is Method.PREFIX_TUNING
        else draw(st.sampled_from([AttnImpl.SDPA, AttnImpl.EAGER])),
        optim=Optim.ADAMW_TORCH
        if delta
        else Optim.ADAMW_TORCH_FUSED
        if in_backward
        else draw(st.sampled_from(list(Optim))),
        autocast=False if other or delta else draw(st.booleans()),
        prompt_tuning=PromptTuningSpec(num_virtual_tokens=draw(st.sampled_from([8, 200])))
        if method is Method.PROMPT_TUNING
        else None,
        prefix_tuning=PrefixTuningSpec(
            num_virtual_tokens=draw(st.sampled_from([8, 200])),
            prefix_projection=draw(st.booleans()),
        )
        if method is Method.PREFIX_TUNING
        else None,
        # (virtual tokens go in front of each row: not packed)
        # (packing is TRL's collator, framework hf)
        packing=False
        if method in (Method.PROMPT_TUNING, Method.PREFIX_TUNING) or in_backward
        else draw(st.booleans()),
    )
    return model, spec


# Examples per property: each estimate of a new model, method or shape replays the step
# through the allocator model (up to a second for an 8B model), so the suite keeps to this
# many (seven properties, about a minute together).
EXAMPLES = 30


def _without_method_options(case: tuple[str, TrainingSpec]) -> tuple[str, TrainingSpec]:
    """The case as LoRA with its defaults when it is another PEFT method, for a change of
    method; without torchtune's optimizer in backward, which is full fine-tuning's."""
    model, spec = case
    spec = replace(spec, optimizer_in_backward=False)
    if spec.method in (Method.FULL, Method.LORA, Method.QLORA):
        return model, spec
    plain = replace(
        spec,
        method=Method.LORA,
        ia3=None,
        ln_tuning=None,
        prompt_tuning=None,
        prefix_tuning=None,
        vera=None,
        loha=None,
        lokr=None,
        adalora=None,
        oft=None,
        boft=None,
    )
    return model, plain


def _peak(model: str, spec: TrainingSpec) -> int:
    return estimate(default_catalog().resolve(model).arch, spec).allocated_bytes


@settings(max_examples=EXAMPLES, deadline=None)
@given(specs(), st.integers(1, 8))
def test_peak_non_decreasing_in_batch(case: tuple[str, TrainingSpec], more: int) -> None:
    model, spec = case
    assert _peak(model, replace(spec, batch_size=spec.batch_size + more)) >= _peak(model, spec)


@settings(max_examples=EXAMPLES, deadline=None)
@given(specs(), st.integers(1, 4096))
def test_peak_non_decreasing_in_sequence(case: tuple[str, TrainingSpec], more: int) -> None:
    model, spec = case
    assert _peak(model, replace(spec, seq_len=spec.seq_len + more)) >= _peak(model, spec)


@settings(max_examples=EXAMPLES, deadline=None)
@given(specs())
def test_checkpointing_never_raises_the_peak(case: tuple[str, TrainingSpec]) -> None:
    # Allowance: one layer's checkpoint and its first norm's fp32 copy. While the first layer's
    # backward runs, its saved input and its recomputed activations coexist (and HF's
    # enable_input_require_grads makes that layer's norm save too), where without
    # checkpointing only the activations are. A few KiB at tiny sizes, never a share of a peak.
    # And the recomputation's biased linears run cuBLASLt on the backward thread's handle,
    # which then takes its own Lt workspace.
    model, spec = _without_method_options(case) if case[1].prefix_tuning else case
    arch = default_catalog().resolve(model).arch
    one_checkpoint = spec.batch_size * spec.seq_len * arch.hidden_size * (4 + 4) + 2 * 512
    one_checkpoint += CUBLASLT_WORKSPACE
    on = _peak(model, replace(spec, gradient_checkpointing=True))
    off = _peak(model, replace(spec, gradient_checkpointing=False))
    assert on <= off + one_checkpoint


# Optimizers with per-element state in torch's allocator. With SGD (no state), Adafactor (row
# and column moments only) or a paged optimizer (state in managed memory) full fine-tuning's
# extra cost is little more than its gradients, which appear
# after the loss peak: LoRA's adapters on top of the same frozen weights can then exceed it by
# their own bytes. That is physics, not an estimator defect, so the property excludes them.
STATEFUL = (Optim.ADAMW_TORCH, Optim.ADAMW_TORCH_FUSED, Optim.ADAMW_BNB_8BIT)


@settings(max_examples=EXAMPLES, deadline=None)
@given(specs(), st.sampled_from(STATEFUL))
def test_lora_never_above_full_fine_tuning(case: tuple[str, TrainingSpec], optim: Optim) -> None:
    # Same settings, adapters in the model's dtype. (fp32 adapters can exceed full fine-tuning
    # at long sequences: PEFT keeps an fp32 copy of each adapted layer's input.)
    model, spec = _without_method_options(case)
    lora = LoraSpec(r=16, target_modules=ALL_LINEAR, adapter_dtype=DType.BF16)
    as_lora = replace(spec, method=Method.LORA, lora=lora, quantization=None, optim=optim)
    as_full = replace(spec, method=Method.FULL, lora=None, quantization=None, optim=optim)
    assert _peak(model, as_lora) <= _peak(model, as_full)


@settings(max_examples=EXAMPLES, deadline=None)
@given(specs())
def test_qlora_weights_below_bf16_weights(case: tuple[str, TrainingSpec]) -> None:
    model, spec = _without_method_options(case)
    arch = default_catalog().resolve(model).arch
    lora = LoraSpec(r=16, target_modules=ALL_LINEAR)
    as_qlora = replace(spec, method=Method.QLORA, lora=lora, quantization=QuantSpec())
    as_lora = replace(spec, method=Method.LORA, lora=lora, quantization=None)
    q = estimate(arch, as_qlora).components[Component.FROZEN_WEIGHTS]
    b = estimate(arch, as_lora).components[Component.FROZEN_WEIGHTS]
    assert q < b


@settings(max_examples=EXAMPLES, deadline=None)
@given(specs())
def test_components_sum_to_the_peak_and_levels_are_ordered(case: tuple[str, TrainingSpec]) -> None:
    model, spec = case
    est = estimate(default_catalog().resolve(model).arch, spec)
    assert sum(est.components.values()) == est.allocated_bytes
    assert est.allocated_bytes <= est.reserved_bytes <= est.device_bytes <= est.device_bytes_upper
    assert all(v >= 0 for v in est.components.values())


@settings(max_examples=EXAMPLES, deadline=None)
@given(specs(), st.sampled_from([1, 2, 8]))
def test_peak_levels_are_the_estimates_levels(case: tuple[str, TrainingSpec], gpus: int) -> None:
    model, spec = case
    # the others run on one GPU, and so does torchtune's optimizer in backward
    if spec.method in (Method.FULL, Method.LORA, Method.QLORA) and not spec.optimizer_in_backward:
        spec = replace(spec, parallel=replace(spec.parallel, gpus=gpus))
    arch = default_catalog().resolve(model).arch
    est = estimate(arch, spec)
    assert tuple(peak_levels(arch, spec)) == (
        est.allocated_bytes,
        est.reserved_bytes,
        est.device_bytes,
        est.device_bytes_upper,
    )
