"""The estimate of an encoder-decoder's (T5 v1.1, mT5) conditional-generation step.

transformers 5.24's T5ForConditionalGeneration (models/t5/modeling_t5.py) in training mode, as
the reference tracer records it (tests/data/traces/t5-*, t0_3b-*): the shared embedding, the
encoder's blocks over the source (seq_len tokens), the decoder's over the target
(target_length tokens) with cross-attention over the encoder's output, the lm_head and
cross-entropy over the target. Each tensor the step keeps is listed with its size and summed
per phase (rounded to the allocator's 512-byte blocks):

- forward end: every tensor autograd saved, the log-probabilities and the loss;
- backward start: the loss's gradient and log_softmax's backward beside them;
- backward: the lm_head's input gradient beside the logits' (with, under full fine-tuning,
  its weight gradient), or for full fine-tuning the decoder embedding's gradient being added
  to the lm_head's (one tied table, three vocab x d_model tensors live) while the encoder's
  saved tensors still wait for their backward, whichever holds more;
- the optimizer step: weights, gradients, states and the update's temporaries.

transformers 5 ties the lm_head to the shared embedding for T5 and mT5 whatever the config
says (T5Config.__post_init__ forces tie_word_embeddings=True; the config's False only turns
off the decoder output's rescaling): the pinned stack holds one vocab x d_model table.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from service.core.arch import Linear, ModelArch
from service.core.arch.hf_t5 import T5_GATED_GELU_ACT
from service.core.cold import starting_cold_work
from service.core.device import cublas_workspace, device_row
from service.core.errors import InvalidConfigError, InvalidSpecError
from service.core.estimator.answer import estimate_from
from service.core.estimator.compiled import compile_notes
from service.core.estimator.ledger import _blk
from service.core.estimator.seq2seq_zero import seq2seq_stage3
from service.core.estimator.uncertainty import _uncertainty
from service.core.estimator.zero import ZeroRank
from service.core.libs.torch_allocator import MIN_BLOCK as SCALAR_BLOCK
from service.core.libs.torch_kernels import EFFICIENT_LSE_PAD, LOSS_SCALARS
from service.core.overhead import Uncertainty, levels
from service.core.result import (
    COMPONENT_ORDER,
    Component,
    Estimate,
    ParamCounts,
    PeakLevels,
    Phase,
    PhasePeak,
)
from service.core.spec import (
    ALL_LINEAR,
    AttnImpl,
    Framework,
    Method,
    Optim,
    ParallelSpec,
    ResolvedSpec,
    SdpaKernel,
    Strategy,
    TrainingSpec,
    resolve,
)
from service.core.stack import stack_note
from service.core.units import BOOL_BYTES, DTYPE_BYTES, FP32_BYTES, INT64_BYTES, DType

# An encoder block's linears with the gated feed-forward: q, k, v, o, wi_0, wi_1, wo.
GATED_BLOCK_LINEARS = 7
# The optimizers modelled: torch's AdamW, foreach (its default on CUDA) or fused.
_OPTIMS = (Optim.ADAMW_TORCH, Optim.ADAMW_TORCH_FUSED)
# How many vocab x d_model tensors live while the decoder embedding's gradient is added to the
# lm_head's (autograd's input buffer for the tied table: the lm_head's, the embedding's, their
# sum), traced on t5-v1_1-small and T0-3B full fine-tuning.
TIED_GRADIENT_TABLES = 3
# The caching allocator's gap above the allocated peak is not modelled for an encoder-decoder
# (no op-by-op schedule): the safe bound takes it as unknown, with this standard deviation as a
# share of allocated, so that its 1.645 deviations cover the largest gap the traced references
# hold: +14.2 % reserved over allocated (tests/data/traces/
# t5-v1_1-small__full__b4-s128__t32__adamw_torch__fp32.json; the 3B-and-larger ones, 0.3-2.9 %).
SEQ2SEQ_RESERVED_SIGMA = 0.0865


def check_seq2seq_spec(arch: ModelArch, spec: TrainingSpec) -> ResolvedSpec:
    """The spec resolved for an encoder-decoder, or InvalidSpecError naming what it cannot run
    (what the traced references do not cover)."""
    if arch.hidden_act != T5_GATED_GELU_ACT or len(arch.linears) != GATED_BLOCK_LINEARS:
        raise InvalidConfigError(
            "feed_forward_proj",
            f"only the gated-gelu feed-forward (T5 v1.1, mT5, T0) is modelled, not "
            f"{arch.hidden_act!r}{' gated' if len(arch.linears) == GATED_BLOCK_LINEARS else ''}",
        )
    if spec.method is Method.QLORA:
        raise InvalidSpecError(
            "method", f"qlora is not modelled for encoder-decoders ({arch.model_type}): use lora"
        )
    if spec.attn_implementation is AttnImpl.FLASH_ATTENTION_2:
        raise InvalidSpecError(
            "attn_implementation",
            f"transformers runs {arch.model_type} without FlashAttention (its relative position "
            "bias is an additive mask): use sdpa or eager",
        )
    if spec.attn_implementation is AttnImpl.SDPA and spec.sdpa_kernel is not SdpaKernel.AUTO:
        raise InvalidSpecError(
            "sdpa_kernel",
            "an encoder-decoder's SDPA runs the mem-efficient kernel (its additive bias rules "
            "flash out); other kernels are not modelled",
        )
    if spec.gradient_checkpointing:
        raise InvalidSpecError(
            "gradient_checkpointing",
            f"checkpointing is not modelled for encoder-decoders ({arch.model_type})",
        )
    checks = (
        (spec.autocast, "autocast", "mixed precision is not modelled for encoder-decoders"),
        (
            spec.dtype is DType.FP16,
            "dtype",
            "transformers keeps T5's wo in fp32 when it loads fp16 weights "
            "(_keep_in_fp32_modules); fp16 is not modelled: use bf16 or fp32",
        ),
        (
            spec.parallel != ParallelSpec()
            and (spec.parallel.strategy is not Strategy.ZERO3 or spec.method is not Method.LORA),
            "parallel.strategy",
            "encoder-decoders are modelled on one GPU, and LoRA on them under zero3 too",
        ),
        (spec.framework is not Framework.HF, "framework", "modelled with HF's step only"),
        (spec.loss is not None, "loss", "T5 computes its own cross-entropy over the target"),
        (spec.optim not in _OPTIMS, "optim", "adamw_torch and adamw_torch_fused are modelled"),
        (spec.num_labels is not None, "num_labels", "an encoder-decoder has no classifier"),
    )
    for failed, name, reason in checks:
        if failed:
            raise InvalidSpecError(name, f"{reason} ({arch.model_type})")
    lora = spec.lora
    if lora is not None and (lora.modules_to_save or lora.use_dora):
        raise InvalidSpecError(
            "lora.modules_to_save" if lora.modules_to_save else "lora.use_dora",
            f"modules_to_save and DoRA are not modelled for encoder-decoders ({arch.model_type})",
        )
    return resolve(spec)


def _adapted(arch: ModelArch, rs: ResolvedSpec, linears: tuple[Linear, ...]) -> set[str]:
    """The names (as the parser lists them) of the linears carrying a LoRA adapter: PEFT
    matches a target against the module name's last part; "all-linear" takes every one (the
    lm_head, the output layer, excepted)."""
    if rs.lora is None:
        return set()
    targets = rs.lora.target_modules
    if targets == ALL_LINEAR:
        return {lin.name for lin in linears}
    names = ("q", "v") if targets is None else tuple(targets)
    every = {lin.name for lin in (*arch.linears, *arch.decoder_linears)}

    def matches(name: str, target: str) -> bool:
        return name == target or name.endswith(f".{target}")

    unknown = [n for n in names if not any(matches(name, n) for name in every)]
    if unknown:
        raise InvalidSpecError(
            "lora.target_modules",
            f"{', '.join(unknown)} not in this model (its linear layers: "
            f"{', '.join(sorted(every))})",
        )
    return {lin.name for lin in linears if any(matches(lin.name, n) for n in names)}


@dataclass(frozen=True, slots=True)
class _Shape:
    """The sizes the step's tensors are made of."""

    b: int
    s: int  # source tokens (seq_len)
    t: int  # target tokens (target_length)
    h: int
    inner: int  # heads x d_kv
    ff: int
    heads: int
    e: int  # the weights' (and activations') bytes per element
    ad: int  # the adapters' bytes per element
    r: int
    lora_dropout: bool
    full: bool
    sdpa: bool  # SDPA's mem-efficient kernel, else eager attention


class _Tensors:
    """A list of tensor sizes, each rounded to whole blocks when summed."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def add(self, *sizes: int) -> None:
        self.sizes.extend(n for n in sizes if n > 0)

    @property
    def total(self) -> int:
        return sum(_blk(n) for n in self.sizes)


def _norm(out: _Tensors, sh: _Shape, tokens: int, *, grad: bool, keep_output: bool) -> None:
    """T5LayerNorm: an fp32 copy of a half input (saved by pow), rsqrt of the fp32 variance
    (saved), the normalised fp32 product cast back to half (saved by the weight's product
    when the weight trains), and the output."""
    if not grad:
        if keep_output:
            out.add(tokens * sh.h * sh.e)
        return
    if sh.e != FP32_BYTES:
        out.add(tokens * sh.h * FP32_BYTES)
    out.add(tokens * FP32_BYTES)
    if sh.full:
        out.add(tokens * sh.h * sh.e)
    if keep_output:
        out.add(tokens * sh.h * sh.e)


def _inputs(
    out: _Tensors, sh: _Shape, elements: int, tokens: int, adapted: int, grad: bool
) -> bool:
    """What the linears reading one input keep of it: under full fine-tuning the input itself;
    per LoRA adapter (PEFT lora.Linear) its dropout's output and mask (the mask only when the
    input needs a gradient), or its cast to the adapters' dtype, and lora_A's output. Returns
    whether the input itself stays saved."""
    same = sh.e == sh.ad and not sh.lora_dropout
    for _ in range(adapted):
        if sh.lora_dropout:
            out.add(elements * sh.ad)
            if grad:
                out.add(elements * BOOL_BYTES)
        elif not same:
            out.add(elements * sh.ad)
        out.add(tokens * sh.r * sh.ad)
    return sh.full or (adapted > 0 and same)


@dataclass(frozen=True, slots=True)
class _Adapted:
    """How many adapters read each input of a block."""

    qkv: int
    q: int  # of which the query's (the cross-attention's only one on the decoder's side)
    k: int
    o: int
    ff_in: int
    wo: int


def _counts(names: set[str], prefix: str) -> _Adapted:
    def n(*parts: str) -> int:
        return sum(f"{prefix}.{p}" in names for p in parts)

    ff_in = ("DenseReluDense.wi_0", "DenseReluDense.wi_1")
    return _Adapted(
        qkv=n("q", "k", "v"),
        q=n("q"),
        k=n("k"),
        o=n("o"),
        ff_in=sum(name in names for name in ff_in),
        wo=int("DenseReluDense.wo" in names),
    )


def _attention(
    out: _Tensors, sh: _Shape, q_len: int, kv_len: int, ad: _Adapted, *, grad: bool, bias: bool
) -> None:
    """One attention's saved tensors, then o's input and its dropout mask.

    Eager: the query made contiguous (saved when the key needs a gradient), the key (made
    contiguous, or the decoder cache's copy), the softmax, its dropout's output and mask, the
    value, the transposed context made contiguous (kept only for a trained or adapted o).
    SDPA (the mem-efficient kernel: an additive float bias rules flash out): the query, key
    and value, the output, the log-sum-exp padded to 32 queries, and the bias made contiguous
    when `bias` (the encoder's permuted relative bias, the decoder's causal one); the dropout
    runs inside the kernel."""
    b, e = sh.b, sh.e
    q_tok, kv_tok = b * q_len, b * kv_len
    q_bytes, kv_bytes = q_tok * sh.inner * e, kv_tok * sh.inner * e
    if sh.sdpa:
        padded = -(-q_len // EFFICIENT_LSE_PAD) * EFFICIENT_LSE_PAD
        out.add(q_bytes, kv_bytes, kv_bytes, q_bytes, b * sh.heads * padded * FP32_BYTES)
        if bias:
            out.add(sh.heads * q_len * kv_len * e)
        _inputs(out, sh, q_tok * sh.inner, q_tok, ad.o, True)  # the output is saved anyway
    else:
        scores = b * sh.heads * q_len * kv_len
        if grad or ad.k:
            out.add(q_bytes)
        out.add(kv_bytes, scores * e, scores * e, scores * BOOL_BYTES, kv_bytes)
        if _inputs(out, sh, q_tok * sh.inner, q_tok, ad.o, True):
            out.add(q_bytes)
    out.add(q_tok * sh.h * BOOL_BYTES)  # o's dropout mask


def _feed_forward(out: _Tensors, sh: _Shape, tokens: int, ad: _Adapted) -> None:
    """DenseReluDense with gelu_new (NewGELUActivation, composed of elementwise ops): wi_0's
    output, 0.5x, tanh, 1 + tanh, the GELU (kept by the gate's product), wi_1's output; the
    dropout's output (kept for wo) and mask, wo's dropout mask, the residual sum."""
    e, f = sh.e, sh.ff
    out.add(*(tokens * f * e for _ in range(6)))
    out.add(tokens * f * BOOL_BYTES)
    if _inputs(out, sh, tokens * f, tokens, ad.wo, True):
        out.add(tokens * f * e)
    out.add(tokens * sh.h * BOOL_BYTES, tokens * sh.h * e)


@dataclass(frozen=True, slots=True)
class _Saved:
    """What the forward leaves for backward: the encoder's side, the decoder's side."""

    encoder: int
    decoder: int


def _saved(arch: ModelArch, sh: _Shape, names: set[str]) -> _Saved:
    """Every tensor autograd keeps at the forward's end, stack by stack."""
    b, s, t, h, e = sh.b, sh.s, sh.t, sh.h, sh.e
    src, tgt = b * s, b * t
    self_enc = _counts(names, "SelfAttention")
    cross = _counts(names, "EncDecAttention")
    enc = _Tensors()
    if sh.full:
        # the embedding's dropout (output and mask; a frozen embedding's output needs no
        # gradient, and the first block's norm saves nothing of it), the relative buckets the
        # bias table's gradient reads
        enc.add(src * h * e, src * h * BOOL_BYTES, s * s * INT64_BYTES)
    for layer in range(arch.num_hidden_layers):
        grad = sh.full or layer > 0
        keep = _inputs(enc, sh, src * h, src, self_enc.qkv, grad)
        _norm(enc, sh, src, grad=grad, keep_output=keep)
        _attention(enc, sh, s, s, self_enc, grad=grad, bias=True)
        enc.add(src * h * e)  # the residual sum
        keep = _inputs(enc, sh, src * h, src, self_enc.ff_in, True)
        _norm(enc, sh, src, grad=True, keep_output=keep)
        _feed_forward(enc, sh, src, self_enc)
    _norm(enc, sh, src, grad=True, keep_output=False)
    enc.add(src * h * BOOL_BYTES)  # the final dropout's mask
    cross_kv = cross.qkv - cross.q
    per_layer = _Tensors()
    if _inputs(per_layer, sh, src * h, src, cross_kv, True):
        enc.add(src * h * e)  # the encoder's output, read by every cross-attention
    dec = _Tensors()
    if sh.full:
        # as the encoder's, and the shifted labels the embedding's gradient reads
        dec.add(tgt * h * e, tgt * h * BOOL_BYTES, t * t * INT64_BYTES, tgt * INT64_BYTES)
    if sh.sdpa:
        dec.add(sh.heads * t * s * e)  # the cross-attention's zero bias, shared by the blocks
        if sh.full:
            # a second target x target int64 tensor the trainable decoder bias keeps under
            # SDPA (traced: tests/data/traces/t5-v1_1-small__full__b4-s64__t256.json)
            dec.add(t * t * INT64_BYTES)
    for layer in range(arch.decoder_layers):
        grad = sh.full or layer > 0
        keep = _inputs(dec, sh, tgt * h, tgt, self_enc.qkv, grad)
        _norm(dec, sh, tgt, grad=grad, keep_output=keep)
        _attention(dec, sh, t, t, self_enc, grad=grad, bias=True)
        dec.add(tgt * h * e)
        keep = _inputs(dec, sh, tgt * h, tgt, cross.q, True)
        _norm(dec, sh, tgt, grad=True, keep_output=keep)
        dec.add(*per_layer.sizes)
        _attention(dec, sh, t, s, cross, grad=True, bias=False)
        dec.add(tgt * h * e)
        keep = _inputs(dec, sh, tgt * h, tgt, self_enc.ff_in, True)
        _norm(dec, sh, tgt, grad=True, keep_output=keep)
        _feed_forward(dec, sh, tgt, self_enc)
    _norm(dec, sh, tgt, grad=True, keep_output=False)
    dec.add(tgt * h * BOOL_BYTES)
    if sh.full:
        dec.add(tgt * h * e)  # the last dropout's output, saved for the lm_head
    return _Saved(encoder=enc.total, decoder=dec.total)


@dataclass(frozen=True, slots=True)
class _Model:
    """The model's tensors (bytes, each rounded): frozen, trainable, and the trainable ones'
    count; the decoder stack's trainable bytes (its gradients exist when the decoder
    embedding's is added)."""

    frozen: int
    trainable: int
    trainable_tensors: int
    decoder_trainable: int
    trainable_params: int


def _model(arch: ModelArch, sh: _Shape, names: set[str]) -> _Model:
    """Every parameter as transformers 5.24 builds it: one shared table (tied to the lm_head),
    the blocks' weights and norms, a relative bias table per stack, the final norms; LoRA's
    A (r x in) and B (out x r) per adapted linear of each block."""
    h, e = sh.h, sh.e
    bias = arch.relative_attention_num_buckets * arch.num_attention_heads * e

    def stack(linears: tuple[Linear, ...], layers: int, norms: int) -> list[int]:
        block = [lin.weight_elements * e for lin in linears] + [h * e] * norms
        return block * layers + [bias, h * e]

    base_enc = stack(arch.linears, arch.num_hidden_layers, 2)
    base_dec = stack(arch.decoder_linears, arch.decoder_layers, 3)
    shared = arch.vocab_size * h * e
    if sh.full:
        every = [shared, *base_enc, *base_dec]
        return _Model(
            frozen=0,
            trainable=sum(_blk(n) for n in every),
            trainable_tensors=len(every),
            decoder_trainable=sum(_blk(n) for n in base_dec),
            trainable_params=sum(n // e for n in every),
        )
    adapters: list[int] = []
    for linears, layers in (
        (arch.linears, arch.num_hidden_layers),
        (arch.decoder_linears, arch.decoder_layers),
    ):
        for lin in linears:
            if lin.name in names:
                adapters += [sh.r * lin.in_features, lin.out_features * sh.r] * layers
    return _Model(
        frozen=sum(_blk(n) for n in (shared, *base_enc, *base_dec)),
        trainable=sum(_blk(n * sh.ad) for n in adapters),
        trainable_tensors=len(adapters),
        decoder_trainable=0,
        trainable_params=sum(adapters),
    )


def _shape(arch: ModelArch, rs: ResolvedSpec) -> _Shape:
    spec = rs.spec
    lora = rs.lora
    return _Shape(
        b=spec.batch_size,
        s=spec.seq_len,
        t=spec.target_length or spec.seq_len,
        h=arch.hidden_size,
        inner=arch.num_attention_heads * arch.head_dim,
        ff=arch.intermediate_size,
        heads=arch.num_attention_heads,
        e=DTYPE_BYTES[spec.dtype],
        ad=DTYPE_BYTES[rs.adapter_dtype] if lora else 0,
        r=lora.r if lora else 0,
        lora_dropout=bool(lora and rs.lora_dropout > 0),
        full=spec.method is Method.FULL,
        sdpa=spec.attn_implementation is AttnImpl.SDPA,
    )


def _adamw_sizes(model: _Model, spec: TrainingSpec) -> tuple[int, int]:
    """AdamW's state and its step's temporaries for `model`'s trainable tensors."""
    fused = spec.optim is Optim.ADAMW_TORCH_FUSED
    # AdamW's exp_avg and exp_avg_sq per trainable tensor; fused keeps each `step` as an fp32
    # scalar on the device (torch/optim/adamw.py _init_group)
    states = 2 * model.trainable + (model.trainable_tensors * SCALAR_BLOCK if fused else 0)
    # foreach: _foreach_sqrt of exp_avg_sq, one trainable-sized list (torch/optim/adamw.py
    # _multi_tensor_adamw); fused: clip_grad_norm_'s per-tensor norms, their total and the
    # clip coefficient (torch/nn/utils/clip_grad.py)
    update = (model.trainable_tensors + 2) * SCALAR_BLOCK if fused else model.trainable
    if spec.max_grad_norm == 0 and fused:
        update = 0
    return states, update


@dataclass(frozen=True, slots=True)
class _Seq2SeqStep:
    """What each phase of an encoder-decoder's step is built from."""

    arch: ModelArch
    sh: _Shape
    saved: _Saved
    model: _Model
    fused: bool  # the fused AdamW (its step's temporaries only from step 2)
    accumulating: bool
    states: int
    update: int
    workspace: int
    inputs: int
    logp: int
    loss: int

    @property
    def src(self) -> int:
        return self.sh.b * self.sh.s

    @property
    def tgt(self) -> int:
        return self.sh.b * self.sh.t


def _backward_window(
    st: _Seq2SeqStep, held: dict[Component, int], forward: dict[Component, int]
) -> dict[Component, int]:
    """The backward phase's peak."""
    sh, model, src, tgt = st.sh, st.model, st.src, st.tgt
    both = {Component.WORKSPACES: 2 * st.workspace}
    if not sh.full:
        # the lm_head's input gradient beside the loss's
        return {
            **forward,
            **both,
            Component.LOGITS_LOSS: st.logp + st.loss,
            Component.BACKWARD_TEMPORARIES: _blk(tgt * sh.h * sh.e),
        }
    # the decoder embedding's gradient added to the lm_head's: the decoder's gradients
    # made, the encoder's saved tensors (less its output, released by the last
    # cross-attention's backward) waiting, its output's gradient accumulating
    table = _blk(st.arch.vocab_size * sh.h * sh.e)
    # or earlier, as the lm_head's weight gradient is made beside the logits' gradient
    # with every saved tensor still waiting
    head = {
        **forward,
        **both,
        Component.LOGITS_LOSS: st.logp + st.loss,
        Component.BACKWARD_TEMPORARIES: table + _blk(tgt * sh.h * sh.e),
    }
    embedding = {
        **held,
        **both,
        Component.GRADIENTS: model.trainable if st.accumulating else model.decoder_trainable,
        Component.ACTIVATIONS: st.saved.encoder - _blk(src * sh.h * sh.e),
        Component.LOGITS_LOSS: st.loss,
        Component.BACKWARD_TEMPORARIES: TIED_GRADIENT_TABLES * table + _blk(src * sh.h * sh.e),
    }
    return max(head, embedding, key=lambda parts: sum(parts.values()))


def _step_peaks(st: _Seq2SeqStep, step: int) -> list[PhasePeak]:
    """Step `step`'s four phase peaks."""
    model = st.model
    weights = {Component.FROZEN_WEIGHTS: model.frozen, Component.TRAINABLE_PARAMS: model.trainable}
    held = {**weights, Component.INPUTS: st.inputs}
    if step == 2:
        held[Component.OPTIMIZER_STATE] = st.states
    if st.accumulating:
        held[Component.GRADIENTS] = model.trainable
    handles = 1 if step == 1 and not st.accumulating else 2
    first = {Component.WORKSPACES: st.workspace * handles}
    activations = st.saved.encoder + st.saved.decoder
    forward = {**held, **first, Component.ACTIVATIONS: activations}
    windows: list[tuple[Phase, dict[Component, int]]] = [
        (Phase.FORWARD_END, {**forward, Component.LOGITS_LOSS: st.logp + st.loss}),
        (Phase.BACKWARD_START, {**forward, Component.LOGITS_LOSS: 3 * st.logp + st.loss}),
        (Phase.BACKWARD, _backward_window(st, held, forward)),
    ]
    optimizer = {
        **held,
        Component.WORKSPACES: 2 * st.workspace,
        Component.GRADIENTS: model.trainable,
        Component.OPTIMIZER_STATE: st.states,
        Component.OPTIMIZER_TEMPORARIES: st.update if (step == 2 or not st.fused) else 0,
    }
    windows.append((Phase.OPTIMIZER_STEP, optimizer))
    peaks = []
    for phase, parts in windows:
        row = tuple(parts.get(c, 0) for c in COMPONENT_ORDER)
        peaks.append(PhasePeak(step, phase, sum(row), row))
    return peaks


def _phases(arch: ModelArch, spec: TrainingSpec, cc: str | None) -> tuple[PhasePeak, ...]:
    """Each step's four phase peaks with their components."""
    starting_cold_work("an encoder-decoder's step")  # (not compiled: each estimate runs it)
    rs = check_seq2seq_spec(arch, spec)
    sh = _shape(arch, rs)
    zero = spec.parallel.strategy is Strategy.ZERO3
    if zero:
        # DeepSpeed casts every floating parameter, the adapters included, to the model's
        # half dtype (`zero._cast_params`)
        sh = dataclasses.replace(sh, ad=sh.e)
    names = _adapted(arch, rs, (*arch.linears, *arch.decoder_linears))
    saved = _saved(arch, sh, names)
    model = _model(arch, sh, names)
    states, update = _adamw_sizes(model, spec)
    workspace = cublas_workspace(cc)
    src, tgt = sh.b * sh.s, sh.b * sh.t
    inputs = _blk(src * INT64_BYTES) + _blk(tgt * INT64_BYTES) + SCALAR_BLOCK
    logp = _blk(tgt * arch.vocab_size * sh.e)  # no upcast: T5 runs CrossEntropyLoss on them
    loss = LOSS_SCALARS * SCALAR_BLOCK
    # With gradient accumulation each window's highest micro-batch is a later one: every
    # .grad made by the first (a later one's gradients are added into them in place and let
    # go), both cuBLAS handles in use.
    accumulating = spec.gradient_accumulation_steps > 1
    if zero:
        return _zero3_phases(
            seq2seq_stage3(arch, rs, names),
            accumulating,
            {Component.INPUTS: inputs, Component.ACTIVATIONS: saved.encoder + saved.decoder},
            logp + loss,
            workspace,
            _blk(tgt * sh.h * sh.e),
        )
    st = _Seq2SeqStep(
        arch=arch,
        sh=sh,
        saved=saved,
        model=model,
        fused=spec.optim is Optim.ADAMW_TORCH_FUSED,
        accumulating=accumulating,
        states=states,
        update=update,
        workspace=workspace,
        inputs=inputs,
        logp=logp,
        loss=loss,
    )
    return tuple(peak for step in (1, 2) for peak in _step_peaks(st, step))


def _zero3_phases(
    rank: ZeroRank,
    accumulating: bool,
    step_tensors: dict[Component, int],
    loss: int,
    workspace: int,
    head_input_grad: int,
) -> tuple[PhasePeak, ...]:
    """The phases of a LoRA step under ZeRO-3 (`seq2seq_zero`): the one-GPU step's inputs,
    activations and loss beside what the rank holds (its parameters, the gathered ones and the
    reduce bucket as communication, the gradient partition, the optimizer state unless
    offloaded). `loss` is the log-probabilities and the loss's scalars; backward starts with
    the loss's gradient and log_softmax's backward beside them (three log-prob tensors), and
    inside backward the lm_head's input gradient comes beside the loss's."""
    logp = loss - LOSS_SCALARS * SCALAR_BLOCK
    peaks: list[PhasePeak] = []
    for step in (1, 2):
        held = {
            Component.FROZEN_WEIGHTS: rank.frozen,
            Component.TRAINABLE_PARAMS: rank.trainable,
            Component.INPUTS: step_tensors[Component.INPUTS],
        }
        if step == 2:
            held[Component.OPTIMIZER_STATE] = rank.optimizer_state
        forward = {
            **held,
            Component.ACTIVATIONS: step_tensors[Component.ACTIVATIONS],
            Component.WORKSPACES: workspace * (1 if step == 1 and not accumulating else 2),
            Component.GRADIENTS: rank.gradients if accumulating else 0,
            Component.COMMUNICATION: rank.comm_forward,
        }
        both = {Component.WORKSPACES: 2 * workspace, Component.GRADIENTS: rank.gradients}
        windows = (
            (Phase.FORWARD_END, {**forward, Component.LOGITS_LOSS: loss}),
            (Phase.BACKWARD_START, {**forward, Component.LOGITS_LOSS: loss + 2 * logp}),
            (
                Phase.BACKWARD,
                {
                    **forward,
                    **both,
                    Component.LOGITS_LOSS: loss,
                    Component.BACKWARD_TEMPORARIES: head_input_grad,
                    Component.COMMUNICATION: rank.comm_backward,
                },
            ),
            (
                Phase.OPTIMIZER_STEP,
                {
                    **held,
                    **both,
                    Component.OPTIMIZER_STATE: rank.optimizer_state,
                    Component.OPTIMIZER_TEMPORARIES: rank.optimizer_temporaries,
                    Component.COMMUNICATION: rank.comm_step,
                },
            ),
        )
        for phase, parts in windows:
            row = tuple(parts.get(c, 0) for c in COMPONENT_ORDER)
            peaks.append(PhasePeak(step, phase, sum(row), row))
    return tuple(peaks)


def _seq2seq_uncertainty(arch: ModelArch, spec: TrainingSpec) -> Uncertainty:
    """The uncertainty of an encoder-decoder's levels: its reserved level is reported at the
    allocated level, so the safe bound takes the allocator's gap as unknown
    (`SEQ2SEQ_RESERVED_SIGMA`)."""
    return dataclasses.replace(_uncertainty(arch, spec), reserved_unmodelled=SEQ2SEQ_RESERVED_SIGMA)


def seq2seq_estimate(
    arch: ModelArch, spec: TrainingSpec, *, compute_capability: str | None, version: str
) -> Estimate:
    """The estimate of an encoder-decoder's step: the phases' allocated peaks and breakdowns,
    the device level above (the reserved level is not modelled: reported as allocated)."""
    phases = _phases(arch, spec, compute_capability)
    peak = max(phases, key=lambda ph: (ph.allocated_bytes, -ph.step))
    over = levels(
        allocated=peak.allocated_bytes,
        reserved=peak.allocated_bytes,
        paged_state=0,
        gpus=spec.parallel.gpus,
        row=device_row(compute_capability, fused_attention=False),
        uncertainty=_seq2seq_uncertainty(arch, spec),
    )
    rs = resolve(spec)
    sh = _shape(arch, rs)
    names = _adapted(arch, rs, (*arch.linears, *arch.decoder_linears))
    model = _model(arch, sh, names)
    untied = 0 if arch.tie_word_embeddings else arch.vocab_size * arch.hidden_size
    rank = seq2seq_stage3(arch, rs, names) if spec.parallel.strategy is Strategy.ZERO3 else None
    assumptions = [
        *rs.assumptions,
        f"conditional generation as transformers' T5ForConditionalGeneration runs it: "
        f"{sh.s} source and {sh.t} target tokens, eager attention, dropout on as in training",
        "transformers 5 ties the lm_head to the shared embedding for T5 and mT5 (one table)",
        *(rank.assumptions if rank is not None else ()),
        "reserved level not modelled for encoder-decoders: reported at the allocated level",
        stack_note(spec.stack),
    ]
    return estimate_from(
        phases,
        peak,
        over,
        params=ParamCounts(total=arch.total_params - untied, trainable=model.trainable_params),
        assumptions=(*assumptions, *over.assumptions, *compile_notes(spec)),
        warnings=(),
        version=version,
        host=(rank.host if rank is not None else 0, 0),
    )


def seq2seq_peak_levels(
    arch: ModelArch, spec: TrainingSpec, *, compute_capability: str | None
) -> PeakLevels:
    """`seq2seq_estimate`'s four levels without the breakdown."""
    allocated = max(ph.allocated_bytes for ph in _phases(arch, spec, compute_capability))
    over = levels(
        allocated=allocated,
        reserved=allocated,
        paged_state=0,
        gpus=spec.parallel.gpus,
        row=device_row(compute_capability, fused_attention=False),
        uncertainty=_seq2seq_uncertainty(arch, spec),
    )
    return PeakLevels(allocated, over.reserved, over.device, over.device_upper)
