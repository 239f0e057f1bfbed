"""VramcastCallback in a real `Trainer.train()` of a tiny random Llama with LoRA, on CPU.

The GPU is the fake probe (there is none here); everything else is real: the Trainer, PEFT,
the spec the callback derives, the service and its store.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

from tests.client.conftest import FakeProbe, Service, ServiceProcess
from vramcast_client import Delivery, RetryPolicy
from vramcast_client.derive import job_from_hf
from vramcast_client.hf_callback import VramcastCallback

# peft 0.21 reads the attribute transformers 5 deprecated; neither is this project's code.
pytestmark = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"
)

SEQ_LEN = 16
STEPS = 4
FAST = RetryPolicy(attempts=2, backoff_s=0.01, max_backoff_s=0.05)


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny matrices: one thread is several times faster than contended ones."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_lora_model() -> Any:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
    )
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    return get_peft_model(LlamaForCausalLM(config), lora)


def train(output: Path, callbacks: list[Any]) -> tuple[float, dict[str, torch.Tensor], Any]:
    """A few optimizer steps; returns the loss, the adapter weights and the trainer."""
    model = tiny_lora_model()
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 128, (16, SEQ_LEN), generator=generator)
    data = [{"input_ids": row, "labels": row} for row in tokens]
    args = TrainingArguments(
        output_dir=str(output),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=STEPS,
        learning_rate=1e-2,
        optim="adamw_torch",
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
    result = trainer.train()
    weights = {
        name: parameter.detach().clone()
        for name, parameter in model.named_parameters()
        if parameter.requires_grad
    }
    return result.training_loss, weights, trainer


def callback(url: str, key: str, spool: Path, **options: Any) -> VramcastCallback:
    return VramcastCallback(
        url,
        api_key=key,
        probe=FakeProbe(),
        spool_dir=spool,
        node_id="gpu-node-17",
        run_id=f"hf-{uuid.uuid4().hex[:8]}-rank0",
        retry=FAST,
        **options,
    )


def test_the_stored_row_carries_the_spec_the_callback_derived(
    service: Service, tmp_path: Path
) -> None:
    reporting = callback(service.url, service.upload_key, tmp_path / "spool")
    _, _, trainer = train(tmp_path / "run", [reporting])

    reporter = reporting.reporter
    assert reporter.last_delivery is Delivery.UPLOADED
    (row,) = service.store.uploads(reporter.run_id)
    derived = job_from_hf(trainer.model, trainer.args, shapes=reporter.shapes)
    assert row.job == derived.to_json()
    assert row.model == "hf_config" and row.method == "lora"

    job = row.job
    assert job["model"]["hf_config"]["model_type"] == "llama"
    assert job["model"]["hf_config"]["hidden_size"] == 32
    assert (job["batch_size"], job["seq_len"]) == (2, SEQ_LEN)  # seq_len as the model saw it
    assert job["lora"] == {
        "r": 4,
        "lora_alpha": 8,
        "lora_dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"],
        "adapter_dtype": "fp32",
    }
    assert job["dtype"] == "fp32" and job["autocast"] is False
    assert job["optim"] == "adamw_torch"
    assert job["gradient_accumulation_steps"] == 2
    assert job["gradient_checkpointing"] is False
    assert job["attn_implementation"] == "sdpa"
    assert job["parallel"] == {"gpus": 1}
    assert row.outcome == "completed" and row.measured_device_bytes is not None


def test_a_killed_service_leaves_training_unchanged(own_service: Service, tmp_path: Path) -> None:
    class KillService(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 2:
                own_service.process.kill()

    spool = tmp_path / "spool"
    baseline_loss, baseline_weights, _ = train(tmp_path / "baseline", [])
    reporting = callback(own_service.url, own_service.upload_key, spool)
    loss, weights, _ = train(tmp_path / "reported", [KillService(), reporting])

    assert loss == baseline_loss
    assert weights.keys() == baseline_weights.keys()
    assert all(torch.equal(weights[name], baseline_weights[name]) for name in weights)
    assert reporting.reporter.last_delivery is Delivery.SPOOLED
    assert len(list(spool.glob("*.json"))) == 1

    # The service comes back; the next run on the node sends the kept upload first.
    restarted = ServiceProcess(own_service.store)
    try:
        next_run = callback(restarted.url, own_service.upload_key, spool)
        train(tmp_path / "next", [next_run])
    finally:
        restarted.stop()
    stored = {row.run_id for row in own_service.store.uploads()}
    assert stored == {reporting.reporter.run_id, next_run.reporter.run_id}
    assert not list(spool.glob("*.json"))


def test_oom_in_training_is_reported_with_track(service: Service, tmp_path: Path) -> None:
    class RunOutOfMemory(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 2:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")

    reporting = callback(service.url, service.upload_key, tmp_path / "spool")
    model = tiny_lora_model()
    tokens = torch.randint(0, 128, (8, SEQ_LEN))
    args = TrainingArguments(
        output_dir=str(tmp_path / "run"),
        per_device_train_batch_size=2,
        max_steps=STEPS,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
    )
    data = [{"input_ids": row, "labels": row} for row in tokens]
    trainer = Trainer(
        model=model, args=args, train_dataset=data, callbacks=[RunOutOfMemory(), reporting]
    )
    with (
        pytest.raises(torch.OutOfMemoryError),
        reporting.reporter.track(model=trainer.model, args=trainer.args),
    ):
        trainer.train()

    (row,) = service.store.uploads(reporting.reporter.run_id)
    assert row.outcome == "oom"
    assert (row.job["batch_size"], row.job["seq_len"]) == (2, SEQ_LEN)
