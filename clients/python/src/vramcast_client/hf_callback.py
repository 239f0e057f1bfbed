"""A Hugging Face `TrainerCallback` that uploads each rank's measured peaks when training ends.

    from vramcast_client.hf_callback import VramcastCallback
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[VramcastCallback()])
    trainer.train()

The Trainer calls no callback when a step raises, so to report an out-of-memory death as
`oom` wrap the call: `with callback.reporter.track(model=trainer.model, args=trainer.args):`.
Every hook swallows its own failures: the callback can never stop or change training.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from vramcast_client.reporter import Delivery, Reporter


class VramcastCallback(TrainerCallback):
    """Starts the probe at `on_train_begin`, reports at `on_train_end`.

    Options go to `Reporter` (url, api_key, probe, model_id, seq_len, spool_dir, ...), or
    pass a `reporter`.
    """

    def __init__(self, url: str | None = None, *, reporter: Reporter | None = None, **options: Any):
        self.reporter = reporter if reporter is not None else Reporter(url, **options)
        self._model: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._model = kwargs.get("model")
        self.reporter.start(self._model)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = kwargs.get("model")
        self.report(model if model is not None else self._model, args)

    def report(self, model: Any, args: Any) -> Delivery:
        """Upload the peaks of a completed run of `model` under TrainingArguments `args`."""
        if model is None:
            return Delivery.SKIPPED
        return self.reporter.finish(self.reporter.hf_job(model, args), "completed")
