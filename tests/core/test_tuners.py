"""PEFT's (IA)^3 and LN tuning: their options' checks, what each trains, and the refusals of
what is not modelled (the estimates themselves are held to the reference traces,
tests/core/test_references.py)."""

from __future__ import annotations

import pytest

from service.catalog.models import default_catalog
from service.core.errors import InvalidConfigError, InvalidSpecError
from service.core.estimator import estimate
from service.core.result import Component
from service.core.spec import LoraSpec, Method, QuantSpec, TrainingSpec
from service.core.spec.prompt import IA3Spec, LnTuningSpec, PrefixTuningSpec, PromptTuningSpec

QWEN = "Qwen/Qwen2.5-0.5B"
LLAMA = "meta-llama/Llama-3.2-1B"


def _estimate(model: str, **kwargs: object) -> int:
    arch = default_catalog().resolve(model).arch
    spec = TrainingSpec(batch_size=1, seq_len=128, **kwargs)  # type: ignore[arg-type]
    return estimate(arch, spec).params.trainable


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"method": Method.LORA, "ia3": IA3Spec()}, "ia3"),
        ({"method": Method.IA3, "ln_tuning": LnTuningSpec()}, "ln_tuning"),
        ({"method": Method.LN_TUNING, "ia3": IA3Spec()}, "ia3"),
        ({"method": Method.IA3, "lora": LoraSpec()}, "lora"),
        ({"method": Method.IA3, "quantization": QuantSpec()}, "quantization"),
        ({"method": Method.LN_TUNING, "quantization": QuantSpec()}, "quantization"),
        ({"method": Method.IA3, "autocast": True}, "autocast"),
        (
            {"method": Method.LORA, "prompt_tuning": PromptTuningSpec(num_virtual_tokens=8)},
            "prompt_tuning",
        ),
        (
            {
                "method": Method.PROMPT_TUNING,
                "prompt_tuning": PromptTuningSpec(num_virtual_tokens=8),
                "prefix_tuning": PrefixTuningSpec(num_virtual_tokens=8),
            },
            "prefix_tuning",
        ),
        ({"method": Method.PREFIX_TUNING}, "prefix_tuning"),
        (
            {
                "method": Method.PREFIX_TUNING,
                "prefix_tuning": PrefixTuningSpec(num_virtual_tokens=8),
                "gradient_checkpointing": True,
            },
            "gradient_checkpointing",
        ),
        (
            {
                "method": Method.PREFIX_TUNING,
                "prefix_tuning": PrefixTuningSpec(num_virtual_tokens=8),
                "autocast": True,
            },
            "autocast",
        ),
    ],
)
def test_options_for_another_method_are_refused_by_name(
    kwargs: dict[str, object], field: str
) -> None:
    with pytest.raises(InvalidSpecError) as caught:
        TrainingSpec(batch_size=1, seq_len=8, **kwargs)  # type: ignore[arg-type]
    assert caught.value.field == field


def test_feedforward_modules_must_be_targets() -> None:
    with pytest.raises(InvalidSpecError) as caught:
        IA3Spec(target_modules=("k_proj", "v_proj"), feedforward_modules=("down_proj",))
    assert caught.value.field == "ia3.feedforward_modules"
    assert "down_proj" in caught.value.reason


def test_empty_target_lists_are_refused() -> None:
    with pytest.raises(InvalidSpecError, match="must not be empty") as caught:
        IA3Spec(target_modules=())
    assert caught.value.field == "ia3.target_modules"
    with pytest.raises(InvalidSpecError) as caught:
        LnTuningSpec(target_modules=())
    assert caught.value.field == "ln_tuning.target_modules"


def test_ia3_trains_one_fp32_vector_per_scaled_linear() -> None:
    # Qwen2: q_proj (896 outputs) and v_proj (128) scaled at the output, down_proj's 4864
    # inputs; 24 layers.
    assert _estimate(QWEN, method=Method.IA3) == 24 * (896 + 128 + 4864)
    # Llama: k_proj and v_proj (512 outputs each), down_proj's 8192 inputs; 16 layers.
    assert _estimate(LLAMA, method=Method.IA3) == 16 * (512 + 512 + 8192)


def test_ln_tuning_trains_copies_of_the_default_norms() -> None:
    assert _estimate(QWEN, method=Method.LN_TUNING) == 24 * 896  # post_attention_layernorm
    assert _estimate(LLAMA, method=Method.LN_TUNING) == (2 * 16 + 1) * 2048


def test_named_targets_change_what_trains() -> None:
    named = IA3Spec(target_modules=("v_proj",), feedforward_modules=())
    assert _estimate(QWEN, method=Method.IA3, ia3=named) == 24 * 128
    norms = LnTuningSpec(target_modules=("input_layernorm", "norm"))
    assert _estimate(QWEN, method=Method.LN_TUNING, ln_tuning=norms) == 25 * 896


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"ia3": IA3Spec(target_modules=("down_proj",))}, "ia3.target_modules"),
        ({"ln_tuning": LnTuningSpec(target_modules=("norm",))}, "ln_tuning.target_modules"),
    ],
)
def test_targets_whose_first_layer_is_not_modelled_are_refused(
    options: dict[str, object], field: str
) -> None:
    method = Method.IA3 if "ia3" in options else Method.LN_TUNING
    with pytest.raises(InvalidSpecError, match="not modelled") as caught:
        _estimate(QWEN, method=method, **options)
    assert caught.value.field == field


def test_a_target_the_model_lacks_is_refused_by_name() -> None:
    with pytest.raises(InvalidSpecError) as caught:
        _estimate(QWEN, method=Method.IA3, ia3=IA3Spec(target_modules=("query_key_value",)))
    assert caught.value.field == "ia3.target_modules"
    with pytest.raises(InvalidSpecError) as caught:
        _estimate(QWEN, method=Method.LN_TUNING, ln_tuning=LnTuningSpec(target_modules=("ln_f",)))
    assert caught.value.field == "ln_tuning.target_modules"


@pytest.mark.parametrize("model", ["microsoft/phi-2", "google-bert/bert-base-uncased"])
@pytest.mark.parametrize("method", [Method.IA3, Method.LN_TUNING])
def test_unmodelled_architectures_are_refused(model: str, method: Method) -> None:
    with pytest.raises(InvalidConfigError, match="modelled on") as caught:
        _estimate(model, method=method)
    assert caught.value.field == "model_type"


def test_prompt_tuning_needs_its_virtual_tokens() -> None:
    with pytest.raises(InvalidSpecError, match="num_virtual_tokens") as caught:
        TrainingSpec(batch_size=1, seq_len=8, method=Method.PROMPT_TUNING)
    assert caught.value.field == "prompt_tuning"
    with pytest.raises(InvalidSpecError) as caught:
        PromptTuningSpec(num_virtual_tokens=0)
    assert caught.value.field == "prompt_tuning.num_virtual_tokens"


def test_prompt_tuning_runs_the_model_on_the_lengthened_sequence() -> None:
    arch = default_catalog().resolve(QWEN).arch
    options = PromptTuningSpec(num_virtual_tokens=64)
    tuned = estimate(
        arch,
        TrainingSpec(batch_size=2, seq_len=448, method=Method.PROMPT_TUNING, prompt_tuning=options),
    )
    assert tuned.params.trainable == 64 * 896  # PromptEmbedding: (num_virtual_tokens, hidden)
    # the frozen model on 448 + 64 positions keeps the same activations and logits
    frozen = estimate(
        arch,
        TrainingSpec(
            batch_size=2,
            seq_len=512,
            method=Method.LN_TUNING,
            ln_tuning=LnTuningSpec(target_modules=("input_layernorm",)),
        ),
    )
    assert tuned.components[Component.LOGITS_LOSS] == frozen.components[Component.LOGITS_LOSS]
    assert tuned.components[Component.INPUTS] < frozen.components[Component.INPUTS]


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"num_virtual_tokens": 0}, "prefix_tuning.num_virtual_tokens"),
        ({"num_virtual_tokens": -3}, "prefix_tuning.num_virtual_tokens"),
        ({"num_virtual_tokens": 8, "encoder_hidden_size": 64}, "prefix_tuning.encoder_hidden_size"),
        (
            {"num_virtual_tokens": 8, "prefix_projection": True, "encoder_hidden_size": 0},
            "prefix_tuning.encoder_hidden_size",
        ),
    ],
)
def test_prefix_tuning_options_are_checked_by_name(options: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidSpecError) as caught:
        PrefixTuningSpec(**options)  # type: ignore[arg-type]
    assert caught.value.field == field


def test_prefix_tuning_trains_every_layers_keys_and_values() -> None:
    # Llama-3.2-1B: 16 layers, 8 key/value heads of 64 (PEFT sizes the prefix by them)
    width = 16 * 2 * 512
    plain = PrefixTuningSpec(num_virtual_tokens=200)
    assert _estimate(LLAMA, method=Method.PREFIX_TUNING, prefix_tuning=plain) == 200 * width
    projected = PrefixTuningSpec(num_virtual_tokens=30, prefix_projection=True)
    mlp = 30 * 512 + 512 * 512 + 512 + 512 * width + width
    assert _estimate(LLAMA, method=Method.PREFIX_TUNING, prefix_tuning=projected) == mlp
    wide = PrefixTuningSpec(num_virtual_tokens=30, prefix_projection=True, encoder_hidden_size=64)
    mlp = 30 * 512 + 64 * 512 + 64 + 64 * width + width
    assert _estimate(LLAMA, method=Method.PREFIX_TUNING, prefix_tuning=wide) == mlp


def test_prefix_tuning_lengthens_the_keys_not_the_queries() -> None:
    arch = default_catalog().resolve(QWEN).arch

    def job(virtual: int) -> TrainingSpec:
        return TrainingSpec(
            batch_size=2,
            seq_len=512,
            method=Method.PREFIX_TUNING,
            prefix_tuning=PrefixTuningSpec(num_virtual_tokens=virtual),
        )

    short, long = estimate(arch, job(8)), estimate(arch, job(256))
    # the logits and the loss stay at the sequence's positions, the attention's keys grow
    assert short.components[Component.LOGITS_LOSS] == long.components[Component.LOGITS_LOSS]
    assert short.components[Component.INPUTS] == long.components[Component.INPUTS]
    assert long.components[Component.ACTIVATIONS] > short.components[Component.ACTIVATIONS]
