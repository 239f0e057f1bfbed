"""ORPO's step (TRL 1.16.0 trl/experimental/orpo/orpo_trainer.py ORPOTrainer): the SFT step on
the doubled [chosen; rejected] batch with HF's LM head, no reference model.

`concatenated_forward` runs the policy once on the 2 x batch_size rows and keeps the whole
(rows, seq_len, vocab) logits: TRL's log-prob kernel (trl/kernels/logprob_entropy.py, the CUDA
path of trl/trainer/utils.py selective_log_softmax) saves them for backward. The NLL over the
chosen half (`cross_entropy_loss`) makes a contiguous copy of its logits and saves their
log-softmax, in the logits' dtype. In backward the two paths each give the logits a gradient
of their full shape (the kernel's through its `[:, :-1]` slice, the NLL's through two slices),
and autograd adds them: three logits-sized gradients at once, every activation alive
(reference traces *__orpo__*, peak at aten.add.Tensor). The layers are the SFT step's (`_step`
with `LossImpl.FUSED`, which adds no logits), the logits' tensors added here.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from service.core.arch import ModelArch
from service.core.estimator.ledger import _blk
from service.core.estimator.preference import head_dtypes, step_phases
from service.core.estimator.step import _Step, _step
from service.core.estimator.step_context import _Moment
from service.core.libs.trl import PAIR_SIDES
from service.core.result import Phase
from service.core.spec import LossImpl, Objective, TrainingSpec
from service.core.units import FP32_BYTES, INT64_BYTES

# The logits' gradients alive together when autograd adds the NLL's to the kernel's: the two
# addends and their sum (reference traces *__orpo__*, peak at aten.add.Tensor).
ADDED_GRADIENTS = 3
# The fp32 per-position tensors TRL's log-prob kernel keeps from its forward: log Z and the
# expected logit (logprob_entropy.py _LogProbEntropyFunction.forward ctx.save_for_backward).
KERNEL_SAVED = 2
# The collator's (b, seq_len) int64 tensors (trl/experimental/utils.py
# DPODataCollatorWithPadding): chosen and rejected input ids, attention masks and labels...
PAIR_TENSORS = 6
# ...and the prompt's ids and attention mask, taken as half the sequence (the trace's
# assumption: service/trace/orpo.py PROMPT_DIVISOR).
PROMPT_TENSORS = 2
PROMPT_DIVISOR = 2


class OrpoShape(NamedTuple):
    """The sizes ORPO's logits take."""

    rows: int  # 2 x batch_size: [chosen; rejected]
    logits: int  # bytes of the (rows, seq_len, vocab) logits
    chosen: int  # bytes of the chosen half without its last position (the NLL's logits)
    element: int  # bytes per logit


def logits_bytes(spec: TrainingSpec) -> int:
    """Bytes per logit: the LM head's dtype (fp32 after kbit preparation), or fp32 under mixed
    precision, where accelerate converts the forward's outputs to fp32
    (accelerate/utils/operations.py convert_outputs_to_fp32)."""
    head, _ = head_dtypes(spec)
    return FP32_BYTES if spec.autocast else head


def orpo_shape(arch: ModelArch, spec: TrainingSpec) -> OrpoShape:
    rows, s, v = PAIR_SIDES * spec.batch_size, spec.seq_len, arch.vocab_size
    e = logits_bytes(spec)
    return OrpoShape(rows, _blk(rows * s * v * e), _blk(spec.batch_size * (s - 1) * v * e), e)


def orpo_policy_spec(spec: TrainingSpec) -> TrainingSpec:
    """The SFT step whose layers ORPO's policy runs: the doubled batch, no logits of its own,
    and no dropout unless ORPOConfig.disable_dropout is False (trl/trainer/utils.py
    disable_dropout_in_model sets every nn.Dropout's p to 0, LoRA's included)."""
    lora = spec.lora
    if lora is not None and lora.lora_dropout and spec.orpo_settings.disable_dropout:
        lora = replace(lora, lora_dropout=0.0)
    return replace(
        spec,
        batch_size=PAIR_SIDES * spec.batch_size,
        objective=Objective.SFT,
        orpo=None,
        loss=LossImpl.FUSED,
        lora=lora,
    )


def orpo_inputs(spec: TrainingSpec) -> int:
    """The collator's batch: the pairs' tensors and the prompt's, int64."""
    b, s = spec.batch_size, spec.seq_len
    return PAIR_TENSORS * _blk(b * s * INT64_BYTES) + PROMPT_TENSORS * _blk(
        b * (s // PROMPT_DIVISOR) * INT64_BYTES
    )


class OrpoStep(NamedTuple):
    """ORPO's phases as (step, phase, parts) with the SFT step they extend."""

    step: _Step
    phases: tuple[tuple[int, Phase, tuple[int, ...]], ...]
    assumptions: tuple[str, ...]


def orpo_step(arch: ModelArch, spec: TrainingSpec, compute_capability: str | None) -> OrpoStep:
    d = orpo_shape(arch, spec)
    st = _step(arch, orpo_policy_spec(spec), compute_capability)
    fixed = st.fixed._replace(inputs=orpo_inputs(spec))
    st = st._replace(fixed=fixed)
    kernel = KERNEL_SAVED * _blk(d.rows * (spec.seq_len - 1) * FP32_BYTES)
    # Gemma-2's final softcapping (tanh(logits / cap) * cap) keeps its tanh's output
    softcap = d.logits if arch.final_logit_softcapping is not None else 0
    # autocast's half copy of a wider LM head weight, saved by its matmul until its backward
    head, compute = head_dtypes(spec)
    weight = _blk(arch.vocab_size * arch.hidden_size * compute) if compute != head else 0
    saved = d.logits + d.chosen + kernel + softcap + weight
    forward_end = st.forward_end._replace(logits_loss=st.forward_end.logits_loss + saved)
    backward_start = st.backward_start._replace(
        logits_loss=st.backward_start.logits_loss + ADDED_GRADIENTS * d.logits + softcap + weight
    )
    # the LM head's backward: the logits' gradient in the head's output dtype (accelerate's
    # fp32 conversion undone) beside every activation and the weight's half copy
    at_head = _Moment(
        gradients=st.backward_start.gradients,
        activations=st.backward_start.activations,
        logits_loss=_blk(d.rows * spec.seq_len * arch.vocab_size * compute) + weight,
    )
    backward = max(st.backward, at_head, key=sum)
    rows = step_phases(st, forward_end, backward_start, backward, st.optimizer_step)
    notes = [
        f"ORPO (TRL 1.16.0 ORPOTrainer): {spec.batch_size} pairs run as {d.rows} sequences "
        f"of {spec.seq_len} tokens ([chosen; rejected]), unpadded, the prompt half of each; "
        "no reference model",
        "the whole logits kept for TRL's log-prob kernel, the chosen half's log-softmax for "
        f"the NLL, {d.element}-byte logits; backward adds two logits-sized gradients",
    ]
    if spec.lora is not None and spec.lora.lora_dropout:
        notes.append(
            "LoRA dropout off: ORPOConfig.disable_dropout (default True) sets p = 0"
            if spec.orpo_settings.disable_dropout
            else "LoRA dropout kept: ORPOConfig.disable_dropout is False"
        )
    return OrpoStep(st, rows, tuple(notes))
