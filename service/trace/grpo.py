"""TRL's GRPO step (trl 1.16.0, trl/trainer/grpo_trainer.py) on the tracer's fake tensors, with
the kernels a GPU runs.

Per optimizer step, in TRL's order: `_generate_single_turn` runs transformers' own
`model.generate` under `torch.no_grad()` with gradient checkpointing off
(`unwrap_model_for_generation`) on the generation batch (batch_size x
gradient_accumulation_steps prompts' rows, each prompt repeated num_generations times by
RepeatSampler), sampling max_completion_length tokens (no EOS: the longest completions); the
completions go to the host (`.tolist()`), and `_generate_and_score_completions` builds the
buffered batch (left-padded prompt ids and mask, right-padded completion ids and mask, the
advantages, num_items_in_batch) on the device. Then per micro-batch `_compute_loss`: the
policy's forward with TRL's fused LM head (log-probs and entropy of the completion tokens),
loss "dapo" with old_per_token_logps = per_token_logps.detach() (num_iterations 1), backward,
and HF Trainer's optimizer step.

Two GPU behaviours are made explicit on fake tensors: the stop check (transformers'
DeferredStopCheck on a CUDA device reports the stop one step late, so one extra decode step
runs and is undone) and torch.multinomial with one sample, which ATen runs as
`probs / empty_like(probs).exponential_()` then argmax (aten/src/ATen/native/Distributions.cpp
multinomial's fast path).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from service.core.result import Component, Phase
from service.core.spec import TrainingSpec
from service.trace import preference
from service.trace.preference import CHECKPOINTING_KWARGS

# GRPOConfig's epsilon (epsilon_high defaults to it) and temperature defaults
# (trl/trainer/grpo_config.py); the values do not change memory.
EPSILON = 0.2
TEMPERATURE = 1.0
# The per-token fields GRPOTrainer asks the policy's fused head for (grpo_trainer.py __init__:
# `outputs=("log_probs", "entropy")`).
POLICY_OUTPUTS = ("log_probs", "entropy")
# DeferredStopCheck (transformers/generation/utils.py) reads the stop flag one step late on a
# CUDA device: one decode step past max_new_tokens, undone after the loop.
DEFERRED_STEPS = 1


def note(spec: TrainingSpec) -> str:
    """What a GRPO trace ran, with the installed TRL's version."""
    from importlib.metadata import version

    g = spec.grpo_settings
    return (
        f"GRPO: trl {version('trl')} GRPOTrainer's step (loss 'dapo', beta 0.0, num_iterations "
        f"1): model.generate of {g.max_completion_length} tokens for {generation_rows(spec)} "
        f"rows ({g.num_generations} per prompt) on {g.prompt_length(spec.seq_len)}-token "
        "prompts, no EOS, CUDA's deferred stop check and multinomial; the fused LM head as a "
        "CUDA device runs it"
    )


def generation_rows(spec: TrainingSpec) -> int:
    """The generation batch's rows: per_device_train_batch_size x steps_per_generation
    (GRPOConfig.__post_init__, steps_per_generation = gradient_accumulation_steps)."""
    return spec.batch_size * spec.gradient_accumulation_steps


def compact_rows(spec: TrainingSpec) -> int:
    """Positions TRL's fused head scores in one forward: the completion tokens
    (`labels[:, :-logits_to_keep] = -100`) over the micro-batch's rows."""
    return spec.batch_size * spec.grpo_settings.max_completion_length


def mask_shape(spec: TrainingSpec) -> tuple[int, int]:
    """The fused head's label mask over the shifted labels."""
    return (spec.batch_size, spec.seq_len - 1)


def prepare(model: torch.nn.Module) -> None:
    """What GRPOTrainer.__init__ does to the policy: the fused LM head on the base model
    (GRPOConfig.disable_dropout defaults to False: dropout stays)."""
    from trl.trainer.utils import add_fused_lm_head

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    add_fused_lm_head(base, temperature=TEMPERATURE, outputs=POLICY_OUTPUTS)


class _StopLate:
    """DeferredStopCheck's schedule without its host copies: stop once the sequence has run
    DEFERRED_STEPS past `max_length`, then undo those steps."""

    def __init__(self, max_length: int) -> None:
        self.max_length = max_length
        self.over = 0

    def __call__(self, unfinished: torch.Tensor, tokens: torch.Tensor, length: int) -> bool:
        self.over = max(0, length - self.max_length)
        return self.over >= DEFERRED_STEPS

    def finish(self) -> int:
        return self.over


class _UnpaddedMasks(TorchDispatchMode):
    """Answers generate's host reads of boolean flags on fake tensors as an unpadded batch's
    device would: every `.all()` of the attention mask True (generate drops an all-ones mask,
    generation/utils.py, and SDPA's mask skip keeps is_causal, masking_utils.py). Any other
    host read stays an error."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default and args[0].dtype is torch.bool:
            return True
        return func(*args, **(kwargs or {}))


def _multinomial_one(probs: torch.Tensor, num_samples: int, *args: Any, **kwargs: Any) -> Any:
    """ATen's multinomial for one sample: the exponential race, then argmax."""
    if num_samples != 1:
        raise ValueError("the traced generation samples one token per step")
    q = torch.empty_like(probs).exponential_(1)
    torch.div(probs, q, out=q)
    return q.argmax(dim=-1, keepdim=True)


@contextmanager
def _gpu_generation(max_length: int, tracker: Any) -> Iterator[None]:
    """transformers' generate as a CUDA device runs it, the cache's tensors labelled."""
    from transformers import cache_utils, masking_utils
    from transformers.generation import utils

    stop = _StopLate(max_length)
    # the cache layers' update methods (a sliding-window model's layers have their own)
    layers = (cache_utils.DynamicLayer, cache_utils.DynamicSlidingWindowLayer)
    updates = [layer.__dict__["update"] for layer in layers]
    saved = (
        utils.StopCheck,
        utils.DeferredStopCheck.is_supported,
        torch.multinomial,
        masking_utils.fast_all,
    )

    def labelled(update: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            before = tracker.component
            tracker.component = Component.GENERATION_KV_CACHE
            try:
                return update(self, *args, **kwargs)
            finally:
                tracker.component = before

        return run

    utils.StopCheck = lambda streamer=None: stop  # type: ignore[assignment,misc]
    utils.DeferredStopCheck.is_supported = staticmethod(lambda *a, **k: False)  # type: ignore[method-assign]
    torch.multinomial = _multinomial_one  # type: ignore[assignment]
    for layer, update in zip(layers, updates, strict=True):
        layer.update = labelled(update)  # type: ignore[method-assign]
    # the prompts unpadded: every attention mask all ones, which SDPA's mask skip reads on
    # the device (masking_utils._ignore_causal_mask_sdpa); fake tensors have no values
    masking_utils.fast_all = lambda tensor: True
    try:
        with _UnpaddedMasks():
            yield
    finally:
        (
            utils.StopCheck,
            is_supported,
            torch.multinomial,
            masking_utils.fast_all,
        ) = saved
        utils.DeferredStopCheck.is_supported = is_supported  # type: ignore[method-assign]
        for layer, update in zip(layers, updates, strict=True):
            layer.update = update  # type: ignore[method-assign]


def _generate(model: torch.nn.Module, spec: TrainingSpec, tracker: Any) -> None:
    """`_generate_single_turn`'s transformers path: the prompts to the device, generate under
    no_grad with checkpointing off, the completions to the host."""
    g = spec.grpo_settings
    rows, prompt = generation_rows(spec), g.prompt_length(spec.seq_len)
    checkpointing = getattr(model, "is_gradient_checkpointing", False)
    if checkpointing:
        model.gradient_checkpointing_disable()
    tracker.component = Component.INPUTS
    input_ids = torch.zeros(rows, prompt, dtype=torch.long)
    attention_mask = torch.ones(rows, prompt, dtype=torch.long)
    tracker.component = Component.ACTIVATIONS
    with torch.no_grad(), _gpu_generation(prompt + g.max_completion_length, tracker):
        out = model.generate(  # type: ignore[operator]
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=g.max_completion_length,
            do_sample=True,
            temperature=TEMPERATURE,
            top_p=1.0,
            top_k=0,
            eos_token_id=None,
            pad_token_id=None,
            disable_compile=True,
        )
    del out, input_ids, attention_mask
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=CHECKPOINTING_KWARGS)


def _buffered_batch(spec: TrainingSpec) -> dict[str, torch.Tensor]:
    """`_generate_and_score_completions`'s output on the device for the generation batch."""
    g = spec.grpo_settings
    rows, prompt = generation_rows(spec), g.prompt_length(spec.seq_len)
    completion = g.max_completion_length
    return {
        "prompt_ids": torch.zeros(rows, prompt, dtype=torch.long),
        "prompt_mask": torch.ones(rows, prompt, dtype=torch.long),
        "completion_ids": torch.zeros(rows, completion, dtype=torch.long),
        "completion_mask": torch.ones(rows, completion, dtype=torch.int),
        "advantages": torch.zeros(rows),
        "num_items_in_batch": torch.zeros((), dtype=torch.long),
    }


def run_grpo_steps(run: preference.TrainerRun) -> None:
    """`steps` optimizer steps of GRPOTrainer: the generation, then per micro-batch
    `_compute_loss` and backward, then HF Trainer's clipping, optimizer step and zero_grad as
    in service/trace/runner.py."""
    model, tracker, steering, spec = run.model, run.tracker, run.steering, run.spec
    rows = spec.batch_size
    with preference.fused_head_steering(run, model) as head:
        for step in range(1, run.steps + 1):
            steering.step = step
            tracker.begin_phase(step, Phase.GENERATION)
            tracker.blas_handle = "forward"  # generate runs on the trainer's thread
            _generate(model, spec, tracker)
            tracker.blas_handle = None
            run.rewrap_checkpoints()
            with tracker.labelling(Component.INPUTS):
                buffered = _buffered_batch(spec)
            for micro in range(spec.gradient_accumulation_steps):
                tracker.begin_phase(step, Phase.FORWARD_END)
                tracker.blas_handle = "forward"
                batch = {
                    k: v[micro * rows : (micro + 1) * rows] for k, v in buffered.items() if v.dim()
                }
                batch["num_items_in_batch"] = buffered["num_items_in_batch"]
                loss = _compute_loss(model, batch, spec, tracker=tracker, step=step)
                tracker.begin_phase(step, Phase.BACKWARD_START)
                tracker.component = Component.LOGITS_LOSS
                steering.in_backward = head.in_backward = True
                tracker.blas_handle = "backward"
                loss.backward()
                steering.in_backward = head.in_backward = False
                tracker.blas_handle = None
                del loss, batch
            del buffered
            preference.optimizer_step(
                tracker, step, run.optimizer, run.params, spec, keep_gradients=run.keep_gradients
            )


def _compute_loss(
    model: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    spec: TrainingSpec,
    *,
    tracker: Any,
    step: int,
) -> torch.Tensor:
    """GRPOTrainer._compute_loss's tensors for loss "dapo", in its order (its metrics, host
    scalars and masked means of detached copies, left out)."""
    tracker.component = Component.ACTIVATIONS
    prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    logits_to_keep = completion_ids.size(1)
    # _get_per_token_logps_and_entropies: one chunk of the whole micro-batch
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :-logits_to_keep] = -100
    # the batch unpadded: its all-ones mask, which transformers drops on the device (SDPA's
    # is_causal, masking_utils._ignore_causal_mask_sdpa), is not passed (fake tensors have no
    # values to read)
    outputs = model(input_ids=input_ids, labels=labels, fused_lm_head=True)
    per_token_logps = torch.cat([outputs.log_probs[:, -logits_to_keep:]], dim=0)
    entropies = torch.cat([outputs.entropy[:, -logits_to_keep:]], dim=0)
    del outputs, labels
    tracker.component = Component.LOGITS_LOSS
    advantages = inputs["advantages"].unsqueeze(1)
    old_per_token_logps = per_token_logps.detach()
    log_ratio = per_token_logps - old_per_token_logps
    coef_1 = torch.exp(log_ratio)
    coef_2 = torch.clamp(coef_1, 1 - EPSILON, 1 + EPSILON)
    per_token_loss1 = coef_1 * advantages
    per_token_loss2 = coef_2 * advantages
    per_token_loss = -torch.min(per_token_loss1, per_token_loss2)
    # num_items_in_batch / num_processes x accumulation / steps_per_generation (equal here)
    normalizer = inputs["num_items_in_batch"].clamp(min=1.0)
    loss: torch.Tensor = (per_token_loss * completion_mask).sum() / normalizer
    tracker.mark(step, Phase.FORWARD_END)
    del entropies
    return loss
