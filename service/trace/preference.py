"""TRL's DPO step (trl 1.16.0, trl/trainer/dpo_trainer.py `_compute_loss`) on the tracer's
fake tensors, with the kernels a GPU runs.

The policy and the reference forwards run TRL's own fused LM head (`add_fused_lm_head`, its
`ChunkedLogProbFunction`), the reference with TRL's `use_adapter` (a PEFT model's adapters
disabled) or on TRL's separate frozen copy (full fine-tuning), under `torch.no_grad()` and
TRL's `disable_gradient_checkpointing`. On a CUDA device TRL scores only the positions whose
label is not -100 (`compact`) and folds each logits tile with Triton kernels that write in
place; the fake device is `cpu`, so this module makes those choices explicitly.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from service.core.result import Component, Phase
from service.core.spec import Method, TrainingSpec, resolve

# DPOConfig.beta default (trl/trainer/dpo_config.py); the value does not change memory.
DPO_BETA = 0.1
# The per-token fields DPOTrainer asks the policy's fused head for (dpo_trainer.py __init__,
# without WPO weighting); the reference's head computes log-probabilities alone.
POLICY_OUTPUTS = ("log_probs", "entropy", "mean_logits", "is_top1")
IGNORE_INDEX = -100  # labels outside the completion (dpo_trainer.py _compute_loss)
INDEX_OP = "aten.index.Tensor"
# HF Trainer's checkpointing as the trace runs it (service/trace/model.py).
CHECKPOINTING_KWARGS = {"use_reentrant": False}


def note() -> str:
    """What a DPO trace ran, with the installed TRL's version."""
    from importlib.metadata import version

    return (
        f"DPO: trl {version('trl')} DPOTrainer's step (loss 'sigmoid'), its fused LM head as a "
        "CUDA device runs it (compact positions, Triton folds, fp32-out GEMMs); the batch "
        "unpadded"
    )


def compact_rows(spec: TrainingSpec) -> int:
    """Positions TRL's fused head scores on a GPU: the labels after the shift that are not
    -100, over the [chosen; rejected] batch (completion at the end of each sequence)."""
    completion = spec.dpo_settings.max_completion_length or spec.seq_len
    return 2 * spec.batch_size * min(completion, spec.seq_len - 1)


class _Launch:
    """A Triton kernel's launch grid stand-in: the kernel writes its outputs in place and
    allocates nothing through torch's allocator."""

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        return _no_allocation


def _no_allocation(*args: Any, **kwargs: Any) -> None:
    return None


def _addmm_fp32_cuda(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """trl/kernels/chunked_logprob.py `_addmm_fp32` as it runs on CUDA (torch >= 2.8): a half
    product accumulated by `addmm(out_dtype=float32)` into the fp32 buffer, no upcast copies."""
    if a.dtype in (torch.float16, torch.bfloat16):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.addmm_(a.float(), b.float())


@contextmanager
def gpu_fused_head() -> Iterator[None]:
    """TRL's chunked log-prob head as a CUDA device runs it: compact positions, Triton folds,
    fp32-out GEMM accumulation."""
    from trl.kernels import chunked_logprob
    from trl.trainer import utils

    saved = {
        (chunked_logprob, "_use_triton"): chunked_logprob._use_triton,
        (utils, "_use_triton"): utils._use_triton,
        (chunked_logprob, "_forward_kernel"): chunked_logprob._forward_kernel,
        (chunked_logprob, "_backward_kernel"): chunked_logprob._backward_kernel,
        (chunked_logprob, "_addmm_fp32"): chunked_logprob._addmm_fp32,
    }
    had_triton = hasattr(chunked_logprob, "triton")
    old_triton = getattr(chunked_logprob, "triton", None)
    try:
        chunked_logprob._use_triton = lambda device: True
        utils._use_triton = lambda device: True
        chunked_logprob._forward_kernel = _Launch()
        chunked_logprob._backward_kernel = _Launch()
        chunked_logprob._addmm_fp32 = _addmm_fp32_cuda
        chunked_logprob.triton = types.SimpleNamespace(cdiv=lambda a, b: -(-a // b))
        yield
    finally:
        for (module, name), value in saved.items():
            setattr(module, name, value)
        if had_triton:
            chunked_logprob.triton = old_triton
        else:
            del chunked_logprob.triton


def compact_index(mask_shape: tuple[int, ...], rows: int) -> Callable[..., Any]:
    """`tensor[mask]` for the fused head's label mask, whose true count a fake tensor cannot
    know: CUDA's boolean indexing takes the mask's nonzero() (int64, one column per mask
    dimension), then gathers those rows."""

    def index(tensor: torch.Tensor, indices: list[Any]) -> Any:
        if len(indices) != 1 or indices[0] is None:
            return None
        mask = indices[0]
        if mask.dtype is not torch.bool or tuple(mask.shape) != mask_shape:
            return None
        nonzero = torch.empty((rows, mask.dim()), dtype=torch.long)
        return torch.ops.aten.index.Tensor(tensor, list(nonzero.unbind(1)))

    return index


def prepare(model: torch.nn.Module) -> None:
    """What DPOTrainer.__init__ does to the policy: dropout off (DPOConfig.disable_dropout),
    the fused LM head on the base model."""
    prepare_policy(model, POLICY_OUTPUTS)


def prepare_policy(model: torch.nn.Module, outputs: tuple[str, ...]) -> None:
    """Dropout off and TRL's fused LM head, computing `outputs`, on the base model."""
    from trl.trainer.utils import add_fused_lm_head, disable_dropout_in_model

    disable_dropout_in_model(model)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    add_fused_lm_head(base, outputs=outputs)


def needs_reference_copy(spec: TrainingSpec) -> bool:
    """Full fine-tuning keeps a frozen reference model unless the log-probs are precomputed
    (DPOTrainer.__init__: a PEFT model is its own reference with the adapters disabled)."""
    return spec.method is Method.FULL and not spec.dpo_settings.precompute_ref_log_probs


def build_reference(spec: TrainingSpec, config: Any) -> torch.nn.Module:
    """DPOTrainer's reference for full fine-tuning: the model loaded again in the policy's
    dtype, frozen, in eval mode, with the fused head computing log-probs alone."""
    from trl.trainer.utils import add_fused_lm_head, disable_dropout_in_model

    from service.trace.model import build_meta_model

    frozen = replace(spec, gradient_checkpointing=False)
    ref = build_meta_model(resolve(frozen), config).model
    ref.requires_grad_(False)
    ref.eval()
    disable_dropout_in_model(ref)
    add_fused_lm_head(ref)
    return ref


class _HeadSteering:
    """Labels the fused head's tensors (it calls no lm_head module) and opens the layers'
    backward when the gradient reaches the backbone's output."""

    def __init__(self, tracker: Any, on_backbone_grad: Callable[[torch.Tensor], None]) -> None:
        self.tracker = tracker
        self.on_backbone_grad = on_backbone_grad
        self.in_backward = False

    def hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.in_backward:
            return
        self.tracker.component = Component.LOGITS_LOSS
        hidden = getattr(output, "last_hidden_state", None)
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(self.on_backbone_grad)


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside a DistributedDataParallel wrapper (accelerate's `unwrap_model`)."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def _backbone(model: torch.nn.Module) -> torch.nn.Module:
    model = unwrapped(model)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.base_model  # type: ignore[no-any-return]


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerRun:
    """What a trainer's steps run with (service/trace/runner.py): the model, its optimizer
    over `params`, the tracker and the steering hooks, the spec, the number of optimizer
    steps, the labelling of checkpoint functions a trainer sets anew, and zero_grad's mode."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    params: list[torch.nn.Parameter]
    tracker: Any
    steering: Any
    spec: TrainingSpec
    steps: int
    rewrap_checkpoints: Callable[[], None]
    keep_gradients: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class LossCall:
    """What a trainer's `_compute_loss` runs with besides its batch: the tracker, the step,
    TRL's `use_adapter`, the policy's `disable_gradient_checkpointing` and the labelling of
    the checkpoint functions that sets anew."""

    tracker: Any
    step: int
    use_adapter: Callable[..., Any]
    no_checkpointing: Callable[[], Any]
    rewrap_checkpoints: Callable[[], None]

    @contextmanager
    def reference(
        self, model: torch.nn.Module, ref_model: torch.nn.Module | None
    ) -> Iterator[torch.nn.Module]:
        """The reference model's forward to run (`ref_model`, or the policy with its adapters
        disabled), under no_grad and without gradient checkpointing; the checkpoint
        functions gradient_checkpointing_enable() set on the layers are relabelled after."""
        with ExitStack() as stack:
            stack.enter_context(torch.no_grad())
            stack.enter_context(self.no_checkpointing())
            if ref_model is None:
                stack.enter_context(self.use_adapter(unwrapped(model), adapter_name=None))
                yield model
            else:
                yield ref_model
        self.rewrap_checkpoints()


@contextmanager
def fused_head_steering(run: TrainerRun, *models: torch.nn.Module | None) -> Iterator[Any]:
    """The fused head's steering on the backbones of `models` (the policy, and a reference
    copy where there is one): it labels the head's tensors and opens the layers' backward
    when the gradient reaches a backbone's output; its hooks removed after."""
    tracker, steering = run.tracker, run.steering

    def backbone_grad(grad: torch.Tensor) -> None:
        tracker.begin_phase(steering.step, Phase.BACKWARD)
        tracker.component = Component.BACKWARD_TEMPORARIES

    head = _HeadSteering(tracker, backbone_grad)
    handles = [_backbone(m).register_forward_hook(head.hook) for m in models if m is not None]
    try:
        yield head
    finally:
        for handle in handles:
            handle.remove()


def run_dpo_steps(run: TrainerRun, ref_model: torch.nn.Module | None) -> None:
    """`steps` optimizer steps of DPOTrainer: per micro-batch `_compute_loss` (policy forward
    with the fused head, reference forward, the sigmoid loss), backward, then HF Trainer's
    clipping, optimizer step and zero_grad as in service/trace/runner.py."""
    model, tracker, spec = run.model, run.tracker, run.spec
    rows = 2 * spec.batch_size  # [chosen; rejected] on the batch axis
    seq = spec.seq_len
    precompute = spec.dpo_settings.precompute_ref_log_probs
    completion = min(spec.dpo_settings.max_completion_length or seq, seq)
    with tracker.labelling(Component.INPUTS):
        # DataCollatorForPreference's batch (dpo_trainer.py): int64 ids and masks, the
        # completion at the end of each sequence
        input_ids = torch.zeros(rows, seq, dtype=torch.long)
        attention_mask = torch.ones(rows, seq, dtype=torch.long)
        completion_mask = torch.zeros(rows, seq, dtype=torch.long)
        completion_mask[:, seq - completion :].fill_(1)
        ref_logps_in = (
            (torch.zeros(spec.batch_size), torch.zeros(spec.batch_size)) if precompute else None
        )

    micro_batch = reference_micro_batch(
        run, _compute_loss, ref_model, input_ids, completion_mask, ref_logps_in
    )
    with fused_head_steering(run, model, ref_model) as head:
        trainer_steps(run, micro_batch, head)
    del attention_mask


def reference_micro_batch(
    run: TrainerRun,
    compute_loss: Callable[..., torch.Tensor],
    ref_model: torch.nn.Module | None,
    *inputs: Any,
) -> Callable[[int], torch.Tensor]:
    """A micro-batch of a trainer with a reference forward (DPO, KTO): `compute_loss` on the
    policy, the reference (a frozen copy, or the policy with TRL's `use_adapter` disabling
    its adapters) and `inputs`, the reference run under TRL's
    `disable_gradient_checkpointing`."""
    from trl.models.utils import disable_gradient_checkpointing
    from trl.trainer.utils import use_adapter

    model = run.model

    def micro_batch(step: int) -> torch.Tensor:
        call = LossCall(
            tracker=run.tracker,
            step=step,
            use_adapter=use_adapter,
            no_checkpointing=lambda: disable_gradient_checkpointing(
                unwrapped(model), CHECKPOINTING_KWARGS
            ),
            rewrap_checkpoints=run.rewrap_checkpoints,
        )
        return compute_loss(model, ref_model, *inputs, call)

    return micro_batch


def trainer_steps(
    run: TrainerRun, micro_batch: Callable[[int], torch.Tensor], *steered: Any
) -> None:
    """HF Trainer's loop as TRL's trainers run it: per micro-batch `micro_batch(step)` (the
    trainer's compute_loss, which marks the forward's end), backward with the steering objects
    told it runs, the detached loss added to the logged total; then clipping, the optimizer
    step and zero_grad (`optimizer_step`)."""
    tracker, steering, spec = run.tracker, run.steering, run.spec
    with tracker.labelling(Component.INPUTS):
        logged = torch.zeros(())  # Trainer's tr_loss
    for step in range(1, run.steps + 1):
        steering.step = step
        for _ in range(spec.gradient_accumulation_steps):
            tracker.begin_phase(step, Phase.FORWARD_END)
            tracker.component = Component.ACTIVATIONS
            tracker.blas_handle = "forward"
            loss = micro_batch(step)
            logged = logged + backward(loss, tracker, step, steering, *steered)
            del loss
        optimizer_step(
            tracker, step, run.optimizer, run.params, spec, keep_gradients=run.keep_gradients
        )


def backward(loss: torch.Tensor, tracker: Any, step: int, *steered: Any) -> torch.Tensor:
    """HF Trainer's backward of one micro-batch's loss as TRL's trainers run it: the phase
    opened, each steering object told backward runs while it does (the autograd thread's
    cuBLAS handle), the detached loss returned for the logged total."""
    tracker.begin_phase(step, Phase.BACKWARD_START)
    tracker.component = Component.LOGITS_LOSS
    for steering in steered:
        steering.in_backward = True
    tracker.blas_handle = "backward"
    loss.backward()
    for steering in steered:
        steering.in_backward = False
    tracker.blas_handle = None
    return loss.detach()


def optimizer_step(
    tracker: Any,
    step: int,
    optimizer: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
    spec: TrainingSpec,
    *,
    keep_gradients: bool,
) -> None:
    """HF Trainer's end of a step as in service/trace/runner.py: the gradients clipped to
    `max_grad_norm`, the optimizer step, zero_grad (set_to_none unless `keep_gradients`)."""
    tracker.begin_phase(step, Phase.OPTIMIZER_STEP)
    tracker.component = Component.OPTIMIZER_TEMPORARIES
    if spec.max_grad_norm > 0:
        torch.nn.utils.clip_grad_norm_(params, spec.max_grad_norm, foreach=True)
    tracker.host_scalar_ops = spec.optim.value != "adamw_torch_fused"
    optimizer.step()
    tracker.host_scalar_ops = False
    optimizer.zero_grad(set_to_none=not keep_gradients)
    tracker.end_phase()


def _compute_loss(
    model: torch.nn.Module,
    ref_model: torch.nn.Module | None,
    input_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    ref_logps_in: tuple[torch.Tensor, torch.Tensor] | None,
    call: LossCall,
) -> torch.Tensor:
    """DPOTrainer._compute_loss's tensors for loss_type "sigmoid" (reverse KL), in its order;
    the metrics' scalars are left out."""
    tracker, step = call.tracker, call.step
    shift_completion_mask = completion_mask[..., 1:]
    labels = input_ids.masked_fill(completion_mask == 0, IGNORE_INDEX)
    outputs = model(input_ids=input_ids, labels=labels, fused_lm_head=True, use_cache=False)
    seq_len = shift_completion_mask.size(1)
    per_token_logps = outputs.log_probs[:, -seq_len:]
    logps = per_token_logps.sum(dim=1)
    chosen_logps, rejected_logps = logps.chunk(2, dim=0)
    tracker.mark(step, Phase.FORWARD_END)

    if ref_logps_in is not None:
        ref_chosen_logps, ref_rejected_logps = ref_logps_in
    else:
        tracker.begin_phase(step, Phase.REFERENCE_FORWARD)
        tracker.component = Component.ACTIVATIONS
        with call.reference(model, ref_model) as forward:
            ref_outputs = forward(
                input_ids=input_ids, labels=labels, fused_lm_head=True, use_cache=False
            )
        ref_per_token_logps = ref_outputs.log_probs[:, -seq_len:]
        ref_logps = ref_per_token_logps.sum(dim=1)
        ref_chosen_logps, ref_rejected_logps = ref_logps.chunk(2, dim=0)
        del ref_outputs, ref_per_token_logps, ref_logps

    tracker.component = Component.LOGITS_LOSS
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    delta_score = chosen_logratios - rejected_logratios
    per_sequence_loss = -F.logsigmoid(DPO_BETA * delta_score)
    loss: torch.Tensor = per_sequence_loss.mean()
    return loss
