"""`vramcast estimate --liger-kernel`: HF Trainer's use_liger_kernel reaches the spec."""

from __future__ import annotations

import pytest

from service.cli.main import build_parser
from service.cli.options import CliError, spec_from_args
from service.core.spec import LossImpl, resolve

JOB = ["Qwen/Qwen2.5-0.5B", "-b", "2", "-s", "512"]


def test_the_flag_turns_liger_on_and_with_it_the_fused_loss() -> None:
    on = spec_from_args(build_parser().parse_args(["estimate", *JOB, "--liger-kernel"]))
    off = spec_from_args(build_parser().parse_args(["estimate", *JOB]))
    assert on.liger_kernel and not off.liger_kernel
    assert resolve(on).loss is LossImpl.FUSED and resolve(off).loss is LossImpl.HF


def test_a_refused_quantization_type_names_the_quant_option() -> None:
    args = build_parser().parse_args(
        [
            "estimate",
            *JOB,
            "--method",
            "qlora",
            "--quant",
            "gptq",
            "--dtype",
            "fp16",
            "--liger-kernel",
        ]
    )
    with pytest.raises(
        CliError, match=r"^--quant \(quantization\.type\): liger_kernel is modelled"
    ):
        spec_from_args(args)
