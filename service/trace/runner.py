"""Run two real training steps of a spec under FakeTensorMode and count every storage.

Step 1 has no optimizer state during forward and backward; step 2 is the steady state. Each step
is `loss = model(input_ids, labels=labels).loss`, `loss.backward()`, `optimizer.step()`,
`optimizer.zero_grad(set_to_none=True)`, as HF Trainer runs it with one micro-batch; AdaLoRA's
steps also call its RankAllocator after the optimizer step, as PEFT's method-comparison loop does.
"""

from __future__ import annotations

import functools
import gc
import warnings
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from service.core.allocator import CachingAllocator
from service.core.device import (
    CUBLASLT_WORKSPACE,
    REFERENCE_COMPUTE_CAPABILITY,
    cublas_workspace,
)
from service.core.result import Component, Phase
from service.core.spec import (
    AttnImpl,
    LossImpl,
    Method,
    Objective,
    Optim,
    QuantType,
    ResolvedSpec,
    TrainingSpec,
    resolve,
)
from service.trace import grpo, kernels, kto, liger, orpo, parallel, preference, reward, vision
from service.trace.autocast import accelerate_forward, autocast_dtype, cuda_autocast_policy
from service.trace.model import build_meta_model, is_encoder, materialize
from service.trace.optimizers import LabelledState, lorafa_optimizer, make_optimizer
from service.trace.steering import Steering
from service.trace.traceable import STEPS, check_traceable
from service.trace.tracker import (
    CUDA_MIN_BLOCK_BYTES,
    MemoryEvent,
    PhaseSnapshot,
    Snapshot,
    StorageTracker,
)
from service.trace.train_features import Offloader, in_backward_optimizers, offloaded_forward

# HF's cross-entropy ignores labels equal to this (transformers/loss/loss_utils.py).
IGNORE_INDEX = -100


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceResult:
    """What one trace measured: the peak, where it happened, and each phase of each step."""

    spec: TrainingSpec
    model_id: str
    peak: Snapshot
    peak_step: int
    peak_phase: Phase
    phases: tuple[PhaseSnapshot, ...]
    steps: tuple[PhaseSnapshot, ...]  # each step's peak, in the phase where it happened
    params_total: int
    params_trainable: int
    assumptions: tuple[str, ...]
    events: tuple[MemoryEvent, ...] = field(default=())
    # The caching allocator model replaying every allocation and free (service.core.allocator,
    # PyTorch's defaults): its reserved peak, its reserved peak in each (step, phase) window,
    # and its allocated peak (blocks as the allocator hands them out, unsplit remainders in).
    reserved_bytes: int = 0
    phase_reserved: Mapping[tuple[int, Phase], int] = field(default_factory=dict)
    allocator_allocated_bytes: int = 0
    host_pinned_bytes: int = 0  # pinned host memory at its peak (activation offloading)


def plain_causal_lm_loss(
    logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, **kwargs: Any
) -> torch.Tensor:
    """HF's ForCausalLMLoss without the fp32 upcast of the logits."""
    labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)
    shift_labels = labels[..., 1:].contiguous()
    return F.cross_entropy(
        logits.view(-1, vocab_size), shift_labels.view(-1), ignore_index=IGNORE_INDEX
    )


@dataclass(frozen=True, slots=True)
class _Goal:
    """The objective a trace runs, as the step's phases branch on it."""

    dpo: bool
    kto: bool
    grpo: bool
    orpo: bool
    reward: bool

    @classmethod
    def of(cls, spec: TrainingSpec) -> _Goal:
        o = spec.objective
        return cls(
            dpo=o is Objective.DPO,
            kto=o is Objective.KTO,
            grpo=o is Objective.GRPO,
            orpo=o is Objective.ORPO,
            reward=o is Objective.REWARD,
        )

    @property
    def trl(self) -> bool:
        """TRL's trainers (GRPO's loop aside), whose forwards run as accelerate's."""
        return self.dpo or self.kto or self.orpo or self.reward


@dataclass(frozen=True, slots=True)
class _Measured:
    """What the tracker holds once the steps have run."""

    step: int
    phase: Phase
    phase_reserved: dict[tuple[int, Phase], int]
    phases: tuple[PhaseSnapshot, ...]
    steps: tuple[PhaseSnapshot, ...]
    peak: Snapshot

    @classmethod
    def of(cls, tracker: StorageTracker) -> _Measured:
        tracker.check_consistent()
        step, phase = tracker.peak_key() or (1, Phase.FORWARD_END)
        return cls(
            step=step,
            phase=phase,
            phase_reserved=tracker.phase_reserved(),
            phases=tuple(_phase_table(tracker)),
            steps=tuple(_step_peaks(tracker)),
            peak=tracker.peak(),
        )


def trace(
    spec: TrainingSpec,
    config: Mapping[str, Any],
    model_id: str = "",
    *,
    real: bool = False,
    cpu_kernels: bool = False,
    record_events: bool = False,
    allocation_unit: int = CUDA_MIN_BLOCK_BYTES,
    keep_gradients: bool = False,
) -> TraceResult:
    """Trace two training steps of `spec` on the model `config` describes.

    `keep_gradients=True` runs zero_grad(set_to_none=False), torch's default before 2.0, on the
    installed stack: the one behaviour of such a stack the tracer emulates (`spec.stack` stays
    the installed one), to check how the estimator models it
    (`Stack.zero_grad_keeps_gradients`).

    `real=True` runs on real CPU tensors instead of fake ones (for validation: tiny configs only);
    it needs `cpu_kernels=True`, which swaps the CUDA-only kernels for CPU ones (the CPU
    flash-attention op, bitsandbytes' own 4-bit matmul), in a fake trace too for comparison.
    """
    resolved = resolve(spec)
    notes = [*resolved.assumptions, *check_traceable(resolved)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the libraries' deprecation notices
        built = build_meta_model(resolved, config)
    model = built.model
    goal = _Goal.of(spec)
    # what the trace holds until it returns, after the tracker stops listening: its frees are
    # none of the step's events
    kept: list[Any] = []
    notes += _prepare_objective(model, spec, resolved, goal, kept)
    allocator = CachingAllocator(spec.allocator)
    tracker = StorageTracker(record_events=record_events, unit=allocation_unit, allocator=allocator)
    _set_up_tracker(tracker, spec, goal, real=real, cpu_kernels=cpu_kernels)
    with _collector_off():
        with ExitStack() as stack:
            stack.enter_context(warnings.catch_warnings())
            warnings.simplefilter("ignore")
            wrapping = None
            if spec.parallel.gpus != 1:  # the process group and its mesh, outside fake mode
                mesh = stack.enter_context(parallel.process_group(spec.parallel.gpus))
                wrapping = parallel.Wrapping(spec, mesh, tracker)
            _enter_kernels(stack, spec, config, resolved, goal, model, tracker, real, cpu_kernels)
            if real:
                torch.manual_seed(0)
            params_total = sum(_numel(p) for p in model.parameters())
            params_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            model, ref_model = _materialize(
                stack, model, spec, config, goal, tracker, wrapping, kept
            )
            # The wrapped model's parameters: FSDP2's DTensors, FSDP1's flat parameters (or the
            # original parameters, views of them, with use_orig_params).
            params = [p for p in model.parameters() if p.requires_grad]
            optimizer, steering = _optimizer_and_steering(
                stack, model, params, built.lm_head, spec, resolved, tracker, real, kept
            )
            offloader = Offloader(tracker) if spec.activation_offloading else None
            _run_objective_steps(
                stack,
                model,
                ref_model,
                optimizer,
                params,
                tracker,
                steering,
                spec,
                config,
                goal,
                offloader,
                keep_gradients,
                kept,
            )
            measured = _Measured.of(tracker)
            del optimizer, model, built, ref_model
        tracker.close()
    return TraceResult(
        spec=spec,
        model_id=model_id,
        peak=measured.peak,
        peak_step=measured.step,
        peak_phase=measured.phase,
        phases=measured.phases,
        steps=measured.steps,
        params_total=params_total,
        params_trainable=params_trainable,
        assumptions=tuple(notes),
        events=tuple(tracker.events or ()),
        reserved_bytes=allocator.peak_reserved,
        phase_reserved=measured.phase_reserved,
        allocator_allocated_bytes=allocator.peak_allocated,
        host_pinned_bytes=tracker.host_peak,
    )


@contextmanager
def _collector_off() -> Iterator[None]:
    """The garbage collector off: frees happen on the last reference, deterministically."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _prepare_objective(
    model: torch.nn.Module,
    spec: TrainingSpec,
    resolved: ResolvedSpec,
    goal: _Goal,
    kept: list[Any],
) -> list[str]:
    """Set the model up for its objective's trainer; the notes the trainer adds."""
    notes: list[str] = []
    if goal.dpo:
        preference.prepare(model)
        notes.append(preference.note())
    if goal.kto:
        kto.prepare(model)
        notes.append(kto.note(spec))
    if goal.grpo:
        grpo.prepare(model)
        notes.append(grpo.note(spec))
    if goal.orpo:
        orpo.prepare(model, spec)
        notes.append(orpo.note())
    if goal.reward:
        reward.prepare(model)
        notes.append(reward.note())
    if resolved.loss is LossImpl.PLAIN and not (goal.trl or goal.grpo):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        base.loss_function = plain_causal_lm_loss
        kept.append(base)
    return notes


def _set_up_tracker(
    tracker: StorageTracker, spec: TrainingSpec, goal: _Goal, *, real: bool, cpu_kernels: bool
) -> None:
    """The host outputs of the attention kernels and, for a GPU run, cuBLAS's workspaces and
    the GPU kernels' allocations the CPU ops stand in for."""
    if not cpu_kernels:
        # A GPU run's cuBLAS handles take their workspaces from the caching allocator.
        tracker.blas_workspace = cublas_workspace(REFERENCE_COMPUTE_CAPABILITY)
        tracker.blaslt_workspace = CUBLASLT_WORKSPACE
    tracker.mark_host_outputs(kernels.FLASH_OP, kernels.FLASH_HOST_OUTPUTS)
    tracker.mark_host_outputs(kernels.EFFICIENT_OP, kernels.EFFICIENT_HOST_OUTPUTS)
    if real and not cpu_kernels:
        raise ValueError("a real CPU run needs cpu_kernels=True")
    if not cpu_kernels:
        _gpu_rewrites(tracker, spec, goal)


def _gpu_rewrites(tracker: StorageTracker, spec: TrainingSpec, goal: _Goal) -> None:
    """The GPU kernels' allocations the CPU ops stand in for: the compacted index of the
    preference losses, bitsandbytes' CUDA kernels."""
    if goal.dpo:
        tracker.rewrite(
            preference.INDEX_OP,
            preference.compact_index(
                (2 * spec.batch_size, spec.seq_len - 1), preference.compact_rows(spec)
            ),
        )
    if goal.kto:
        tracker.rewrite(
            preference.INDEX_OP,
            preference.compact_index(kto.mask_shape(spec), kto.compact_rows(spec)),
        )
    if goal.grpo:
        tracker.rewrite(
            preference.INDEX_OP,
            preference.compact_index(grpo.mask_shape(spec), grpo.compact_rows(spec)),
        )
    if spec.method is Method.QLORA:
        tracker.rewrite("bitsandbytes.gemm_4bit.default", kernels.gemm_4bit_cuda)
        tracker.rewrite(
            "bitsandbytes.int8_vectorwise_quant.default", kernels.int8_vectorwise_quant_cuda
        )
        tracker.rewrite(
            "bitsandbytes.int8_mixed_scaled_mm.default", kernels.int8_mixed_scaled_mm_cuda
        )
        tracker.rewrite("bitsandbytes.int8_scaled_mm.default", kernels.int8_scaled_mm_cuda)


def _enter_kernels(
    stack: ExitStack,
    spec: TrainingSpec,
    config: Mapping[str, Any],
    resolved: ResolvedSpec,
    goal: _Goal,
    model: torch.nn.Module,
    tracker: StorageTracker,
    real: bool,
    cpu_kernels: bool,
) -> None:
    """Fake mode (unless real), and the kernels, autocast policy and Liger patches the step
    runs under."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if not real:
        fake_mode = FakeTensorMode()
        stack.enter_context(fake_mode)
    stack.enter_context(
        # (flash_attention_2, traced as SDPA, reads the sequences' boundaries from the
        # collator's cu_seq_lens: transformers builds it no mask)
        kernels.gpu_kernels(
            spec.sdpa_kernel,
            cpu_flash=cpu_kernels,
            packed=spec.packing and spec.attn_implementation is not AttnImpl.FLASH_ATTENTION_2,
        )
    )
    if vision.is_vision_language(config) and not real:
        stack.enter_context(vision.constants())
    if (goal.dpo or goal.kto or goal.grpo) and not cpu_kernels:
        stack.enter_context(preference.gpu_fused_head())
    if goal.orpo and not cpu_kernels:
        stack.enter_context(orpo.gpu_logprob_kernel())
    int8 = resolved.quantization is not None and resolved.quantization.type is QuantType.INT8
    if int8 and not cpu_kernels:
        import bitsandbytes as bnb

        stack.enter_context(kernels.patched(bnb, "matmul", kernels.matmul_8bit_cuda))
        # MatMul8bitLt logs its fp16 cast of every non-fp16 input, once per call
        stack.enter_context(kernels.quiet_logger("bitsandbytes.autograd._functions"))
    if spec.autocast:
        stack.enter_context(cuda_autocast_policy())
    if spec.liger_kernel:
        stack.enter_context(liger.applied(model))
        stack.enter_context(liger.registers(tracker.off_device))


def _materialize(
    stack: ExitStack,
    model: torch.nn.Module,
    spec: TrainingSpec,
    config: Mapping[str, Any],
    goal: _Goal,
    tracker: StorageTracker,
    wrapping: parallel.Wrapping | None,
    kept: list[Any],
) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """Start tracking and give the model (wrapped for its parallel strategy) and the frozen
    reference copy of DPO and KTO their storages, labelled; the model and the copy."""
    if wrapping is not None and wrapping.shards_before_tracking:
        materialize(model)
        model = wrapping.wrap(model)
    stack.enter_context(tracker)
    if wrapping is not None and wrapping.shards_before_tracking:
        owned = list(wrapping.local_tensors(model))
    else:
        with tracker.labelling(Component.FROZEN_WEIGHTS):
            owned = materialize(model)
    for tensor, component in owned:
        tracker.label(tensor, component)
    kept.append(owned)
    ref_model = None
    if goal.dpo and preference.needs_reference_copy(spec):
        ref_model = preference.build_reference(spec, config)
    if goal.kto and kto.needs_reference_copy(spec):
        ref_model = kto.build_reference(spec, config)
    if ref_model is not None:
        with tracker.labelling(Component.REFERENCE_MODEL):
            ref_owned = materialize(ref_model)
            for tensor, _ in ref_owned:
                tracker.label(tensor, Component.REFERENCE_MODEL)
        kept += [tensor for tensor, _ in ref_owned[-1:]]
    if wrapping is not None and not wrapping.shards_before_tracking:
        model = wrapping.wrap(model)
    if wrapping is not None:
        stack.enter_context(wrapping.labelling())
    return model, ref_model


def _optimizer_and_steering(
    stack: ExitStack,
    model: torch.nn.Module,
    params: list[torch.nn.Parameter],
    lm_head: torch.nn.Module,
    spec: TrainingSpec,
    resolved: ResolvedSpec,
    tracker: StorageTracker,
    real: bool,
    kept: list[Any],
) -> tuple[torch.optim.Optimizer, Steering]:
    """The optimizer, its state labelled, and the hooks that steer the tracker's labels."""
    if spec.method is Method.LORA_FA:
        optimizer = lorafa_optimizer(model, resolved)
    else:
        optimizer = make_optimizer(params, spec.optim, fake=not real)
    optimizer.state = LabelledState(tracker)
    qmaps = list(getattr(optimizer, "name2qmap", {}).values())
    for qmap in qmaps:
        tracker.label(qmap, Component.OPTIMIZER_STATE)
    kept += qmaps[-1:]
    steering = Steering(tracker, lm_head, liger.backbone(model) if spec.liger_kernel else None)
    stack.enter_context(steering.installed(model, params))
    if spec.optimizer_in_backward:  # after the steering's hooks, which label .grad
        optimizer = _in_backward(params, spec, tracker, stack, fake=not real)
    return optimizer, steering


def _run_objective_steps(
    stack: ExitStack,
    model: torch.nn.Module,
    ref_model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
    tracker: StorageTracker,
    steering: Steering,
    spec: TrainingSpec,
    config: Mapping[str, Any],
    goal: _Goal,
    offloader: Offloader | None,
    keep_gradients: bool,
    kept: list[Any],
) -> None:
    """The STEPS training steps, as the objective's trainer runs them."""
    if goal.trl:  # TRL's: forwards as accelerate's
        stack.enter_context(
            accelerate_forward(
                (preference.unwrapped(m) for m in (model, ref_model) if m is not None), spec
            )
        )
    run = preference.TrainerRun(
        model=model,
        optimizer=optimizer,
        params=params,
        tracker=tracker,
        steering=steering,
        spec=spec,
        steps=STEPS,
        rewrap_checkpoints=functools.partial(steering.rewrap, model),
        keep_gradients=keep_gradients,
    )
    if goal.dpo:
        preference.run_dpo_steps(run, ref_model)
    elif goal.kto:
        kto.run_kto_steps(run, ref_model)
    elif goal.grpo:
        grpo.run_grpo_steps(run)
    elif goal.orpo:
        micro_batch = orpo.micro_batches(model, tracker, spec)
        kept.append(micro_batch)  # its inputs outlive the steps
        preference.trainer_steps(run, micro_batch)
    elif goal.reward:
        reward.run_reward_steps(run)
    else:
        _run_steps(
            model,
            params,
            optimizer,
            tracker,
            steering,
            spec,
            classes=is_encoder(config),
            keep_gradients=keep_gradients,
            offloader=offloader,
            vision_config=config if vision.is_vision_language(config) else None,
        )


def _in_backward(
    params: list[torch.nn.Parameter],
    spec: TrainingSpec,
    tracker: StorageTracker,
    stack: ExitStack,
    *,
    fake: bool,
) -> torch.optim.Optimizer:
    """torchtune's optimizers in backward, their states labelled; returns the first as the
    step's optimizer (its step and zero_grad are the hooks' business)."""

    def make(group: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        optimizer = make_optimizer(group, spec.optim, fake=fake)
        optimizer.state = LabelledState(tracker)
        return optimizer

    optimizers, handles = in_backward_optimizers(params, make)
    stack.callback(lambda: [handle.remove() for handle in handles])
    return next(iter(optimizers.values()))


def _offloaded_loss(
    model: torch.nn.Module,
    offloader: Offloader,
    lm_head: torch.nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    packed: Mapping[str, Any],
) -> torch.Tensor:
    """torchtune's _loss_step: the model's forward under the offloading hooks, the loss after
    it (here transformers' own loss function on the logits)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    with offloaded_forward(offloader, lm_head):
        logits = model(input_ids=input_ids, **packed).logits
    loss: torch.Tensor = base.loss_function(
        logits=logits, labels=labels, vocab_size=base.config.vocab_size
    )
    del logits
    return loss


def _numel(param: torch.Tensor) -> int:
    """Parameters a weight stands for (a packed 4-bit weight holds two per byte)."""
    state = getattr(param, "quant_state", None)
    if state is not None:
        shape = state.shape
        return int(shape[0]) * int(shape[1])
    return param.numel()


def _run_steps(
    model: torch.nn.Module,
    params: list[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    tracker: StorageTracker,
    steering: Steering,
    spec: TrainingSpec,
    *,
    classes: bool = False,
    keep_gradients: bool = False,
    offloader: Offloader | None = None,
    vision_config: Mapping[str, Any] | None = None,
) -> None:
    """HF Trainer's steps (trainer.py training_step and _inner_training_loop): the forward and
    the loss under autocast when mixed precision is on (accelerate's autocast), backward
    outside it (fp16: of the GradScaler's scaled loss), the detached loss added to the logged
    total, the gradients unscaled (fp16) and clipped to `max_grad_norm`
    (torch.nn.utils.clip_grad_norm_), the optimizer step, zero_grad(set_to_none=True), or with
    `keep_gradients` set_to_none=False (torch's default before 2.0)."""
    host_scalars = spec.optim is not Optim.ADAMW_TORCH_FUSED
    dtype = autocast_dtype(spec)
    scaler = torch.amp.GradScaler("cpu") if spec.autocast and dtype == torch.float16 else None
    with tracker.labelling(Component.INPUTS):
        # (`_held`: inputs the batch keeps, alive for the step, that the model is not passed)
        input_ids, labels, packed, _held = _inputs(
            spec, classes=classes, vision_config=vision_config
        )
        logged = torch.zeros(())  # Trainer's tr_loss

    for step in range(1, STEPS + 1):
        steering.step = step
        # Each optimizer step runs gradient_accumulation_steps micro-batches (the inputs of
        # each the same shape); gradients add up in .grad until the step.
        for _ in range(spec.gradient_accumulation_steps):
            tracker.begin_phase(step, Phase.FORWARD_END)
            tracker.component = Component.ACTIVATIONS
            tracker.blas_handle = "forward"
            with torch.autocast("cpu", dtype=dtype, enabled=spec.autocast):
                if offloader is None:
                    loss = model(input_ids=input_ids, labels=labels, **packed).loss
                else:
                    loss = _offloaded_loss(
                        model, offloader, steering.lm_head, input_ids, labels, packed
                    )
            tracker.mark(step, Phase.FORWARD_END)

            tracker.begin_phase(step, Phase.BACKWARD_START)
            tracker.component = Component.LOGITS_LOSS
            steering.in_backward = True
            # On a GPU the autograd engine runs backward on its device thread: another cuBLAS
            # handle.
            tracker.blas_handle = "backward"
            (loss if scaler is None else scaler.scale(loss)).backward()
            steering.in_backward = False
            tracker.blas_handle = None
            logged = logged + loss.detach()
            del loss

        tracker.begin_phase(step, Phase.OPTIMIZER_STEP)
        tracker.component = Component.OPTIMIZER_TEMPORARIES
        if spec.optimizer_in_backward:  # each parameter stepped as its gradient landed
            tracker.end_phase()
            continue
        if scaler is not None:
            scaler.unscale_(optimizer)
        if spec.max_grad_norm > 0:
            # foreach, as clip_grad_norm_ picks for CUDA tensors (fake ones fail its type check)
            torch.nn.utils.clip_grad_norm_(params, spec.max_grad_norm, foreach=True)
        tracker.host_scalar_ops = host_scalars
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
        tracker.host_scalar_ops = False
        if spec.method is Method.ADALORA:
            _allocate_ranks(model, tracker, step)
        optimizer.zero_grad(set_to_none=not keep_gradients)
        tracker.end_phase()


def _inputs(
    spec: TrainingSpec, *, classes: bool, vision_config: Mapping[str, Any] | None = None
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], tuple[torch.Tensor, ...]]:
    """The micro-batch's input_ids and labels, the model's other inputs, and what the batch
    holds besides. A packed batch is
    TRL's padding-free collator's (trl/trainer/sft_trainer.py DataCollatorForLanguageModeling):
    one row of batch_size x seq_len tokens with position_ids restarting at each sequence and
    no attention mask. SDPA and eager get the position_ids, from which transformers builds the
    block-diagonal mask; flash_attention_2 (traced as SDPA's flash kernel) reads the collator's
    cu_seq_lens instead and builds none, so the position_ids are held, as the batch holds them,
    and not passed."""
    if spec.packing:
        row = (1, spec.batch_size * spec.seq_len)
        input_ids = torch.zeros(row, dtype=torch.long)
        labels = torch.zeros(row, dtype=torch.long)
        position_ids = torch.zeros(row, dtype=torch.long)
        if spec.attn_implementation is AttnImpl.FLASH_ATTENTION_2:
            return input_ids, labels, {}, (position_ids,)
        return input_ids, labels, {"position_ids": position_ids}, ()
    if vision_config is not None:
        # a vision-language model's: the processor's image inputs, with their input_ids
        images = vision.batch(spec, vision_config)
        input_ids = images.pop("input_ids")
        return input_ids, torch.zeros(spec.batch_size, spec.seq_len, dtype=torch.long), images, ()
    input_ids = torch.zeros(spec.batch_size, spec.seq_len, dtype=torch.long)
    # a sequence classifier's labels are one class id per sequence
    # (an encoder-decoder's are the target's tokens, which the decoder reads shifted)
    target = spec.target_length or spec.seq_len
    label_shape = (spec.batch_size,) if classes else (spec.batch_size, target)
    return input_ids, torch.zeros(label_shape, dtype=torch.long), {}, ()


def _allocate_ranks(model: torch.nn.Module, tracker: StorageTracker, step: int) -> None:
    """AdaLoRA's RankAllocator after the optimizer step and before zero_grad, as PEFT's
    method-comparison loop calls it (method_comparison/MetaMathQA/run.py train:
    `model.base_model.update_and_allocate(step)`): its importance buffers, kept across steps,
    and the temporaries that update them are labelled optimizer state."""
    with tracker.labelling(Component.OPTIMIZER_STATE):
        model.base_model.update_and_allocate(step)


def _step_peaks(tracker: StorageTracker) -> Iterator[PhaseSnapshot]:
    """The highest phase window of each step (the first, where two are equal)."""
    windows = tracker.phase_peaks()
    for step in range(1, STEPS + 1):
        mine = [w for w in windows if w.step == step]
        yield max(mine, key=lambda w: w.snapshot.allocated_bytes)


def _phase_table(tracker: StorageTracker) -> Iterator[PhaseSnapshot]:
    """Per step: the generation's peak (GRPO), the forward-end mark, then the peaks of backward
    start, backward, optimizer."""
    peaks = {(p.step, p.phase): p for p in tracker.phase_peaks()}
    marks = {(m.step, m.phase): m for m in tracker.marks()}
    for step in range(1, STEPS + 1):
        if (step, Phase.GENERATION) in peaks:  # GRPO's model.generate, before the forward
            yield peaks[(step, Phase.GENERATION)]
        if (step, Phase.FORWARD_END) in marks:
            yield marks[(step, Phase.FORWARD_END)]
        for phase in (
            Phase.REFERENCE_FORWARD,
            Phase.BACKWARD_START,
            Phase.BACKWARD,
            Phase.OPTIMIZER_STEP,
        ):
            if (step, phase) in peaks:
                yield peaks[(step, phase)]
