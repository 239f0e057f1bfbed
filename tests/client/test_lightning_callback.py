"""VramcastLightningCallback in a real Lightning `fit` of a tiny random Llama with LoRA, on
CPU, with the fake probe: a completed run, and one that dies of CUDA out-of-memory."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from tests.client.conftest import FakeProbe, Service
from tests.client.test_hf_callback import SEQ_LEN, tiny_lora_model
from vramcast_client import Delivery, RetryPolicy
from vramcast_client.lightning_callback import VramcastLightningCallback

pytestmark = [
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
    # Lightning's advice for real runs (more dataloader workers, a logger) is not for a test.
    pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning"),
    # lightning 2.6 still uses torch pytree's LeafSpec, deprecated in torch 2.13.
    pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)`:FutureWarning"),
]
FAST = RetryPolicy(attempts=2, backoff_s=0.01, max_backoff_s=0.05)


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class TinyModule(L.LightningModule):
    def __init__(self, oom_at_step: int | None = None) -> None:
        super().__init__()
        self.model = tiny_lora_model()
        self.oom_at_step = oom_at_step

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if self.oom_at_step is not None and self.global_step >= self.oom_at_step:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")
        loss: torch.Tensor = self.model(input_ids=batch, labels=batch).loss
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        trainable = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(trainable, lr=1e-3, fused=False)


def fit(module: TinyModule, callback: VramcastLightningCallback, root: Path) -> None:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        accumulate_grad_batches=2,
        precision="bf16-mixed",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
        callbacks=[callback],
    )
    tokens = torch.randint(0, 128, (24, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    trainer.fit(module, DataLoader(tokens, batch_size=4))  # type: ignore[arg-type]


def lightning_callback(service: Service, spool: Path) -> VramcastLightningCallback:
    return VramcastLightningCallback(
        service.url,
        api_key=service.upload_key,
        probe=FakeProbe(),
        spool_dir=spool,
        run_id=f"lightning-{uuid.uuid4().hex[:8]}-rank0",
        retry=FAST,
    )


def test_a_completed_fit_is_reported_with_its_spec(service: Service, tmp_path: Path) -> None:
    callback = lightning_callback(service, tmp_path / "spool")
    fit(TinyModule(), callback, tmp_path)

    assert callback.reporter.last_delivery is Delivery.UPLOADED
    (row,) = service.store.uploads(callback.reporter.run_id)
    job: dict[str, Any] = row.job
    assert row.outcome == "completed" and row.method == "lora"
    assert (job["batch_size"], job["seq_len"]) == (4, SEQ_LEN)
    assert job["lora"]["r"] == 4 and job["lora"]["target_modules"] == ["q_proj", "v_proj"]
    assert job["optim"] == "adamw_torch" and job["autocast"] is True
    assert job["gradient_accumulation_steps"] == 2
    assert job["model"]["hf_config"]["model_type"] == "llama"


def test_an_oom_is_reported_through_on_exception(service: Service, tmp_path: Path) -> None:
    callback = lightning_callback(service, tmp_path / "spool")
    with pytest.raises(torch.OutOfMemoryError):
        fit(TinyModule(oom_at_step=1), callback, tmp_path)

    (row,) = service.store.uploads(callback.reporter.run_id)
    assert row.outcome == "oom"
    assert (row.job["batch_size"], row.job["seq_len"]) == (4, SEQ_LEN)
