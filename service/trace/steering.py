"""The hooks that steer a trace's tracker: which component a tensor is, which phase a step is in."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from service.core.result import Component, Phase
from service.trace.tracker import StorageTracker


class Steering:
    """Module and tensor hooks that set the tracker's labels and phases as the step runs."""

    def __init__(
        self,
        tracker: StorageTracker,
        lm_head: torch.nn.Module,
        backbone: torch.nn.Module | None = None,
    ) -> None:
        self.tracker = tracker
        self.lm_head = lm_head
        # Liger's fused loss calls no lm_head: the backbone's output opens the loss's part
        self.backbone = backbone
        self.step = 0
        self.in_backward = False
        self._handles: list[Any] = []

    @contextmanager
    def installed(self, model: torch.nn.Module, params: list[torch.nn.Parameter]) -> Iterator[None]:
        self._handles = [
            self.lm_head.register_forward_pre_hook(self._lm_head_pre),
            self.lm_head.register_forward_hook(self._lm_head_post),
        ]
        if self.backbone is not None:
            self._handles.append(self.backbone.register_forward_hook(self._backbone_post))
        for param in params:
            self._handles.append(param.register_post_accumulate_grad_hook(self._grad_ready))
        wrapped = []
        for module in model.modules():
            checkpoint = getattr(module, "_gradient_checkpointing_func", None)
            if checkpoint is not None:
                module._gradient_checkpointing_func = self._labelling_checkpoint(checkpoint)
                wrapped.append((module, checkpoint))
        try:
            yield
        finally:
            for handle in self._handles:
                handle.remove()
            self._handles = []
            for module, checkpoint in wrapped:
                module._gradient_checkpointing_func = checkpoint

    def _labelling_checkpoint(self, checkpoint: Callable[..., Any]) -> Callable[..., Any]:
        """HF's checkpoint function, its forward labelled `recompute` when rerun in backward."""

        def run(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            return checkpoint(self._recomputing(function), *args, **kwargs)

        run.labelling = True  # type: ignore[attr-defined]
        return run

    def rewrap(self, model: torch.nn.Module) -> None:
        """Label the checkpoint functions a gradient_checkpointing_enable() call has set anew
        (TRL's disable_gradient_checkpointing around the DPO reference forward)."""
        for module in model.modules():
            checkpoint = getattr(module, "_gradient_checkpointing_func", None)
            if checkpoint is not None and not getattr(checkpoint, "labelling", False):
                module._gradient_checkpointing_func = self._labelling_checkpoint(checkpoint)

    def _recomputing(self, function: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            if not self.in_backward:
                return function(*args, **kwargs)
            before = self.tracker.component
            self.tracker.component = Component.RECOMPUTE
            try:  # recomputation stops early by raising once it has what backward needs
                return function(*args, **kwargs)
            finally:
                self.tracker.component = before

        return run

    def _lm_head_pre(self, module: torch.nn.Module, args: Any) -> None:
        if not self.in_backward:
            self.tracker.component = Component.LOGITS_LOSS

    def _lm_head_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self.in_backward and isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(self._logits_grad)

    def _backbone_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """The fused loss's tensors are the loss's; the gradient reaching them opens backward."""
        if self.in_backward:
            return
        self.tracker.component = Component.LOGITS_LOSS
        hidden = getattr(output, "last_hidden_state", None)
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(self._logits_grad)

    def _logits_grad(self, grad: torch.Tensor) -> None:
        # The loss's gradient has reached the logits: the rest of backward is the layers'.
        self.tracker.begin_phase(self.step, Phase.BACKWARD)
        self.tracker.component = Component.BACKWARD_TEMPORARIES

    def _grad_ready(self, param: torch.Tensor) -> None:
        if param.grad is not None:
            self.tracker.label(param.grad, Component.GRADIENTS)
