"""GRPO's step (TRL 1.16.0 GRPOTrainer, beta 0.0, num_iterations 1, model.generate): a
generation phase, then DPO's fused-head step (estimator/preference.py `fused_head_phases`) on
the micro-batch's completions.

Once per optimizer step `_generate_and_score_completions` runs model.generate under no_grad,
checkpointing off, on the generation batch (batch_size x gradient_accumulation_steps rows),
its KV cache a transformers DynamicCache (one key and one value tensor per layer, grown by
torch.cat a token at a time). Its largest moment is the prefill's: every row's prompt through
one layer with the prompt's cache alive; decoding adds a token per row at a time, the cache
growing to prompt + completion tokens. The completions then go to the host, and the buffered
batch (prompt and completion ids and masks, the advantages) stays on the device for the
step. `_compute_loss` runs the policy's forward with the fused head scoring the completion
tokens (`labels[:, :-logits_to_keep] = -100`), asking for log-probs and entropy alone
(grpo_trainer.py __init__ `outputs=("log_probs", "entropy")`), and loss "dapo" on per-token
tensors of batch_size x max_completion_length.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from service.core.arch import ModelArch
from service.core.estimator.ledger import _blk
from service.core.estimator.preference import (
    TILE_TOKENS,
    TILE_VOCAB,
    DpoShape,
    fused_head_phases,
    head_dtypes,
)
from service.core.estimator.step import _Step, _step
from service.core.estimator.step_context import _Moment
from service.core.libs.transformers import KV_TENSORS, PREFILL_HIDDEN, PREFILL_INTERMEDIATES
from service.core.result import COMPONENT_ORDER, Component, Phase
from service.core.spec import LossImpl, Objective, TrainingSpec
from service.core.units import DTYPE_BYTES, FP32_BYTES, INT32_BYTES, INT64_BYTES

# The fp32 per-token outputs GRPOTrainer's fused head returns: log_probs and entropy
# (grpo_trainer.py __init__ `add_fused_lm_head(..., outputs=("log_probs", "entropy"))`).
POLICY_FP32_OUTPUTS = 2
# Loss "dapo"'s per-token fp32 tensors of batch_size x max_completion_length alive at the end
# of `_compute_loss`: the log-probs and entropies concatenated, log_ratio, coef_1, coef_2,
# per_token_loss1 and 2, their minimum, its negation and its product with the mask
# (grpo_trainer.py `_compute_loss`; reference traces *__grpo__*).
LOSS_PER_TOKEN_TENSORS = 10


def generation_rows(spec: TrainingSpec) -> int:
    """The generation batch: per_device_train_batch_size x steps_per_generation rows
    (GRPOConfig.__post_init__, steps_per_generation = gradient_accumulation_steps)."""
    return spec.batch_size * spec.gradient_accumulation_steps


def grpo_shape(spec: TrainingSpec) -> DpoShape:
    """The micro-batch's completions, the positions TRL's fused head scores (the completion
    tokens), and the head's dtypes (`preference.head_dtypes`)."""
    rows = spec.batch_size
    scored = rows * min(spec.grpo_settings.max_completion_length, spec.seq_len - 1)
    return DpoShape(rows, scored, *head_dtypes(spec))


def grpo_policy_spec(spec: TrainingSpec) -> TrainingSpec:
    """The SFT step whose layers GRPO's policy runs: the micro-batch's completions, no logits
    (GRPOConfig.disable_dropout defaults to False: dropout stays)."""
    return replace(spec, objective=Objective.SFT, grpo=None, loss=LossImpl.FUSED)


def kv_cache_bytes(arch: ModelArch, spec: TrainingSpec, tokens: int, attn: int = 0) -> int:
    """The generation's DynamicCache at `tokens` positions: a key and a value per layer, each
    rows x kv_heads x tokens x head_dim in the attention's dtype (`attn` bytes; fp32 after
    QLoRA's kbit preparation, reference trace phi-3-mini-4k-instruct__qlora__grpo__*), the
    model's dtype where not given."""
    e = attn or DTYPE_BYTES[spec.dtype]
    per = _blk(generation_rows(spec) * arch.kv_dim * tokens * e)
    return arch.num_hidden_layers * KV_TENSORS * per


def buffered_inputs(spec: TrainingSpec) -> int:
    """`_generate_and_score_completions`'s batch on the device for the generation batch:
    prompt ids and mask (int64), completion ids (int64) and mask (int32), the advantages
    (fp32) and num_items_in_batch."""
    g = spec.grpo_settings
    rows, prompt = generation_rows(spec), g.prompt_length(spec.seq_len)
    completion = g.max_completion_length
    return (
        2 * _blk(rows * prompt * INT64_BYTES)
        + _blk(rows * completion * INT64_BYTES)
        + _blk(rows * completion * INT32_BYTES)
        + _blk(rows * FP32_BYTES)
        + _blk(INT64_BYTES)
    )


def _generation(arch: ModelArch, spec: TrainingSpec, st: _Step) -> tuple[int, int, int]:
    """The generation's largest moment as (inputs, activations, kv cache): the prefill's MLP
    product over every prompt token beside the prompt's cache, or the last decode step with
    the whole cache (the larger)."""
    g = spec.grpo_settings
    rows, prompt = generation_rows(spec), g.prompt_length(spec.seq_len)
    tokens = rows * prompt
    f = st.plan.flow
    prefill = PREFILL_INTERMEDIATES * _blk(tokens * arch.intermediate_size * f.norm_out) + (
        PREFILL_HIDDEN * _blk(tokens * arch.hidden_size * f.residual)
    )
    inputs = 2 * _blk(tokens * INT64_BYTES)
    at_prompt = kv_cache_bytes(arch, spec, prompt, f.attn)
    at_end = kv_cache_bytes(arch, spec, prompt + g.max_completion_length, f.attn)
    if prefill + at_prompt >= at_end:
        return inputs, prefill, at_prompt
    return inputs, 0, at_end


class GrpoStep(NamedTuple):
    """GRPO's phases as (step, phase, parts) with the SFT step they extend."""

    step: _Step
    phases: tuple[tuple[int, Phase, tuple[int, ...]], ...]
    assumptions: tuple[str, ...]


def grpo_step(arch: ModelArch, spec: TrainingSpec, compute_capability: str | None) -> GrpoStep:
    d = grpo_shape(spec)
    st = _step(arch, grpo_policy_spec(spec), compute_capability)
    st = st._replace(fixed=st.fixed._replace(inputs=st.fixed.inputs + buffered_inputs(spec)))
    rows = list(
        fused_head_phases(
            arch,
            spec,
            d,
            st,
            reference_forward=False,
            reference=0,
            top1=False,
            fp32_outputs=POLICY_FP32_OUTPUTS,
        )
    )
    # the loss's per-token tensors at the end of the forward
    loss = LOSS_PER_TOKEN_TENSORS * _blk(d.scored * FP32_BYTES)
    at = COMPONENT_ORDER.index(Component.LOGITS_LOSS)
    rows = [
        (step, phase, (*parts[:at], parts[at] + loss, *parts[at + 1 :]))
        if phase is Phase.FORWARD_END
        else (step, phase, parts)
        for step, phase, parts in rows
    ]
    inputs, activations, cache = _generation(arch, spec, st)
    moment = _Moment(gradients=0, activations=activations, generation_kv_cache=cache)
    one, both = st.workspaces
    frozen, trainable = st.fixed.frozen_weights, st.fixed.trainable_params
    for step, held in (
        (1, (frozen, trainable, inputs, one, 0)),
        (2, (frozen, trainable, inputs, both, st.optimizer_state)),
    ):
        index = next(i for i, row in enumerate(rows) if row[0] == step)
        rows.insert(index, (step, Phase.GENERATION, held + tuple(moment)))
    if len(rows[0][2]) != len(COMPONENT_ORDER):
        raise AssertionError("GRPO's generation parts are not in COMPONENT_ORDER")
    g = spec.grpo_settings
    prompt = g.prompt_length(spec.seq_len)
    notes = (
        f"GRPO (TRL 1.16.0 GRPOTrainer, loss 'dapo', beta 0.0): model.generate samples "
        f"{g.max_completion_length} tokens (no EOS: the longest completions) for "
        f"{generation_rows(spec)} rows ({g.num_generations} per prompt) on {prompt}-token "
        "prompts, unpadded; its KV cache is "
        f"{Component.GENERATION_KV_CACHE.value} during the {Phase.GENERATION.value} phase",
        f"the step: {spec.batch_size} completions of {spec.seq_len} tokens; the fused LM head "
        f"scores the {g.max_completion_length} completion tokens of each: {d.scored} "
        f"positions, in tiles of {TILE_TOKENS} x {TILE_VOCAB} logits",
    )
    return GrpoStep(st, tuple(rows), notes)
