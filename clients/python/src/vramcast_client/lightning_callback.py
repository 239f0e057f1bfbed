"""A Lightning `Callback` that uploads each rank's measured peaks when `fit` ends or dies of OOM.

    from vramcast_client.lightning_callback import VramcastLightningCallback
    trainer = L.Trainer(..., callbacks=[VramcastLightningCallback(seq_len=2048)])
    trainer.fit(module)

The LightningModule must hold a Hugging Face model (a module with a `config`), PEFT-wrapped
or not; the job spec is read from it, the Trainer (precision, accumulation, strategy, world
size) and its first optimizer. Lightning hands `on_exception` the error that ends `fit`, so
a CUDA out-of-memory death is reported as `oom`, a lower bound of what the job needed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch.callbacks import Callback

from vramcast_client.derive import find_hf_model, job_from_lightning
from vramcast_client.measure import is_out_of_memory
from vramcast_client.models import Job
from vramcast_client.reporter import Reporter


class VramcastLightningCallback(Callback):
    """Options go to `Reporter` (url, api_key, probe, model_id, seq_len, ...), or pass one."""

    def __init__(self, url: str | None = None, *, reporter: Reporter | None = None, **options: Any):
        self.reporter = reporter if reporter is not None else Reporter(url, **options)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        try:
            model = find_hf_model(pl_module)
        except Exception:
            model = pl_module  # the spec is checked, and the failure logged, at the end
        self.reporter.start(model)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self.reporter.finish(self._job(trainer, pl_module), "completed")

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if is_out_of_memory(exception):
            self.reporter.finish(self._job(trainer, pl_module), "oom")

    def _job(self, trainer: Any, pl_module: Any) -> Callable[[], Job]:
        reporter = self.reporter
        return lambda: job_from_lightning(
            trainer,
            pl_module,
            seq_len=reporter.seq_len,
            shapes=reporter.shapes,
            model_id=reporter.model_id_for(pl_module),
        )
