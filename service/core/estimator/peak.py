"""The estimate: the allocated peak over the phases and the levels above it."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from service.core.arch import ModelArch
from service.core.device import device_row
from service.core.errors import InvalidConfigError, InvalidSpecError
from service.core.estimator.answer import estimate_from, job_levels
from service.core.estimator.compiled import compile_notes
from service.core.estimator.encoder import encoder_estimate, encoder_peak_levels
from service.core.estimator.grpo import GrpoStep, grpo_policy_spec, grpo_step
from service.core.estimator.kto import KtoStep, kto_policy_spec, kto_step, reference_copy
from service.core.estimator.looped_experts import looped_arch
from service.core.estimator.orpo import logits_bytes, orpo_policy_spec, orpo_step
from service.core.estimator.packing import packed_job
from service.core.estimator.pieces import CompiledJob, DecoderStep, Piece, Pieces
from service.core.estimator.plan import _Plan
from service.core.estimator.preference import DpoStep, dpo_step, policy_spec
from service.core.estimator.reward import reward_arch, reward_spec, reward_step
from service.core.estimator.seq2seq import seq2seq_estimate, seq2seq_peak_levels
from service.core.estimator.step import PHASES, _Step, _step
from service.core.estimator.step_context import _check_modelled, check_liger
from service.core.estimator.symbolic import Compiled
from service.core.estimator.tuners import sequence_spec
from service.core.estimator.uncertainty import _uncertainty
from service.core.estimator.vision import model_step
from service.core.overhead import AboveAllocated, LevelMath
from service.core.reserved import reserved_gap, reserved_gap_bytes, resolve_kernel
from service.core.result import Estimate, ParamCounts, PeakLevels, PhasePeak
from service.core.schedule import Kernel
from service.core.spec import (
    METHOD_OPTIONS,
    Framework,
    LossImpl,
    Method,
    Objective,
    TrainingSpec,
)
from service.core.stack import stack_note
from service.core.units import FP32_BYTES

ESTIMATOR_VERSION = "0.2.0"
# The methods the encoder's step (`encoder_estimate`) models.
ENCODER_METHODS = (Method.FULL, Method.LORA, Method.QLORA)


def estimate(
    arch: ModelArch, spec: TrainingSpec, *, compute_capability: str | None = None
) -> Estimate:
    """The peak memory of one GPU running `spec` on `arch`; `compute_capability` ("9.0") picks
    the device level's row when the GPU is known."""
    _check_modelled(arch, spec)  # before the objectives' own steps, which run SFT policies
    check_packed_model(arch, spec)
    if spec.objective in (Objective.DPO, Objective.KTO, Objective.ORPO, Objective.GRPO):
        return _dpo_estimate(arch, spec, compute_capability)
    if spec.objective is Objective.REWARD:
        return _reward_estimate(arch, spec, compute_capability)
    check_liger(arch, spec)
    if _is_encoder(arch, spec):
        if arch.encoder_decoder:
            return seq2seq_estimate(
                arch, spec, compute_capability=compute_capability, version=ESTIMATOR_VERSION
            )
        return encoder_estimate(
            arch, spec, compute_capability=compute_capability, version=ESTIMATOR_VERSION
        )
    job = _PIECES.job(arch, spec, compute_capability)
    found = _piece_estimate(job, spec, spec.batch_size, spec.seq_len, compute_capability)
    if found is not None:
        return found
    st = _PIECES.step(arch, spec, compute_capability)
    phases = tuple(
        PhasePeak(step, phase, sum(parts), parts)
        for (step, phase), parts in zip(PHASES, st.parts, strict=True)
    )
    peak = max(phases, key=lambda ph: (ph.allocated_bytes, -ph.step))
    over = _above(
        st.arch, st.spec, st.plan, peak.allocated_bytes, st.paged_state, compute_capability
    )
    return _estimate(
        phases,
        peak,
        over,
        st.spec,
        plan=st.plan,
        assumptions=st.assumptions,
        warnings=st.warnings,
        host=(st.host, st.host_pinned),
    )


def peak_levels(
    arch: ModelArch,
    spec: TrainingSpec,
    *,
    compute_capability: str | None = None,
) -> PeakLevels:
    """The peak's four levels alone, as `estimate` computes them, without the breakdown: what a
    fit-check evaluates dozens of times per request."""
    _check_modelled(arch, spec)
    check_packed_model(arch, spec)
    if spec.objective in (
        Objective.DPO,
        Objective.KTO,
        Objective.ORPO,
        Objective.GRPO,
        Objective.REWARD,
    ):
        est = estimate(arch, spec, compute_capability=compute_capability)
        return PeakLevels(
            est.allocated_bytes, est.reserved_bytes, est.device_bytes, est.device_bytes_upper
        )
    check_liger(arch, spec)
    if _is_encoder(arch, spec):
        if arch.encoder_decoder:
            return seq2seq_peak_levels(arch, spec, compute_capability=compute_capability)
        return encoder_peak_levels(arch, spec, compute_capability=compute_capability)
    st = _PIECES.step(arch, spec, compute_capability, notes=False)
    over = _above(st.arch, st.spec, st.plan, st.allocated, st.paged_state, compute_capability)
    return PeakLevels(st.allocated, over.reserved, over.device, over.device_upper)


def shape_levels(
    arch: ModelArch, spec: TrainingSpec, *, compute_capability: str | None = None
) -> Callable[[int, int], PeakLevels]:
    """`peak_levels` of `spec`'s job at any micro-batch and sequence length:
    `shape_levels(arch, spec)(b, s) == peak_levels(arch, spec.with_shape(b, s))`, refusals
    included. A decoder's SFT job reads its compiled pieces straight from (b, s), with what the
    levels above allocated take from the job worked out once per piece; any other shape, job or
    objective runs `peak_levels` itself. What a fit-check's curves evaluate."""

    def ran(b: int, s: int) -> PeakLevels:
        shaped = spec if b == spec.batch_size and s == spec.seq_len else spec.with_shape(b, s)
        return peak_levels(arch, shaped, compute_capability=compute_capability)

    if spec.objective is not Objective.SFT or arch.encoder or arch.encoder_decoder:
        return ran
    job = _PIECES.job(arch, spec, compute_capability)
    # each piece's compiled peak and its levels above, in the job's order (its pieces are
    # appended to, never changed): taken up as the job records them
    read: list[tuple[Compiled, _PieceAbove]] = []

    def at(b: int, s: int) -> PeakLevels:
        # A job holds pieces only once its step ran, after the checks `peak_levels` makes
        # first, none of which reads the shape.
        if b >= 1 and s >= 1:
            if len(read) < len(job.pieces):
                read.extend(
                    (piece.peak, _above_of(job, piece, spec, compute_capability))
                    for piece in job.pieces[len(read) :]
                )
            for peak, above in read:
                found = peak(b, s)
                if found is not None:
                    return above.levels(found[0], found[1], found[2])
        return ran(b, s)

    return at


def _piece_estimate(
    job: CompiledJob, spec: TrainingSpec, b: int, s: int, compute_capability: str | None
) -> Estimate | None:
    """`estimate` of `job` at (b, s) from the piece that holds there, or None where none does
    or its notes name the shape (the step then runs itself)."""
    for piece in job.pieces:  # (appended to, never changed)
        found = piece.step(b, s)
        if found is not None:
            if piece.notes is None:
                return None
            return _above_of(job, piece, spec, compute_capability).estimate(piece, found)
    return None


def _above_of(
    job: CompiledJob, piece: Piece, spec: TrainingSpec, compute_capability: str | None
) -> _PieceAbove:
    """What the levels above allocated read of `piece` besides the shape: worked out once per
    piece and kept with the job (the same for every spec of the job)."""
    above: _PieceAbove | None = job.derived.get(id(piece))  # the job holds its pieces for good
    if above is None:
        above = job.derived[id(piece)] = _PieceAbove(
            piece.arch, spec, piece.plan, piece.paged_state, compute_capability
        )
    return above


class _PieceAbove:
    """What `_above` reads of a piece's job besides the shape, worked out once: its levels at
    any shape the piece holds."""

    __slots__ = ("fused", "math", "notes", "params", "plan", "window")

    def __init__(
        self,
        arch: ModelArch,
        spec: TrainingSpec,
        plan: _Plan,
        paged_state: int,
        compute_capability: str | None,
    ) -> None:
        self.plan = plan.reserved
        # The kernel reads the sequence only through whether the model's window masks it
        # (`ModelArch.windowed`): resolved once on each side of the window.
        model = self.plan.arch
        window = None if model.explicit_mask else model.sliding_window
        self.fused = tuple(
            resolve_kernel(self.plan, s)[0] is Kernel.FLASH and plan.flow.attn != FP32_BYTES
            for s in (1, window or 1)
        )
        # the sequence from which the kernel is the window's (none: never)
        self.window = math.inf if window is None else window
        eager = spec.stack.eager_module_loading
        uncertainty = _uncertainty(arch, spec)
        rows = tuple(
            device_row(compute_capability, fused_attention=fused, eager_loading=eager)
            for fused in (False, True)
        )
        # What `_estimate` adds of the job's own (none of it reads the shape).
        p = plan.params
        self.params = ParamCounts(total=p.total_count, trainable=p.trainable_count)
        self.notes = (*compile_notes(spec), stack_note(spec.stack))
        self.math = tuple(
            LevelMath(
                paged_state=paged_state, gpus=spec.parallel.gpus, row=row, uncertainty=uncertainty
            )
            for row in rows
        )

    def levels(self, allocated: int, b: int, s: int) -> PeakLevels:
        """`_above`'s levels over `allocated` at batch `b`, sequence `s` as the model ran."""
        reserved, device, upper = self.math[self.fused[s >= self.window]].numbers(
            allocated, allocated + reserved_gap_bytes(self.plan, b, s, allocated=allocated)
        )
        return PeakLevels(allocated, reserved, device, upper)

    def estimate(self, piece: Piece, found: tuple[int, ...]) -> Estimate:
        """`estimate`'s answer from what `piece`'s step found at a shape (its notes kept):
        `_from_piece`, the phases' peak, `_above` and `_estimate`, the job's parts made once."""
        allocated, b, s = found[:3]
        width = (len(found) - 5) // piece.phases
        made: list[PhasePeak] = []
        start = 5
        # The peak as `estimate` finds it: the most allocated, the earlier step of equals
        # first, the first phase of equals (`max` keeps the first of equal keys).
        peak: PhasePeak | None = None
        for step, phase in PHASES:  # the piece's phases, `_from_piece`'s parts in a row
            parts = found[start : start + width]
            start += width
            made.append(ph := _tuple_new(PhasePeak, (step, phase, sum(parts), parts)))
            if peak is None or (ph[2], -step) > (peak[2], -peak[0]):
                peak = ph
        if peak is None or start != len(found):
            raise ValueError(f"a piece of {piece.phases} phases, not {len(PHASES)}")
        phases = tuple(made)
        allocated = peak.allocated_bytes
        gap, gap_note = reserved_gap(self.plan, b, s, allocated=allocated)
        fused = self.fused[s >= self.window]
        over = self.math[fused].above(allocated, allocated + gap, gap_note)
        assumptions, warnings = piece.notes or ((), ())
        return estimate_from(
            phases,
            peak,
            over,
            params=self.params,
            assumptions=(*assumptions, *over.assumptions, *self.notes),
            warnings=warnings,
            version=ESTIMATOR_VERSION,
            host=(found[3], found[4]),
        )


# A named tuple made straight from its values: its own `__new__` is Python code that makes
# the same tuple, and a batch's estimate makes seven per job.
_tuple_new = tuple.__new__


def shape_estimates(
    arch: ModelArch, spec: TrainingSpec, *, compute_capability: str | None = None
) -> Callable[[int, int], Estimate]:
    """`estimate` of `spec`'s job at any micro-batch and sequence length:
    `shape_estimates(arch, spec)(b, s) == estimate(arch, spec.with_shape(b, s))`, refusals
    included. A decoder's SFT job reads its step from the compiled piece that holds (b, s),
    with what the levels above allocated and the notes take from the job worked out once per
    piece; any other shape, job or objective runs `estimate` itself. What a batch of one job at
    many shapes evaluates."""

    def ran(b: int, s: int) -> Estimate:
        shaped = spec if b == spec.batch_size and s == spec.seq_len else spec.with_shape(b, s)
        return estimate(arch, shaped, compute_capability=compute_capability)

    if spec.objective is not Objective.SFT or arch.encoder or arch.encoder_decoder:
        return ran
    job = _PIECES.job(arch, spec, compute_capability)

    def at(b: int, s: int) -> Estimate:
        # A job holds pieces only once its step ran, after the checks `estimate` makes first,
        # none of which reads the shape.
        found = _piece_estimate(job, spec, b, s, compute_capability) if b >= 1 and s >= 1 else None
        return ran(b, s) if found is None else found

    return at


def decoder_step(
    arch: ModelArch, spec: TrainingSpec, compute_capability: str | None
) -> DecoderStep:
    """A decoder's SFT step at `spec`, the framework's notes after the step's."""
    spec = sequence_spec(spec)
    arch, untied = framework_arch(arch, spec)
    arch = looped_arch(arch, spec)
    arch, spec, packed = packed_job(arch, spec)
    st = model_step(arch, spec, compute_capability)
    parts = tuple(st.parts())
    return DecoderStep(
        arch=arch,
        spec=spec,
        plan=st.plan,
        paged_state=st.paged_state,
        allocated=max(map(sum, parts)),
        parts=parts,
        host=st.host,
        host_pinned=st.host_pinned,
        assumptions=(*st.assumptions, *untied, *packed),
        warnings=tuple(st.warnings),
    )


# The decoder's step compiled per job: what a fit-check's dozens of shapes of a job evaluate.
_PIECES = Pieces(decoder_step)


def forget_compiled_steps() -> None:
    """Forget every job's compiled step (benchmarks time a job's first estimate with it)."""
    _PIECES.clear()


def check_packed_model(arch: ModelArch, spec: TrainingSpec) -> None:
    """A GPTQ, AWQ, HQQ or torchao base (quant_formats.py) is modelled on dense decoder-only
    text models: refuse the others, naming the field."""
    quant = spec.quantization
    if quant is None or not quant.type.packed:
        return
    kind = quant.type.value
    if arch.encoder or arch.encoder_decoder:
        raise InvalidSpecError(
            "quantization.type", f"a {kind} base is modelled on decoder-only models"
        )
    if arch.is_moe or arch.is_mla:
        raise InvalidSpecError(
            "quantization.type", f"a {kind} base of a mixture-of-experts model is not modelled"
        )
    if arch.vision is not None or arch.mllama is not None:
        raise InvalidSpecError(
            "quantization.type", f"a {kind} base of a vision-language model is not modelled"
        )
    if arch.model_type == "falcon":
        raise InvalidSpecError(
            "quantization.type", f"a {kind} base of Falcon (FalconLinear layers) is not modelled"
        )


def framework_arch(arch: ModelArch, spec: TrainingSpec) -> tuple[ModelArch, tuple[str, ...]]:
    """The model as the framework builds it, with a note where that differs from `arch`:
    LitGPT's GPT holds its own embedding and lm_head matrices (lit_gpt/model.py and
    litgpt/model.py `GPT.__init__`: `transformer.wte` and `lm_head`, never tied), so a model
    whose config ties them is two tables under LitGPT."""
    if spec.framework is Framework.LITGPT and arch.tie_word_embeddings:
        note = (
            "LitGPT builds separate embedding and lm_head matrices: the config's tied table "
            "is counted twice"
        )
        return replace(arch, tie_word_embeddings=False), (note,)
    return arch, ()


def _dpo_estimate(arch: ModelArch, spec: TrainingSpec, compute_capability: str | None) -> Estimate:
    """DPO's step (estimator/preference.py): the policy's SFT step on the doubled batch, the
    fused head, the reference forward as a phase of its own; KTO's (estimator/kto.py) is the
    same step on the batch's unpaired rows."""
    name = spec.objective.value
    if arch.encoder or arch.encoder_decoder:
        raise InvalidSpecError(
            "objective",
            f"objective {name!r} is modelled on decoder-only LMs, not {arch.model_type!r}",
        )
    if arch.is_moe:
        raise InvalidSpecError(
            "objective",
            f"objective {name!r} on a mixture-of-experts model is not modelled (its router "
            "logits and load-balancing loss in the policy's forward)",
        )
    if spec.objective is Objective.KTO:
        return _kto_estimate(arch, spec, compute_capability)
    if spec.objective is Objective.GRPO:
        return _grpo_estimate(arch, spec, compute_capability)
    if spec.objective is Objective.ORPO:
        return _orpo_estimate(arch, spec, compute_capability)
    dpo = dpo_step(arch, spec, compute_capability)
    settings = spec.dpo_settings
    return _fused_head_answer(
        arch,
        spec,
        dpo,
        policy_spec(spec),
        compute_capability,
        dpo_completion=settings.max_completion_length or 0,
        dpo_reference=not settings.precompute_ref_log_probs,
        dpo_reference_copy=spec.method is Method.FULL and not settings.precompute_ref_log_probs,
    )


def _fused_head_answer(
    arch: ModelArch,
    spec: TrainingSpec,
    objective: DpoStep | KtoStep | GrpoStep,
    policy: TrainingSpec,
    compute_capability: str | None,
    **replayed: Any,  # ReservedPlan fields
) -> Estimate:
    """The answer of a step on TRL's fused head (DPO, KTO, GRPO): its phases' peak, and the
    levels above allocated from the policy's replay with the objective's `replayed` plan
    fields."""
    st = objective.step
    phases = tuple(
        PhasePeak(step, phase, sum(parts), parts) for step, phase, parts in objective.phases
    )
    peak = max(phases, key=lambda ph: (ph.allocated_bytes, -ph.step))
    reserved = replace(st.plan.reserved, **replayed)
    over = _above(
        arch,
        policy,
        replace(st.plan, reserved=reserved),
        peak.allocated_bytes,
        st.paged_state,
        compute_capability,
    )
    return _answer(st, phases, peak, over, spec, before=objective.assumptions)


def _kto_estimate(arch: ModelArch, spec: TrainingSpec, compute_capability: str | None) -> Estimate:
    """KTO's step (estimator/kto.py): DPO's fused-head step on the batch's unpaired rows."""
    return _fused_head_answer(
        arch,
        spec,
        kto_step(arch, spec, compute_capability),
        kto_policy_spec(spec),
        compute_capability,
        dpo_completion=0,
        dpo_reference=not spec.kto_settings.precompute_ref_log_probs,
        dpo_reference_copy=reference_copy(spec),
        kto_kl=spec.kto_settings.calculate_kl,
        dpo_top1=False,
    )


def _grpo_estimate(arch: ModelArch, spec: TrainingSpec, compute_capability: str | None) -> Estimate:
    """GRPO's step (estimator/grpo.py): the generation, then DPO's fused-head step on the
    micro-batch's completions."""
    return _fused_head_answer(
        arch,
        spec,
        grpo_step(arch, spec, compute_capability),
        grpo_policy_spec(spec),
        compute_capability,
        dpo_completion=spec.grpo_settings.max_completion_length,
        dpo_reference=False,
        dpo_reference_copy=False,
        dpo_top1=False,
        dpo_mean_logits=False,
        generation=True,
    )


def _orpo_estimate(arch: ModelArch, spec: TrainingSpec, compute_capability: str | None) -> Estimate:
    """ORPO's step (estimator/orpo.py): the policy's SFT step on the doubled batch with the
    whole logits, no reference; the levels above allocated replay the SFT step whose loss
    keeps its logits as ORPO's does (`LossImpl.PLAIN` on the doubled batch)."""
    orpo = orpo_step(arch, spec, compute_capability)
    st = orpo.step
    phases = tuple(PhasePeak(step, phase, sum(parts), parts) for step, phase, parts in orpo.phases)
    peak = max(phases, key=lambda ph: (ph.allocated_bytes, -ph.step))
    replay = replace(orpo_policy_spec(spec), loss=LossImpl.PLAIN)
    plan = _step(arch, replay, compute_capability).plan
    plan = replace(plan, reserved=replace(plan.reserved, orpo_logits=logits_bytes(spec)))
    over = _above(arch, replay, plan, peak.allocated_bytes, st.paged_state, compute_capability)
    return _answer(st, phases, peak, over, spec, before=orpo.assumptions)


def _reward_estimate(
    arch: ModelArch, spec: TrainingSpec, compute_capability: str | None
) -> Estimate:
    """The reward model's step (estimator/reward.py): the SFT step on the doubled batch with
    the score head in place of the LM head."""
    reward = reward_step(arch, spec, compute_capability)
    st = reward.step
    model, run = reward_arch(arch), reward_spec(spec)
    phases = tuple(
        PhasePeak(step, phase, sum(parts), parts)
        for (step, phase), parts in zip(PHASES, st.parts(), strict=True)
    )
    peak = max(phases, key=lambda ph: (ph.allocated_bytes, -ph.step))
    over = _above(model, run, st.plan, peak.allocated_bytes, st.paged_state, compute_capability)
    return _answer(st, phases, peak, over, spec, before=reward.assumptions)


def _answer(
    st: _Step,
    phases: tuple[PhasePeak, ...],
    peak: PhasePeak,
    over: AboveAllocated,
    spec: TrainingSpec,
    *,
    before: tuple[str, ...] = (),
    after: tuple[str, ...] = (),
) -> Estimate:
    """The estimate of a decoder's step `st` peaking at `peak`, with the levels `over` it; the
    objective's notes come `before` the step's, the framework's `after` them."""
    return _estimate(
        phases,
        peak,
        over,
        spec,
        plan=st.plan,
        assumptions=(*before, *st.assumptions, *after),
        warnings=tuple(st.warnings),
        host=(st.host, st.host_pinned),
    )


def _estimate(
    phases: tuple[PhasePeak, ...],
    peak: PhasePeak,
    over: AboveAllocated,
    spec: TrainingSpec,
    *,
    plan: _Plan,
    assumptions: tuple[str, ...],
    warnings: tuple[str, ...],
    host: tuple[int, int],
) -> Estimate:
    """The estimate peaking at `peak`, the step's `assumptions` before those of the levels
    above, of torch.compile and of the stack; `host` is the host memory per rank and its
    pinned part."""
    p = plan.params
    return estimate_from(
        phases,
        peak,
        over,
        params=ParamCounts(total=p.total_count, trainable=p.trainable_count),
        assumptions=(
            *assumptions,
            *over.assumptions,
            *compile_notes(spec),
            stack_note(spec.stack),
        ),
        warnings=warnings,
        version=ESTIMATOR_VERSION,
        host=host,
    )


def _is_encoder(arch: ModelArch, spec: TrainingSpec) -> bool:
    """Whether `arch` is an encoder (its own step); `num_labels` is refused on a decoder, and
    `target_length` on any model but an encoder-decoder, and PEFT's methods besides LoRA on
    an encoder or an encoder-decoder (`tuners.TUNER_MODEL_TYPES`)."""
    if (arch.encoder or arch.encoder_decoder) and spec.packing:
        packed_job(arch, spec)  # refused: packing is modelled on decoder-only LMs
    if (arch.encoder or arch.encoder_decoder) and spec.method in METHOD_OPTIONS:
        raise InvalidConfigError(
            "model_type",
            f"method {spec.method.value!r} is modelled on decoders, not {arch.model_type!r}",
        )
    if arch.encoder_decoder:
        if spec.method not in ENCODER_METHODS:
            raise InvalidSpecError(
                "method",
                f"{spec.method.value!r} is not modelled on encoder-decoders; they take "
                f"{', '.join(m.value for m in ENCODER_METHODS)}",
            )
        return True  # its own step (estimator/seq2seq.py)
    if spec.target_length is not None:
        raise InvalidSpecError(
            "target_length",
            f"only encoder-decoder models (T5) have a target apart from the input; "
            f"{arch.model_type!r} reads one sequence of seq_len tokens",
        )
    if arch.encoder:
        if spec.method not in ENCODER_METHODS:
            raise InvalidSpecError(
                "method",
                f"{spec.method.value!r} is modelled on decoder-only LMs; an encoder takes "
                f"{', '.join(m.value for m in ENCODER_METHODS)}",
            )
        return True
    if spec.num_labels is not None:
        raise InvalidSpecError(
            "num_labels",
            f"only encoder models (BERT) have a classification head; {arch.model_type!r} is a "
            "decoder-only LM",
        )
    return False


def _above(
    arch: ModelArch,
    spec: TrainingSpec,
    plan: _Plan,
    allocated: int,
    paged_state: int,
    compute_capability: str | None,
) -> AboveAllocated:
    rplan = plan.reserved
    gap, gap_note = reserved_gap(rplan, spec.batch_size, spec.seq_len, allocated=allocated)
    kernel, _windowed = resolve_kernel(rplan, spec.seq_len)
    fused = kernel is Kernel.FLASH and plan.flow.attn != FP32_BYTES
    return job_levels(
        arch,
        spec,
        allocated=allocated,
        reserved=allocated + gap,
        paged_state=paged_state,
        fused_attention=fused,
        compute_capability=compute_capability,
        reserved_note=gap_note,
    )
