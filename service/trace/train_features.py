"""torchtune's optimizer in backward and activation offloading, run with torch's own hooks.

The optimizer in backward is torchtune's (training/memory.py register_optim_in_bwd_hooks): one
optimizer per parameter, stepped and zeroed (set_to_none) in the parameter's
post-accumulate-grad hook. Offloading follows torchtune's OffloadActivations
(training/_activation_offloading.py) with its defaults, the streams variant that torch >= 2.5
selects: a `saved_tensors_hooks` pair that copies every saved tensor of at least 1024 bytes
that is not a parameter to pinned host memory, keeps the last 5 offloaded tensors (by pack
count) alive on the GPU until the copy would be done, brings each back in backward when its
autograd node unpacks it, and frees what a node brought back once the next node that
brings tensors back has run. The output projection's forward runs outside it
(get_act_offloading_ctx_manager's NoOpManager on lm_head), and so does the loss (the recipes'
_loss_step computes it after the model). On the fake tensors the tracer runs, the host copies
are counted apart from the device (`StorageTracker.host_pinned`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

from service.core.result import Component
from service.trace.tracker import StorageTracker

# OffloadActivations.__init__ defaults (torchtune training/_activation_offloading.py).
MIN_OFFLOAD_BYTES = 1024  # min_offload_size: smaller saved tensors stay on the GPU
MAX_FWD_STASH = 5  # max_fwd_stash_size: offloaded tensors kept alive on the GPU in forward


class Offloader:
    """The pack and unpack hooks, counting host copies and what comes back to the device."""

    def __init__(self, tracker: StorageTracker) -> None:
        self.tracker = tracker
        self.next_id = 0
        self.saved: dict[int, tuple[torch.Tensor, bool]] = {}  # id -> (tensor, on the host)
        self.fwd_stash: dict[int, torch.Tensor] = {}
        self.bwd_stash: dict[int, torch.Tensor] = {}
        self.first_backward_call = True
        self.graph_id: int | None = None
        self.node: Any = None

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def begin_forward(self) -> None:
        self.first_backward_call = True

    def _pack(self, activation: torch.Tensor) -> int:
        self.next_id += 1
        tensor_id = self.next_id
        nbytes = activation.element_size() * activation.nelement()
        if nbytes < MIN_OFFLOAD_BYTES or isinstance(
            activation, (torch.nn.Parameter, torch.nn.Buffer)
        ):
            self.saved[tensor_id] = (activation, False)
            return tensor_id
        for old in list(self.fwd_stash):
            if old > tensor_id - MAX_FWD_STASH:
                break
            del self.fwd_stash[old]
        with self.tracker.off_device():
            host = torch.empty_like(activation)
            host.copy_(activation)
        self.tracker.host_pinned(host)
        self.saved[tensor_id] = (host, True)
        self.fwd_stash[tensor_id] = activation
        return tensor_id

    def _unpack(self, tensor_id: int) -> torch.Tensor:
        if self.first_backward_call:
            self.first_backward_call = False
            self.graph_id = torch._C._current_graph_task_id()
            torch.autograd.Variable._execution_engine.queue_callback(self.bwd_stash.clear)
        tensor, on_host = self.saved.pop(tensor_id)
        if not on_host:
            return tensor
        node = torch._C._current_autograd_node()
        previous: list[int] = []
        if torch._C._current_graph_task_id() == self.graph_id and self.node is not node:
            self.node = node
            previous = list(self.bwd_stash)
        brought_back = tensor_id not in self.fwd_stash
        if brought_back:
            with self.tracker.labelling(Component.ACTIVATIONS):
                tensor = tensor.clone()  # the host-to-device copy
            self.bwd_stash[tensor_id] = tensor
            uses = torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)
        else:
            tensor = self.fwd_stash[tensor_id]

        def after_node(outputs: Any, inputs: Any) -> Any:
            if brought_back and tensor_id in self.bwd_stash:
                held = self.bwd_stash[tensor_id]
                if torch._C._storage_Use_Count(held.untyped_storage()._cdata) > uses:
                    del self.bwd_stash[tensor_id]  # a view lives on: its storage stays with it
            self.fwd_stash.clear()
            for old in previous:
                self.bwd_stash.pop(old, None)
            return outputs

        node.register_hook(after_node)
        return tensor


@contextmanager
def offloaded_forward(offloader: Offloader | None, lm_head: torch.nn.Module) -> Iterator[None]:
    """The model's forward under the offloading hooks, its output projection outside them."""
    if offloader is None:
        yield
        return
    inner = ExitStack()

    def enter(*args: Any) -> None:
        inner.enter_context(torch.autograd.graph.saved_tensors_hooks(_same, _same))

    def leave(*args: Any) -> None:
        inner.close()

    handles = [
        lm_head.register_forward_pre_hook(enter),
        lm_head.register_forward_hook(leave, always_call=True),
    ]
    offloader.begin_forward()
    try:
        with offloader.hooks():
            yield
    finally:
        for handle in handles:
            handle.remove()


def _same(tensor: Any) -> Any:
    return tensor


def in_backward_optimizers(
    params: list[torch.nn.Parameter],
    make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
) -> tuple[dict[torch.nn.Parameter, torch.optim.Optimizer], list[Any]]:
    """One optimizer per parameter, stepped and zeroed in its post-accumulate-grad hook
    (torchtune training/memory.py register_optim_in_bwd_hooks); returns them and the hooks'
    handles."""
    optimizers = {p: make([p]) for p in params}

    def step(param: torch.Tensor) -> None:
        optimizer = optimizers[param]  # type: ignore[index]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    handles = [p.register_post_accumulate_grad_hook(step) for p in params]
    return optimizers, handles
