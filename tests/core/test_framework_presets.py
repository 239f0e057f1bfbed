"""What a framework preset changes of the model itself: LitGPT's untied head, and the kbit
preparation only HF + PEFT runs."""

from __future__ import annotations

from service.catalog.models import default_catalog
from service.core.estimator import estimate, peak_levels
from service.core.result import Component
from service.core.spec import Framework, Method, QuantSpec, TrainingSpec

BF16_BYTES = 2


def _job(**overrides: object) -> TrainingSpec:
    values: dict[str, object] = {"method": Method.LORA, "batch_size": 1, "seq_len": 512}
    return TrainingSpec(**{**values, **overrides})  # type: ignore[arg-type]


def test_litgpt_holds_a_tied_models_embedding_and_head_apart() -> None:
    arch = default_catalog().resolve("meta-llama/Llama-3.2-1B").arch
    assert arch.tie_word_embeddings
    hf = estimate(arch, _job())
    litgpt = estimate(arch, _job(framework=Framework.LITGPT))
    table = arch.vocab_size * arch.hidden_size
    assert litgpt.params.total == hf.params.total + table
    frozen = Component.FROZEN_WEIGHTS
    assert litgpt.components[frozen] - hf.components[frozen] >= table * BF16_BYTES
    assert any("separate embedding and lm_head" in note for note in litgpt.assumptions)
    assert not any("separate embedding and lm_head" in note for note in hf.assumptions)
    levels = peak_levels(arch, _job(framework=Framework.LITGPT))
    assert levels.allocated_bytes == litgpt.allocated_bytes


def test_an_untied_model_is_the_same_under_litgpt() -> None:
    arch = default_catalog().resolve("meta-llama/Llama-2-7b-hf").arch
    assert not arch.tie_word_embeddings
    litgpt = estimate(arch, _job(framework=Framework.LITGPT))
    assert litgpt.params.total == estimate(arch, _job()).params.total
    assert not any("separate embedding and lm_head" in note for note in litgpt.assumptions)


def test_only_hf_prepares_a_4bit_model_for_training() -> None:
    arch = default_catalog().resolve("meta-llama/Llama-2-7b-hf").arch
    frozen = Component.FROZEN_WEIGHTS
    hf = estimate(arch, _job(method=Method.QLORA))
    # the embedding kbit preparation casts to fp32 stays bf16 under LitGPT and torchtune
    embedding_fp32_over_bf16 = arch.vocab_size * arch.hidden_size * BF16_BYTES
    for framework in (Framework.LITGPT, Framework.TORCHTUNE):
        alone = estimate(arch, _job(method=Method.QLORA, framework=framework))
        assert hf.components[frozen] - alone.components[frozen] >= embedding_fp32_over_bf16
        assert any("does not run PEFT's kbit preparation" in n for n in alone.assumptions)
        # asked for explicitly, it still is not run: the framework has no such step
        asked = estimate(
            arch,
            _job(method=Method.QLORA, framework=framework, quantization=QuantSpec()),
        )
        assert asked.components[frozen] == alone.components[frozen]
