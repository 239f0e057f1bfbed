"""The command line refuses the job specs the REST API refuses, naming the same field with the
same reason: both go through the core's limits (the CLI through the spec codec)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.cli.main import EXIT_USAGE, main
from tests.api.conftest import make_app

MODEL = "Qwen/Qwen2.5-0.5B"
JOB: dict[str, Any] = {"model": MODEL, "batch_size": 2, "seq_len": 512}
ARGV = ["estimate", MODEL, "-b", "2", "-s", "512"]


@pytest.fixture(scope="module")
def service() -> Iterator[TestClient]:
    with TestClient(make_app()) as client:
        yield client


@pytest.mark.parametrize(
    ("options", "job"),
    [
        (["-b", "1000000000"], {"batch_size": 1_000_000_000}),
        (["-b", "0"], {"batch_size": 0}),
        (["-s", "2000000"], {"seq_len": 2_000_000}),
        (["--gradient-accumulation-steps", "100000"], {"gradient_accumulation_steps": 100_000}),
        (["--max-grad-norm", "1e7"], {"max_grad_norm": 1e7}),
        (["--max-grad-norm", "-1"], {"max_grad_norm": -1.0}),
        (["--r", "100000"], {"lora": {"r": 100_000}}),
        (["--lora-alpha", "0"], {"lora": {"lora_alpha": 0}}),
        (["--lora-dropout", "1.5"], {"lora": {"lora_dropout": 1.5}}),
        (["--gpus", "5000"], {"parallel": {"gpus": 5000}}),
        (
            ["--gpus", "2", "--offload", "optimizer_and_params"],
            {"parallel": {"gpus": 2, "offload": "optimizer_and_params"}},
        ),
        (["--alloc-conf", "max_split_size_mb:10"], {"allocator": {"max_split_size_mb": 10}}),
        # LitGPT's adapters under another framework than litgpt
        (["--method", "llama-adapter"], {"method": "llama-adapter"}),
        (
            ["--alloc-conf", "roundup_power2_divisions:4096"],
            {"allocator": {"roundup_power2_divisions": 4096}},
        ),
        # a reward model under ZeRO (DDP is modelled), or under fp16 mixed precision
        (
            ["--objective", "reward", "--gpus", "2", "--strategy", "zero2"],
            {"objective": "reward", "parallel": {"gpus": 2, "strategy": "zero2"}},
        ),
        (
            ["--objective", "reward", "--autocast", "--dtype", "fp16"],
            {"objective": "reward", "autocast": True, "dtype": "fp16"},
        ),
        # KTO's KL batch needs two examples per micro-batch
        (["--objective", "kto", "-b", "1"], {"objective": "kto", "batch_size": 1}),
        # GRPO: vLLM not traced; the generation batch divisible by num_generations
        (
            ["--objective", "grpo", "--use-vllm", "--max-completion-length", "256"],
            {"objective": "grpo", "grpo": {"use_vllm": True, "max_completion_length": 256}},
        ),
        (
            ["--objective", "grpo", "--max-completion-length", "256"],
            {"objective": "grpo", "grpo": {"max_completion_length": 256}},
        ),
        # ORPO with QLoRA under bf16 (ORPOTrainer's peft_module_casting_to_bf16), or on DDP
        (
            ["--objective", "orpo", "--method", "qlora", "--autocast"],
            {"objective": "orpo", "method": "qlora", "autocast": True},
        ),
        (
            ["--objective", "orpo", "--gpus", "2", "--strategy", "fsdp"],
            {"objective": "orpo", "parallel": {"gpus": 2, "strategy": "fsdp"}},
        ),
    ],
)
def test_the_cli_refuses_what_the_api_refuses_for_the_same_reason(
    service: TestClient,
    capsys: pytest.CaptureFixture[str],
    options: list[str],
    job: dict[str, Any],
) -> None:
    response = service.post("/v1/estimates", json={**JOB, **job})
    assert response.status_code == 422
    [error] = response.json()["errors"]
    field = ".".join(str(part) for part in error["loc"][1:])

    assert main([*ARGV, *options]) == EXIT_USAGE
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("vramcast estimate: error: ")
    assert field in captured.err
    assert captured.err.rstrip("\n").endswith(f": {error['detail']}")


def test_a_huge_batch_is_a_usage_error_naming_batch_size(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([*ARGV[:2], "-b", "1000000000", "-s", "512"]) == EXIT_USAGE
    assert capsys.readouterr().err == (
        "vramcast estimate: error: --batch-size (batch_size): "
        "Input should be less than or equal to 4096\n"
    )


def test_litgpt_adapters_over_a_4bit_base_are_estimated(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["estimate", "stabilityai/stablelm-base-alpha-3b", "-b", "1", "-s", "256"]
    litgpt = ["--method", "llama-adapter", "--framework", "litgpt", "--quant", "nf4"]
    assert main([*argv, *litgpt]) == 0
    out = capsys.readouterr().out
    assert "573,888 trainable" in out
    assert "not traced" in out


def test_a_reward_model_is_estimated_from_the_command_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([*ARGV, "--objective", "reward", "--method", "full"]) == 0
    out = capsys.readouterr().out
    assert "RewardTrainer" in out and "4 sequences of 512 tokens" in out
    assert "logits_loss" not in out


def test_a_kto_job_is_estimated_from_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    kto = ["--objective", "kto", "--method", "full"]
    assert main([*ARGV, *kto]) == 0
    out = capsys.readouterr().out
    assert "KTOTrainer" in out and "2 unpaired examples of 512 tokens" in out
    assert "reference_model" in out and "reference_forward" in out
    assert (
        main([*ARGV, *kto, "--precompute-ref-log-probs", "--kto-loss-type", "apo_zero_unpaired"])
        == 0
    )
    out = capsys.readouterr().out
    assert "no KL batch" in out and "reference_model" not in out


def test_a_grpo_job_is_estimated_from_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    grpo = ["--objective", "grpo", "--num-generations", "2", "--max-completion-length", "256"]
    assert main([*ARGV, *grpo]) == 0
    out = capsys.readouterr().out
    assert "GRPOTrainer" in out and "2 rows (2 per prompt) on 256-token prompts" in out
    assert "generation" in out and "generation_kv_cache" in out
    assert main([*ARGV, *grpo, "--grpo-beta", "0.04"]) == 2
    err = capsys.readouterr().err
    assert "--grpo-beta (grpo.beta): beta above 0.0 is not modelled" in err


def test_an_orpo_job_is_estimated_from_the_command_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    orpo = ["--objective", "orpo", "--method", "lora"]
    assert main([*ARGV, *orpo]) == 0
    out = capsys.readouterr().out
    assert "ORPOTrainer" in out and "4 sequences of 512 tokens" in out
    assert "backward_start" in out and "reference_model" not in out
    assert main([*ARGV, *orpo, "--lora-dropout", "0.1", "--keep-dropout"]) == 0
    assert "LoRA dropout kept" in capsys.readouterr().out
