"""Padding-free packing: the packed micro-batch is one row of batch x seq tokens, with the
attention's mask as each implementation builds it, and what is not modelled refused."""

from __future__ import annotations

from dataclasses import replace

import pytest

from service.catalog.models import default_catalog
from service.core.errors import InvalidSpecError
from service.core.estimator import estimate
from service.core.result import Component
from service.core.spec import (
    AttnImpl,
    Framework,
    LoraSpec,
    Method,
    Objective,
    SdpaKernel,
    TrainingSpec,
)
from service.core.spec.prompt import PromptTuningSpec
from service.core.units import INT64_BYTES


def _arch(model: str = "Qwen/Qwen2.5-0.5B"):  # type: ignore[no-untyped-def]
    return default_catalog().resolve(model).arch


def test_flash_runs_the_packed_row_as_one_sequence() -> None:
    """flash_attention_2's varlen run is one sequence of batch x seq tokens; the row's
    position_ids (int64) are held beside its input_ids and labels."""
    arch = _arch()
    lora = LoraSpec(r=16, target_modules="all-linear")
    flash = AttnImpl.FLASH_ATTENTION_2
    packed = TrainingSpec(batch_size=4, seq_len=512, lora=lora, attn_implementation=flash)
    packed = replace(packed, packing=True)
    row = replace(packed, packing=False, batch_size=1, seq_len=4 * 512)
    a, b = estimate(arch, packed), estimate(arch, row)
    assert a.components[Component.INPUTS] - b.components[Component.INPUTS] == 4 * 512 * INT64_BYTES
    assert a.allocated_bytes - b.allocated_bytes == 4 * 512 * INT64_BYTES
    assert a.peak_phase == b.peak_phase
    assert any("padding-free packing" in note for note in a.assumptions)


def test_sdpa_takes_the_block_diagonal_mask_and_its_kernel() -> None:
    """Under SDPA the packed row's mask makes the mem-efficient kernel run with the key/value
    heads repeated: more than the same tokens unmasked, as much as a model that always builds a
    mask (Falcon's `explicit_mask`) would take."""
    arch = _arch()
    packed = TrainingSpec(batch_size=4, seq_len=512, method=Method.FULL, packing=True)
    row = replace(packed, packing=False, batch_size=1, seq_len=4 * 512)
    masked = replace(arch, explicit_mask=True)
    a = estimate(arch, packed)
    assert a.allocated_bytes > estimate(arch, row).allocated_bytes
    assert a.allocated_bytes - estimate(masked, row).allocated_bytes == 4 * 512 * INT64_BYTES
    assert any("block-diagonal" in note for note in a.assumptions)


def test_more_sequences_per_row_never_lower_the_peak() -> None:
    arch = _arch()
    peaks = [
        estimate(arch, TrainingSpec(batch_size=b, seq_len=1024, packing=True)).allocated_bytes
        for b in (1, 2, 4, 8)
    ]
    assert peaks == sorted(peaks) and len(set(peaks)) == len(peaks)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"objective": Objective.DPO}, "packing"),
        ({"framework": Framework.LITGPT}, "packing"),
        (
            {
                "method": Method.PROMPT_TUNING,
                "prompt_tuning": PromptTuningSpec(num_virtual_tokens=8),
            },
            "packing",
        ),
    ],
)
def test_what_packing_is_not_modelled_with_is_refused(
    changes: dict[str, object], field: str
) -> None:
    with pytest.raises(InvalidSpecError) as raised:
        TrainingSpec(batch_size=2, seq_len=512, packing=True, **changes)  # type: ignore[arg-type]
    assert raised.value.field == field


@pytest.mark.parametrize(
    ("model", "changes", "field"),
    [
        # SDPA's flash kernel takes no mask
        ("Qwen/Qwen2.5-0.5B", {"sdpa_kernel": SdpaKernel.FLASH}, "sdpa_kernel"),
        # Gemma-3's global layers each build a mask of their own
        ("google/gemma-3-1b-pt", {}, "packing"),
        # an encoder is not TRL's SFT collator's
        ("google-bert/bert-base-uncased", {"method": Method.FULL}, "packing"),
    ],
)
def test_what_the_estimator_cannot_pack_is_refused(
    model: str, changes: dict[str, object], field: str
) -> None:
    spec = TrainingSpec(batch_size=2, seq_len=512, packing=True, **changes)  # type: ignore[arg-type]
    with pytest.raises(InvalidSpecError) as raised:
        estimate(_arch(model), spec)
    assert raised.value.field == field
    assert raised.value.reason


def test_a_compiled_step_is_estimated_as_the_eager_one_and_says_so() -> None:
    arch = _arch()
    eager = TrainingSpec(batch_size=2, seq_len=512, lora=LoraSpec(r=8))
    compiled = estimate(arch, replace(eager, torch_compile=True))
    plain = estimate(arch, eager)
    assert compiled.allocated_bytes == plain.allocated_bytes
    assert compiled.device_bytes_upper == plain.device_bytes_upper
    assert [a for a in compiled.assumptions if a not in plain.assumptions] == [
        a for a in compiled.assumptions if a.startswith("torch_compile")
    ]
    assert any(a.startswith("torch_compile") for a in compiled.assumptions)
