"""TRL's ORPO step (trl 1.16.0, trl/experimental/orpo/orpo_trainer.py `compute_loss`) on the
tracer's fake tensors, with the kernel a GPU runs.

ORPOTrainer has no reference model. Per micro-batch it concatenates the chosen and rejected
sequences into one [chosen; rejected] batch (`concatenated_inputs`), runs the policy once with
HF's LM head (the whole 2 x batch_size x seq_len x vocab logits), takes the NLL over the
chosen half of the logits (`cross_entropy_loss`: a contiguous copy, then nn.CrossEntropyLoss)
and the mean log-probabilities of both halves (`get_batch_logps`: trl/trainer/utils.py
`selective_log_softmax`, which on a CUDA device with Triton runs TRL's log-prob kernel,
trl/kernels/logprob_entropy.py, saving the logits themselves for backward), then the
odds-ratio term. TRL's own `concatenated_forward` and `odds_ratio_loss` run here on a stand-in
trainer; the metrics' host scalars (`.item()`) are left out. The fake device is `cpu` and the
tracer has no Triton, so `gpu_logprob_kernel` makes TRL take its CUDA path with the kernels'
launches writing in place.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from service.core.result import Component, Phase
from service.core.spec import TrainingSpec
from service.trace.preference import _Launch

# ORPOConfig.beta default (trl/experimental/orpo/orpo_config.py); the value changes no memory.
ORPO_BETA = 0.1
# The prompt's tokens in the collator's batch (prompt_input_ids, prompt_attention_mask), as a
# fraction of seq_len: the decoder-only step never reads them, only holds them (an assumption
# of the trace, the estimator's too: service/core/estimator/orpo.py PROMPT_FRACTION).
PROMPT_DIVISOR = 2


def note() -> str:
    """What an ORPO trace ran, with the installed TRL's version."""
    from importlib.metadata import version

    return (
        f"ORPO: trl {version('trl')} ORPOTrainer's step (concatenated_forward, "
        "odds_ratio_loss) with HF's LM head and TRL's log-prob kernel as a CUDA device runs it "
        "(Triton, the logits saved); the batch unpadded, the prompt half of seq_len"
    )


def prepare(model: torch.nn.Module, spec: TrainingSpec) -> None:
    """What ORPOTrainer.__init__ does to the policy: dropout off unless
    ORPOConfig.disable_dropout is False."""
    from trl.trainer.utils import disable_dropout_in_model

    if spec.orpo_settings.disable_dropout:
        disable_dropout_in_model(model)


@contextmanager
def gpu_logprob_kernel() -> Iterator[None]:
    """trl/trainer/utils.py selective_log_softmax as it runs on a CUDA device with Triton:
    `_LogProbEntropyFunction` (trl/kernels/logprob_entropy.py), its forward and backward
    kernels writing in place into the tensors it allocates. The module imports triton, which
    the tracer lacks: a stand-in serves the import and the launch grid's `cdiv`.
    `_supports_trl_loss_kernel` answers for the device alone: ORPO's call passes its other
    checks (the 3-D logits view, unit last stride, int64 labels of its shape)."""
    from trl.trainer import utils

    stub = types.ModuleType("triton")
    language = types.ModuleType("triton.language")
    language.constexpr = object  # type: ignore[attr-defined]
    stub.language = language  # type: ignore[attr-defined]
    stub.jit = lambda fn: fn  # type: ignore[attr-defined]
    stub.cdiv = lambda a, b: -(-a // b)  # type: ignore[attr-defined]
    missing = object()
    before = {name: sys.modules.get(name, missing) for name in ("triton", "triton.language")}
    sys.modules["triton"], sys.modules["triton.language"] = stub, language
    try:
        kernel = importlib.import_module("trl.kernels.logprob_entropy")
    finally:
        for name, module in before.items():
            if module is missing:
                del sys.modules[name]
            else:
                sys.modules[name] = module  # type: ignore[assignment]
    saved = {
        (kernel, "_forward_kernel"): kernel._forward_kernel,
        (kernel, "_backward_kernel"): kernel._backward_kernel,
        (utils, "is_triton_available"): utils.is_triton_available,
        (utils, "_supports_trl_loss_kernel"): utils._supports_trl_loss_kernel,
        (utils, "_fused_logprob_entropy"): getattr(utils, "_fused_logprob_entropy", missing),
    }
    try:
        kernel._forward_kernel = _Launch()
        kernel._backward_kernel = _Launch()
        utils.is_triton_available = lambda: True
        utils._supports_trl_loss_kernel = lambda logits, index=None, row_mask=None: True
        utils._fused_logprob_entropy = kernel.selective_log_softmax_and_entropy
        yield
    finally:
        for (module, name), value in saved.items():
            if value is missing:
                delattr(module, name)
            else:
                setattr(module, name, value)


class _Trainer:
    """The ORPOTrainer attributes its `concatenated_forward` and `odds_ratio_loss` read."""

    is_encoder_decoder = False
    aux_loss_enabled = False
    padding_value = 0
    beta = ORPO_BETA

    def __init__(self) -> None:
        self.accelerator = types.SimpleNamespace(device=torch.device("cpu"))

    def concatenated_inputs(self, *args: Any, **kwargs: Any) -> Any:
        from trl.experimental.orpo import ORPOTrainer

        return ORPOTrainer.concatenated_inputs(*args, **kwargs)

    def get_batch_logps(self, *args: Any, **kwargs: Any) -> Any:
        from trl.experimental.orpo import ORPOTrainer

        return ORPOTrainer.get_batch_logps(*args, **kwargs)


def _batch(spec: TrainingSpec) -> dict[str, torch.Tensor]:
    """DPODataCollatorWithPadding's tensors (trl/experimental/utils.py) for an unpadded batch:
    int64 ids, masks and labels of the chosen and rejected sequences, and the prompt's."""
    rows, seq = spec.batch_size, spec.seq_len
    prompt = seq // PROMPT_DIVISOR
    batch: dict[str, torch.Tensor] = {}
    for side in ("chosen", "rejected"):
        batch[f"{side}_input_ids"] = torch.zeros(rows, seq, dtype=torch.long)
        batch[f"{side}_attention_mask"] = torch.ones(rows, seq, dtype=torch.long)
        batch[f"{side}_labels"] = torch.zeros(rows, seq, dtype=torch.long)
    batch["prompt_input_ids"] = torch.zeros(rows, prompt, dtype=torch.long)
    batch["prompt_attention_mask"] = torch.ones(rows, prompt, dtype=torch.long)
    return batch


def micro_batches(
    model: torch.nn.Module, tracker: Any, spec: TrainingSpec
) -> Callable[[int], torch.Tensor]:
    """ORPOTrainer's `compute_loss` for one micro-batch (`get_batch_loss_metrics` without its
    metrics), on the collator's batch made here, for service/trace/preference.py
    `trainer_steps`. The LM head's output carries the steering's hook that opens the layers'
    backward."""
    from trl.experimental.orpo import ORPOTrainer

    trainer = _Trainer()

    def forward(input_ids: torch.Tensor, attention_mask: Any = None, **kwargs: Any) -> Any:
        # the all-ones mask of an unpadded batch, which the model's mask creation skips on a
        # GPU (a fake tensor cannot say it is all ones): held in the batch, not passed
        return model(input_ids, **kwargs)

    with tracker.labelling(Component.INPUTS):
        batch = _batch(spec)

    def micro_batch(step: int) -> torch.Tensor:
        # get_batch_loss_metrics: its logits views and metrics go when it returns
        chosen_logps, rejected_logps, *_, nll = ORPOTrainer.concatenated_forward(
            trainer,  # type: ignore[arg-type]
            forward,
            batch,
        )
        losses, *_ = ORPOTrainer.odds_ratio_loss(
            trainer,  # type: ignore[arg-type]
            chosen_logps,
            rejected_logps,
        )
        loss: torch.Tensor = nll - losses.mean()
        tracker.mark(step, Phase.FORWARD_END)
        return loss

    return micro_batch
