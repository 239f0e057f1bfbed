"""DPO's step (TRL 1.16.0 DPOTrainer): the SFT step on the doubled [chosen; rejected] batch, its
logits replaced by TRL's fused chunked log-prob head, and the reference model's forward.

The policy's layers are the SFT step's on 2 x batch_size rows (`_step`), with a loss that
materialises no logits (`LossImpl.FUSED`); the fused head's own tensors are added here, as TRL's
CUDA path allocates them (trl/kernels/chunked_logprob.py ChunkedLogProbFunction, Triton folds
writing in place, fp32 accumulation by addmm(out_dtype=float32)). The reference forward is a
phase of its own: every policy activation alive, one layer's no-grad transients, then the
head's tiles. Full fine-tuning holds a frozen reference copy unless the log-probs are
precomputed.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from service.core.arch import LinearKind, ModelArch
from service.core.estimator.ledger import _blk
from service.core.estimator.step import _Step, _step
from service.core.estimator.step_context import _Moment
from service.core.libs.trl import DPO_RUNNING_STATS, DPO_TILE_TOKENS, DPO_TILE_VOCAB
from service.core.result import Phase
from service.core.spec import AttnImpl, LossImpl, Method, Objective, TrainingSpec
from service.core.units import AUTOCAST_BYTES, BOOL_BYTES, DTYPE_BYTES, FP32_BYTES, INT64_BYTES

# trl/kernels/chunked_logprob.py: tokens per projection tile (TOKEN_CHUNK_SIZE) and the
# vocabulary width of a tile (trl/trainer/utils.py _CHUNKED_LOGPROB_CHUNK_SIZE); the fp32
# per-token running statistics of ChunkedLogProbFunction.forward (running_max, sum_exp,
# x_sum_exp, sq_sum_exp, z_sum, max_before_target, target_logit), allocated whatever outputs
# are asked for. The schedule replays the same tensors (service/core/schedule/step.py).
TILE_TOKENS = DPO_TILE_TOKENS
TILE_VOCAB = DPO_TILE_VOCAB
RUNNING_STATS = DPO_RUNNING_STATS
# The per-token fields the policy's head returns in DPOTrainer (log_probs, entropy,
# mean_logits in fp32; is_top1 a bool), each scattered back to (rows, seq_len - 1).
POLICY_FP32_OUTPUTS = 3
# The live bytes of one decoder layer's no-grad forward at its MLP product, in tokens x
# intermediate_size elements of the compute dtype: SiLU(gate), up and their product
# (transformers LlamaMLP.forward; reference traces *__dpo__*).
MLP_TRANSIENTS = 3
# ...and hidden-sized tensors in the residual dtype at that moment (same traces).
LAYER_HIDDEN_TRANSIENTS = 4
# SDPA's math kernel under no_grad (torch/nn/functional.py scaled_dot_product_attention's
# math path): the scores and the softmax output, each b x heads x s x s in the attention's
# dtype, and q-sized tensors beside them: q after RoPE, k and v expanded to every head, the
# scaled q and its contiguous copy (reference trace llama-3_2-1b__qlora__dpo__*).
MATH_SCORE_COPIES = 2
MATH_Q_SIZED = 5


class DpoShape(NamedTuple):
    """The sizes DPO's step adds to the SFT machinery's."""

    rows: int  # 2 x batch_size: [chosen; rejected]
    scored: int  # positions the fused head scores (labels not -100 after the shift)
    head_bytes: int  # bytes per element of the LM head's weight and of its input
    # the tiles' dtype: the autocast dtype under mixed precision, else the input's
    # (ChunkedLogProbFunction.forward `compute_dtype`)
    compute_bytes: int


def head_dtypes(spec: TrainingSpec) -> tuple[int, int]:
    """The fused head's bytes per element: of its weight and input (fp32 after kbit
    preparation, which casts the LM head), and of its tiles (half precision under autocast)."""
    prepared = spec.method is Method.QLORA and (
        spec.quantization is None or spec.quantization.prepare_kbit
    )
    head = FP32_BYTES if prepared else DTYPE_BYTES[spec.dtype]
    return head, AUTOCAST_BYTES if spec.autocast else head


def dpo_shape(arch: ModelArch, spec: TrainingSpec) -> DpoShape:
    """The [chosen; rejected] rows, the positions scored, and the head's dtypes."""
    completion = spec.dpo_settings.max_completion_length or spec.seq_len
    rows = 2 * spec.batch_size
    return DpoShape(rows, rows * min(completion, spec.seq_len - 1), *head_dtypes(spec))


def policy_spec(spec: TrainingSpec) -> TrainingSpec:
    """The SFT step whose layers DPO's policy runs: the doubled batch, no logits, and no
    dropout (DPOConfig.disable_dropout, True by default, sets every nn.Dropout's p to 0,
    LoRA's included: trl/trainer/utils.py disable_dropout_in_model)."""
    return replace(
        without_dropout(spec),
        batch_size=2 * spec.batch_size,
        objective=Objective.SFT,
        dpo=None,
        loss=LossImpl.FUSED,
    )


def without_dropout(spec: TrainingSpec) -> TrainingSpec:
    """`spec` with LoRA's dropout at 0, as TRL's trainers' disable_dropout sets it
    (trl/trainer/utils.py disable_dropout_in_model)."""
    lora = spec.lora
    if lora is None or not lora.lora_dropout:
        return spec
    return replace(spec, lora=replace(lora, lora_dropout=0.0))


def reference_notes(spec: TrainingSpec, precompute: bool, config: str) -> list[str]:
    """What a preference trainer (`config`: its TRL config class) does with LoRA's dropout
    and where its reference model's log-probs come from."""
    notes: list[str] = []
    if spec.lora is not None and spec.lora.lora_dropout:
        notes.append(f"LoRA dropout off: {config}.disable_dropout (default True) sets p = 0")
    if precompute:
        notes.append("reference log-probs precomputed: no reference forward, no reference copy")
    elif spec.method is Method.FULL:
        notes.append("the reference model: a frozen copy of the policy's weights, held all run")
    else:
        notes.append("the reference model: the policy with its adapters disabled (no copy)")
    return notes


def _head_saved(
    arch: ModelArch, d: DpoShape, s: int, *, top1: bool = True, fp32_outputs: int = 0
) -> int:
    """What the policy's fused head keeps from its forward into backward: the scored hidden
    states (compact), their targets, log Z and entropy (ctx.save_for_backward), the label mask
    and the per-token outputs scattered back to the padded shape (is_top1 a bool where
    `top1`; `fp32_outputs` of them in fp32, POLICY_FP32_OUTPUTS where 0)."""
    n, h = d.scored, arch.hidden_size
    padded = d.rows * (s - 1)
    return (
        _blk(n * h * d.head_bytes)
        + _blk(n * INT64_BYTES)
        + 2 * _blk(n * FP32_BYTES)
        + _blk(padded * BOOL_BYTES)
        + (fp32_outputs or POLICY_FP32_OUTPUTS) * _blk(padded * FP32_BYTES)
        + (_blk(padded * BOOL_BYTES) if top1 else 0)
    )


def _tile(arch: ModelArch, d: DpoShape) -> int:
    """The fused head's tile buffer, in the compute dtype."""
    return _blk(min(d.scored, TILE_TOKENS) * min(TILE_VOCAB, arch.vocab_size) * d.compute_bytes)


def _tile_casts(arch: ModelArch, d: DpoShape, weight_tiles: int) -> int:
    """The casts to the compute dtype a tile's product reads when the head's input and weight
    are wider (autocast over an fp32 head): the token chunk of the hidden states, and
    `weight_tiles` copies of a vocabulary tile of the weight (chunked_logprob.py
    `hidden[...].to(compute_dtype)`, `weight[start:end].to(compute_dtype)`)."""
    if d.compute_bytes == d.head_bytes:
        return 0
    h = arch.hidden_size
    chunk = _blk(min(d.scored, TILE_TOKENS) * h * d.compute_bytes)
    return chunk + weight_tiles * _blk(min(TILE_VOCAB, arch.vocab_size) * h * d.compute_bytes)


def _head_tile(arch: ModelArch, d: DpoShape) -> int:
    """One forward's tile buffer and running statistics (ChunkedLogProbFunction.forward), with
    the casts its product reads (one weight tile's, freed after its product)."""
    return _tile(arch, d) + RUNNING_STATS * _blk(d.scored * FP32_BYTES) + _tile_casts(arch, d, 1)


def _head_backward(arch: ModelArch, d: DpoShape, head_trains: bool) -> int:
    """ChunkedLogProbFunction.backward at its end: the fp32 gradient accumulators (hidden, and
    the head's weight when it trains), the tile buffer, and the accumulators cast back to the
    inputs' dtypes (no copy when they are fp32 already)."""
    n, h, v = d.scored, arch.hidden_size, arch.vocab_size
    cast = d.head_bytes != FP32_BYTES
    # in the loop each vocabulary tile's weight cast is made before the previous one is let go
    # (backward's `w_chunk = weight[start:end].to(compute_dtype)`)
    in_loop = _tile_casts(arch, d, 2 if v > TILE_VOCAB else 1)
    at_end = _blk(n * h * d.head_bytes) if cast else 0
    grad = _blk(n * h * FP32_BYTES) + _tile(arch, d) + max(in_loop, at_end)
    if head_trains:
        grad += _blk(v * h * FP32_BYTES) + (_head_weight_grad(arch, d) if cast else 0)
    return grad


def _head_weight_grad(arch: ModelArch, d: DpoShape) -> int:
    """The head weight's gradient in its dtype, as the fused head's backward returns it."""
    return _blk(arch.vocab_size * arch.hidden_size * d.head_bytes)


def _reference_layer(arch: ModelArch, spec: TrainingSpec, d: DpoShape, st: _Step) -> int:
    """One decoder layer's no-grad forward at its MLP product, beyond what the policy holds:
    SiLU(gate), up and their product (with a fused gate_up projection, Phi-3, its whole
    output too), beside the layer's input, the residual after attention, the normed input
    and the embedding-sized output the model keeps between layers (reference traces
    llama-3_2-1b__lora__dpo__*, phi-3-mini-4k-instruct__lora__dpo__*)."""
    tokens = d.rows * spec.seq_len
    f = st.plan.flow
    mlp_in = sum(1 for lin in arch.linears if lin.kind is LinearKind.MLP_IN)
    intermediates = MLP_TRANSIENTS + (1 if mlp_in == 1 else 0)
    return intermediates * _blk(tokens * arch.intermediate_size * f.norm_out) + (
        LAYER_HIDDEN_TRANSIENTS * _blk(tokens * arch.hidden_size * f.residual)
    )


def _reference_attention(arch: ModelArch, spec: TrainingSpec, d: DpoShape, st: _Step) -> int:
    """One layer's no-grad attention through SDPA's math kernel (fp32 q/k/v with grouped
    heads after kbit preparation, or sdpa_kernel 'math'): its scores and probabilities with
    their boolean check, the causal mask, the layer's input and normed input, and the q-sized
    and k/v-sized tensors around the kernel (reference trace
    llama-3_2-1b__qlora__dpo__*: the peak at the probabilities' all-masked-row check)."""
    b, s = d.rows, spec.seq_len
    tokens = b * s
    f = st.plan.flow
    scores = b * arch.num_attention_heads * s * s
    return (
        MATH_SCORE_COPIES * _blk(scores * f.attn)
        + _blk(scores * BOOL_BYTES)
        + _blk(s * s * f.attn)
        + 2 * _blk(tokens * arch.hidden_size * f.residual)
        + MATH_Q_SIZED * _blk(tokens * arch.q_dim * f.attn)
        + 2 * _blk(tokens * arch.kv_dim * f.attn)
    )


def _policy_head(arch: ModelArch, d: DpoShape, s: int) -> int:
    """The policy's fused head at its tile (ChunkedLogProbFunction.forward): the label mask,
    the scored hidden states and targets gathered, the tile and the running statistics
    (reference trace llama-3_2-1b__qlora__kto__precomputed-ref__*: the peak at the tile)."""
    padded = d.rows * (s - 1)
    return (
        _head_tile(arch, d)
        + _blk(d.scored * arch.hidden_size * d.head_bytes)
        + _blk(d.scored * INT64_BYTES)
        + _blk(padded * BOOL_BYTES)
    )


def _reference_head(arch: ModelArch, d: DpoShape) -> int:
    """The reference's fused head: the scored hidden states gathered again, the tile buffer
    and the running statistics."""
    return _head_tile(arch, d) + _blk(d.scored * arch.hidden_size * d.head_bytes)


def fused_head_phases(
    arch: ModelArch,
    spec: TrainingSpec,
    d: DpoShape,
    st: _Step,
    *,
    reference_forward: bool,
    reference: int,
    top1: bool = True,
    fp32_outputs: int = 0,
) -> tuple[tuple[int, Phase, tuple[int, ...]], ...]:
    """The phases of a step whose policy `st` (the SFT step on `d.rows` rows) scores tokens
    with TRL's fused head, with a no-grad reference forward after the policy's when
    `reference_forward`, and `reference` bytes of frozen reference copy held all run; `top1`:
    the policy's head also returns is_top1 (DPOTrainer's, not KTOTrainer's); `fp32_outputs`:
    its fp32 per-token outputs where they are not POLICY_FP32_OUTPUTS (GRPOTrainer's two)."""
    saved = _head_saved(arch, d, spec.seq_len, top1=top1, fp32_outputs=fp32_outputs)
    head_trains = st.plan.traits.head_trains
    # the end of the policy's forward: what its head keeps (its tiles are freed by then)
    forward_end = st.forward_end._replace(logits_loss=saved, reference_model=reference)
    # ...or inside its head, the final norm's output still alive where the head is frozen
    # (it is freed after the head; a trained head keeps it)
    tokens = d.rows * spec.seq_len
    final_norm = 0 if head_trains else _blk(tokens * arch.hidden_size * st.plan.flow.residual)
    in_policy_head = st.forward_end._replace(
        activations=st.forward_end.activations + final_norm,
        logits_loss=_policy_head(arch, d, spec.seq_len),
        reference_model=reference,
    )
    forward_end = max(forward_end, in_policy_head, key=sum)
    backward_start = st.backward_start._replace(
        logits_loss=saved + _head_backward(arch, d, head_trains), reference_model=reference
    )
    # the reference forward's largest moment: inside a layer, or in its head
    in_layer = st.forward_end._replace(
        activations=st.forward_end.activations + _reference_layer(arch, spec, d, st),
        logits_loss=saved,
        reference_model=reference,
    )
    in_head = st.forward_end._replace(
        logits_loss=saved + _reference_head(arch, d), reference_model=reference
    )
    candidates = [in_layer, in_head]
    if st.plan.traits.scores and spec.attn_implementation is AttnImpl.SDPA:
        attention = _reference_attention(arch, spec, d, st)
        candidates.append(in_layer._replace(activations=st.forward_end.activations + attention))
    ref_forward = max(candidates, key=sum)
    backward = st.backward._replace(reference_model=reference)
    if head_trains and arch.tie_word_embeddings:
        # The top layer's backward: every activation still alive, and the tied weight's
        # gradient from the fused head waiting for the embedding's to join it
        # (reference trace qwen2_5-0_5b__full__dpo__b1-s512).
        top = _Moment(
            gradients=st.backward_start.gradients,
            activations=st.forward_end.activations,
            logits_loss=_head_weight_grad(arch, d),
            backward_temporaries=2 * _blk(tokens * arch.hidden_size * st.plan.flow.residual),
            reference_model=reference,
        )
        weight_grad = _head_weight_grad(arch, d)
        if backward.backward_temporaries >= weight_grad and not backward.logits_loss:
            # at the embedding's gradient the tied weight's earlier gradient is the fused
            # head's output (the same traces label it with the head)
            backward = backward._replace(
                backward_temporaries=backward.backward_temporaries - weight_grad,
                logits_loss=weight_grad,
            )
        backward = max(backward, top, key=sum)
    optimizer = st.optimizer_step._replace(reference_model=reference)
    return step_phases(
        st,
        forward_end,
        backward_start,
        backward,
        optimizer,
        reference_forward=ref_forward if reference_forward else None,
    )


def step_phases(
    st: _Step,
    forward_end: _Moment,
    backward_start: _Moment,
    backward: _Moment,
    optimizer: _Moment,
    *,
    reference_forward: _Moment | None = None,
) -> tuple[tuple[int, Phase, tuple[int, ...]], ...]:
    """A TRL trainer's phases as (step, phase, parts) from its moments: both steps' forward,
    reference forward (when there is one), backward start and backward, the first step's
    optimizer step; the first step without optimizer state, and without the autograd
    thread's cuBLAS workspace before its backward."""
    one, both = st.workspaces
    fixed = tuple(st.fixed)
    first = (*fixed, one, 0)
    steady = (*fixed, both, st.optimizer_state)
    rows: list[tuple[int, Phase, tuple[int, ...]]] = []
    for step, held in ((1, first), (2, steady)):
        rows.append((step, Phase.FORWARD_END, held + tuple(forward_end)))
        if reference_forward is not None:
            rows.append((step, Phase.REFERENCE_FORWARD, held + tuple(reference_forward)))
        rows.append((step, Phase.BACKWARD_START, held + tuple(backward_start)))
        back_held = (*fixed, both, 0) if step == 1 else steady
        rows.append((step, Phase.BACKWARD, back_held + tuple(backward)))
    rows.append((1, Phase.OPTIMIZER_STEP, steady + tuple(optimizer)))
    return tuple(rows)


class DpoStep(NamedTuple):
    """DPO's phases as (step, phase, parts) with the SFT step they extend."""

    step: _Step
    phases: tuple[tuple[int, Phase, tuple[int, ...]], ...]
    assumptions: tuple[str, ...]


def dpo_step(arch: ModelArch, spec: TrainingSpec, compute_capability: str | None) -> DpoStep:
    d = dpo_shape(arch, spec)
    st = _step(arch, policy_spec(spec), compute_capability)
    settings = spec.dpo_settings
    precompute = settings.precompute_ref_log_probs
    reference = st.fixed.trainable_params if spec.method is Method.FULL and not precompute else 0
    rows = fused_head_phases(
        arch, spec, d, st, reference_forward=not precompute, reference=reference
    )
    completion = settings.max_completion_length
    notes = [
        f"DPO (TRL 1.16.0 DPOTrainer, loss 'sigmoid'): {spec.batch_size} pairs run as "
        f"{d.rows} sequences of {spec.seq_len} tokens ([chosen; rejected]), unpadded",
        "the fused LM head scores "
        + (
            f"{completion} completion tokens per sequence"
            if completion
            else "every position but the first (the whole sequence as completion)"
        )
        + f": {d.scored} positions, in tiles of {TILE_TOKENS} x {TILE_VOCAB} logits",
    ]
    notes += reference_notes(spec, precompute, "DPOConfig")
    return DpoStep(st, rows, tuple(notes))
