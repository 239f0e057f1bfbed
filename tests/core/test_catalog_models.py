"""Every model of the catalog estimates: dense, grouped-query, sliding-window, soft-capped and
mixture-of-experts layers (with and without a shared expert) all go through the step and the
allocator replay."""

from __future__ import annotations

from dataclasses import replace

import pytest

from service.catalog.models import CatalogEntry, default_catalog
from service.core.errors import InvalidSpecError
from service.core.estimator import estimate
from service.core.spec import AttnImpl, LoraSpec, Method, QuantSpec, TrainingSpec
from service.core.spec.vision import VisionInputs

ENTRIES = default_catalog().entries()


@pytest.mark.parametrize("entry", ENTRIES, ids=[e.id for e in ENTRIES])
def test_every_catalog_model_estimates(entry: CatalogEntry) -> None:
    lora = LoraSpec(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear")
    for method in (Method.LORA, Method.QLORA):
        if entry.arch.encoder and method is Method.QLORA:
            continue  # refused for encoders (tests/core/test_encoder.py)
        spec = TrainingSpec(
            method=method,
            batch_size=1,
            seq_len=256,
            lora=lora,
            quantization=QuantSpec() if method is Method.QLORA else None,
            gradient_checkpointing=True,
        )
        if entry.arch.encoder_decoder:  # eager, no checkpointing (tests/core/test_seq2seq.py)
            spec = replace(spec, gradient_checkpointing=False, attn_implementation=AttnImpl.EAGER)
            if method is Method.QLORA:
                continue
        if entry.arch.vision is not None:
            # the language model's linears (all-linear would adapt the frozen vision tower,
            # which is refused) and one image of 64 tokens in the 256
            targets = ("q_proj", "k_proj", "v_proj", "o_proj")
            spec = replace(
                spec,
                lora=replace(lora, target_modules=targets),
                vision=VisionInputs(images_per_sample=1, image_tokens=64),
            )
        if entry.arch.mllama is not None:
            # Llama-3.2-Vision: LoRA on the language model's MLP (its tower has q/k/v/o_proj
            # of its own), one image of 560 x 560 pixels; QLoRA is refused
            spec = replace(
                spec,
                lora=replace(lora, target_modules=("gate_proj", "up_proj", "down_proj")),
                vision=VisionInputs(images_per_sample=1, image_height=560, image_width=560),
            )
            if method is Method.QLORA:
                with pytest.raises(InvalidSpecError) as refused:
                    estimate(entry.arch, spec)
                assert refused.value.field == "method"
                continue
        est = estimate(entry.arch, spec)
        assert 0 < est.allocated_bytes <= est.reserved_bytes <= est.device_bytes
        assert est.device_bytes < est.device_bytes_upper
