"""Which modules train, and the bytes of parameters, gradients and optimizer state."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

from service.core.arch import SCORE_OUTPUTS, Linear, ModelArch, NormKind
from service.core.errors import InvalidSpecError
from service.core.estimator.ledger import _blk
from service.core.estimator.lora_targets import deepseek_lora_targets, default_target_modules
from service.core.libs.bitsandbytes import (
    NESTED_BLOCK,
    NESTED_CODE_ENTRIES,
    NF4_BLOCK,
    NF4_CODE_ENTRIES,
    NF4_VALUES_PER_BYTE,
)
from service.core.libs.optimizers import FP32_COPIES, OPTIMIZERS, Temporaries
from service.core.libs.peft import LORAFA_AUTOCAST_BYTES
from service.core.quant_formats import check_shape, packed_bytes
from service.core.spec import (
    ADAPTER_METHODS,
    ALL_LINEAR,
    LoraSpec,
    Method,
    Optim,
    QuantSpec,
    QuantType,
    ResolvedSpec,
)
from service.core.spec.delta import BoftSpec, LokrSpec, OftSpec
from service.core.units import DTYPE_BYTES, FP32_BYTES, INT8_BYTES, INT64_BYTES, UINT8_BYTES, DType

# Two one-element tensors an OFT model holds beside its rotations and index buffers (reference
# traces *__oft__*: 1024 bytes of frozen weights over the modules' own tensors).
OFT_MODEL_CONSTANTS = 2 * 512


# Model types whose "all-linear" PEFT 0.21 also points at the MoE experts' 3-D parameters and
# the router's weight under transformers 5 (peft/utils/transformers_weight_conversion.py
# _convert_peft_config_moe with transformers' conversion_mapping: qwen3_moe follows the
# qwen2_moe pattern, PEFT adds mixtral): lora.ParamWrapper adapters, gate_up_proj's with
# twice the rank (gate and up were two linears before they were fused).
EXPERT_LORA_MODEL_TYPES = frozenset({"qwen3_moe", "mixtral"})
FUSED_GATE_UP_RANK_FACTOR = 2


def expert_adapters(arch: ModelArch, rs: ResolvedSpec) -> tuple[tuple[int, int], ...]:
    """The (rows, cols) of each LoRA A and B that PEFT puts on the experts and the router of
    one layer (ParamWrapper: A is (experts * rank, in), B is (out, experts * rank)); empty when
    it puts none."""
    lora = rs.lora
    if (
        lora is None
        or lora.target_modules != ALL_LINEAR
        or not arch.is_moe
        or arch.model_type not in EXPERT_LORA_MODEL_TYPES
        # transformers 4's experts are nn.Linear modules, adapted one by one (adapted_linears)
        or any(lin.looped for lin in arch.linears)
    ):
        return ()
    if rs.spec.method not in (Method.LORA, Method.QLORA):
        raise InvalidSpecError(
            f"{rs.options_field}.target_modules",
            f"'all-linear' here also adapts the experts' parameters, modelled for LoRA alone "
            f"(not {rs.spec.method.value}); name the target modules",
        )
    if lora.use_dora:
        # peft/tuners/lora/layer.py ParamWrapper.update_layer raises on LoRA variants.
        raise InvalidSpecError(
            "lora.use_dora",
            "PEFT 0.21 cannot put DoRA on the experts' parameters that 'all-linear' targets "
            "here; name the target modules",
        )
    e, h, i, r = arch.num_experts, arch.hidden_size, arch.expert_intermediate_size, lora.r
    fused = FUSED_GATE_UP_RANK_FACTOR * r * e
    return (
        (fused, h),  # gate_up_proj's A
        (2 * i, fused),  # and B
        (r * e, i),  # down_proj's A
        (h, r * e),  # and B
        (r, h),  # the router weight's A (one "expert")
        (e, r),  # and B
    )


def adapted_linears(arch: ModelArch, rs: ResolvedSpec) -> tuple[Linear, ...]:
    """The decoder-layer linears that carry a LoRA adapter."""
    if rs.lora is None:
        return ()
    targets = rs.lora.target_modules
    candidates = [lin for lin in arch.linears if lin.nn_linear]
    if arch.is_mla:
        # DeepSeek: PEFT sends the MLP names to the experts' parameters, so no nn.Linear of
        # those names takes an adapter (`lora_targets.deepseek_lora_targets`)
        modules = deepseek_lora_targets(arch, rs.lora).modules
        return tuple(lin for lin in candidates if lin.name in modules)
    if targets == ALL_LINEAR:
        return tuple(candidates)
    field = rs.options_field
    names = default_target_modules(arch, field) if targets is None else tuple(targets)
    chosen = tuple(
        lin for lin in candidates if lin.name in names or lin.name.split(".")[-1] in names
    )
    unknown = [
        n
        for n in names
        if not any(n in (lin.name, lin.name.split(".")[-1]) for lin in arch.linears)
    ]
    if unknown or not chosen:
        known = ", ".join(sorted({lin.name for lin in candidates}))
        raise InvalidSpecError(
            f"{field}.target_modules",
            f"{', '.join(unknown or names)} not in this model (its linear layers: {known})",
        )
    return chosen


@dataclass(frozen=True, slots=True)
class _Tensor:
    """`count` trainable tensors of one shape: (rows, cols) or (rows,) when cols is 0."""

    rows: int
    cols: int
    itemsize: int
    count: int

    @property
    def elements(self) -> int:
        return self.rows * (self.cols or 1)

    @property
    def nbytes(self) -> int:
        return self.count * _blk(self.elements * self.itemsize)


@dataclass(frozen=True, slots=True)
class _Params:
    frozen: int  # bytes of frozen weights (quantized ones included)
    trainable: int  # bytes of trainable parameters
    tensors: tuple[_Tensor, ...]  # the trainable tensors
    total_count: int
    trainable_count: int
    embed_trainable: int  # bytes of a trainable input embedding (its gradient comes last)
    head_trainable: int  # bytes of a trainable lm_head and final norm (gradients come first)
    # For strategies that gather parameters by module: one decoder layer's parameters (its
    # adapters included) and those outside the layers (embedding, final norm, LM head), bytes.
    layer: int = 0
    outside_layers: int = 0


def _quantized_weight_bytes(lin: Linear, quant: QuantSpec | None, dtype_bytes: int = 2) -> int:
    return _quantized_matrix_bytes(lin.in_features, lin.out_features, quant, dtype_bytes)


def _quantized_matrix_bytes(
    in_features: int, out_features: int, quant: QuantSpec | None, dtype_bytes: int = 2
) -> int:
    """One quantized weight's stored tensors; `dtype_bytes`: the model's dtype (HQQ keeps its
    scales and zeros in it)."""
    if quant is None:
        raise InvalidSpecError("quantization", "required for method 'qlora'")
    if quant.type.packed:
        bits, group = quant.resolved_bits, quant.resolved_group_size
        why = check_shape(quant.type.value, bits, group, in_features, out_features)
        if why:
            raise InvalidSpecError(
                "quantization.group_size", f"{why} ({in_features} -> {out_features} linear)"
            )
        sizes = packed_bytes(quant.type.value, bits, group, in_features, out_features, dtype_bytes)
        return sum(_blk(nbytes) for nbytes in sizes)
    n = in_features * out_features
    if quant.type is QuantType.INT8:
        return _blk(n * INT8_BYTES) + _blk(out_features * FP32_BYTES)
    packed = _blk(n // NF4_VALUES_PER_BYTE)
    blocks = -(-n // NF4_BLOCK)
    code = _blk(NF4_CODE_ENTRIES * FP32_BYTES)
    if not quant.double_quant:
        return packed + _blk(blocks * FP32_BYTES) + code
    nested = -(-blocks // NESTED_BLOCK)
    return (
        packed
        + _blk(blocks * UINT8_BYTES)
        + _blk(nested * FP32_BYTES)
        + _blk(NESTED_CODE_ENTRIES * FP32_BYTES)
        + _blk(FP32_BYTES)  # the nested offset
        + code
    )


@dataclass(slots=True)
class _Tally:
    """The weights counted so far: frozen bytes, the trainable tensors, and the bytes inside
    one decoder layer's stack and outside the layers (for strategies that gather by module)."""

    frozen: int = 0
    trainable: list[_Tensor] = dataclasses.field(default_factory=list)
    layers_bytes: int = 0
    outside_layers: int = 0

    def put(self, rows: int, cols: int, itemsize: int, count: int, train: bool) -> None:
        tensor = _Tensor(rows, cols, itemsize, count)
        if train:
            self.trainable.append(tensor)
        else:
            self.frozen += tensor.nbytes

    def train_in_layers(self, rows: int, cols: int, itemsize: int, count: int) -> None:
        """A trainable adapter tensor inside the decoder layers."""
        tensor = _Tensor(rows, cols, itemsize, count)
        self.trainable.append(tensor)
        self.layers_bytes += tensor.nbytes

    def freeze_in_layers(self, nbytes: int) -> None:
        """A frozen adapter tensor (or buffer) inside the decoder layers."""
        self.frozen += nbytes
        self.layers_bytes += nbytes

    def trainable_bytes(self, start: int = 0, end: int | None = None) -> int:
        return sum(t.nbytes for t in self.trainable[start:end])


class _Base(NamedTuple):
    """How the model's own weights are stored: the model's dtype, whether the base is k-bit,
    the dtype of its other parameters, and which of them train."""

    arch: ModelArch
    md: int  # the model's dtype's bytes
    kbit: bool
    other: int  # bytes of every parameter that is not 4/8-bit
    full: bool
    quant: QuantSpec | None
    norms_train: bool


def _layer_weights(tally: _Tally, base: _Base) -> None:
    """The decoder layers' linears and norms."""
    arch, md, kbit, other, full, quant = (
        base.arch,
        base.md,
        base.kbit,
        base.other,
        base.full,
        base.quant,
    )
    L = arch.num_hidden_layers
    for lin in arch.linears:
        if lin.looped:
            # transformers 4's experts: one nn.Linear per expert (each quantized on its own)
            if kbit:
                tally.frozen += L * lin.count * _quantized_weight_bytes(lin, quant, md)
            else:
                tally.put(lin.out_features, lin.in_features, md, L * lin.count, full)
        elif kbit and not lin.expert:
            tally.frozen += L * _quantized_weight_bytes(lin, quant, md)
        else:
            # transformers 5 keeps a stack of experts (and a router) as a bare 3-D (2-D)
            # parameter that bitsandbytes leaves in half precision: kbit preparation casts it
            # to fp32 like any other unquantized parameter.
            tally.put(lin.out_features * lin.count, lin.in_features, other if kbit else md, L, full)
        if lin.bias:
            # gptqmodel's and torchao's quantized linears keep the bias as a buffer in the
            # model's dtype (gptqmodel registers it fp16), which kbit preparation never casts
            packed = quant is not None and quant.type.packed and not lin.expert
            bias_bytes = md if packed or not kbit else other
            tally.put(lin.out_features * lin.count, 0, bias_bytes, L, full)
    norm_tensors = arch.norms_per_layer * (2 if arch.norm is NormKind.LAYER else 1)
    tally.put(arch.hidden_size, 0, other, L * norm_tensors, full or base.norms_train)
    if arch.qk_norm:
        tally.put(arch.head_dim, 0, other, 2 * L, full)


def _embedding_weights(tally: _Tally, base: _Base, saved_modules: set[str]) -> None:
    """The input embedding, and PEFT's trained copy of it (modules_to_save)."""
    arch, other, full = base.arch, base.other, base.full
    tally.put(arch.vocab_size, arch.hidden_size, other, 1, full)
    if "embed_tokens" in saved_modules and not full:
        # ModulesToSaveWrapper trains a copy and keeps the original.
        tally.trainable.append(_Tensor(arch.vocab_size, arch.hidden_size, other, 1))


def _head_weights(
    tally: _Tally, base: _Base, saved_modules: set[str], head_quantized: bool
) -> None:
    """The final norm and the LM head (or a sequence classifier's score)."""
    arch, other, full = base.arch, base.other, base.full
    final_norms = 2 if arch.norm is NormKind.LAYER else 1
    tally.put(arch.hidden_size, 0, other, final_norms, full or base.norms_train)
    if arch.score_head:
        # the sequence classifier's score (hidden -> 1, no bias); PEFT's SEQ_CLS task trains a
        # copy of it beside the original (PeftModelForSequenceClassification: modules_to_save)
        tally.put(SCORE_OUTPUTS, arch.hidden_size, other, 1, full)
        if not full:
            tally.trainable.append(_Tensor(SCORE_OUTPUTS, arch.hidden_size, other, 1))
    elif not arch.tie_word_embeddings:
        if head_quantized:
            tally.frozen += _quantized_matrix_bytes(arch.hidden_size, arch.vocab_size, base.quant)
        else:
            tally.put(arch.vocab_size, arch.hidden_size, other, 1, full)
        if arch.lm_head_bias:
            tally.put(arch.vocab_size, 0, other, 1, full)
        if "lm_head" in saved_modules and not full:
            tally.trainable.append(_Tensor(arch.vocab_size, arch.hidden_size, other, 1))


class _Adapters(NamedTuple):
    """A weight-side PEFT method's settings, for its tensors (`_ADAPTER_WEIGHTS`)."""

    method: Method
    lora: LoraSpec | None
    adapter_dtype: DType
    adapted: tuple[Linear, ...]
    expert_lora: tuple[tuple[int, int], ...]
    lokr: LokrSpec | None
    oft: OftSpec | None
    boft: BoftSpec | None
    layers: int


def _lora_options(adapters: _Adapters) -> LoraSpec:
    if adapters.lora is None:
        raise AssertionError("the adapter's options were checked by its entry")
    return adapters.lora


def _vera_weights(tally: _Tally, adapters: _Adapters) -> None:
    r, L = _lora_options(adapters).r, adapters.layers
    tally.frozen += _vera_projections(adapters.adapted, r)
    for lin in adapters.adapted:
        # vera_lambda_b (out) and vera_lambda_d (r), fp32 (torch.ones / torch.randn in
        # peft/tuners/vera/layer.py VeraLayer.update_layer)
        tally.train_in_layers(lin.out_features, 0, FP32_BYTES, L)
        tally.train_in_layers(r, 0, FP32_BYTES, L)


def _lokr_weights(tally: _Tally, adapters: _Adapters) -> None:
    lora, lokr = _lora_options(adapters), adapters.lokr
    if lokr is None:
        raise AssertionError("LoKr's options were checked by its entry")
    for lin in adapters.adapted:
        shape = lokr_shape(lin, lora.r, lokr.decompose_both, lokr.decompose_factor)
        for rows, cols in shape.tensors(lora.r):
            tally.train_in_layers(rows, cols, FP32_BYTES, adapters.layers)


def _oft_weights(tally: _Tally, adapters: _Adapters) -> None:
    """OFT's rotations are `tuner` tensors (`tuners.tuner_tensors`); each rotation module
    registers the upper triangle's row and column indices as int64 buffers
    (peft/tuners/oft/layer.py OFTRotationModule.__init__: torch.triu_indices)."""
    oft = adapters.oft
    if oft is None:
        raise AssertionError("OFT's options were checked by its entry")
    for lin in adapters.adapted:
        _, size = oft.blocks(lin.in_features)
        indices = _Tensor(size * (size - 1) // 2, 0, INT64_BYTES, adapters.layers)
        tally.freeze_in_layers(2 * indices.nbytes)
    tally.frozen += OFT_MODEL_CONSTANTS


def _boft_weights(tally: _Tally, adapters: _Adapters) -> None:
    """BOFT's blocks and scales are `tuner` tensors (`tuners.tuner_tensors`); each adapted
    linear registers its butterfly permutations as a dense fp32 buffer (peft/tuners/boft/
    layer.py BOFTLayer.update_layer: boft_P, (factors, in, in), torch.empty)."""
    boft = adapters.boft
    if boft is None:
        raise AssertionError("BOFT's options were checked by its entry")
    for lin in adapters.adapted:
        factors, _, _ = boft.blocks(lin.in_features)
        perms = _Tensor(factors * lin.in_features, lin.in_features, FP32_BYTES, adapters.layers)
        tally.freeze_in_layers(perms.nbytes)
    tally.frozen += OFT_MODEL_CONSTANTS  # (the same two in the traces *__boft__*)


def _loha_weights(tally: _Tally, adapters: _Adapters) -> None:
    r = _lora_options(adapters).r
    for lin in adapters.adapted:
        for rows, cols in loha_tensors(lin, r):
            tally.train_in_layers(rows, cols, FP32_BYTES, adapters.layers)


def _lora_weights(tally: _Tally, adapters: _Adapters) -> None:
    """LoRA's A and B (LoRA-FA's A frozen), AdaLoRA's E and rank, DoRA's magnitude, and the
    adapters on the experts' parameters."""
    lora, method, L = _lora_options(adapters), adapters.method, adapters.layers
    ad = DTYPE_BYTES[adapters.adapter_dtype]
    r = lora.r
    for lin in adapters.adapted:
        # one adapter per layer, or per expert for transformers 4's looped experts
        n = L * lin.count if lin.looped else L
        if method is Method.LORA_FA:
            # create_lorafa_optimizer freezes every lora_A (peft/optimizers/lorafa.py)
            tally.freeze_in_layers(_Tensor(r, lin.in_features, ad, n).nbytes)
        else:
            tally.train_in_layers(r, lin.in_features, ad, n)
        tally.train_in_layers(lin.out_features, r, ad, n)  # lora_B
        if method is Method.ADALORA:
            # lora_E (r, 1), registered after lora_A and lora_B, then ranknum, one fp32
            # element (peft/tuners/adalora/layer.py AdaLoraLayer.update_layer): created
            # frozen, it is trainable once moved to the base layer's device (re-registered
            # as a new Parameter; reference traces *__adalora__*)
            tally.train_in_layers(r, 0, ad, L)
            tally.train_in_layers(1, 0, FP32_BYTES, L)
        if lora.use_dora:
            # DoRA's magnitude: one per output feature, the norm of the adapter-dtype weight
            # (peft/tuners/lora/dora.py DoraLinearLayer.update_layer).
            tally.train_in_layers(lin.out_features, 0, ad, L)
    for rows, cols in adapters.expert_lora:
        tally.train_in_layers(rows, cols, ad, L)


# The weight-side methods' tensors: the first entry whose test holds adds them.
_ADAPTER_WEIGHTS: tuple[
    tuple[Callable[[_Adapters], bool], Callable[[_Tally, _Adapters], None]], ...
] = (
    (lambda a: a.lora is not None and a.method is Method.VERA, _vera_weights),
    (
        lambda a: a.lora is not None and a.method is Method.LOKR and a.lokr is not None,
        _lokr_weights,
    ),
    (lambda a: a.oft is not None, _oft_weights),
    (lambda a: a.boft is not None, _boft_weights),
    (lambda a: a.lora is not None and a.method is Method.LOHA, _loha_weights),
    (lambda a: a.lora is not None, _lora_weights),
)


def _adapter_weights(tally: _Tally, adapters: _Adapters) -> None:
    for applies, add in _ADAPTER_WEIGHTS:
        if applies(adapters):
            add(tally, adapters)
            return


@lru_cache(maxsize=1024)
def _params(
    arch: ModelArch,
    method: Method,
    dtype: DType,
    lora: LoraSpec | None,
    quant: QuantSpec | None,
    adapter_dtype: DType,
    adapted: tuple[Linear, ...],
    head_quantized: bool = False,
    expert_lora: tuple[tuple[int, int], ...] = (),
    tuner: tuple[tuple[int, int, int, int], ...] = (),
    lokr: LokrSpec | None = None,
    norms_train: bool = False,
    oft: OftSpec | None = None,
    boft: BoftSpec | None = None,
) -> _Params:
    """Weights by role. Every decoder layer is alike, so one is counted and multiplied.
    Cached: it depends on the model and method, not on batch or sequence length.

    `head_quantized`: the LM head is a 4-bit linear too (LitGPT's QLoRA: Fabric's
    BitsandbytesPrecision replaces every torch.nn.Linear, lm_head included). `expert_lora`:
    the adapters PEFT puts on a layer's experts and router (`expert_adapters`). `tuner`: the
    trainable tensors of (IA)^3 or LN tuning (`tuners.tuner_tensors`) or of LitGPT's adapters
    (`adapter.adapter_tensors`). `norms_train`: the model's own norms train (LLaMA-Adapter
    v2's adapter_filter: norm_1, norm_2, ln_f)."""
    md = DTYPE_BYTES[dtype]
    kbit = method is Method.QLORA or (method in ADAPTER_METHODS and quant is not None)
    prep = kbit and quant is not None and quant.prepare_kbit
    # prepare_model_for_kbit_training casts every parameter that is not 4/8-bit to fp32
    # (peft/utils/other.py: param.data = param.data.to(torch.float32)).
    other = FP32_BYTES if prep else md
    base = _Base(arch, md, kbit, other, method is Method.FULL, quant, norms_train)
    saved_modules = set(lora.modules_to_save) if lora else set()
    L = arch.num_hidden_layers

    tally = _Tally()
    _layer_weights(tally, base)
    layers_end = len(tally.trainable)
    layers_frozen = tally.frozen
    _embedding_weights(tally, base, saved_modules)
    embed_trainable = tally.trainable_bytes(layers_end)
    head_start = len(tally.trainable)
    _head_weights(tally, base, saved_modules, head_quantized)
    head_trainable = tally.trainable_bytes(head_start)
    tally.layers_bytes = layers_frozen + tally.trainable_bytes(0, layers_end)
    tally.outside_layers = tally.frozen - layers_frozen + tally.trainable_bytes(layers_end)

    adapters = _Adapters(method, lora, adapter_dtype, adapted, expert_lora, lokr, oft, boft, L)
    _adapter_weights(tally, adapters)
    for rows, cols, itemsize, count in tuner:
        tuned = _Tensor(rows, cols, itemsize, count)
        tally.trainable.append(tuned)
        if count == L:
            tally.layers_bytes += tuned.nbytes
        else:
            tally.outside_layers += tuned.nbytes
    trainable = tally.trainable
    return _Params(
        frozen=tally.frozen,
        trainable=sum(t.nbytes for t in trainable),
        tensors=tuple(trainable),
        total_count=arch.total_params,
        trainable_count=sum(t.elements * t.count for t in trainable),
        embed_trainable=embed_trainable,
        head_trainable=head_trainable,
        layer=tally.layers_bytes // L,
        outside_layers=tally.outside_layers,
    )


def loha_tensors(lin: Linear, r: int) -> tuple[tuple[int, int], ...]:
    """LoHa's parameters of one linear, (rows, cols) in registration order: hada_w1_a (out, r),
    hada_w1_b (r, in), hada_w2_a, hada_w2_b; fp32 (torch.empty in peft/tuners/loha/layer.py
    LoHaLayer.create_adapter_parameters)."""
    out = lin.out_features * lin.count
    return ((out, r), (r, lin.in_features), (out, r), (r, lin.in_features))


def kronecker_factors(dimension: int, factor: int) -> tuple[int, int]:
    """How LoKr splits a dimension into two factors, smaller first (peft/tuners/lokr/layer.py
    factorization): `factor` and the rest when it divides the dimension; otherwise the
    divisor pair with the smallest sum whose first member stays within `factor` (any, for
    -1), starting from (1, dimension)."""
    if factor > 0 and dimension % factor == 0:
        return factor, dimension // factor
    limit = dimension if factor == -1 else factor
    m, n = 1, dimension
    while m < n:
        nxt = m + 1
        while dimension % nxt:
            nxt += 1
        if nxt + dimension // nxt > m + n or nxt > limit:
            break
        m, n = nxt, dimension // nxt
    return min(m, n), max(m, n)


@dataclass(frozen=True, slots=True)
class LokrShape:
    """One linear's LoKr factors: w1 is (out1, in1), w2 is (out2, in2); each a parameter, or
    a rank-r pair whose product the forward builds (peft/tuners/lokr/layer.py update_layer)."""

    out1: int
    in1: int
    out2: int
    in2: int
    w1_whole: bool
    w2_whole: bool

    def tensors(self, r: int) -> tuple[tuple[int, int], ...]:
        """(rows, cols) in registration order: lokr_w1 or lokr_w1_a, lokr_w1_b, then lokr_w2
        or lokr_w2_a, lokr_w2_b; fp32 (torch.empty in create_adapter_parameters)."""
        first = ((self.out1, self.in1),) if self.w1_whole else ((self.out1, r), (r, self.in1))
        second = ((self.out2, self.in2),) if self.w2_whole else ((self.out2, r), (r, self.in2))
        return first + second


def lokr_shape(lin: Linear, r: int, decompose_both: bool, factor: int) -> LokrShape:
    in1, in2 = kronecker_factors(lin.in_features, factor)
    out1, out2 = kronecker_factors(lin.out_features * lin.count, factor)
    return LokrShape(
        out1=out1,
        in1=in1,
        out2=out2,
        in2=in2,
        w1_whole=not (decompose_both and r < max(out1, in1) / 2),
        w2_whole=not r < max(out2, in2) / 2,
    )


def vera_projection_sizes(adapted: tuple[Linear, ...], r: int) -> tuple[int, int]:
    """VeRA's shared frozen projections, bytes: vera_A (r x the largest in_features) and
    vera_B (the largest out_features x r) over the adapted linears, fp32 (peft/tuners/vera/
    model.py VeraModel._find_dim and _init_vera_A_vera_B: _kaiming_init in the default dtype)."""
    largest_in = max((lin.in_features for lin in adapted), default=0)
    largest_out = max((lin.out_features * lin.count for lin in adapted), default=0)
    return r * largest_in * FP32_BYTES, largest_out * r * FP32_BYTES


def _vera_projections(adapted: tuple[Linear, ...], r: int) -> int:
    return sum(_blk(n) for n in vera_projection_sizes(adapted, r))


def _gradients(p: _Params) -> int:
    """One gradient per trainable tensor, in the parameter's dtype."""
    return p.trainable


def _lorafa_state(p: _Params) -> tuple[int, int, int]:
    """PEFT's LoraFAOptimizer (peft/optimizers/lorafa.py LoraFAOptimizer.step): exp_avg_B and
    exp_avg_sq_B (zeros_like B; `step` a Python int), one lora_B at a time. For each B it
    projects the gradient through (A A^T)^-1 under bf16 autocast (a half copy of the gradient
    and the half product), scales it (half), casts it back to B's dtype and takes
    sqrt(exp_avg_sq) + eps; the previous B's projected gradient and denominator stay bound to
    their Python names until these replace them. The largest of those moments over each
    pair of consecutive Bs (the last layer's last B precedes nothing, the loop's order repeats
    layer by layer)."""
    state = 2 * p.trainable
    sizes = [(_blk(t.elements * t.itemsize), t.elements) for t in p.tensors]
    temps = 0
    for (prev, _), (full, elements) in zip([sizes[-1], *sizes[:-1]], sizes, strict=True):
        half = _blk(elements * LORAFA_AUTOCAST_BYTES)
        # the product with the previous B's two, then the cast-back beside the previous
        # denominator and the scaled half, then the new denominator beside that one
        temps = max(temps, 2 * prev + 2 * half, prev + half + full, prev + 2 * full)
    return state, 0, temps


def _optimizer_state(p: _Params, optim: Optim) -> tuple[int, int, int]:
    """(state bytes inside torch's allocator, state bytes outside it, step temporaries), as
    the optimizer's descriptor (`service.core.libs.optimizers`) lays its state out."""
    opt = OPTIMIZERS[optim]
    state = 0
    for t in p.tensors:
        nbytes = _blk(t.elements * t.itemsize)
        sizes = opt.state_sizes(nbytes, t.elements, (t.rows, t.cols, t.itemsize))
        state += t.count * sum(_blk(n) for n in sizes)
    if opt.device_step:
        state += sum(t.count for t in p.tensors) * _blk(FP32_BYTES)
    temps = 0
    if opt.temporaries is Temporaries.STATE_COPY:
        temps = p.trainable
    elif opt.temporaries is Temporaries.FP32_COPIES:
        largest = max((t.elements for t in p.tensors), default=0)
        temps = FP32_COPIES * _blk(largest * FP32_BYTES)
    return (0, state, temps) if opt.paged else (state, 0, temps)
