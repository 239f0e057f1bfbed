"""What a decoder layer's attention saves for backward, by implementation and kernel."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from service.core.arch import ModelArch
from service.core.estimator.ledger import _Kind, _Ledger
from service.core.spec import AttnImpl, SdpaKernel
from service.core.units import FP32_BYTES, HALF_BYTES


class LayerFlow(Protocol):
    """What the attention's saves read of a layer's flow (`activations.LayerFlow`)."""

    @property
    def attn(self) -> int: ...  # bytes per element of q, k, v and the output
    @property
    def fused_qkv(self) -> bool: ...  # q, k and v are views of one projection's output
    @property
    def prefix(self) -> bool: ...  # prefix tuning's virtual tokens lead the keys


@dataclass(frozen=True, slots=True)
class _AttnChoice:
    attn_implementation: AttnImpl
    sdpa_kernel: SdpaKernel
    windowed: bool  # a sliding window shorter than the sequence: an explicit mask
    single: bool = False  # one sequence per micro-batch


def _resolved_kernel(f: LayerFlow, arch: ModelArch, spec: _AttnChoice) -> SdpaKernel:
    """The SDPA kernel that runs: `auto` as PyTorch picks it on a GPU."""
    kernel = spec.sdpa_kernel
    if spec.attn_implementation is not AttnImpl.SDPA or kernel is not SdpaKernel.AUTO:
        return kernel
    # On a GPU, PyTorch picks the flash kernel for fp16/bf16 without an explicit mask (a
    # sliding window shorter than the sequence makes transformers build one); for fp32,
    # the math kernel when transformers passes grouped key/value heads (enable_gqa, with
    # no mask), else the memory-efficient one (torch._fused_sdp_choice on an H200,
    # tests/data/gpu/h200_environment.json; service/trace/kernels.py).
    half = f.attn == HALF_BYTES
    # prefix tuning's keys outnumber the queries: transformers passes an explicit mask
    masked = spec.windowed or f.prefix
    gqa = arch.num_key_value_heads < arch.num_attention_heads and not masked
    if half and not masked:
        return SdpaKernel.FLASH
    return SdpaKernel.MATH if gqa and not half else SdpaKernel.EFFICIENT


class _Call(NamedTuple):
    """One attention's saves being recorded: the ledger, the layer's flow, the model, the
    choice of implementation and the kernel that runs."""

    led: _Ledger
    f: LayerFlow
    arch: ModelArch
    spec: _AttnChoice
    kernel: SdpaKernel

    @property
    def q_bytes(self) -> int:
        return self.arch.q_dim * self.f.attn

    @property
    def kv_bytes(self) -> int:
        return self.arch.kv_dim * self.f.attn

    @property
    def value(self) -> tuple[str, int]:
        """The value as the kernels save it: a view of the fused projection's whole output
        where q, k and v share it."""
        if self.f.fused_qkv:
            return "qkv_out", self.q_bytes + 2 * self.kv_bytes
        return "v", self.kv_bytes


def _flash_saves(c: _Call) -> None:
    """flash saves q, k, v (GQA native), output and the fp32 logsumexp (b, n_h, s)."""
    c.led.add("k_rope", c.kv_bytes)
    c.led.add(*c.value)
    c.led.add("attn_out", c.q_bytes)
    c.led.add("lse", c.arch.num_attention_heads * FP32_BYTES)


def _efficient_saves(c: _Call) -> None:
    """mem-efficient saves k/v expanded to n_h heads (repeat_kv) and an fp32 logsumexp padded
    to a multiple of 32 queries (aten/src/ATen/native/transformers/cuda). With a mask
    transformers repeats them itself (repeat_kv): from one key/value head that is an expanded
    view, and the kernel keeps k and v themselves. So it does without grouped heads (repeat_kv
    returns its input): the value is then a view of its projection's output, of the whole
    fused one where q, k and v share it (Phi-3's qkv_proj), as the flash kernel's (traces
    phi-3*__qlora__*nf4-dq__b1-s1024*)."""
    led, f, arch, spec = c.led, c.f, c.arch, c.spec
    q_bytes, kv_bytes = c.q_bytes, c.kv_bytes
    n_h, n_kv = arch.num_attention_heads, arch.num_key_value_heads
    if f.prefix:
        # prefix tuning: the keys and values concatenated behind the virtual tokens'
        # (DynamicLayer.update), repeated to the query heads, and the mask's additive bias
        keys = _Kind.KEYS
        led.add("k_rep" if n_kv < n_h else "k_cat", q_bytes if n_kv > 1 else kv_bytes, keys)
        led.add("v_rep" if n_kv < n_h else "v_cat", q_bytes if n_kv > 1 else kv_bytes, keys)
        led.add("attn_out", q_bytes)
        led.add("lse", n_h * FP32_BYTES, _Kind.TOKENS_PAD32)
        led.add("attn_bias", f.attn, _Kind.KEYS_SQUARE)
        return
    if n_kv < n_h and not (n_kv == 1 and spec.windowed):
        led.add("k_rep", q_bytes)
        led.add("v_rep", q_bytes)
    else:
        led.add("k_rope", kv_bytes)
        led.add(*c.value)
    led.add("attn_out", q_bytes)
    led.add("lse", n_h * FP32_BYTES, _Kind.TOKENS_PAD32)
    if spec.windowed:
        # the boolean window mask, converted to an additive bias in the attention dtype
        # per call and saved by the kernel (b, 1, s, s)
        led.add("attn_bias", f.attn, _Kind.SQUARE)


def _fp32_math_saves(c: _Call) -> None:
    """SDPA's math composite on fp32 q, k, v (aten _scaled_dot_product_attention_math, as the
    tracer runs it op by op): value repeated to n_h heads, the scaled key's contiguous copy
    (saved by the score matmul), the fp32 probabilities. probs @ v keeps its inputs, not its
    output: the output's contiguous copy ("attn_out") is kept only by an o_proj that saves its
    input (its LoRA takes fp32 as it is), not by a frozen 4-bit one (reference traces
    *__qlora__r16-gate_proj+up_proj+down_proj__*)."""
    c.led.add("v_rep", c.q_bytes)
    c.led.add("k_contiguous", c.q_bytes)
    c.led.add("probs", c.arch.num_attention_heads * FP32_BYTES, _Kind.SQUARE)


def _math_saves(c: _Call) -> None:
    """SDPA's math backend (aten _scaled_dot_product_attention_math) decomposes into ops that
    keep, per the reference tracer (tests/data/traces/*sdpa-math*): k and v repeated to n_h
    heads, scaled copies of q and k, the output, and two score-sized tensors in the attention
    dtype (the softmax output and _safe_softmax's masked copy)."""
    led, q_bytes = c.led, c.q_bytes
    probs = c.arch.num_attention_heads * c.f.attn
    led.add("k_rep", q_bytes)
    led.add("v_rep", q_bytes)
    led.add("q_scaled", q_bytes)
    led.add("k_scaled", q_bytes)
    led.add("attn_out", q_bytes)
    led.add("probs", probs, _Kind.SQUARE)
    led.add("probs_safe", probs, _Kind.SQUARE)


def _eager_saves(c: _Call) -> None:
    """Eager attention: scores and probabilities materialised per head."""
    led, f, arch = c.led, c.f, c.arch
    q_bytes, kv_bytes = c.q_bytes, c.kv_bytes
    n_h = arch.num_attention_heads
    if arch.attn_logit_softcapping is not None:
        # Gemma-2's eager attention caps the scores: tanh saves its output.
        led.add("scores_tanh", n_h * f.attn, _Kind.SQUARE)
    # repeat_kv copies k and v to the query heads, except from a single key/value head: the
    # expanded view then reshapes without a copy, and the matmuls keep k and v themselves.
    rep_bytes = q_bytes if arch.num_key_value_heads > 1 else kv_bytes
    led.add("k_rep", rep_bytes)
    if arch.num_key_value_heads == 1 and n_h > 1:
        led.add("v", kv_bytes)
    elif f.fused_qkv and arch.num_key_value_heads == n_h and c.spec.single:
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


def _sdpa(c: _Call, kernel: SdpaKernel) -> bool:
    return c.spec.attn_implementation is AttnImpl.SDPA and c.kernel is kernel


# Each attention's saves after the rotated query's, by implementation and kernel: the first
# entry whose test holds records them; eager attention's otherwise.
_ATTENTION_SAVES: tuple[tuple[Callable[[_Call], bool], Callable[[_Call], None]], ...] = (
    (
        lambda c: c.spec.attn_implementation is AttnImpl.SDPA and c.arch.kv_broadcast,
        lambda c: _broadcast_math_saves(c.led, c.arch, c.spec.single),
    ),
    (
        lambda c: c.spec.attn_implementation is AttnImpl.EAGER and c.arch.model_type == "falcon",
        lambda c: _falcon_eager_saves(c.led, c.f, c.arch, c.spec.single),
    ),
    (
        lambda c: (
            c.spec.attn_implementation is AttnImpl.FLASH_ATTENTION_2 or _sdpa(c, SdpaKernel.FLASH)
        ),
        _flash_saves,
    ),
    (lambda c: _sdpa(c, SdpaKernel.EFFICIENT), _efficient_saves),
    (lambda c: _sdpa(c, SdpaKernel.MATH) and c.f.attn == FP32_BYTES, _fp32_math_saves),
    (lambda c: _sdpa(c, SdpaKernel.MATH), _math_saves),
)


def attention_saves(led: _Ledger, f: LayerFlow, arch: ModelArch, spec: _AttnChoice) -> None:
    if arch.alibi:
        _alibi_attention_saves(led, f, arch)
        return
    led.add("q_rope", arch.q_dim * f.attn)
    call = _Call(led, f, arch, spec, _resolved_kernel(f, arch, spec))
    for applies, record in _ATTENTION_SAVES:
        if applies(call):
            record(call)
            return
    _eager_saves(call)


def _broadcast_math_saves(led: _Ledger, arch: ModelArch, single: bool) -> None:
    """SDPA's math kernel on one key/value head broadcast over the query heads (Falcon-7B; no
    other kernel takes unequal head counts without enable_gqa): in fp32 (half inputs upcast,
    aten _scaled_dot_product_attention_math), the score matmul saves the scaled query and
    the scaled key, probs @ v the probabilities and the fp32 value. With one sequence the
    matmuls fold the broadcast head into a stride-0 batch without a copy; with several they
    copy key and value expanded to every head (reference traces falcon-7b__*)."""
    led.items.pop("q_rope", None)  # the rotated query is upcast; its scaled copy is saved
    kd = arch.kv_dim if single else arch.q_dim
    led.add("q_scaled", arch.q_dim * FP32_BYTES)
    led.add("k_scaled", kd * FP32_BYTES)
    led.add("v_fp32", kd * FP32_BYTES)
    led.add("probs", arch.num_attention_heads * FP32_BYTES, _Kind.SQUARE)


def _falcon_eager_saves(led: _Ledger, f: LayerFlow, arch: ModelArch, single: bool) -> None:
    """FalconAttention's eager branch (transformers 5.24): q @ k^T saves the rotated q and k
    (the 7B layout's one key head broadcast without a copy for one sequence, copied to every
    head for several; the new architecture's k has every query head), the scores are scaled
    in place and the mask added, softmax runs in the model's dtype (no fp32 copy) and its
    output is saved, and probs @ v saves v (likewise)."""
    kd = arch.kv_dim if arch.kv_broadcast and single else arch.q_dim
    led.add("k_rope", kd * f.attn)
    led.add("v", kd * f.attn)
    led.add("probs", arch.num_attention_heads * f.attn, _Kind.SQUARE)


def _alibi_attention_saves(led: _Ledger, f: LayerFlow, arch: ModelArch) -> None:
    """BLOOM's own attention, whatever the attention implementation (BloomAttention.forward,
    transformers 5.24): q, k and v, strided views of the fused projection, reshaped into
    contiguous copies; alibi.baddbmm(q, k) saves q and k; the scores plus the mask, softmax
    in fp32 (saved) cast back to the attention dtype (saved by the bmm with v, which saves v)."""
    q_bytes = arch.q_dim * f.attn
    n_h = arch.num_attention_heads
    led.add("q_copy", q_bytes)
    led.add("k_copy", q_bytes)
    led.add("v_copy", q_bytes)
    led.add("probs_fp32", n_h * FP32_BYTES, _Kind.SQUARE)
    if f.attn != FP32_BYTES:
        led.add("probs", n_h * f.attn, _Kind.SQUARE)
