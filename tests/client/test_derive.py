"""Job specs read from what a training process holds: QLoRA, DeepSpeed and the cases the API
cannot describe, on stand-in objects (the real Trainer runs in test_hf_callback)."""

from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import Any

import pytest

from tests.client.conftest import Service
from vramcast_client import VramcastClient
from vramcast_client.derive import (
    InputShapes,
    UndescribableJobError,
    job_from_hf,
    name_or_path,
)
from vramcast_client.errors import InvalidRequestError


class Config:
    """A config as transformers' PretrainedConfig presents it."""

    def __init__(self, **values: Any) -> None:
        self.__dict__.update(values)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}


QWEN_0_5B = Config(
    model_type="qwen2",
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    tie_word_embeddings=True,
    _attn_implementation="flash_attention_2",
    _name_or_path="Qwen/Qwen2.5-0.5B",
    quantization_config={
        "quant_method": "bitsandbytes",
        "load_in_4bit": True,
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": True,
        "bnb_4bit_compute_dtype": "bfloat16",
    },
)


class Parameter:
    def __init__(self, dtype: str) -> None:
        self.dtype = dtype


class PeftModel:
    """The attributes of a peft.PeftModel the derivation reads."""

    def __init__(self, config: Config, peft_type: str = "LORA") -> None:
        self.config = config
        self.active_adapter = "default"
        self.peft_config = {
            "default": SimpleNamespace(
                peft_type=peft_type,
                r=16,
                lora_alpha=32,
                lora_dropout=0.05,
                target_modules={"v_proj", "q_proj"},
                modules_to_save=None,
            )
        }

    def get_input_embeddings(self) -> Any:
        return SimpleNamespace(weight=Parameter("torch.bfloat16"))

    def named_parameters(self) -> list[tuple[str, Parameter]]:
        return [
            ("base_model.model.embed_tokens.weight", Parameter("torch.bfloat16")),
            (
                "base_model.model.layers.0.self_attn.q_proj.lora_A.default.weight",
                Parameter("torch.float32"),
            ),
        ]


def arguments(**changes: Any) -> SimpleNamespace:
    """TrainingArguments' fields the derivation reads (TRL's SFTConfig adds max_length)."""
    values: dict[str, Any] = {
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 8,
        "gradient_checkpointing": True,
        "bf16": True,
        "fp16": False,
        "optim": "paged_adamw_8bit",
        "world_size": 8,
        "fsdp": [],
        "deepspeed": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
        "max_length": 2048,
    }
    return SimpleNamespace(**{**values, **changes})


def test_a_qlora_run_under_deepspeed(service: Service) -> None:
    job = job_from_hf(PeftModel(QWEN_0_5B), arguments())
    assert job.to_json() == {
        "model": {"hf_config": QWEN_0_5B.to_dict()},
        "method": "qlora",
        "batch_size": 4,
        "seq_len": 2048,
        "lora": {
            "r": 16,
            "lora_alpha": 32,
            "lora_dropout": 0.05,
            "target_modules": ["q_proj", "v_proj"],
            "adapter_dtype": "fp32",
        },
        "quantization": {"type": "nf4", "double_quant": True, "compute_dtype": "bf16"},
        "dtype": "bf16",
        "autocast": True,
        "optim": "paged_adamw_8bit",
        "gradient_accumulation_steps": 8,
        "gradient_checkpointing": True,
        "attn_implementation": "flash_attention_2",
        "parallel": {"gpus": 8, "strategy": "zero2", "offload": "optimizer"},
    }
    # What the reporter derives is a job the service estimates.
    with VramcastClient(service.url) as client:
        assert client.estimate(job).params.trainable > 0
        catalog = job_from_hf(PeftModel(QWEN_0_5B), arguments(), model_id="Qwen/Qwen2.5-0.5B")
        assert client.estimate(catalog).model == "Qwen/Qwen2.5-0.5B"


def test_sequence_length_prefers_what_the_model_took() -> None:
    shapes = InputShapes()
    shapes.max_seq_len, shapes.max_batch_size = 1536, 4
    assert job_from_hf(PeftModel(QWEN_0_5B), arguments(), shapes=shapes).seq_len == 1536
    assert (
        job_from_hf(PeftModel(QWEN_0_5B), arguments(), shapes=shapes, seq_len=4096).seq_len == 4096
    )


@pytest.mark.parametrize(
    ("model", "args", "reason"),
    [
        (PeftModel(QWEN_0_5B, peft_type="IA3"), arguments(), "not LoRA"),
        (PeftModel(QWEN_0_5B), arguments(optim="lion_8bit"), "lion_8bit"),
        (PeftModel(QWEN_0_5B), arguments(max_length=None), "sequence length"),
        (SimpleNamespace(), arguments(), "no Hugging Face model"),
    ],
)
def test_jobs_the_api_cannot_describe(model: Any, args: Any, reason: str) -> None:
    with pytest.raises(UndescribableJobError, match=reason):
        job_from_hf(model, args)


def test_hub_ids_and_local_paths(tmp_path: Any) -> None:
    assert name_or_path(PeftModel(QWEN_0_5B)) == "Qwen/Qwen2.5-0.5B"
    local = Config(**{**QWEN_0_5B.__dict__, "_name_or_path": str(tmp_path / "checkpoint")})
    assert name_or_path(PeftModel(local)) is None


def test_all_linear_as_peft_expands_it_names_the_modules() -> None:
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    with torch.device("meta"):
        base = transformers.Qwen2ForCausalLM(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers' notice, raised by PEFT
        model = peft.get_peft_model(
            base, peft.LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM")
        )
    # PEFT keeps the expanded, dotted module paths, not "all-linear"
    assert "model.layers.0.self_attn.q_proj" in model.peft_config["default"].target_modules
    job = job_from_hf(model, arguments(), model_id="Qwen/Qwen2.5-0.5B")
    assert job.to_json()["lora"]["target_modules"] == [
        "down_proj",
        "gate_proj",
        "k_proj",
        "o_proj",
        "q_proj",
        "up_proj",
        "v_proj",
    ]


class RewardConfig(SimpleNamespace):
    """TRL's RewardConfig as the derivation recognises it: by its class name."""


def test_a_reward_run_counts_pairs(service: Service) -> None:
    values = vars(arguments(world_size=1, deepspeed=None, optim="adamw_torch_fused", bf16=False))
    job = job_from_hf(PeftModel(QWEN_0_5B), RewardConfig(**values), model_id="Qwen/Qwen2.5-0.5B")
    assert job.to_json()["objective"] == "reward" and "dpo" not in job.to_json()
    assert job.batch_size == 4
    shapes = InputShapes()
    shapes.max_batch_size, shapes.max_seq_len = 8, 1024
    unsized = RewardConfig(**{**values, "per_device_train_batch_size": None})
    assert job_from_hf(PeftModel(QWEN_0_5B), unsized, shapes=shapes).batch_size == 4
    with VramcastClient(service.url) as client:
        assert client.estimate(job).peak.allocated_bytes > 0


class DPOConfig(SimpleNamespace):
    """TRL's DPOConfig as the derivation recognises it: by its class name."""


def test_a_dpo_run_counts_pairs_and_its_reference_setting(service: Service) -> None:
    values = vars(arguments(world_size=1, deepspeed=None, optim="adamw_torch_fused", bf16=False))
    args = DPOConfig(**{**values, "precompute_ref_log_probs": True})
    job = job_from_hf(PeftModel(QWEN_0_5B), args, model_id="Qwen/Qwen2.5-0.5B")
    assert job.to_json()["objective"] == "dpo"
    assert job.to_json()["dpo"] == {"precompute_ref_log_probs": True}
    assert job.batch_size == 4  # pairs: the model takes 8 sequences
    shapes = InputShapes()
    shapes.max_batch_size, shapes.max_seq_len = 8, 1024
    unsized = DPOConfig(**{**values, "per_device_train_batch_size": None})
    assert job_from_hf(PeftModel(QWEN_0_5B), unsized, shapes=shapes).batch_size == 4
    with VramcastClient(service.url) as client:
        assert client.estimate(job).peak.allocated_bytes > 0


class KTOConfig(SimpleNamespace):
    """TRL's KTOConfig as the derivation recognises it: by its class name."""


@pytest.mark.parametrize("config", [DPOConfig, KTOConfig, RewardConfig])
def test_a_preference_run_under_trls_default_bf16_is_estimated(
    service: Service, config: type[SimpleNamespace]
) -> None:
    # TRL's configs set bf16=True unless fp16 is asked for (trl/trainer/base_config.py)
    values = vars(arguments(world_size=1, deepspeed=None, optim="adamw_torch_fused", bf16=True))
    job = job_from_hf(PeftModel(QWEN_0_5B), config(**values), model_id="Qwen/Qwen2.5-0.5B")
    assert job.to_json()["autocast"] is True
    plain = job_from_hf(
        PeftModel(QWEN_0_5B), config(**{**values, "bf16": False}), model_id="Qwen/Qwen2.5-0.5B"
    )
    with VramcastClient(service.url) as client:
        mixed, fp = client.estimate(job), client.estimate(plain)
    assert mixed.peak.allocated_bytes > 0
    assert mixed.peak.allocated_bytes != fp.peak.allocated_bytes


def test_a_kto_run_counts_examples_and_its_settings(service: Service) -> None:
    values = vars(arguments(world_size=1, deepspeed=None, optim="adamw_torch_fused", bf16=False))
    args = KTOConfig(**{**values, "precompute_ref_log_probs": True, "loss_type": "kto"})
    job = job_from_hf(PeftModel(QWEN_0_5B), args, model_id="Qwen/Qwen2.5-0.5B")
    assert job.to_json()["objective"] == "kto" and "dpo" not in job.to_json()
    assert job.to_json()["kto"] == {"precompute_ref_log_probs": True, "loss_type": "kto"}
    assert job.batch_size == 4  # unpaired: the model takes 4 sequences
    shapes = InputShapes()
    shapes.max_batch_size, shapes.max_seq_len = 8, 1024
    unsized = KTOConfig(**{**values, "per_device_train_batch_size": None})
    assert job_from_hf(PeftModel(QWEN_0_5B), unsized, shapes=shapes).batch_size == 8
    with VramcastClient(service.url) as client:
        assert client.estimate(job).peak.allocated_bytes > 0


class GRPOConfig(SimpleNamespace):
    """TRL's GRPOConfig as the derivation recognises it: by its class name."""


def test_a_grpo_run_counts_completions_and_its_settings(service: Service) -> None:
    values = vars(arguments(world_size=1, deepspeed=None, optim="adamw_torch_fused", bf16=False))
    values.update(per_device_train_batch_size=8, gradient_accumulation_steps=1, max_length=None)
    grpo = {"num_generations": 8, "max_completion_length": 256, "beta": 0.0, "use_vllm": False}
    args = GRPOConfig(**{**values, **grpo, "num_iterations": 1})
    job = job_from_hf(PeftModel(QWEN_0_5B), args, seq_len=512, model_id="Qwen/Qwen2.5-0.5B")
    data = job.to_json()
    assert data["objective"] == "grpo" and "dpo" not in data and "kto" not in data
    assert data["grpo"] == {**grpo, "num_iterations": 1}
    assert job.batch_size == 8 and job.seq_len == 512  # completions of prompt + completion
    assert job.grpo is not None
    with VramcastClient(service.url) as client:
        assert client.estimate(job).peak.allocated_bytes > 0
        vllm = job.model_copy(update={"grpo": job.grpo.model_copy(update={"use_vllm": True})})
        with pytest.raises(Exception, match="use_vllm"):
            client.estimate(vllm)


class ORPOConfig(SimpleNamespace):
    """TRL's ORPOConfig as the derivation recognises it: by its class name."""


def test_an_orpo_run_counts_pairs_and_its_settings(service: Service) -> None:
    values = vars(arguments(world_size=1, deepspeed=None, optim="adamw_torch_fused", bf16=True))
    args = ORPOConfig(**{**values, "disable_dropout": False})
    job = job_from_hf(PeftModel(QWEN_0_5B), args, model_id="Qwen/Qwen2.5-0.5B")
    data = job.to_json()
    assert data["objective"] == "orpo" and "dpo" not in data and "kto" not in data
    assert data["orpo"] == {"disable_dropout": False}
    assert data["autocast"] is True  # ORPOConfig's bf16=True: accelerate's autocast
    shapes = InputShapes()
    shapes.max_batch_size, shapes.max_seq_len = 8, 1024
    unsized = ORPOConfig(**{**values, "per_device_train_batch_size": None})
    assert job_from_hf(PeftModel(QWEN_0_5B), unsized, shapes=shapes).batch_size == 4  # pairs
    with VramcastClient(service.url) as client:
        # this model is 4-bit: QLoRA under bf16 is refused, naming autocast
        with pytest.raises(InvalidRequestError, match="autocast"):
            client.estimate(job)
        plain = job.model_copy(update={"autocast": False})
        assert client.estimate(plain).peak.allocated_bytes > 0


class SFTConfig(SimpleNamespace):
    """TRL's SFTConfig as the derivation recognises it: by its class name."""


@pytest.mark.parametrize(
    ("settings", "packed"),
    [
        ({"padding_free": True}, True),
        ({"packing": True}, True),  # TRL's default strategy, "bfd", is padding-free
        ({"packing": True, "packing_strategy": "bfd_split"}, True),
        ({"packing": True, "packing_strategy": "wrapped"}, False),  # rows with their own mask
        ({}, False),
    ],
)
def test_a_padding_free_sft_run_is_packed(
    service: Service, settings: dict[str, Any], packed: bool
) -> None:
    values = vars(arguments(world_size=1, deepspeed=None, optim="adamw_torch_fused"))
    args = SFTConfig(**{**values, "packing": False, "padding_free": False, **settings})
    job = job_from_hf(PeftModel(QWEN_0_5B), args, model_id="Qwen/Qwen2.5-0.5B")
    assert job.to_json().get("packing", False) is packed
    if packed:
        row = job.model_copy(update={"packing": None, "batch_size": 1, "seq_len": 4 * 2048})
        with VramcastClient(service.url) as client:
            # flash_attention_2 (the model's) runs the packed row varlen, as one sequence of
            # 4 x 2048 tokens: the same step, with the row's int64 position_ids held beside
            # its input_ids and labels
            grown = client.estimate(job).peak.allocated_bytes
            assert grown - client.estimate(row).peak.allocated_bytes == 4 * 2048 * 8


def test_use_liger_kernel_is_read_and_estimated(service: Service) -> None:
    """TrainingArguments.use_liger_kernel becomes the job's liger_kernel; the service answers
    it below the same job's HF loss (QLoRA, no mixed precision, one GPU)."""
    values = vars(arguments(world_size=1, deepspeed=None, optim="adamw_torch_fused", bf16=False))
    liger = job_from_hf(PeftModel(QWEN_0_5B), SimpleNamespace(**values, use_liger_kernel=True))
    plain = job_from_hf(PeftModel(QWEN_0_5B), SimpleNamespace(**values, use_liger_kernel=False))
    assert liger.to_json()["liger_kernel"] is True
    assert "liger_kernel" not in plain.to_json()
    with VramcastClient(service.url) as client:
        fused = client.estimate(liger).peak.allocated_bytes
        assert fused < client.estimate(plain).peak.allocated_bytes
