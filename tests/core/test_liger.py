"""HF Trainer's use_liger_kernel: Liger's patches change what the step saves (its RMSNorm keeps
its input, not an fp32 copy; its SwiGLU keeps the gate and up outputs, not the activation), its
fused linear cross-entropy replaces the logits, and what is not modelled is refused by name."""

from __future__ import annotations

from dataclasses import replace

import pytest

from service.catalog.models import default_catalog
from service.core.codec import spec_from_dict, spec_to_dict
from service.core.errors import InvalidSpecError
from service.core.estimator import estimate, layer_saved_bytes
from service.core.liger import liger_chunk_rows, liger_patches, liger_refusal
from service.core.spec import (
    Framework,
    LoraSpec,
    LossImpl,
    Method,
    Objective,
    ParallelSpec,
    Strategy,
    TrainingSpec,
    resolve,
)
from service.core.units import FP32_BYTES

LLAMA = "meta-llama/Llama-3.2-1B"
LORA = LoraSpec(r=16, lora_alpha=32, target_modules="all-linear")


def _arch(model_id: str = LLAMA):  # type: ignore[no-untyped-def]
    return default_catalog().resolve(model_id).arch


def test_liger_implies_its_fused_loss_and_round_trips() -> None:
    spec = TrainingSpec(batch_size=2, seq_len=1024, lora=LORA, liger_kernel=True)
    assert resolve(spec).loss is LossImpl.FUSED
    assert spec_from_dict(spec_to_dict(spec)) == spec
    assert "liger_kernel" not in spec_to_dict(replace(spec, liger_kernel=False))
    # an explicit fused loss is the same job
    assert resolve(replace(spec, loss=LossImpl.FUSED)).loss is LossImpl.FUSED


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"loss": LossImpl.HF}, "loss"),
        ({"framework": Framework.LITGPT}, "framework"),
        ({"method": Method.IA3, "lora": None}, "method"),
        ({"autocast": True}, "autocast"),
        ({"packing": True}, "packing"),
        ({"torch_compile": True}, "torch_compile"),
        ({"lora": replace(LORA, modules_to_save=("lm_head",))}, "lora.modules_to_save"),
        ({"parallel": ParallelSpec(gpus=2, strategy=Strategy.DDP)}, "parallel.gpus"),
        ({"objective": Objective.DPO}, "objective"),
    ],
)
def test_what_liger_is_not_modelled_with_is_refused_by_name(
    changes: dict[str, object], field: str
) -> None:
    with pytest.raises(InvalidSpecError) as caught:
        TrainingSpec(
            **{"batch_size": 2, "seq_len": 512, "lora": LORA, **changes}, liger_kernel=True
        )  # type: ignore[arg-type]
    assert caught.value.field == field


@pytest.mark.parametrize(
    ("model_id", "patched"),
    [
        ("google/gemma-3-1b-pt", True),
        ("microsoft/Phi-3-mini-4k-instruct", True),
        ("tiiuae/falcon-7b", False),
    ],
)
def test_model_types_whose_patches_are_not_modelled_are_refused(
    model_id: str, patched: bool
) -> None:
    arch = _arch(model_id)
    spec = TrainingSpec(batch_size=1, seq_len=512, lora=LORA, liger_kernel=True)
    with pytest.raises(InvalidSpecError) as caught:
        estimate(arch, spec)
    assert caught.value.field == "liger_kernel"
    assert ("patches model type" in str(caught.value)) is patched
    assert liger_patches(arch.model_type) is None


def test_the_modelled_families_take_their_apply_functions_defaults() -> None:
    for model_type in ("llama", "mistral", "qwen2"):
        patches = liger_patches(model_type)
        assert patches is not None and liger_refusal(model_type) is None
        assert (patches.rms_casting, patches.rms_offset, patches.rms_in_place) == ("llama", 0, True)
        assert patches.mlp == "swiglu" and patches.rope and patches.fused_linear_cross_entropy
    gemma2 = liger_patches("gemma2")
    assert gemma2 is not None and liger_refusal("gemma2") is None
    # apply_liger_kernel_to_gemma2: (1 + weight) in fp32, dY kept (its residual needs it)
    assert (gemma2.rms_casting, gemma2.rms_offset, gemma2.rms_in_place) == ("gemma", 1.0, False)
    assert gemma2.mlp == "geglu" and len(gemma2.layer_norms) == 4


def test_each_layer_saves_its_norm_inputs_and_no_activation() -> None:
    """Per layer per token, LoRA with fp32 adapters: Liger's two norms keep the bf16 inputs the
    residual stream holds anyway (x_in is the checkpoint-like layer input, x_mid the residual)
    instead of two fp32 copies, and its SwiGLU does not keep SiLU's output (I bf16 elements)."""
    arch = _arch()
    hf = TrainingSpec(batch_size=1, seq_len=1, lora=LORA)
    liger = replace(hf, liger_kernel=True)
    h, i = arch.hidden_size, arch.intermediate_size
    saved_hf = layer_saved_bytes(arch, resolve(hf), 1, 1)
    saved_liger = layer_saved_bytes(arch, resolve(liger), 1, 1)
    # fp32 copies (4h each) become the bf16 inputs themselves (2h each); no act_out (2I)
    assert saved_hf - saved_liger == 2 * (FP32_BYTES * h - 2 * h) + 2 * i


def test_the_fused_loss_keeps_the_input_gradient_not_the_logits() -> None:
    arch = _arch()
    spec = TrainingSpec(batch_size=2, seq_len=1024, lora=LORA)
    hf = estimate(arch, spec)
    liger = estimate(arch, replace(spec, liger_kernel=True))
    assert liger.allocated_bytes < hf.allocated_bytes
    # b*s*V never exists: the loss holds less than one fp32 logits tensor's worth
    logits = 2 * 1024 * arch.vocab_size * FP32_BYTES
    assert hf.allocated_bytes - liger.allocated_bytes > logits


def test_chunk_rows_follow_liger() -> None:
    # cdiv(V, H) = 63 for Llama-3.2-1B; 2048 tokens -> cdiv 33 -> next power of two 64
    assert liger_chunk_rows(2048, 128256, 2048) == 64
    # Qwen2.5-0.5B: cdiv(151936, 896) = 170; 1024 tokens -> 7 -> 8
    assert liger_chunk_rows(1024, 151936, 896) == 8
    assert liger_chunk_rows(3, 151936, 896) == 1
