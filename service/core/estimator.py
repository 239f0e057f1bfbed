"""Peak GPU memory of one training step, computed from tensor shapes and dtypes.

The allocated level is modelled tensor by tensor, as the HF Trainer + PEFT step creates and
frees them: each tensor's bytes rounded to the caching allocator's 512 B block, shared
storages counted once. The peak is the maximum over the step's phases, for step 1 (no
optimizer state yet) and the steady state. Reserved and device levels add priors that
calibration refines (`service.core.overhead`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import StrEnum
from functools import lru_cache
from typing import NamedTuple

from service.core.allocator import AllocatorConfig
from service.core.architecture import Linear, LinearKind, MlpKind, ModelArch, NormKind
from service.core.device import CUBLASLT_WORKSPACE, cublas_workspace, device_row
from service.core.errors import InvalidSpecError
from service.core.overhead import AboveAllocated, Uncertainty, levels
from service.core.reserved import ReservedPlan, reserved_gap, resolve_kernel
from service.core.result import Estimate, ParamCounts, PeakLevels, Phase, PhasePeak
from service.core.schedule import Kernel
from service.core.spec import (
    ALL_LINEAR,
    AttnImpl,
    Framework,
    LoraSpec,
    LossImpl,
    Method,
    Offload,
    Optim,
    QuantSpec,
    QuantType,
    ResolvedSpec,
    SdpaKernel,
    Strategy,
    TrainingSpec,
    resolve,
)
from service.core.units import (
    DTYPE_BYTES,
    FP32_BYTES,
    GIB,
    INT64_BYTES,
    UINT8_BYTES,
    DType,
)

ESTIMATOR_VERSION = "0.1.0"

# CUDACachingAllocator rounds every block up to kMinBlockSize = 512 B
# (c10/cuda/CUDACachingAllocator.cpp).
ALLOC_BLOCK = 512

# bitsandbytes 4-bit: two 4-bit values per uint8, one fp32 absmax per block of 64
# (bitsandbytes/functional.py quantize_4bit, blocksize=64); double quant stores the absmax
# as uint8 with one fp32 absmax per 256 of them plus a 256-entry fp32 code and an fp32 offset
# (quantize_blockwise, blocksize=256).
NF4_VALUES_PER_BYTE = 2
NF4_BLOCK = 64
NESTED_BLOCK = 256
NESTED_CODE_ENTRIES = 256
NF4_CODE_ENTRIES = 16  # quant_state.code: the 16 NF4/FP4 levels, fp32
# LLM.int8 (bitsandbytes Linear8bitLt): int8 weight plus one fp32 scale per output row (SCB).
INT8_BYTES = 1

# bitsandbytes 8-bit optimizers: uint8 state per element, one fp32 absmax per 256-element
# block (bitsandbytes/optim/optimizer.py Optimizer2State, blockwise=True); parameters with
# fewer than min_8bit_size = 4096 elements keep fp32 states.
BNB_8BIT_BLOCK = 256
BNB_MIN_8BIT_SIZE = 4096

# Cross-entropy in transformers' ForCausalLMLoss (loss/loss_utils.py): logits.float() then
# F.cross_entropy. Live bytes per logit element:
#   end of forward: bf16 logits (2) + fp32 copy (4) + fp32 log-probs (4);
#   start of backward: saved log-probs (4) + NLL grad (4) + LogSoftmax grad (4).
HF_LOSS_SAVED_PER_ELEM = FP32_BYTES  # log_softmax output kept for backward
# torchtune CEWithChunkedOutputLoss splits the sequence in 8 chunks
# (torchtune/modules/loss/ce_chunked_output_loss.py num_output_chunks=8).
TORCHTUNE_CE_CHUNKS = 8
# LitGPT's chunked lm_head + cross-entropy over 128 tokens (litgpt/finetune/lora.py,
# lm_head_chunk_size=128; litgpt/utils.py chunked_cross_entropy chunk_size=128).
LITGPT_CE_CHUNK_TOKENS = 128
# What LitGPT's LoRA fine-tuning keeps beyond an HF + PEFT step, read from the sources behind its
# published resource tables (lit-gpt commit 8641822 with lightning 71aed751 and bitsandbytes
# 0.41.1) and checked tensor by tensor against a storage trace of those sources:
# * Fabric's _FabricModule.forward ends with precision.convert_output(), which casts every
#   floating output to torch.get_default_dtype(), fp32 (lightning/fabric/plugins/precision/
#   half.py and bitsandbytes.py convert_output): the bf16 lm_head chunks become an fp32 list that
#   finetune/lora.py keeps as `logits` through backward, and chunked_cross_entropy's log_softmax
#   saves fp32 chunks.
LITGPT_LOGITS_BYTES = FP32_BYTES
# * bitsandbytes 0.41.1 MatMul4Bit (autograd/_functions.py) computes
#   F.linear(A, dequantize_4bit(B, state).to(A.dtype).t()) in forward and again in backward:
#   the weight in the quant_state dtype and its cast to the compute dtype exist together. The
#   quant_state dtype is fp16 because lightning's _Linear4bit._quantize_weight casts the weight
#   to half before quantize_4bit.
LITGPT_QUANT_STATE_BYTES = 2  # fp16


# The estimate's stated uncertainty (relative standard deviations; the safe bound adds 1.645 of
# them, `service.core.overhead`). Allocated level: the traced HF + PEFT step (HF Trainer's mixed
# precision included), where every reference trace is matched within 1 %
# (tests/core/test_references.py) and the measured H200 runs within about that
# (tests/data/gpu/); steps no trace checks: framework presets and multi-GPU strategies
# (published rows off by up to 60 % for FSDP / ZeRO-3).
ALLOCATED_SIGMA_TRACED = 0.01
ALLOCATED_SIGMA_PRESET = 0.05
ALLOCATED_SIGMA_PARALLEL = 0.25
# Reserved level, as a share of reserved - allocated: the schedule replayed through the
# allocator model matches the tracer's replay within 2 % of reserved on the reference traces of
# the families it schedules op by op (about a quarter of the allocator's share), and coarser
# elsewhere (MoE experts as one wide MLP, untraced steps).
RESERVED_SIGMA_TRACED = 0.25
RESERVED_SIGMA_APPROXIMATE = 0.5
SCHEDULED_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2"})
# A 4-bit base is quantized on the GPU as it loads: each linear's bf16 weight is freed once
# packed, and where the packed tensors land among those freed blocks depends on the loader
# (from_pretrained quantizes one weight at a time; a model built on the GPU and quantized layer
# by layer holds every bf16 weight first). The estimate replays the weights as if allocated in
# their final form. The same Qwen2.5-7B QLoRA job reserved 1.27 GiB more after a
# build-then-quantize load (tests/data/gpu/h200_set1.jsonl, q7-qlora-b4s2048-gc) than after the
# probe's direct build (h200_set2.jsonl): 9.7 % of the quantized weights' bf16 bytes. One
# standard deviation of reserved: this share of those bytes.
QUANTIZED_LOAD_SIGMA = 0.08
# Gradient accumulation: the reserved level's replay runs at most this many micro-batches per
# optimizer step (the first creates the gradients, later ones add into them in place).
REPLAYED_MICRO_BATCHES = 3


# HF Trainer's mixed precision computes in bf16 or fp16 (TrainingArguments bf16/fp16).
AUTOCAST_BYTES = 2


def _blk(nbytes: int) -> int:
    """Bytes the allocator hands out for a request of `nbytes`."""
    if nbytes <= 0:
        return 0
    return -(-nbytes // ALLOC_BLOCK) * ALLOC_BLOCK


class _Kind(StrEnum):
    """How a saved tensor's size scales with the micro-batch b and sequence length s."""

    TOKENS = "b*s"
    TOKENS_PAD32 = "b*ceil32(s)"  # memory-efficient attention pads its logsumexp
    SQUARE = "b*s*s"  # eager attention's scores and probabilities


class _Ledger:
    """A layer's saved tensors by identity (a storage saved by several ops counts once), each
    as bytes per unit of its `_Kind`; `bytes_at(b, s)` rounds each tensor to the block."""

    __slots__ = ("items",)

    def __init__(self) -> None:
        self.items: dict[str, tuple[int, _Kind]] = {}

    def add(self, key: str, per_token: int, kind: _Kind = _Kind.TOKENS) -> None:
        if key not in self.items:
            self.items[key] = (per_token, kind)

    def recipe(self) -> tuple[tuple[int, _Kind, int], ...]:
        """(bytes per unit, kind, how many tensors of that size)."""
        counts: dict[tuple[int, _Kind], int] = {}
        for item in self.items.values():
            counts[item] = counts.get(item, 0) + 1
        return tuple((coef, kind, n) for (coef, kind), n in counts.items())


@lru_cache(maxsize=4096)
def _recipe_bytes(recipe: tuple[tuple[int, _Kind, int], ...], b: int, s: int) -> int:
    units = {
        _Kind.TOKENS: b * s,
        _Kind.TOKENS_PAD32: b * (-(-s // 32) * 32),
        _Kind.SQUARE: b * s * s,
    }
    return sum(n * _blk(coef * units[kind]) for coef, kind, n in recipe)


# ---------------------------------------------------------------------------------------------
# Which modules train


def default_target_modules(arch: ModelArch) -> tuple[str, ...]:
    """PEFT's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING (peft/utils/constants.py)."""
    defaults = {
        "llama": ("q_proj", "v_proj"),
        "mistral": ("q_proj", "v_proj"),
        "mixtral": ("q_proj", "v_proj"),
        "qwen2": ("q_proj", "v_proj"),
        "qwen3": ("q_proj", "v_proj"),
        "gemma": ("q_proj", "v_proj"),
        "gemma2": ("q_proj", "v_proj"),
        "gemma3_text": ("q_proj", "v_proj"),
        "stablelm": ("q_proj", "v_proj"),
        "phi": ("q_proj", "v_proj", "fc1", "fc2"),
        "gpt_neox": ("query_key_value",),
        "chatglm": ("query_key_value",),
    }
    if arch.model_type not in defaults:
        raise InvalidSpecError(
            "lora.target_modules",
            f"PEFT has no default target modules for model_type {arch.model_type!r}; name them",
        )
    return defaults[arch.model_type]


def adapted_linears(arch: ModelArch, rs: ResolvedSpec) -> tuple[Linear, ...]:
    """The decoder-layer linears that carry a LoRA adapter."""
    if rs.lora is None:
        return ()
    targets = rs.lora.target_modules
    candidates = [lin for lin in arch.linears if not lin.expert]
    if targets == ALL_LINEAR:
        return tuple(candidates)
    names = default_target_modules(arch) if targets is None else tuple(targets)
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
            "lora.target_modules",
            f"{', '.join(unknown or names)} not in this model (its linear layers: {known})",
        )
    return chosen


# ---------------------------------------------------------------------------------------------
# Parameters, gradients, optimizer state


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


def _quantized_weight_bytes(lin: Linear, quant: QuantSpec | None) -> int:
    return _quantized_matrix_bytes(lin.in_features, lin.out_features, quant)


def _quantized_matrix_bytes(in_features: int, out_features: int, quant: QuantSpec | None) -> int:
    if quant is None:
        raise InvalidSpecError("quantization", "required for method 'qlora'")
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
) -> _Params:
    """Weights by role. Every decoder layer is alike, so one is counted and multiplied.
    Cached: it depends on the model and method, not on batch or sequence length.

    `head_quantized`: the LM head is a 4-bit linear too (LitGPT's QLoRA: Fabric's
    BitsandbytesPrecision replaces every torch.nn.Linear, lm_head included)."""
    md = DTYPE_BYTES[dtype]
    kbit = method is Method.QLORA
    prep = kbit and quant is not None and quant.prepare_kbit
    # prepare_model_for_kbit_training casts every parameter that is not 4/8-bit to fp32
    # (peft/utils/other.py: param.data = param.data.to(torch.float32)).
    other = FP32_BYTES if prep else md
    full = method is Method.FULL
    saved_modules = set(lora.modules_to_save) if lora else set()
    L = arch.num_hidden_layers

    frozen = 0
    trainable: list[_Tensor] = []

    def put(rows: int, cols: int, itemsize: int, count: int, train: bool) -> None:
        nonlocal frozen
        tensor = _Tensor(rows, cols, itemsize, count)
        if train:
            trainable.append(tensor)
        else:
            frozen += tensor.nbytes

    for lin in arch.linears:
        if kbit and not lin.expert:
            frozen += L * _quantized_weight_bytes(lin, quant)
        else:
            # transformers 5 keeps a stack of experts as one 3-D parameter.
            put(lin.out_features * lin.count, lin.in_features, md, L, full)
        if lin.bias:
            put(lin.out_features * lin.count, 0, other if kbit else md, L, full)
    norm_tensors = arch.norms_per_layer * (2 if arch.norm is NormKind.LAYER else 1)
    put(arch.hidden_size, 0, other, L * norm_tensors, full)
    if arch.qk_norm:
        put(arch.head_dim, 0, other, 2 * L, full)

    layers_end = len(trainable)
    put(arch.vocab_size, arch.hidden_size, other, 1, full)
    if "embed_tokens" in saved_modules and not full:
        # ModulesToSaveWrapper trains a copy and keeps the original.
        trainable.append(_Tensor(arch.vocab_size, arch.hidden_size, other, 1))
    embed_trainable = sum(t.nbytes for t in trainable[layers_end:])
    head_start = len(trainable)
    put(arch.hidden_size, 0, other, 2 if arch.norm is NormKind.LAYER else 1, full)
    if not arch.tie_word_embeddings:
        if head_quantized:
            frozen += _quantized_matrix_bytes(arch.hidden_size, arch.vocab_size, quant)
        else:
            put(arch.vocab_size, arch.hidden_size, other, 1, full)
        if arch.lm_head_bias:
            put(arch.vocab_size, 0, other, 1, full)
        if "lm_head" in saved_modules and not full:
            trainable.append(_Tensor(arch.vocab_size, arch.hidden_size, other, 1))
    head_trainable = sum(t.nbytes for t in trainable[head_start:])

    if lora is not None:
        ad = DTYPE_BYTES[adapter_dtype]
        r = lora.r
        for lin in adapted:
            trainable.append(_Tensor(r, lin.in_features, ad, L))  # lora_A
            trainable.append(_Tensor(lin.out_features, r, ad, L))  # lora_B
    return _Params(
        frozen=frozen,
        trainable=sum(t.nbytes for t in trainable),
        tensors=tuple(trainable),
        total_count=arch.total_params,
        trainable_count=sum(t.elements * t.count for t in trainable),
        embed_trainable=embed_trainable,
        head_trainable=head_trainable,
    )


def _gradients(p: _Params) -> int:
    """One gradient per trainable tensor, in the parameter's dtype."""
    return p.trainable


def _optimizer_state(p: _Params, optim: Optim) -> tuple[int, int, int]:
    """(state bytes inside torch's allocator, state bytes outside it, step temporaries)."""
    tensors = p.tensors
    if optim is Optim.SGD:
        # HF "sgd" is torch.optim.SGD with momentum 0: no state (transformers/trainer.py).
        return 0, 0, 0
    if optim in (Optim.ADAMW_TORCH, Optim.ADAMW_TORCH_FUSED):
        # exp_avg and exp_avg_sq take the parameter's dtype (torch/optim/adamw.py _init_group).
        state = 2 * p.trainable
        if optim is Optim.ADAMW_TORCH_FUSED:
            # fused AdamW keeps each parameter's `step` as an fp32 scalar on the device
            # (torch/optim/adamw.py _init_group: device=p.device if capturable or fused);
            # foreach keeps it on the host.
            state += sum(t.count for t in p.tensors) * _blk(FP32_BYTES)
        # foreach AdamW's torch._foreach_sqrt(exp_avg_sqs) allocates one state-sized copy
        # (torch/optim/adamw.py _multi_tensor_adamw); fused and for-loop do not.
        temps = p.trainable if optim is Optim.ADAMW_TORCH else 0
        return state, 0, temps
    if optim in (Optim.ADAMW_BNB_8BIT, Optim.PAGED_ADAMW_8BIT):
        state = 0
        for t in tensors:
            e = t.elements
            if e < BNB_MIN_8BIT_SIZE:
                state += t.count * 2 * _blk(e * FP32_BYTES)
            else:
                absmax = _blk(-(-e // BNB_8BIT_BLOCK) * FP32_BYTES)
                state += t.count * 2 * (_blk(e * UINT8_BYTES) + absmax)
        paged = optim is Optim.PAGED_ADAMW_8BIT
        return (0, state, 0) if paged else (state, 0, 0)
    if optim is Optim.PAGED_ADAMW_32BIT:
        # bitsandbytes 32-bit states are fp32 whatever the parameter's dtype; paged states live
        # in CUDA managed memory, outside torch's allocator counters (bitsandbytes/optim).
        return 0, sum(t.count * 2 * _blk(t.elements * FP32_BYTES) for t in tensors), 0
    # Adafactor (transformers/optimization.py, beta1=None as HF Trainer builds it): for a 2-D
    # parameter, row and column second moments in the gradient's dtype; for 1-D, a full one.
    # step() works one parameter at a time on fp32 copies of the gradient and the parameter
    # and an fp32 update: three fp32 copies of the largest parameter.
    state = 0
    for t in tensors:
        if t.cols:
            state += t.count * (_blk(t.rows * t.itemsize) + _blk(t.cols * t.itemsize))
        else:
            state += t.count * _blk(t.rows * t.itemsize)
    largest = max((t.elements for t in tensors), default=0)
    return state, 0, 3 * _blk(largest * FP32_BYTES)


# ---------------------------------------------------------------------------------------------
# Activations


@dataclass(frozen=True, slots=True)
class _Flow:
    """Element sizes of the tensors flowing through a layer."""

    residual: int  # the residual stream
    norm_out: int  # what the norms hand to the linears
    attn: int  # q/k/v after RoPE, attention output
    adapter: int
    lora_targets: frozenset[str]
    full: bool
    r: int
    dropout: bool
    autocast: bool
    # q, k, v come from one fused projection, so the saved v view keeps its whole output alive.
    fused_qkv: bool
    quantized: bool
    # bitsandbytes <= 0.41 (MatMul4Bit.forward: ctx.tensors = (A, B)) kept the 4-bit
    # linear's input for backward; LitGPT's published QLoRA tables were measured with 0.41.1.
    quant_saves_input: bool
    # LitGPT's LoRAQKVLinear.zero_pad (lit_gpt/lora.py) index_copies the adapters' q/k/v output,
    # `zero_pad_width` features per token, into the fused qkv width when q, k and v are not all
    # adapted; index_copy's backward keeps that source (autograd's index_copy formula,
    # grad.index_select(dim, index).expand_as(source)). 0: no such copy.
    zero_pad_width: int = 0
    # LitGPT's CausalSelfAttention reshapes SDPA's (B, nh, T, hs) output to (B, T, C) through
    # y.transpose(1, 2).reshape(...), a copy: the output projection's input is its own storage.
    proj_input_copy: bool = False
    # The LM head is a 4-bit linear that keeps its input (LitGPT QLoRA with bitsandbytes 0.41.1).
    head_quantized: bool = False


def _litgpt_zero_pad_width(arch: ModelArch, adapted: tuple[Linear, ...]) -> int:
    """Features per token of the adapters' q/k/v output that LitGPT's zero_pad index_copies; 0
    when q, k and v are all adapted (zero_pad then returns its input unchanged)."""
    qkv = [lin for lin in arch.linears if lin.kind is LinearKind.ATTN_QKV and not lin.expert]
    names = {lin.name for lin in adapted}
    if arch.fused_qkv_linear:
        # One fused projection (GPT-NeoX's query_key_value): LitGPT adapts its parts through
        # to_query / to_key / to_value, and finetune/lora.py enables query and value.
        return arch.q_dim + arch.kv_dim if qkv[0].name in names else 0
    chosen = [lin for lin in qkv if lin.name in names]
    if not chosen or len(chosen) == len(qkv):
        return 0
    return sum(lin.out_features for lin in chosen)


def _flow(arch: ModelArch, rs: ResolvedSpec, adapted: tuple[Linear, ...]) -> _Flow:
    spec = rs.spec
    md = DTYPE_BYTES[spec.dtype]
    prep = (
        spec.method is Method.QLORA and rs.quantization is not None and rs.quantization.prepare_kbit
    )
    # prepare_model_for_kbit_training leaves embeddings and norms in fp32, so the residual
    # stream and every 4-bit linear's output (cast back to its input dtype by bnb's
    # Linear4bit.forward) run in fp32.
    residual = FP32_BYTES if prep else md
    if spec.autocast:
        norm_out = residual
        attn = DTYPE_BYTES[DType.BF16] if spec.dtype is DType.FP32 else md
    else:
        norm_out = residual
        attn = residual
    lora = rs.lora
    targets = frozenset(lin.name for lin in adapted)
    litgpt = spec.framework is Framework.LITGPT
    return _Flow(
        residual=residual,
        norm_out=norm_out,
        attn=attn,
        adapter=DTYPE_BYTES[rs.adapter_dtype],
        lora_targets=targets,
        full=spec.method is Method.FULL,
        r=lora.r if lora else 0,
        dropout=bool(lora and rs.lora_dropout > 0),
        fused_qkv=spec.framework is Framework.LITGPT
        or sum(1 for lin in arch.linears if lin.kind is LinearKind.ATTN_QKV) == 1,
        quantized=spec.method is Method.QLORA,
        quant_saves_input=spec.method is Method.QLORA and spec.framework is Framework.LITGPT,
        autocast=spec.autocast,
        zero_pad_width=_litgpt_zero_pad_width(arch, adapted) if litgpt and lora else 0,
        proj_input_copy=litgpt,
        head_quantized=litgpt
        and spec.method is Method.QLORA
        and not arch.tie_word_embeddings
        and rs.quantization is not None
        and rs.quantization.type is not QuantType.INT8,
    )


def _linear_saves(
    led: _Ledger, f: _Flow, lin: Linear, x_key: str, x_bytes: int, *, input_grad: bool = True
) -> None:
    """What one linear keeps for backward, given its input tensor `x_key` (`input_grad`: whether
    that input needs a gradient; bitsandbytes 0.41.1 keeps it only then)."""
    if f.full or (f.quant_saves_input and input_grad and not lin.expert):
        led.add(x_key, lin.in_features * x_bytes)  # weight grad needs the input
    if lin.name not in f.lora_targets:
        return
    # A fused q/k/v projection has one adapter input (cast or dropout) shared by q, k and v.
    lin_key = "qkv" if f.fused_qkv and lin.kind is LinearKind.ATTN_QKV else lin.name
    # PEFT lora.Linear.forward: x = self._cast_input_dtype(x, lora_A.weight.dtype), then
    # lora_B(lora_A(dropout(x))): lora_A saves its input, lora_B saves lora_A's output.
    in_bytes = f.adapter
    shared = in_bytes == x_bytes
    if f.autocast:
        # Autocast runs lora_A in half precision: it casts its input to a half copy that the
        # matmul saves, one per adapted linear (the input is no leaf, so the cast is not
        # cached). PEFT's lora.Linear first casts the input to the adapters' dtype (always);
        # its bitsandbytes layers do not under autocast (peft/tuners/lora/bnb.py
        # requires_conversion). The layer's own input is saved when nothing casts it.
        in_bytes = AUTOCAST_BYTES
        peft_dtype = x_bytes if f.quantized and not lin.expert else f.adapter
        shared = x_bytes == peft_dtype == AUTOCAST_BYTES
    cast_key = x_key if shared else f"{x_key}>{lin_key}"
    if f.dropout:
        led.add(f"{lin_key}.dropout_out", lin.in_features * in_bytes)
        led.add(f"{lin_key}.dropout_mask", lin.in_features)  # bool mask
    else:
        led.add(cast_key, lin.in_features * in_bytes)
    led.add(f"{lin.name}.lora_a_out", f.r * in_bytes)
    if lin.kind is LinearKind.ATTN_QKV and f.zero_pad_width:
        led.add("qkv.zero_pad_source", f.zero_pad_width * in_bytes)


def _norm_saves(led: _Ledger, f: _Flow, key: str, x_key: str, h: int, arch: ModelArch) -> None:
    """RMSNorm (LlamaRMSNorm): saves an fp32 copy of its input and the rsqrt per token."""
    if arch.norm is NormKind.RMS:
        fp32_key = x_key if f.residual == FP32_BYTES else f"{key}.fp32"
        led.add(fp32_key, h * FP32_BYTES)
        led.add(f"{key}.rstd", FP32_BYTES)
        if f.full:
            led.add(f"{key}.normed", h * f.residual)  # weight grad needs it
    else:
        # nn.LayerNorm: saves its input, mean and rstd (fp32) per token.
        led.add(x_key, h * f.residual)
        led.add(f"{key}.mean", FP32_BYTES)
        led.add(f"{key}.rstd", FP32_BYTES)


def _attention_saves(led: _Ledger, f: _Flow, arch: ModelArch, spec: _AttnChoice) -> None:
    q_bytes = arch.q_dim * f.attn
    kv_bytes = arch.kv_dim * f.attn
    n_h = arch.num_attention_heads
    impl = spec.attn_implementation
    kernel = spec.sdpa_kernel
    if impl is AttnImpl.SDPA and kernel is SdpaKernel.AUTO:
        # On a GPU, PyTorch picks the flash kernel for fp16/bf16 without an explicit mask (a
        # sliding window shorter than the sequence makes transformers build one); for fp32,
        # the math kernel when transformers passes grouped key/value heads (enable_gqa, with
        # no mask), else the memory-efficient one (torch._fused_sdp_choice on an H200,
        # tests/data/gpu/h200_environment.json; service/trace/kernels.py).
        half = f.attn == 2
        gqa = arch.num_key_value_heads < n_h and not spec.windowed
        if half and not spec.windowed:
            kernel = SdpaKernel.FLASH
        else:
            kernel = SdpaKernel.MATH if gqa and not half else SdpaKernel.EFFICIENT
    led.add("q_rope", q_bytes)
    v_key, v_bytes = ("qkv_out", q_bytes + 2 * kv_bytes) if f.fused_qkv else ("v", kv_bytes)
    if impl is AttnImpl.FLASH_ATTENTION_2 or (impl is AttnImpl.SDPA and kernel is SdpaKernel.FLASH):
        # flash saves q, k, v (GQA native), output and the fp32 logsumexp (b, n_h, s).
        led.add("k_rope", kv_bytes)
        led.add(v_key, v_bytes)
        led.add("attn_out", q_bytes)
        led.add("lse", n_h * FP32_BYTES)
        return
    if impl is AttnImpl.SDPA and kernel is SdpaKernel.EFFICIENT:
        # mem-efficient saves k/v expanded to n_h heads (repeat_kv) and an fp32 logsumexp
        # padded to a multiple of 32 queries (aten/src/ATen/native/transformers/cuda).
        led.add("k_rep", q_bytes)
        led.add("v_rep", q_bytes)
        led.add("attn_out", q_bytes)
        led.add("lse", n_h * FP32_BYTES, _Kind.TOKENS_PAD32)
        if spec.windowed:
            # the boolean window mask, converted to an additive bias in the attention dtype
            # per call and saved by the kernel (b, 1, s, s)
            led.add("attn_bias", f.attn, _Kind.SQUARE)
        return
    if impl is AttnImpl.SDPA and kernel is SdpaKernel.MATH and f.attn == FP32_BYTES:
        # SDPA's math composite on fp32 q, k, v (aten _scaled_dot_product_attention_math, as
        # the tracer runs it op by op): value repeated to n_h heads, the scaled key's
        # contiguous copy (saved by the score matmul), the fp32 probabilities, and the
        # output's contiguous copy (saved by o_proj's LoRA, which takes fp32 as it is).
        led.add("v_rep", q_bytes)
        led.add("k_contiguous", q_bytes)
        led.add("attn_out", q_bytes)
        led.add("probs", n_h * FP32_BYTES, _Kind.SQUARE)
        return
    if impl is AttnImpl.SDPA and kernel is SdpaKernel.MATH:
        # SDPA's math backend (aten _scaled_dot_product_attention_math) decomposes into
        # ops that keep, per the reference tracer (tests/data/traces/*sdpa-math*): k and v
        # repeated to n_h heads, scaled copies of q and k, the output, and two score-sized
        # tensors in the attention dtype (the softmax output and _safe_softmax's masked copy).
        led.add("k_rep", q_bytes)
        led.add("v_rep", q_bytes)
        led.add("q_scaled", q_bytes)
        led.add("k_scaled", q_bytes)
        led.add("attn_out", q_bytes)
        led.add("probs", n_h * f.attn, _Kind.SQUARE)
        led.add("probs_safe", n_h * f.attn, _Kind.SQUARE)
        return
    # eager: scores and probabilities materialised per head.
    if arch.attn_logit_softcapping is not None:
        # Gemma-2's eager attention caps the scores: tanh saves its output.
        led.add("scores_tanh", n_h * f.attn, _Kind.SQUARE)
    led.add("k_rep", q_bytes)
    if f.fused_qkv and arch.num_key_value_heads == n_h and spec.single:
        # The value, a strided view of the fused projection's output, reshapes for probs @ v
        # without a copy when there is one sequence: the matmul keeps that whole output.
        led.add("qkv_out", q_bytes + 2 * kv_bytes)
    else:
        led.add("v_rep", q_bytes)
    led.add("probs_fp32", n_h * FP32_BYTES, _Kind.SQUARE)  # softmax(dtype=float32) output
    if f.attn != FP32_BYTES:
        # .to(query.dtype), saved by probs @ v; a no-op (the same storage) when q is fp32
        led.add("probs", n_h * f.attn, _Kind.SQUARE)
    # probs @ v saves its inputs, not its output: the output (transposed into o_proj's input,
    # "attn_out") is kept only if o_proj saves its input.


def _mlp_saves(
    led: _Ledger,
    f: _Flow,
    arch: ModelArch,
    x_key: str,
    *,
    at_up_proj: bool = False,
    input_grad: bool = True,
) -> None:
    """The MLP's saved tensors; with `at_up_proj`, what is live while the last input
    projection's LoRA output is formed (see `_layer_recipe`)."""
    i_size = arch.intermediate_size
    out = f.norm_out
    by_kind = {lin.kind: lin for lin in arch.linears if not lin.expert}
    mlp_in = [lin for lin in arch.linears if lin.kind is LinearKind.MLP_IN and not lin.expert]
    down = by_kind.get(LinearKind.MLP_OUT)
    for lin in mlp_in:
        _linear_saves(led, f, lin, x_key, out, input_grad=input_grad)
    if arch.is_moe:
        _moe_saves(led, f, arch, x_key)
        return
    if arch.mlp is MlpKind.GATED:
        fused = len(mlp_in) == 1  # one gate_up projection (Phi-3): its act comes after it
        if not fused or not at_up_proj:
            # act(gate) saves gate; act(gate) * up saves both operands.
            led.add("mlp.gate_out", i_size * out)
            led.add("mlp.act_out", i_size * out)
        if at_up_proj:
            up = mlp_in[-1]
            width = up.out_features
            # Live beside the saved tensors: the MLP's input and the residual it will be added
            # to, and up_proj's output in the making: the base output, lora_B's output and
            # its scaled copy (peft lora.Linear.forward), as the reference traces show.
            led.add(x_key, arch.hidden_size * out)
            led.add("x_mid", arch.hidden_size * f.residual)
            led.add("up.base_out", width * out)
            if up.name in f.lora_targets:
                ad = AUTOCAST_BYTES if f.autocast else f.adapter
                led.add("up.lora_b_out", width * ad)
                led.add("up.lora_scaled", width * ad)
            return
        led.add("mlp.up_out", i_size * out)
    else:
        led.add("mlp.fc1_out", i_size * out)  # GELU saves its input
    if down is not None:
        _linear_saves(led, f, down, "mlp.product", out)


def _moe_saves(led: _Ledger, f: _Flow, arch: ModelArch, x_key: str) -> None:
    """Routed experts (transformers 5 MixtralExperts / Qwen2MoeExperts, frozen 3-D weights):
    per token, its k experts' gate_up output (kept whole by the chunked views that act and
    mul save), the activation, and the down output that the routing weight multiplies; the
    router's fp32 softmax and top-k indices; a shared expert like a dense MLP, gated by a
    sigmoid that saves its output and the shared output it multiplies."""
    e = arch.num_experts
    k = arch.num_experts_per_tok
    i_size = arch.expert_intermediate_size
    out = f.norm_out
    led.add("moe.router_probs", e * FP32_BYTES)  # softmax(router_logits, dtype=float)
    led.add("moe.topk_indices", k * INT64_BYTES)
    led.add("moe.gate_up", k * 2 * i_size * out)
    led.add("moe.act", k * i_size * out)
    led.add("moe.down_out", k * arch.hidden_size * out)
    if arch.shared_expert_intermediate_size:
        si = arch.shared_expert_intermediate_size
        led.add("shared.gate_out", si * out)
        led.add("shared.up_out", si * out)
        led.add("shared.act_out", si * out)
        led.add("shared.sigmoid", out)
        led.add("shared.out", arch.hidden_size * out)
        for lin in arch.linears:
            if lin.kind is LinearKind.MLP_OUT and not lin.expert:
                _linear_saves(led, f, lin, "shared.product", out)
            if lin.kind is LinearKind.SHARED_GATE:
                _linear_saves(led, f, lin, x_key, out)


def layer_saved_bytes(
    arch: ModelArch, rs: ResolvedSpec, b: int, s: int, *, input_needs_grad: bool = True
) -> int:
    """Bytes one decoder layer keeps for backward, without checkpointing.

    `input_needs_grad` is False for the first layer of a LoRA/QLoRA model without
    checkpointing: the frozen embedding's output takes no gradient, so autograd records
    nothing for the first norm (its fp32 copy and rstd are never saved).
    """
    f = _flow(arch, rs, adapted_linears(arch, rs))
    return _recipe_bytes(
        _layer_recipe(arch, f, rs.spec.attn_implementation, rs.spec.sdpa_kernel, input_needs_grad),
        b,
        s,
    )


@lru_cache(maxsize=4096)
def _layer_recipe(
    arch: ModelArch,
    f: _Flow,
    attn: AttnImpl,
    kernel: SdpaKernel,
    input_needs_grad: bool,
    at_up_proj: bool = False,
    windowed: bool = False,
    until_attention: bool = False,
    single: bool = False,
) -> tuple[tuple[int, _Kind, int], ...]:
    """A decoder layer's saved tensors, sized per unit of batch and sequence (cached: the
    shapes depend on the model and settings, not on b or s).

    With `at_up_proj`: what is live when the layer's forward (or its recomputation under
    checkpointing) forms the MLP's last input projection, the largest moment of a LoRA
    layer's forward: every tensor saved so far, the MLP's inputs and up_proj's output with
    its fp32 LoRA branch."""
    led = _Ledger()
    h = arch.hidden_size
    spec_like = _AttnChoice(attn, kernel, windowed, single)
    if input_needs_grad:
        _norm_saves(led, f, "norm1", "x_in", h, arch)
    for lin in arch.linears:
        if lin.kind is LinearKind.ATTN_QKV:
            _linear_saves(led, f, lin, "norm1.out", f.norm_out, input_grad=input_needs_grad)
    _attention_saves(led, f, arch, spec_like)
    if until_attention:
        # What the scores' backward still finds: o_proj's backward has consumed its input, and
        # probs @ v's backward the repeated value (eager: and the probabilities' copy in the
        # attention dtype, or the fused projection's output that the value view held).
        for key in ("attn_out", "v_rep", "probs", "qkv_out"):
            if key != "probs" or attn is AttnImpl.EAGER:
                led.items.pop(key, None)
        return led.recipe()
    proj_key = "attn_out.reshaped" if f.proj_input_copy else "attn_out"
    for lin in arch.linears:
        if lin.kind is LinearKind.ATTN_OUT:
            _linear_saves(led, f, lin, proj_key, f.attn)
    # A parallel-residual MLP reads the layer input: in a first layer whose input takes no
    # gradient, the MLP records nothing for backward unless one of its linears trains.
    mlp_trains = f.full or any(
        lin.name in f.lora_targets
        for lin in arch.linears
        if lin.kind in (LinearKind.MLP_IN, LinearKind.MLP_OUT)
    )
    mlp_input_grad = input_needs_grad or not arch.parallel_residual
    if arch.parallel_residual and arch.norms_per_layer == 1:
        mlp_in_key = "norm1.out"
    else:
        # GPT-NeoX's parallel residual feeds both norms the layer input.
        if mlp_input_grad:
            _norm_saves(led, f, "norm2", "x_in" if arch.parallel_residual else "x_mid", h, arch)
        mlp_in_key = "norm2.out"
    if arch.norms_per_layer == 4:
        # Gemma-2's post-attention and post-feedforward norms act on branch outputs.
        _norm_saves(led, f, "norm3", "attn_proj", h, arch)
        _norm_saves(led, f, "norm4", "mlp_proj", h, arch)
    if mlp_input_grad or mlp_trains:
        _mlp_saves(led, f, arch, mlp_in_key, at_up_proj=at_up_proj, input_grad=mlp_input_grad)
    return led.recipe()


@dataclass(frozen=True, slots=True)
class _AttnChoice:
    attn_implementation: AttnImpl
    sdpa_kernel: SdpaKernel
    windowed: bool  # a sliding window shorter than the sequence: an explicit mask
    single: bool = False  # one sequence per micro-batch


# ---------------------------------------------------------------------------------------------
# Logits and loss


@dataclass(frozen=True, slots=True)
class _LossBytes:
    forward_peak: int  # extra live bytes at the loss's forward peak
    saved: int  # kept from the end of forward into backward
    backward_peak: int  # live bytes at the loss gradient


def _loss_bytes(arch: ModelArch, rs: ResolvedSpec, b: int, s: int) -> _LossBytes:
    v = arch.vocab_size
    head = (
        FP32_BYTES
        if (rs.spec.method is Method.QLORA and rs.quantization and rs.quantization.prepare_kbit)
        else DTYPE_BYTES[rs.spec.dtype]
    )
    tokens = b * s
    softcap = arch.final_logit_softcapping is not None
    if rs.loss is LossImpl.FUSED:
        # Fused linear cross-entropy never materialises b*s*V (Liger, Cut Cross-Entropy).
        return _LossBytes(forward_peak=0, saved=0, backward_peak=0)
    if rs.loss is LossImpl.CHUNKED:
        if rs.spec.framework.value == "torchtune":
            chunk = -(-tokens // TORCHTUNE_CE_CHUNKS)
            # torchtune keeps every chunk's logits (model dtype) for backward and upcasts one
            # chunk at a time to fp32.
            saved = _blk(tokens * v * head)
            return _LossBytes(
                forward_peak=saved + 2 * _blk(chunk * v * FP32_BYTES),
                saved=saved + TORCHTUNE_CE_CHUNKS * _blk(chunk * v * FP32_BYTES),
                backward_peak=saved
                + TORCHTUNE_CE_CHUNKS * _blk(chunk * v * FP32_BYTES)
                + 2 * _blk(chunk * v * FP32_BYTES),
            )
        if rs.spec.framework is Framework.LITGPT:
            return _litgpt_loss_bytes(arch, rs, b, s, head)
        chunk = min(tokens, b * LITGPT_CE_CHUNK_TOKENS)
        per_chunk = _blk(chunk * v * head)
        n_chunks = -(-tokens // chunk)
        saved = n_chunks * 2 * per_chunk
        return _LossBytes(
            forward_peak=saved + per_chunk, saved=saved, backward_peak=saved + 2 * per_chunk
        )
    weight_copy = 0
    if rs.spec.autocast:
        # Autocast runs the LM head in half precision: half logits, and a half copy of a weight
        # that is not (fp32 after kbit preparation, or an fp32 model), saved by the matmul
        # until the head's backward (not cached: a frozen weight needs no grad).
        if head != AUTOCAST_BYTES:
            weight_copy = _blk(v * arch.hidden_size * AUTOCAST_BYTES)
        head = AUTOCAST_BYTES
    logits = _blk(tokens * v * head)
    cap = _blk(tokens * v * head) if softcap else 0  # tanh output saved (Gemma-2 softcap)
    if rs.loss is LossImpl.PLAIN:
        logp = _blk(tokens * v * head)
        return _LossBytes(
            forward_peak=weight_copy + logits + cap + logp,
            saved=weight_copy + logp + cap,
            backward_peak=weight_copy + logp + cap + 2 * logp,
        )
    # logits.float() is a no-op (no copy) when the head already runs in fp32 (kbit prep).
    upcast = _blk(tokens * v * FP32_BYTES) if head != FP32_BYTES else 0
    logp = _blk(tokens * v * FP32_BYTES)
    return _LossBytes(
        forward_peak=weight_copy + logits + cap + upcast + logp,
        saved=weight_copy + logp + cap,
        backward_peak=weight_copy + logp + cap + 2 * logp,
    )


def _litgpt_dequant_bytes(in_features: int, out_features: int, rs: ResolvedSpec) -> int:
    """Transient bytes of one bitsandbytes 0.41.1 4-bit matmul in LitGPT: the weight dequantized
    in the quant_state dtype (fp16) and its cast to the compute dtype, alive together; double
    quant first rebuilds the fp32 absmax (functional.dequantize_4bit: dequantize_blockwise)."""
    n = in_features * out_features
    quant = rs.quantization
    nested = _blk(-(-n // NF4_BLOCK) * FP32_BYTES) if quant and quant.double_quant else 0
    return _blk(n * LITGPT_QUANT_STATE_BYTES) + _blk(n * DTYPE_BYTES[rs.compute_dtype]) + nested


def _litgpt_loss_bytes(arch: ModelArch, rs: ResolvedSpec, b: int, s: int, head: int) -> _LossBytes:
    """LitGPT finetune/lora.py: model(x, lm_head_chunk_size=128) returns (b, 128, V) chunks that
    Fabric casts to fp32 (kept by `logits` through backward); logits[-1] drops its last position;
    chunked_cross_entropy saves each chunk's fp32 log-probabilities. Backward first runs every
    chunk's cross-entropy (NLL's and log_softmax's gradients of one chunk at a time, each result
    then waiting for its cast node), then the casts back to bf16, then lm_head."""
    v, h = arch.vocab_size, arch.hidden_size
    full, rem = divmod(s, LITGPT_CE_CHUNK_TOKENS)
    sizes = [LITGPT_CE_CHUNK_TOKENS] * full + ([rem] if rem else [])
    shifted = [*sizes[:-1], sizes[-1] - 1]
    logits_half = sum(_blk(b * n * v * head) for n in sizes)
    logits = sum(_blk(b * n * v * LITGPT_LOGITS_BYTES) for n in sizes)
    logp = sum(_blk(b * n * v * LITGPT_LOGITS_BYTES) for n in shifted)
    chunk = _blk(b * sizes[0] * v * LITGPT_LOGITS_BYTES)
    # convert_output: the bf16 list and its fp32 copy; then the fp32 list and the log-probs.
    forward_peak = max(logits_half + logits, logits + logp)
    backward_peak = logits + logp + 2 * chunk
    if rs.spec.method is Method.QLORA and not arch.tie_word_embeddings:
        # The 4-bit lm_head dequantizes its weight for each chunk, forward and backward; its
        # backward comes after every chunk's gradient has been cast back to bf16.
        weight = _litgpt_dequant_bytes(h, v, rs)
        forward_peak = max(forward_peak, logits_half + weight)
        backward_peak = max(
            backward_peak, logits + logits_half + weight + _blk(b * sizes[0] * h * head)
        )
    return _LossBytes(forward_peak=forward_peak, saved=logits + logp, backward_peak=backward_peak)


# ---------------------------------------------------------------------------------------------
# The step


def _validate(arch: ModelArch, spec: TrainingSpec) -> list[str]:
    warnings: list[str] = []
    if spec.seq_len > arch.max_position_embeddings:
        warnings.append(
            f"seq_len {spec.seq_len} is longer than the model's max_position_embeddings "
            f"({arch.max_position_embeddings}); quality may suffer without RoPE scaling"
        )
    if (
        spec.method is Method.QLORA
        and spec.quantization
        and spec.quantization.type is QuantType.INT8
    ):
        warnings.append("int8 (LLM.int8) base weights: activations modelled as for 4-bit")
    if spec.method is Method.QLORA and spec.framework is Framework.LITGPT:
        warnings.append(
            "LitGPT with bitsandbytes <= 0.41 keeps each 4-bit layer's input until the next "
            "forward pass: a later iteration as long as the first can peak above this estimate"
        )
    return warnings


@dataclass(frozen=True, slots=True)
class _Plan:
    """What an estimate needs that depends on the model and settings but not on the batch or
    sequence length; cached, so a scheduler's many calls pay for it once."""

    rs: ResolvedSpec  # resolved with batch_size = seq_len = 1
    adapted: tuple[Linear, ...]
    flow: _Flow
    params: _Params
    optimizer: tuple[int, int, int]
    layer: tuple[tuple[int, _Kind, int], ...]
    first_layer: tuple[tuple[int, _Kind, int], ...]
    # live at up_proj in a recomputed layer, when that moment is modelled (else empty)
    up_proj_moment: tuple[tuple[int, _Kind, int], ...]
    # a recomputed layer's saved tensors that its attention's backward still finds
    attention_part: tuple[tuple[int, _Kind, int], ...]
    dequant: int  # a transient dequantized copy of the largest 4-bit weight (QLoRA)
    lt_workspaces: tuple[int, int]  # cuBLASLt workspaces: the forward thread's, the backward's
    reserved: ReservedPlan  # what the reserved level's allocation schedule needs
    assumptions: tuple[str, ...]  # the resolved spec's, and the plan's own


@lru_cache(maxsize=4096)
def _plan(arch: ModelArch, key: _PlanKey) -> _Plan:
    unit = key.unit_spec()
    rs = resolve(unit)
    adapted = adapted_linears(arch, rs)
    f = _flow(arch, rs, adapted)
    p = _params(
        arch,
        unit.method,
        unit.dtype,
        rs.lora,
        rs.quantization,
        rs.adapter_dtype,
        adapted,
        f.head_quantized,
    )
    attn, kernel = unit.attn_implementation, unit.sdpa_kernel
    largest = max(
        (lin for lin in arch.linears if not lin.expert),
        key=lambda lin: lin.in_features * lin.out_features,
    )
    if unit.method is not Method.QLORA:
        dequant = 0
    elif unit.framework is Framework.LITGPT:
        dequant = _litgpt_dequant_bytes(largest.in_features, largest.out_features, rs)
    else:
        dequant = _blk(largest.in_features * largest.out_features * DTYPE_BYTES[rs.compute_dtype])
    assumptions = rs.assumptions
    if f.zero_pad_width and arch.fused_qkv_linear:
        assumptions += (
            "LitGPT adapts the query and value parts of the fused qkv projection "
            "(finetune/lora.py's lora_query and lora_value defaults)",
        )
    single = key.single_sequence
    return _Plan(
        rs=rs,
        adapted=adapted,
        flow=f,
        params=p,
        optimizer=_optimizer_state(p, unit.optim),
        layer=_layer_recipe(arch, f, attn, kernel, True, windowed=key.windowed, single=single),
        first_layer=_layer_recipe(
            arch, f, attn, kernel, False, windowed=key.windowed, single=single
        ),
        up_proj_moment=_layer_recipe(
            arch, f, attn, kernel, True, True, windowed=key.windowed, single=single
        )
        if unit.method is Method.LORA and arch.mlp is MlpKind.GATED and not arch.is_moe
        else (),
        attention_part=_layer_recipe(
            arch,
            f,
            attn,
            kernel,
            True,
            windowed=key.windowed,
            until_attention=True,
            single=single,
        ),
        dequant=dequant,
        lt_workspaces=_lt_workspaces(arch, unit),
        reserved=_reserved_plan(arch, rs, f, p, key.gradient_checkpointing),
        assumptions=assumptions,
    )


def _materialises_scores(arch: ModelArch, spec: TrainingSpec, f: _Flow) -> bool:
    """Whether attention builds b x heads x s x s scores (eager attention, SDPA's math
    kernel)."""
    if spec.attn_implementation is AttnImpl.EAGER:
        return True
    if spec.attn_implementation is not AttnImpl.SDPA:
        return False
    if spec.sdpa_kernel is SdpaKernel.MATH:
        return True
    if spec.sdpa_kernel is not SdpaKernel.AUTO or f.attn != FP32_BYTES:
        return False
    windowed = arch.windowed(spec.seq_len)
    return arch.num_key_value_heads < arch.num_attention_heads and not windowed


def _lt_workspaces(arch: ModelArch, spec: TrainingSpec) -> tuple[int, int]:
    """cuBLASLt workspaces in the allocator: one once a linear with a bias runs through addmm
    (not bitsandbytes' 4-bit path) on the Python thread, one more when checkpointing reruns
    such a linear on the autograd thread."""
    biased = any(lin.bias for lin in arch.linears if not lin.expert)
    lt = _blk(CUBLASLT_WORKSPACE) if biased and spec.method is not Method.QLORA else 0
    return lt, lt if spec.gradient_checkpointing else 0


def _workspaces(plan: _Plan, compute_capability: str | None) -> tuple[int, int]:
    """cuBLAS(Lt) workspace bytes with the forward thread's handle alone, and with the
    autograd thread's too (each handle takes one at its first GEMM)."""
    workspace = _blk(cublas_workspace(compute_capability))
    forward_lt, backward_lt = plan.lt_workspaces
    return workspace + forward_lt, 2 * workspace + forward_lt + backward_lt


def reserved_plan(arch: ModelArch, spec: TrainingSpec) -> ReservedPlan:
    """What the reserved level's schedule needs of `spec` (batch and sequence aside)."""
    return _plan(arch, _PlanKey.of(spec, arch)).reserved


def _model_order(
    arch: ModelArch, rs: ResolvedSpec, f: _Flow, adapted: tuple[Linear, ...]
) -> list[tuple[int, int]]:
    """The trainable tensors (bytes, elements) in model.parameters() order, the order an
    optimizer creates their state in: the embedding, then layer by layer each linear's weight
    and bias (or its adapters' A and B) and the layer's norms, the final norm, the LM head."""
    spec = rs.spec
    full = spec.method is Method.FULL
    md = DTYPE_BYTES[spec.dtype]
    quant = rs.quantization
    prep = spec.method is Method.QLORA and quant is not None and quant.prepare_kbit
    other = FP32_BYTES if prep else md
    saved = set(rs.lora.modules_to_save) if rs.lora else set()
    h, v = arch.hidden_size, arch.vocab_size

    def tensor(count: int, itemsize: int) -> tuple[int, int]:
        return _blk(count * itemsize), count

    out: list[tuple[int, int]] = []
    if full or "embed_tokens" in saved:
        out.append(tensor(v * h, other))
    layer: list[tuple[int, int]] = []
    for lin in arch.linears:
        if full:
            layer.append(tensor(lin.weight_elements, md))
            if lin.bias:
                layer.append(tensor(lin.out_features * lin.count, md))
        elif lin in adapted:
            layer.append(tensor(f.r * lin.in_features, f.adapter))
            layer.append(tensor(lin.out_features * f.r, f.adapter))
    if full:
        norm_tensors = arch.norms_per_layer * (2 if arch.norm is NormKind.LAYER else 1)
        layer += [tensor(h, other)] * norm_tensors
        if arch.qk_norm:
            layer += [tensor(arch.head_dim, other)] * 2
    out += layer * arch.num_hidden_layers
    if full:
        out += [tensor(h, other)] * (2 if arch.norm is NormKind.LAYER else 1)
        if not arch.tie_word_embeddings:
            out.append(tensor(v * h, other))
            if arch.lm_head_bias:
                out.append(tensor(v, other))
    elif "lm_head" in saved and not arch.tie_word_embeddings:
        out.append(tensor(v * h, other))
    return out


def _reserved_plan(
    arch: ModelArch, rs: ResolvedSpec, f: _Flow, p: _Params, checkpointing: bool
) -> ReservedPlan:
    spec = rs.spec
    lora = rs.lora
    quant = rs.quantization
    prep = spec.method is Method.QLORA and quant is not None and quant.prepare_kbit
    sizes = []
    elements = []
    for t in p.tensors:
        sizes += [_blk(t.elements * t.itemsize)] * t.count
        elements += [t.elements] * t.count
    ordered = _model_order(arch, rs, f, adapted_linears(arch, rs))
    if sorted(ordered) == sorted(zip(sizes, elements, strict=True)):
        sizes = [n for n, _ in ordered]
        elements = [e for _, e in ordered]
    saved = set(lora.modules_to_save) if lora else set()
    return ReservedPlan(
        arch=arch,
        method=spec.method,
        dtype_bytes=DTYPE_BYTES[spec.dtype],
        residual=f.residual,
        compute=DTYPE_BYTES[rs.compute_dtype],
        adapter=f.adapter if lora else 0,
        rank=lora.r if lora else 0,
        dropout=f.dropout,
        adapted=f.lora_targets,
        quant_type=quant.type if quant else None,
        double_quant=bool(quant and quant.double_quant),
        attn=f.attn,
        attn_implementation=spec.attn_implementation,
        sdpa_kernel=spec.sdpa_kernel,
        loss=rs.loss,
        head_bytes=FP32_BYTES if prep else DTYPE_BYTES[spec.dtype],
        head_trainable=spec.method is Method.FULL or "lm_head" in saved,
        embed_trainable=spec.method is Method.FULL or "embed_tokens" in saved,
        optim=spec.optim,
        trainable=tuple(sizes),
        trainable_elements=tuple(elements),
        checkpointing=checkpointing,
        allocator=spec.allocator,
        autocast=spec.autocast,
        clip=spec.max_grad_norm > 0,
        accumulation=spec.gradient_accumulation_steps,
    )


class _PlanKey(NamedTuple):
    """The fields a plan depends on (everything but sizes, steps and parallelism)."""

    method: Method
    lora: LoraSpec | None
    quantization: QuantSpec | None
    dtype: DType
    autocast: bool
    optim: Optim
    attn_implementation: AttnImpl
    sdpa_kernel: SdpaKernel
    loss: LossImpl | None
    framework: Framework
    windowed: bool  # the sequence reaches the model's sliding window (an explicit mask)
    gradient_checkpointing: bool
    allocator: AllocatorConfig
    clip: bool  # max_grad_norm > 0
    # micro-batches per step the reserved level's replay runs: the third and later repeat
    # the second's allocations on the allocator state it leaves
    replayed_micro_batches: int
    # one sequence per micro-batch: a strided view of a fused projection reshapes without a
    # copy (eager attention's value)
    single_sequence: bool

    @classmethod
    def of(cls, spec: TrainingSpec, arch: ModelArch) -> _PlanKey:
        return cls(
            spec.method,
            spec.lora,
            spec.quantization,
            spec.dtype,
            spec.autocast,
            spec.optim,
            spec.attn_implementation,
            spec.sdpa_kernel,
            spec.loss,
            spec.framework,
            arch.windowed(spec.seq_len),
            spec.gradient_checkpointing,
            spec.allocator,
            spec.max_grad_norm > 0,
            min(spec.gradient_accumulation_steps, REPLAYED_MICRO_BATCHES),
            spec.batch_size == 1,
        )

    def unit_spec(self) -> TrainingSpec:
        fields = self._asdict()
        del fields["windowed"]
        del fields["single_sequence"]
        clip = fields.pop("clip")
        accumulation = fields.pop("replayed_micro_batches")
        return TrainingSpec(
            batch_size=1,
            seq_len=1,
            max_grad_norm=1.0 if clip else 0.0,
            gradient_accumulation_steps=accumulation,
            **fields,
        )


class _Step(NamedTuple):
    """A step's allocated bytes phase by phase, before they become an `Estimate`."""

    plan: _Plan
    fixed: tuple[int, int, int]  # frozen weights, trainable parameters, inputs
    # (step, phase, the parts that vary by phase), in COMPONENT_ORDER after the fixed parts
    rows: list[tuple[int, Phase, tuple[int, ...]]]
    paged_state: int  # optimizer state outside the allocator (paged optimizers)
    assumptions: list[str]
    warnings: list[str]


def estimate(
    arch: ModelArch, spec: TrainingSpec, *, compute_capability: str | None = None
) -> Estimate:
    """The peak memory of one GPU running `spec` on `arch`; `compute_capability` ("9.0") picks
    the device level's row when the GPU is known."""
    plan, fixed, rows, paged_state, assumptions, warnings = _step(arch, spec, compute_capability)
    p = plan.params
    fixed_sum = sum(fixed)
    phases = tuple(
        PhasePeak(step, phase, fixed_sum + sum(vec), fixed + vec) for step, phase, vec in rows
    )
    peak = max(phases, key=lambda ph: (ph.allocated_bytes, -ph.step))
    over = _above(arch, spec, plan, peak.allocated_bytes, paged_state, compute_capability)
    return Estimate(
        allocated_bytes=peak.allocated_bytes,
        reserved_bytes=over.reserved,
        device_bytes=over.device,
        device_bytes_upper=over.device_upper,
        components=peak.components,
        overheads=over.overheads,
        peak_step=peak.step,
        peak_phase=peak.phase,
        phases=phases,
        params=ParamCounts(total=p.total_count, trainable=p.trainable_count),
        upper_margin=over.upper_margin,
        assumptions=tuple(assumptions) + over.assumptions,
        warnings=tuple(warnings),
        estimator_version=ESTIMATOR_VERSION,
    )


def peak_levels(
    arch: ModelArch,
    spec: TrainingSpec,
    *,
    compute_capability: str | None = None,
) -> PeakLevels:
    """The peak's four levels alone, as `estimate` computes them, without the breakdown: what a
    fit-check evaluates dozens of times per request."""
    step = _step(arch, spec, compute_capability)
    allocated = sum(step.fixed) + max(sum(vec) for _s, _p, vec in step.rows)
    over = _above(arch, spec, step.plan, allocated, step.paged_state, compute_capability)
    return PeakLevels(allocated, over.reserved, over.device, over.device_upper)


def _above(
    arch: ModelArch,
    spec: TrainingSpec,
    plan: _Plan,
    allocated: int,
    paged_state: int,
    compute_capability: str | None,
) -> AboveAllocated:
    rplan = plan.reserved
    gap, gap_note = reserved_gap(rplan, spec.batch_size, spec.seq_len)
    kernel, _windowed = resolve_kernel(rplan, spec.seq_len)
    fused = kernel is Kernel.FLASH and plan.flow.attn != FP32_BYTES
    over = levels(
        allocated=allocated,
        reserved=allocated + gap,
        paged_state=paged_state,
        gpus=spec.parallel.gpus,
        row=device_row(compute_capability, fused_attention=fused),
        uncertainty=_uncertainty(arch, spec),
    )
    if gap_note:
        return replace(over, assumptions=(gap_note, *over.assumptions))
    return over


def _uncertainty(arch: ModelArch, spec: TrainingSpec) -> Uncertainty:
    """How far each level may be off, by how the configuration was checked."""
    return _uncertainty_of(arch, spec.method, spec.framework, spec.parallel.gpus > 1)


@lru_cache(maxsize=1024)
def _uncertainty_of(
    arch: ModelArch, method: Method, framework: Framework, parallel: bool
) -> Uncertainty:
    notes: list[str] = []
    allocated, reserved = ALLOCATED_SIGMA_TRACED, RESERVED_SIGMA_TRACED
    if framework is not Framework.HF:
        allocated, reserved = ALLOCATED_SIGMA_PRESET, RESERVED_SIGMA_APPROXIMATE
        notes.append(f"the {framework} preset's step is not traced: wider uncertainty")
    if parallel:
        allocated, reserved = ALLOCATED_SIGMA_PARALLEL, RESERVED_SIGMA_APPROXIMATE
        notes.append("multi-GPU strategies are not traced: wide uncertainty")
    if arch.is_moe or arch.model_type not in SCHEDULED_FAMILIES:
        reserved = RESERVED_SIGMA_APPROXIMATE
    loading = 0
    if method is Method.QLORA:
        quantized = sum(
            lin.in_features * lin.out_features for lin in arch.linears if not lin.expert
        )
        loading = math.ceil(
            QUANTIZED_LOAD_SIGMA * quantized * arch.num_hidden_layers * DTYPE_BYTES[DType.BF16]
        )
        notes.append(
            "a 4-bit base leaves cached blocks where its bf16 weights were quantized, laid out "
            "by the loader: reserved is uncertain by that"
        )
    return Uncertainty(
        allocated=allocated, reserved=reserved, loading_bytes=loading, notes=tuple(notes)
    )


def _step(arch: ModelArch, spec: TrainingSpec, compute_capability: str | None = None) -> _Step:
    plan = _plan(arch, _PlanKey.of(spec, arch))
    rs = plan.rs
    warnings = _validate(arch, spec)
    assumptions = list(plan.assumptions)
    b, s = spec.batch_size, spec.seq_len
    tokens = b * s
    h = arch.hidden_size
    L = arch.num_hidden_layers
    f = plan.flow
    p = plan.params
    shard = _sharding(spec)

    frozen = p.frozen // shard.params
    trainable = p.trainable // shard.params
    grads = _gradients(p) // shard.grads
    state, state_outside, temps = plan.optimizer
    state //= shard.state
    state_outside //= shard.state
    temps //= shard.state
    if spec.parallel.offload is not Offload.NONE:
        state = temps = state_outside = 0
        assumptions.append("optimizer state offloaded to host memory")

    per_layer = _recipe_bytes(plan.layer, b, s)
    # HF Trainer calls enable_input_require_grads() for PEFT models with checkpointing; without
    # it (and with a frozen embedding) the first layer's input takes no gradient.
    embed_trains = spec.method is Method.FULL or (
        rs.lora is not None and "embed_tokens" in rs.lora.modules_to_save
    )
    first_layer = (
        per_layer
        if embed_trains or spec.gradient_checkpointing
        else _recipe_bytes(plan.first_layer, b, s)
    )
    checkpoint = _blk(tokens * h * f.residual)
    inputs = 2 * _blk(tokens * INT64_BYTES)  # input_ids and labels (torch.long)
    final_norm = _blk(tokens * h * FP32_BYTES) + _blk(tokens * FP32_BYTES)
    # RoPE's cos and sin, (1, s, head_dim) in the residual dtype, computed once per forward
    # and saved by every layer's rotation (transformers LlamaRotaryEmbedding).
    rope = 2 * _blk(s * arch.head_dim * f.residual)
    final_norm += rope
    head_trains = spec.method is Method.FULL or (
        rs.lora is not None and "lm_head" in rs.lora.modules_to_save
    )
    if head_trains or f.head_quantized:
        # lm_head's input: for its weight grad, or kept by a 4-bit head (bitsandbytes 0.41.1
        # MatMul4Bit's ctx.tensors)
        final_norm += _blk(tokens * h * f.residual)
    loss = _loss_bytes(arch, rs, b, s)
    grad_hidden = _blk(tokens * h * max(f.residual, 2))  # gradient flowing down the stack

    windowed_sdpa = arch.windowed(s) and spec.attn_implementation is AttnImpl.SDPA
    # Masks that checkpointing keeps as every layer's input until backward ends.
    masks = 0
    if spec.gradient_checkpointing and windowed_sdpa:
        masks = _blk(b * s * s)  # transformers' boolean sliding-window mask (b, 1, s, s)
    if spec.gradient_checkpointing and spec.attn_implementation is AttnImpl.EAGER:
        # Eager attention takes an explicit (b, 1, s, s) causal mask in the embeddings' dtype;
        # Gemma-2 alternates global and sliding-window layers, with a mask for each kind.
        kinds = 2 if arch.model_type in ("gemma2", "gemma3_text") else 1
        masks = kinds * _blk(b * s * s * f.residual)
    final_norm += masks
    if spec.gradient_checkpointing:
        activations = L * checkpoint + final_norm
        # The recomputed first norm saves the layer's input itself when it needs no fp32 copy
        # (an fp32 residual stream, or LayerNorm): that storage is the checkpoint.
        shares_input = arch.norm is NormKind.LAYER or f.residual == FP32_BYTES
        recompute = per_layer - (checkpoint if shares_input else 0)
        assumptions.append("gradient checkpointing: one layer's input kept, one layer recomputed")
    else:
        activations = (L - 1) * per_layer + first_layer + final_norm
        recompute = 0
    if spec.attn_implementation is AttnImpl.EAGER:
        extra = 6 * b * arch.num_attention_heads * s * s
        warnings.append(
            f"eager attention stores heads*s^2 scores and probabilities: about "
            f"{extra * (1 if spec.gradient_checkpointing else L) / GIB:.1f} GiB"
        )

    ga_grads = grads if spec.gradient_accumulation_steps > 1 else 0
    head_grads = p.head_trainable // shard.grads
    embed_grads = p.embed_trainable // shard.grads
    ckpt = spec.gradient_checkpointing
    rs_r = rs.lora.r if rs.lora else 0
    tied_head = arch.tie_word_embeddings
    # bitsandbytes' 4-bit matmul dequantizes one weight to the compute dtype for each forward
    # and backward matmul (bitsandbytes/autograd/_functions.py MatMul4Bit): a transient copy
    # of the largest quantized weight.
    dequant = plan.dequant
    fixed = (frozen, trainable, inputs)
    # (step, phase, the parts that vary by phase), in COMPONENT_ORDER after the fixed parts:
    # optimizer state, gradients, activations, recompute, logits/loss, backward and optimizer
    # temporaries.
    # Inside the layers' backward: at the top layer every activation is still alive (plus
    # one recomputed layer when checkpointing) and only the head's gradients exist; at the
    # first layer the activations are gone and every gradient but the embedding's exists;
    # the embedding's gradient comes last. The phase's peak is the largest of these moments.
    # (Each tuple lacks the optimizer state, which steps 1 and 2 add alike.)
    in_flight = 2 * grad_hidden + dequant
    recompute_end = recompute
    down = next((lin for lin in arch.linears if lin.kind is LinearKind.MLP_OUT), None)
    if (
        ckpt
        and f.autocast
        and down is not None
        and down.name in f.lora_targets
        and not f.quantized
        and f.adapter != f.norm_out
        and not arch.is_moe
    ):
        # The recomputation stops at down_proj's saved half copy of its input (non-reentrant
        # checkpointing): alive then beside the layer's saved tensors are the MLP's input and
        # the residual it will join, the product down_proj takes, its base output, and
        # PEFT's cast of the product to the adapters' dtype.
        out = f.norm_out
        recompute_end += (
            _blk(tokens * h * out)
            + _blk(tokens * h * f.residual)
            + _blk(tokens * down.in_features * out)
            + _blk(tokens * h * out)
            + _blk(tokens * down.in_features * f.adapter)
        )
    top = (grads if ga_grads else head_grads, activations, recompute_end, 0, in_flight, 0)
    bottom_acts = checkpoint if ckpt else first_layer
    bottom_grads = grads if ga_grads else grads - embed_grads
    bottom = (bottom_grads, bottom_acts, recompute, 0, in_flight, 0)
    # The embedding's gradient is a temporary until it lands in .grad, with the gradient
    # flowing into the embedding's backward beside it. A tied embedding already holds the LM
    # head's gradient: AccumulateGrad adds out of place, so the old gradient, the new one and
    # their sum coexist (reference traces of Qwen2.5-0.5B and Gemma-2 full fine-tuning).
    if embed_grads and tied_head:
        end = (grads - embed_grads, 0, 0, 0, 3 * embed_grads, 0)
    elif embed_grads:
        end = (grads - embed_grads, 0, 0, 0, embed_grads + grad_hidden, 0)
    else:
        end = (grads, 0, 0, 0, 0, 0)
    candidates = [top, bottom, end]
    if ckpt and plan.up_proj_moment:
        # Recomputing the top layer: every checkpoint (the final norm's saved tensors are
        # gone), the gradient arriving from the head (an fp32 and two bf16 hidden-sized
        # tensors, per the reference traces) and the recomputed layer at its up_proj.
        arriving = _blk(tokens * h * FP32_BYTES) + 2 * _blk(tokens * h * 2)
        moment = _recipe_bytes(plan.up_proj_moment, b, s)
        candidates.append((ga_grads, L * checkpoint + rope + masks, moment, 0, arriving, 0))
    if spec.method is Method.QLORA and arch.mlp is MlpKind.GATED and not arch.is_moe:
        # down_proj's backward in the top layer: its saved input is consumed, and the
        # gradient of that input exists three times in the MLP's dtype: through the LoRA
        # branch, through the 4-bit matmul (upcast back from the compute dtype), and their
        # sum (reference trace mistral-7b-v0_1__qlora__...__ckpt); with the gradient of the
        # layer's output, in the residual dtype.
        i_bytes = tokens * arch.intermediate_size
        down_input = _blk(i_bytes * f.norm_out) + _blk(tokens * rs_r * f.adapter)
        grads_in = 3 * _blk(i_bytes * f.norm_out) + _blk(tokens * h * f.residual)
        layer_now = (recompute if ckpt else per_layer) - down_input
        if ckpt:
            acts_now = L * checkpoint + rope + masks
        else:
            acts_now = activations - final_norm + rope + masks - per_layer
        candidates.append((ga_grads, acts_now, layer_now, 0, grads_in, 0))
    if _materialises_scores(arch, spec, f):
        # The attention's backward in the top layer (recomputed under checkpointing) with the
        # scores materialised: the probabilities' gradient and the scores' (fp32 for SDPA's
        # math kernel) beside the saved probabilities, with the output's gradient made
        # contiguous and the residual stream's gradient (reference traces *qlora*b1-s8192*,
        # peak at _softmax_backward_data).
        score_bytes = FP32_BYTES
        scores = _blk(b * arch.num_attention_heads * s * s * score_bytes)
        # (SDPA's fp32 softmax backward also takes a scores-sized scratch on CUDA: an H200
        # allocator history, service/trace/kernels.py _SafeSoftmax.)
        copies = 2 if spec.attn_implementation is not AttnImpl.SDPA else 3
        grads_now = copies * scores + 2 * _blk(tokens * arch.q_dim * max(f.attn, f.residual))
        if ckpt:
            attention_part = _recipe_bytes(plan.attention_part, b, s)
            if f.residual == FP32_BYTES or arch.norm is NormKind.LAYER:
                attention_part -= checkpoint  # the first norm saved the checkpoint itself
            recomputed = (ga_grads, L * checkpoint + rope + masks, attention_part, 0, grads_now, 0)
            candidates.append(recomputed)
        else:
            candidates.append(
                (ga_grads, activations - final_norm + rope + masks, 0, 0, grads_now, 0)
            )
    inside = max(candidates, key=sum)
    forward_end = (ga_grads, activations, 0, loss.forward_peak, 0, 0)
    backward_start = (ga_grads, activations, 0, loss.backward_peak, 0, 0)

    # (step, phase, the parts that vary by phase), in COMPONENT_ORDER after the fixed parts:
    # optimizer state, gradients, activations, recompute, logits/loss, backward and optimizer
    # temporaries.
    rows: list[tuple[int, Phase, tuple[int, ...]]] = []
    # cuBLAS workspaces: the forward thread's handle takes one at the step's first GEMM, the
    # autograd thread's at its first (the LM head's backward, after the loss gradient).
    one, both = _workspaces(plan, compute_capability)
    for step in (1, 2):
        st = (state if step == 2 else 0,)
        early = (one if step == 1 else both,)
        rows.append((step, Phase.FORWARD_END, early + st + forward_end))
        rows.append((step, Phase.BACKWARD_START, early + st + backward_start))
        rows.append((step, Phase.BACKWARD, (both, *st, *inside)))
    rows.append((1, Phase.OPTIMIZER_STEP, (both, state, grads, 0, 0, 0, 0, temps)))

    return _Step(plan, fixed, rows, state_outside, assumptions, warnings)


@dataclass(frozen=True, slots=True)
class _Shards:
    params: int
    grads: int
    state: int


def _sharding(spec: TrainingSpec) -> _Shards:
    """Divisors over ranks: ZeRO-1 shards optimizer state, ZeRO-2 also gradients, ZeRO-3 and
    FSDP also parameters (Rajbhandari et al. 2020, ZeRO, section 5)."""
    n = spec.parallel.gpus
    strategy = spec.parallel.strategy
    if n == 1 or strategy is Strategy.DDP:
        return _Shards(1, 1, 1)
    if strategy is Strategy.ZERO1:
        return _Shards(1, 1, n)
    if strategy is Strategy.ZERO2:
        return _Shards(1, n, n)
    return _Shards(n, n, n)
