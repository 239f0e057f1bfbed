"""The optimizers a trace builds, as HF Trainer builds them by `optim` name, and the state
dicts that label what they create as optimizer state."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from service.core.result import Component
from service.core.spec import Optim, ResolvedSpec
from service.trace.model import LEARNING_RATE
from service.trace.traceable import NotTraceableError
from service.trace.tracker import StorageTracker


def make_optimizer(
    params: list[torch.nn.Parameter], optim: Optim, *, fake: bool
) -> torch.optim.Optimizer:
    """HF Trainer's optimizer for `optim`, with the implementation a GPU gets chosen explicitly."""
    if optim is Optim.ADAMW_TORCH_FUSED:
        return torch.optim.AdamW(params, lr=LEARNING_RATE, fused=True)
    if optim is Optim.ADAMW_TORCH:
        # On CUDA tensors torch picks foreach by default (torch/optim/optimizer.py).
        return torch.optim.AdamW(params, lr=LEARNING_RATE, foreach=True)
    if optim is Optim.SGD:
        return torch.optim.SGD(params, lr=LEARNING_RATE, foreach=True)
    if optim is Optim.ADAMW_BNB_8BIT:
        return _adamw_8bit(params, fake=fake)
    raise NotTraceableError(f"optimizer {optim!r} is not traced")


def lorafa_optimizer(model: torch.nn.Module, resolved: ResolvedSpec) -> torch.optim.Optimizer:
    """PEFT's LoRA-FA optimizer as its helper builds it (peft/optimizers/lorafa.py
    create_lorafa_optimizer): one group over every named parameter, AdamW state for each
    lora_B only."""
    from peft.optimizers import create_lorafa_optimizer

    lora = resolved.lora
    if lora is None:  # resolve() always fills it for LoRA-FA
        raise ValueError("LoRA-FA needs a LoRA spec")
    return create_lorafa_optimizer(model, r=lora.r, lora_alpha=lora.lora_alpha, lr=LEARNING_RATE)  # type: ignore[arg-type]


def _adamw_8bit(params: list[torch.nn.Parameter], *, fake: bool) -> torch.optim.Optimizer:
    """bitsandbytes' AdamW8bit, its two 256-entry quantization maps made where fake tensors can.

    The maps are computed through `.tolist()` of tensors, which fake tensors cannot answer, so
    the optimizer is built outside every mode; its maps are then replaced by tensors made inside
    them (the values do not matter to a fake run): two fp32 maps that every 8-bit state shares.
    """
    import bitsandbytes as bnb
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        optimizer = bnb.optim.AdamW8bit(params, lr=LEARNING_RATE)
    for name, qmap in optimizer.name2qmap.items():
        optimizer.name2qmap[name] = (
            torch.empty(qmap.shape, dtype=qmap.dtype) if fake else qmap.clone()
        )
    return optimizer


class LabelledState(defaultdict):  # type: ignore[type-arg]
    """An optimizer's `state` whose per-parameter dicts label tensors as optimizer state."""

    def __init__(self, tracker: StorageTracker) -> None:
        super().__init__(lambda: _LabellingDict(tracker))


class _LabellingDict(dict):  # type: ignore[type-arg]
    def __init__(self, tracker: StorageTracker) -> None:
        super().__init__()
        self._tracker = tracker

    def __setitem__(self, key: Any, value: Any) -> None:
        if isinstance(value, torch.Tensor) and self._tracker.component_of(value) is not None:
            self._tracker.label(value, Component.OPTIMIZER_STATE)
        super().__setitem__(key, value)
