"""`vramcast estimate` with PEFT's prompt and prefix tuning: the virtual tokens and the prefix's
projection reach the spec, and options of another method are refused by name."""

from __future__ import annotations

import pytest

from service.cli.main import build_parser
from service.cli.options import CliError, spec_from_args
from service.core.spec import Method, TrainingSpec
from service.core.spec.prompt import PrefixTuningSpec, PromptTuningSpec

JOB = ["Qwen/Qwen2.5-0.5B", "-b", "2", "-s", "512"]


def _spec(*argv: str) -> TrainingSpec:
    return spec_from_args(build_parser().parse_args(["estimate", *JOB, *argv]))


def test_prefix_tuning_takes_its_tokens_and_projection() -> None:
    spec = _spec("--method", "prefix-tuning", "--num-virtual-tokens", "200")
    assert spec.method is Method.PREFIX_TUNING
    assert spec.prefix_tuning == PrefixTuningSpec(num_virtual_tokens=200)
    spec = _spec(
        "--method",
        "prefix-tuning",
        "--num-virtual-tokens",
        "30",
        "--prefix-projection",
        "--encoder-hidden-size",
        "256",
    )
    assert spec.prefix_tuning == PrefixTuningSpec(
        num_virtual_tokens=30, prefix_projection=True, encoder_hidden_size=256
    )


def test_prompt_tuning_keeps_its_virtual_tokens() -> None:
    spec = _spec("--method", "prompt-tuning", "--num-virtual-tokens", "20")
    assert spec.prompt_tuning == PromptTuningSpec(num_virtual_tokens=20)
    assert spec.prefix_tuning is None


def test_prefix_options_need_prefix_tuning() -> None:
    with pytest.raises(CliError, match="--prefix-projection"):
        _spec("--method", "prompt-tuning", "--num-virtual-tokens", "20", "--prefix-projection")
    with pytest.raises(CliError, match="--num-virtual-tokens"):
        _spec("--method", "lora", "--num-virtual-tokens", "20")


def test_a_projection_width_without_the_projection_is_refused_by_name() -> None:
    with pytest.raises(CliError, match=r"--encoder-hidden-size \(prefix_tuning.encoder_hidden"):
        _spec(
            "--method", "prefix-tuning", "--num-virtual-tokens", "8", "--encoder-hidden-size", "64"
        )
