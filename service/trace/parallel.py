"""Rank 0 of a multi-GPU job: DDP, FSDP1 or FSDP2 run on fake tensors under a fake process group.

torch's `fake` backend (torch.testing._internal.distributed.fake_pg) answers every collective at
once without moving data, so one process runs the training step exactly as rank 0 of `gpus`
ranks runs it: the same shards, the same gathered parameters, the same collective buffers. The
model is wrapped as HF Trainer + accelerate wrap it:

- DDP: `DistributedDataParallel(model, bucket_cap_mb, gradient_as_bucket_view)`, accelerate's
  defaults otherwise. `init_sync=False` (a DDP argument) skips the checks made at construction
  that compare parameter shapes across ranks and broadcast rank 0's values: they read tensor data,
  which fake tensors do not have, and allocate nothing that outlives them. The C++ Reducer's
  gradient buckets are made through the dispatcher and counted as `Component.COMMUNICATION`.
- FSDP1: `FullyShardedDataParallel` with transformers' auto-wrap policy (the `_no_split_modules`
  decoder layer class; for PEFT models `peft.utils.other.fsdp_auto_wrap_policy`, as
  transformers' `update_fsdp_plugin_peft` sets it), no mixed-precision policy (accelerate sets
  none without autocast: a bf16 model keeps bf16 parameters), the spec's sharding strategy,
  use_orig_params, limit_all_gathers, forward and backward prefetch.
- FSDP2: `fully_shard` as accelerate's `fsdp2_prepare_model` applies it (accelerate/utils/
  fsdp_utils.py): each decoder layer (full fine-tuning: the transformer policy; PEFT models get
  peft's policy, which accelerate's FSDP2 path does not apply, so no per-layer groups), the input
  embedding when it is not tied, the final norm with the LM head (never resharded after forward),
  then the root.

FSDP models are sharded before the tracker starts (accelerate's cpu_ram_efficient_loading:
rank 0 never holds the whole model on its GPU); their shards are then counted as parameters.
FSDP frees and re-allocates gathered parameters with `UntypedStorage.resize_`, which the
dispatcher never sees; the wrappers here re-count those storages (`StorageTracker.resized`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from service.core.result import Component
from service.core.spec import (
    FsdpBackwardPrefetch,
    FsdpSharding,
    Method,
    Offload,
    Strategy,
    TrainingSpec,
)
from service.trace.tracker import OpMode, StorageTracker

TRACED_STRATEGIES = (Strategy.DDP, Strategy.FSDP, Strategy.FSDP2)
TRACED_FSDP_SHARDING = (FsdpSharding.FULL_SHARD, FsdpSharding.SHARD_GRAD_OP)


def refusal(spec: TrainingSpec) -> str | None:
    """Why the tracer cannot run `spec`'s multi-GPU setup, or None when it can."""
    parallel = spec.parallel
    if parallel.strategy not in TRACED_STRATEGIES:
        return f"strategy {parallel.strategy.value} is not traced (ddp, fsdp and fsdp2 are)"
    if parallel.offload is not Offload.NONE:
        return "offload keeps parameters in host memory; it is not traced"
    if parallel.strategy is Strategy.FSDP and parallel.sharding_strategy not in (
        TRACED_FSDP_SHARDING
    ):
        return (
            f"FSDP sharding strategy {parallel.sharding_strategy.value} is not traced "
            "(FULL_SHARD and SHARD_GRAD_OP are)"
        )
    if parallel.strategy is Strategy.FSDP and parallel.forward_prefetch:
        return "FSDP forward_prefetch is not traced"
    if parallel.strategy in (Strategy.FSDP, Strategy.FSDP2) and spec.autocast:
        return "mixed precision under FSDP (a MixedPrecision policy) is not traced"
    if spec.method is Method.QLORA:
        return "QLoRA on several GPUs is not traced"
    if spec.gradient_accumulation_steps != 1:
        return "gradient accumulation on several GPUs (no_sync micro-batches) is not traced"
    return None


def notes(spec: TrainingSpec) -> list[str]:
    """What a multi-GPU trace assumes."""
    parallel = spec.parallel
    out = [
        f"rank 0 of {parallel.gpus} traced under torch's fake process group: collectives move "
        "no data and return at once, so a buffer lives from its allocation to its last use on "
        "the compute stream"
    ]
    if parallel.strategy is Strategy.DDP:
        out.append(
            "DDP built with init_sync=False: the construction-time shape check and broadcast "
            "of rank 0's values read data and allocate nothing lasting"
        )
    if parallel.strategy in (Strategy.FSDP, Strategy.FSDP2):
        out.append(
            "FSDP shards the model before the first step (accelerate's cpu_ram_efficient_loading)"
            "; gradient clipping runs on the local shards (the global norm's all-reduce is a "
            "scalar)"
        )
    if parallel.strategy is Strategy.FSDP2 and spec.method is not Method.FULL:
        out.append(
            "FSDP2 with PEFT: accelerate's FSDP2 path does not apply peft's auto-wrap policy, "
            "so only the embedding, the final norm with the LM head, and the root are groups"
        )
    return out


@contextmanager
def process_group(world_size: int) -> Iterator[Any]:
    """A fake process group of `world_size` ranks (this process is rank 0) and its 1-D CPU
    device mesh; made outside any fake mode, torn down on exit."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()


def decoder_layer_classes(model: torch.nn.Module) -> set[type[torch.nn.Module]]:
    """The classes transformers' `_no_split_modules` names, found in `model` (what accelerate's
    transformer-based auto wrap wraps)."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    classes = {type(m) for m in model.modules() if type(m).__name__ in names}
    if not classes:
        raise ValueError(f"{type(model).__name__} names no decoder layer class to wrap")
    return classes


class Wrapping:
    """How one strategy wraps the model and where its memory is labelled."""

    def __init__(self, spec: TrainingSpec, mesh: Any, tracker: StorageTracker) -> None:
        self.spec = spec
        self.parallel = spec.parallel
        self.mesh = mesh
        self.tracker = tracker
        self.strategy = spec.parallel.strategy

    @property
    def shards_before_tracking(self) -> bool:
        return self.strategy in (Strategy.FSDP, Strategy.FSDP2)

    # -- wrapping ---------------------------------------------------------------------------

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.strategy is Strategy.DDP:
            return self._ddp(model)
        if self.strategy is Strategy.FSDP:
            return self._fsdp1(model)
        return self._fsdp2(model)

    def _ddp(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.nn.parallel import DistributedDataParallel
        from transformers import PreTrainedModel

        # HF Trainer's find_unused_parameters (trainer.py create_accelerator_and_postprocess):
        # off for a transformers model with gradient checkpointing, on otherwise (PEFT models
        # are not PreTrainedModels).
        find_unused = not (isinstance(model, PreTrainedModel) and self.spec.gradient_checkpointing)
        with self.tracker.labelling(Component.COMMUNICATION), _HostIndexTensors(make=True):
            wrapped = DistributedDataParallel(
                model,
                bucket_cap_mb=self.parallel.bucket_cap_mb,
                gradient_as_bucket_view=self.parallel.gradient_as_bucket_view,
                find_unused_parameters=find_unused,
                init_sync=False,
            )
        # Without find_unused_parameters DDP rebuilds its buckets in the order gradients
        # arrived, in the second step's forward (Reducer::rebuild_buckets from _pre_forward).
        pre_forward = wrapped._pre_forward

        def labelled_pre_forward(*args: Any, **kwargs: Any) -> Any:
            with self.tracker.labelling(Component.COMMUNICATION), _HostIndexTensors(make=True):
                return pre_forward(*args, **kwargs)

        wrapped._pre_forward = labelled_pre_forward  # type: ignore[method-assign]
        wrapped.register_comm_hook(None, _allreduce_in_place)
        return wrapped

    def _fsdp1(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import BackwardPrefetch, ShardingStrategy
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

        if self.spec.method is Method.FULL:
            policy: Callable[..., Any] = functools.partial(
                transformer_auto_wrap_policy, transformer_layer_cls=decoder_layer_classes(model)
            )
        else:
            from peft.utils.other import fsdp_auto_wrap_policy

            policy = fsdp_auto_wrap_policy(model)
        prefetch = self.parallel.backward_prefetch
        return FSDP(
            model,
            process_group=self.mesh.get_group(),
            sharding_strategy=ShardingStrategy[self.parallel.sharding_strategy.value],
            auto_wrap_policy=policy,
            backward_prefetch=(
                None
                if prefetch is FsdpBackwardPrefetch.NO_PREFETCH
                else BackwardPrefetch[prefetch.value]
            ),
            forward_prefetch=self.parallel.forward_prefetch,
            limit_all_gathers=self.parallel.limit_all_gathers,
            use_orig_params=self.parallel.use_orig_params,
            device_id=torch.device("cpu"),
        )

    def _fsdp2(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        kwargs = {"mesh": self.mesh, "reshard_after_forward": self.parallel.reshard_after_forward}
        if self.spec.method is Method.FULL:
            layers = tuple(decoder_layer_classes(model))
            for module in _children_bottom_up(model)[:-1]:
                if isinstance(module, layers) and not isinstance(module, FSDPModule):
                    fully_shard(module, **kwargs)
        # accelerate looks these up on the model it is given (a PeftModel forwards them).
        input_embed = model.get_input_embeddings()
        output_embed = model.get_output_embeddings()
        tied = output_embed is not None and input_embed.weight is output_embed.weight
        if not tied and not isinstance(input_embed, FSDPModule):
            fully_shard(input_embed, **kwargs)
        norm = _final_norm(model)
        tail_modules = (norm, input_embed, output_embed) if tied else (norm, output_embed)
        tail = [m for m in tail_modules if m is not None and not isinstance(m, FSDPModule)]
        if tail:
            fully_shard(tail, **{**kwargs, "reshard_after_forward": False})
        fully_shard(model, mesh=self.mesh)
        return model

    # -- what the tracker counts ------------------------------------------------------------

    def local_tensors(self, model: torch.nn.Module) -> Iterator[tuple[torch.Tensor, Component]]:
        """Every parameter's and buffer's storage on this rank after sharding, with its role."""
        for param in model.parameters():
            local = getattr(param, "_local_tensor", param)
            trainable = param.requires_grad
            yield local, Component.TRAINABLE_PARAMS if trainable else Component.FROZEN_WEIGHTS
        for buf in model.buffers():
            yield getattr(buf, "_local_tensor", buf), Component.FROZEN_WEIGHTS

    @contextmanager
    def labelling(self) -> Iterator[None]:
        """Patch FSDP's collective and storage helpers so their memory is counted and labelled
        while the steps run."""
        with ExitStack() as stack:
            if self.strategy is Strategy.DDP:
                stack.enter_context(_HostIndexTensors(make=False))
            if self.strategy is Strategy.FSDP:
                self._fsdp1_patches(stack)
            elif self.strategy is Strategy.FSDP2:
                self._fsdp2_patches(stack)
            yield

    def _communication(self, function: Callable[..., Any]) -> Callable[..., Any]:
        tracker = self.tracker

        @functools.wraps(function)
        def run(*args: Any, **kwargs: Any) -> Any:
            with tracker.labelling(Component.COMMUNICATION):
                return function(*args, **kwargs)

        return run

    def _resizing(self, function: Callable[..., Any]) -> Callable[..., Any]:
        tracker = self.tracker

        @functools.wraps(function)
        def run(tensor: torch.Tensor, *args: Any) -> Any:
            out = function(tensor, *args)
            tracker.resized(tensor.untyped_storage(), Component.COMMUNICATION, function.__name__)
            return out

        return run

    def _fsdp2_patches(self, stack: ExitStack) -> None:
        from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

        group = _fsdp_param_group
        for module, name in (
            (_fsdp_param, "alloc_storage"),
            (_fsdp_param, "free_storage"),
            (group, "alloc_storage"),
        ):
            stack.enter_context(_patched(module, name, self._resizing(getattr(module, name))))
        for name in ("foreach_all_gather", "foreach_all_gather_copy_out"):
            stack.enter_context(_patched(group, name, self._communication(getattr(group, name))))
        reduce = self._communication(group.foreach_reduce)
        tracker = self.tracker

        def foreach_reduce(fsdp_params: list[Any], *args: Any, **kwargs: Any) -> Any:
            out = reduce(fsdp_params, *args, **kwargs)
            # The sharded gradients are views of the reduce-scatter output (or added into the
            # gradients already there): that storage now holds gradients.
            for fsdp_param in fsdp_params:
                grad = fsdp_param.sharded_param.grad
                if grad is not None:
                    tracker.label(grad._local_tensor, Component.GRADIENTS)
            return out

        stack.enter_context(_patched(group, "foreach_reduce", foreach_reduce))

    def _fsdp1_patches(self, stack: ExitStack) -> None:
        from torch.distributed.fsdp import _flat_param, _runtime_utils

        for name in ("_alloc_storage", "_free_storage"):
            resizing = self._resizing(getattr(_flat_param, name))
            stack.enter_context(_patched(_flat_param, name, resizing))
        # FSDP1 asks whether an unsharded flat parameter is allocated by its data pointer, which a
        # fake tensor's storage never has; its size says the same (FSDP frees by resizing to 0).
        stack.enter_context(_patched(_flat_param, "_data_ptr_allocated", _storage_allocated))
        # Likewise it compares data pointers to tell whether two tensors share a storage
        # (_flat_param._same_storage) and whether a flat parameter is back on its local shard
        # (_runtime_utils._catch_all_reshard, which reshards what no post-backward hook did: the
        # frozen units of a PEFT model); every fake storage's pointer is 0, so both would always
        # answer yes. Storage identity answers what the pointers answer on a GPU.
        stack.enter_context(_patched(_flat_param, "_same_storage", _same_storage))
        stack.enter_context(
            _patched(_runtime_utils, "_catch_all_reshard", _catch_all_reshard(_runtime_utils))
        )
        handle_type = _flat_param.FlatParamHandle
        for name in ("unshard", "_use_unsharded_flat_param", "pre_unshard", "post_unshard"):
            wrapped = self._communication(getattr(handle_type, name))
            stack.enter_context(_patched(handle_type, name, wrapped))
        reduce = self._communication(_runtime_utils._reduce_grad)
        tracker = self.tracker

        def reduce_grad(state: Any, handle: Any) -> Any:
            out = reduce(state, handle)
            flat = handle.flat_param
            for grad in (getattr(flat, "_saved_grad_shard", None), flat.grad):
                if grad is not None:
                    tracker.label(grad, Component.GRADIENTS)
            return out

        stack.enter_context(_patched(_runtime_utils, "_reduce_grad", reduce_grad))


class _HostIndexTensors(OpMode):
    """Real tensors for the Reducer's int32 bookkeeping, which it reads back on the host (a
    fake tensor has no data to read): the bucket indices and sizes Reducer::sync_bucket_indices
    broadcasts, and the used-parameter map that find_unused_parameters all-reduces and reads
    per parameter (Reducer::finalize_bucket_dense). They hold 4 bytes per parameter tensor
    and are not counted. With `make=True` int32 tensors made here are real; ops whose tensors
    are all real run outside the fake mode; every other op passes through."""

    def __init__(self, *, make: bool) -> None:
        super().__init__()
        self.make = make

    def dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.utils._python_dispatch import _disable_current_modes

        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        host_ints = (
            self.make
            and func in (torch.ops.aten.empty.memory_format, torch.ops.aten.zeros.default)
            and kwargs.get("dtype") == torch.int32
        )
        real = bool(tensors) and not any(isinstance(t, FakeTensor) for t in tensors)
        if host_ints or real:
            with _disable_current_modes():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def _allreduce_in_place(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
    """DDP's built-in all-reduce (Reducer's AllReduceCommHook): the bucket averaged and
    all-reduced in place, the bucket itself the result. The fake backend completes a work with no
    value, which the built-in hook would hand the Reducer as its result; this hook allocates what
    the built-in one does (nothing) and returns the bucket."""
    import torch.distributed as dist

    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size())
    dist.all_reduce(buffer)
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future


def _storage_allocated(tensor: torch.Tensor) -> bool:
    return tensor.untyped_storage().nbytes() > 0


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return getattr(tensor, "_local_tensor", tensor)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(_local(a).untyped_storage()._cdata == _local(b).untyped_storage()._cdata)


def _catch_all_reshard(runtime: Any) -> Callable[[Any], None]:
    """FSDP1's end-of-backward reshard of a unit still unsharded, its "already resharded" test
    by storage identity instead of data pointers."""

    def reshard(state: Any) -> None:
        handle = state._handle
        if not handle:
            return
        flat = handle.flat_param
        if _same_storage(flat, flat._local_shard) and not handle._skipped_use_sharded_views:
            return
        runtime._reshard(state, handle, runtime._should_free_in_backward(state, handle))

    return reshard


@contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    before = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, before)


def _children_bottom_up(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every module, children before their parents, the root last (accelerate's
    get_module_children_bottom_up order)."""
    order: list[torch.nn.Module] = []

    def visit(module: torch.nn.Module) -> None:
        for child in module.children():
            visit(child)
        order.append(module)

    visit(model)
    return order


def _final_norm(model: torch.nn.Module) -> torch.nn.Module | None:
    """The last norm among the base model's direct children (accelerate's _find_final_norm)."""
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else model
    if not isinstance(base, torch.nn.Module):
        return None
    norm = None
    for _, module in base.named_children():
        if "Norm" in type(module).__name__:
            norm = module
    return norm
