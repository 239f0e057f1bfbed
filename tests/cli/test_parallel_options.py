"""`vramcast estimate` with several GPUs: DeepSpeed and FSDP config files read as users write
them, and the options beside them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.cli.main import build_parser
from service.cli.options import CliError, spec_from_args
from service.core.spec import FsdpSharding, Offload, Strategy, TrainingSpec

JOB = ["mistralai/Mistral-7B-v0.1", "--method", "full", "-b", "1", "-s", "2048", "--gpus", "4"]


def _spec(*argv: str) -> TrainingSpec:
    return spec_from_args(build_parser().parse_args(["estimate", *JOB, *argv]))


def _file(tmp_path: Path, config: object) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_a_deepspeed_file_sets_the_strategy_and_offload(tmp_path: Path) -> None:
    config = {
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu"},
            "reduce_bucket_size": "auto",
            "stage3_max_live_parameters": 2e8,
        }
    }
    parallel = _spec("--deepspeed", _file(tmp_path, config)).parallel
    assert parallel.strategy is Strategy.ZERO3
    assert parallel.offload is Offload.OPTIMIZER
    assert parallel.reduce_bucket_size is None  # "auto": HF fills it from the model
    assert parallel.stage3_max_live_parameters == 200_000_000
    # an option beside the file wins
    assert _spec(
        "--deepspeed", _file(tmp_path, config), "--strategy", "zero2"
    ).parallel.strategy == (Strategy.ZERO2)


def test_an_accelerate_fsdp_file_sets_fsdp1_and_checkpointing(tmp_path: Path) -> None:
    config = {
        "fsdp_version": 1,
        "fsdp_sharding_strategy": "SHARD_GRAD_OP",
        "fsdp_activation_checkpointing": True,
    }
    spec = _spec("--fsdp-config", _file(tmp_path, config))
    assert spec.parallel.strategy is Strategy.FSDP
    assert spec.parallel.sharding_strategy is FsdpSharding.SHARD_GRAD_OP
    assert spec.gradient_checkpointing


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ({"zero_optimization": {"stage": 7}}, "--deepspeed: zero_optimization.stage"),
        ({"zero_optimization": {"offload_param": {"device": "cpu"}}}, "offload_param.device"),
    ],
)
def test_a_bad_deepspeed_file_names_the_key(tmp_path: Path, config: object, words: str) -> None:
    with pytest.raises(CliError, match=words):
        _spec("--deepspeed", _file(tmp_path, config))


def test_an_unreadable_file_and_two_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(CliError, match="cannot read"):
        _spec("--deepspeed", str(tmp_path / "missing.json"))
    path = _file(tmp_path, {})
    with pytest.raises(CliError, match="give one of them"):
        _spec("--deepspeed", path, "--fsdp-config", path)


def test_peft_methods_take_their_defaults_and_target_modules() -> None:
    job = ["Qwen/Qwen2.5-0.5B", "-b", "1", "-s", "512"]
    parse = build_parser().parse_args
    spec = spec_from_args(parse(["estimate", *job, "--method", "ia3"]))
    assert spec.method.value == "ia3" and spec.ia3 is None and spec.lora is None
    spec = spec_from_args(
        parse(["estimate", *job, "--method", "ln-tuning", "--target-modules", "norm"])
    )
    assert spec.ln_tuning is not None and spec.ln_tuning.target_modules == ("norm",)
    with pytest.raises(CliError, match="LoRA options"):
        spec_from_args(parse(["estimate", *job, "--method", "ia3", "--r", "8"]))
