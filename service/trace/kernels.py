"""The kernels a GPU run would pick, forced on the CPU-device fake tensors of a trace.

The fake device is `cpu` (CPU builds of torch cannot make `cuda` fake tensors), so where PyTorch
or bitsandbytes choose a kernel by device, this module makes the CUDA choice explicitly:
SDPA runs the flash / mem-efficient / math op that `torch.backends.cuda` would pick, dropout
saves a one-byte mask as CUDA's `native_dropout` does, bitsandbytes' 4-bit matmul takes its
CUDA dequantize + F.linear path for training-sized inputs, and a grouped matmul (MoE experts)
takes any floating dtype, as CUDA's does.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from service.core.libs.bitsandbytes import uses_dequant_fallback
from service.core.spec import SdpaKernel

# Head dims the CUDA flash kernel takes (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp,
# check_head_dim_size_flash: at most 256).
FLASH_MAX_HEAD_DIM = 256
# Flattened outputs 6 and 7 of aten._scaled_dot_product_flash_attention are the philox seed and
# offset; outside CUDA-graph capture they are host tensors (aten's flash wrapper, attention.cu).
FLASH_HOST_OUTPUTS = (6, 7)
# ...and outputs 2 and 3 of aten._scaled_dot_product_efficient_attention (attention.cu likewise).
EFFICIENT_HOST_OUTPUTS = (2, 3)
FLASH_OP = "aten._scaled_dot_product_flash_attention.default"
EFFICIENT_OP = "aten._scaled_dot_product_efficient_attention.default"
# Nested absmax is quantized in blocks of this size (bitsandbytes/functional.py quantize_4bit).
NESTED_ABSMAX_BLOCKSIZE = 256
# Columns of an LLM.int8 input above the outlier threshold: they depend on the values. The trace
# runs without any; with k of them a layer keeps k input columns more for backward (LLM.int8,
# Dettmers et al. 2022, arXiv:2208.07339, section 4: a handful of feature dimensions).
INT8_OUTLIER_COLUMNS = 0

_HALF = (torch.float16, torch.bfloat16)

# Overrides of aten kernels at the Meta key for the trace's process (`_relaxed_grouped_mm`).
_META_OVERRIDES = torch.library.Library("aten", "IMPL")
_GROUPED_MM_RELAXED = False


def choose_sdpa_kernel(
    requested: SdpaKernel,
    *,
    dtype: torch.dtype,
    head_dim: int,
    has_mask: bool,
    gqa: bool = False,
    broadcast_heads: bool = False,
    value_head_dim: int | None = None,
) -> SdpaKernel:
    """The backend a CUDA GPU runs: flash for half precision without a mask, else mem-efficient,
    else math.

    Follows the priority order of aten's `select_sdp_backend` (flash, efficient, math) with the
    constraints that matter for decoder training: flash needs fp16/bf16, no explicit mask and a
    head dim up to 256; the mem-efficient kernel takes no grouped key/value heads
    (`enable_gqa=True`, which transformers passes when there is no mask), so fp32 GQA attention
    runs on math. Measured with torch._fused_sdp_choice on an H200 (torch 2.11,
    tests/data/gpu/h200_environment.json): fp32 chose math with enable_gqa and mem-efficient
    without, for every mask and head size. (Half precision chose cuDNN's kernel there, which
    keeps what flash keeps: q, k, v, the output and an fp32 log-sum-exp.) Flash also needs
    the value's head dim to equal the query's (check_head_dim_size_flash), which multi-head
    latent attention's (192 for q and k, 128 for v in DeepSeek-V2/V3) is not; mem-efficient
    takes them unequal.
    """
    if broadcast_heads:
        # One key/value head broadcast over the query heads without enable_gqa (Falcon-7B's
        # multi-query attention): the flash and mem-efficient kernels need equal head counts
        # then (sdp_utils check_batch_size_and_num_heads_dense), so only math runs it.
        if requested not in (SdpaKernel.AUTO, SdpaKernel.MATH):
            raise ValueError("only the math SDPA kernel broadcasts key/value heads")
        return SdpaKernel.MATH
    same_dims = value_head_dim is None or value_head_dim == head_dim
    flash_ok = dtype in _HALF and not has_mask and head_dim <= FLASH_MAX_HEAD_DIM and same_dims
    if requested is SdpaKernel.FLASH:
        if not flash_ok:
            raise ValueError(
                "the flash SDPA kernel needs fp16/bf16, no attention mask, head_dim <= 256 and "
                "the value's head dim equal to the query's"
            )
        return SdpaKernel.FLASH
    if requested is not SdpaKernel.AUTO:
        return requested
    if flash_ok:
        return SdpaKernel.FLASH
    return SdpaKernel.MATH if gqa and dtype not in _HALF else SdpaKernel.EFFICIENT


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean keep-mask as the additive bias aten converts it to (0 or -inf): one tensor of
    the mask's shape (convert_boolean_attn_mask: at::where(mask, 0, -inf))."""
    zero = torch.zeros((), dtype=dtype)
    neg_inf = torch.full((), float("-inf"), dtype=dtype)
    return torch.where(mask, zero, neg_inf)


def _expand_kv(tensor: torch.Tensor, groups: int) -> torch.Tensor:
    return tensor if groups == 1 else tensor.repeat_interleave(groups, dim=-3)


def make_sdpa(requested: SdpaKernel, *, cpu_flash: bool = False) -> Callable[..., torch.Tensor]:
    """A drop-in `F.scaled_dot_product_attention` that calls the CUDA backend's op directly.

    `cpu_flash` swaps the flash and mem-efficient ops for the CPU flash op (which saves the same
    tensors as CUDA's flash op), so validation runs on real CPU tensors can execute them.
    """

    def sdpa(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        groups = query.size(-3) // key.size(-3)
        broadcast = groups > 1 and not enable_gqa
        if broadcast and key.size(-3) != 1:
            raise ValueError("key/value heads differ from query heads without enable_gqa")
        kernel = choose_sdpa_kernel(
            requested,
            dtype=query.dtype,
            head_dim=query.size(-1),
            has_mask=attn_mask is not None,
            gqa=enable_gqa and groups > 1,
            broadcast_heads=broadcast,
            value_head_dim=value.size(-1),
        )
        if broadcast:  # matmul broadcasts the single key/value head, as aten's math does
            groups = 1
        if cpu_flash and kernel is not SdpaKernel.MATH:
            if attn_mask is not None and attn_mask.dtype == torch.bool:
                attn_mask = _additive(attn_mask, query.dtype)
            out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query,
                _expand_kv(key, groups),
                _expand_kv(value, groups),
                dropout_p,
                is_causal,
                attn_mask=attn_mask,
                scale=scale,
            )
            return out[0]
        if kernel is SdpaKernel.FLASH:
            # The CUDA flash kernel reads grouped key/value heads natively.
            out = torch.ops.aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, False, scale=scale
            )
            return out[0]
        if kernel is SdpaKernel.EFFICIENT:
            # The mem-efficient kernel has no grouped-query support: aten expands key/value heads.
            bias = attn_mask
            if bias is not None and bias.dtype == torch.bool:
                bias = _additive(bias, query.dtype)
            if bias is not None:
                bias = bias.expand(query.size(0), query.size(1), query.size(2), key.size(2))
            out = torch.ops.aten._scaled_dot_product_efficient_attention(
                query,
                _expand_kv(key, groups),
                _expand_kv(value, groups),
                bias,
                True,
                dropout_p,
                is_causal,
                scale=scale,
            )
            return out[0]
        return _math_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, groups)

    def under_autocast(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        """aten::scaled_dot_product_attention's autocast kernel (lower_precision_fp): its
        floating inputs cast to the autocast dtype, then the backend chosen for that dtype and
        run without autocast, as the composite runs below the Autocast key."""
        if not torch.is_autocast_enabled("cpu"):
            return sdpa(query, key, value, attn_mask, *args, **kwargs)
        dtype = torch.get_autocast_dtype("cpu")

        def cast(t: torch.Tensor | None) -> torch.Tensor | None:
            eligible = t is not None and t.is_floating_point() and t.dtype != torch.float64
            return t.to(dtype) if eligible and t is not None and t.dtype != dtype else t

        q, k, v = cast(query), cast(key), cast(value)
        assert q is not None and k is not None and v is not None
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
            return sdpa(q, k, v, cast(attn_mask), *args, **kwargs)

    return under_autocast


_AUTOCAST_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


def _math_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    groups: int,
) -> torch.Tensor:
    """aten's math backend op by op, as its composite runs on CUDA tensors.

    (aten/src/ATen/native/transformers/attention.cpp `_scaled_dot_product_attention_math`:
    half inputs upcast to fp32 unless `allow_fp16_bf16_reduction_math_sdp` is set, which it is
    not by default; q scaled by sqrt(scale); a causal mask built as a boolean (L, S) tril and
    converted to an additive one; key and value repeated to the query's heads for GQA; the key
    scaled and transposed; the mask added in place; `_safe_softmax`.) On fake tensors aten's own
    composite adds the mask out of place (it does for tensor subclasses), so it is spelled out.
    The allocation order matches the caching allocator's history on an H200 (torch 2.11,
    tests/data/gpu/allocator/).
    """
    dtype = query.dtype
    if dtype in _HALF:
        query, key, value = query.float(), key.float(), value.float()
    head_dim = query.size(-1)
    scaling = math.sqrt(scale if scale is not None else 1.0 / math.sqrt(head_dim))
    query = query * scaling
    if is_causal:
        causal = torch.ones(query.size(-2), key.size(-2), dtype=torch.bool).tril()
        attn_mask = _additive(causal, query.dtype)
        del causal
    elif attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = _additive(attn_mask, query.dtype)
    key, value = _expand_kv(key, groups), _expand_kv(value, groups)
    scores = torch.matmul(query, key.transpose(-2, -1) * scaling)
    if attn_mask is not None:
        scores.add_(attn_mask)
    probs = _SafeSoftmax.apply(scores)
    # _safe_softmax: rows that are entirely -inf are found (and zeroed); none are here.
    scores.eq(float("-inf")).all(-1, keepdim=True)
    del scores
    if dropout_p > 0.0:
        probs = F.dropout(probs, dropout_p, True)
    return torch.matmul(probs, value).to(dtype)


class _SafeSoftmax(torch.autograd.Function):
    """`_safe_softmax` over the last dim as its backward runs on CUDA: the caching allocator's
    history on an H200 (torch 2.11, tests/data/gpu/allocator/q7-qlora-b4s2048-gc.json.gz) shows
    a second scores-sized buffer beside the gradient, freed as the backward returns."""

    @staticmethod
    def forward(ctx: Any, scores: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(scores, -1)
        ctx.save_for_backward(probs)
        return probs

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (probs,) = ctx.saved_tensors
        grad_scores = torch.ops.aten._softmax_backward_data(grad, probs, -1, probs.dtype)
        scratch = torch.empty_like(grad_scores)
        del scratch
        return grad_scores


def gemm_4bit_cuda(
    A: torch.Tensor,
    B: torch.Tensor,
    shapeB: list[int],
    absmax: torch.Tensor,
    blocksize: int,
    quant_type: str,
    bias: torch.Tensor | None = None,
    absmax_8bit: torch.Tensor | None = None,
    absmax_code: torch.Tensor | None = None,
    absmax_offset: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """What `bitsandbytes::gemm_4bit` runs on CUDA; None where it is the fused kernel itself.

    Above its row threshold it rebuilds the (nested) absmax in fp32, dequantizes the whole
    weight to the input's dtype, and calls F.linear (backends/cuda/ops.py,
    _dequant_linear_fallback).
    """
    rows = A.numel() // A.size(-1)
    if not uses_dequant_fallback(rows, shapeB[0], shapeB[1]):
        return None
    if absmax_8bit is not None:
        scales = torch.ops.bitsandbytes.dequantize_blockwise.default(
            absmax_8bit, absmax, absmax_code, NESTED_ABSMAX_BLOCKSIZE, torch.float32
        )
        absmax = scales + absmax_offset  # both stay alive until the matmul, as on CUDA
    weight = torch.ops.bitsandbytes.dequantize_4bit.default(
        B, absmax, blocksize, quant_type, shapeB, A.dtype
    )
    return F.linear(A, weight, bias)


def int8_vectorwise_quant_cuda(
    A: torch.Tensor, threshold: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """What `bitsandbytes::int8_vectorwise_quant` runs on CUDA (backends/cuda/ops.py): with a
    threshold, `A.abs() >= threshold` as a bool mask held to the end, then the row scales and
    the int8 rows. Which columns hold outliers depends on the values, which a fake tensor has
    not: the trace takes the no-outlier branch (`INT8_OUTLIER_COLUMNS`)."""
    rows = A.numel() // A.size(-1)
    outliers = None
    outlier_cols = None
    if threshold > 0.0:
        outliers = A.abs() >= threshold
        outlier_cols = torch.empty(INT8_OUTLIER_COLUMNS, device=A.device, dtype=torch.int64)
    row_stats = torch.empty(rows, device=A.device, dtype=torch.float32)
    out_row = torch.empty(A.shape, device=A.device, dtype=torch.int8)
    del outliers  # a local of the CUDA kernel until it returns
    return out_row, row_stats, outlier_cols


def int8_mixed_scaled_mm_cuda(
    A: torch.Tensor,
    CA: torch.Tensor,
    CB: torch.Tensor,
    SCA: torch.Tensor,
    SCB: torch.Tensor,
    outlier_cols: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`bitsandbytes::int8_mixed_scaled_mm`'s default kernel (backends/default/ops.py), the one
    CUDA runs, without outlier columns: an empty `subA`, and the int8 matmul."""
    if outlier_cols is not None and outlier_cols.numel():
        raise NotImplementedError("the trace models no outlier columns")
    sub_a = torch.empty(0, device=A.device, dtype=A.dtype)
    output = torch.ops.bitsandbytes.int8_scaled_mm.default(
        CA, CB, SCA, SCB, bias=bias, dtype=A.dtype
    )
    return output, sub_a


def int8_scaled_mm_cuda(
    A: torch.Tensor,
    B: torch.Tensor,
    row_stats: torch.Tensor,
    col_stats: torch.Tensor,
    bias: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`bitsandbytes::int8_scaled_mm`'s default kernel on CUDA: the int32 product, then
    `int8_mm_dequant`'s CUDA kernel (backends/cuda/ops.py): an fp16 output, the bias added
    when it is not fp16, cast to `dtype`; the int32 product lives until the cast returns."""
    product = torch.ops.bitsandbytes.int8_linear_matmul.default(A, B)
    out = torch.empty_like(product, dtype=torch.float16)
    if bias is not None and bias.dtype != torch.float16:
        out.add_(bias)
    result = out.to(dtype or torch.float16)
    del out, product
    return result


def matmul_8bit_cuda(
    A: torch.Tensor,
    B: torch.Tensor,
    out: torch.Tensor | None = None,
    state: Any = None,
    threshold: float = 0.0,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`bitsandbytes.matmul` as it dispatches for a CUDA tensor: MatMul8bitLt (a CPU tensor in
    training takes MatMul8bitFp, autograd/_functions.py matmul)."""
    import bitsandbytes as bnb
    from bitsandbytes.autograd._functions import MatMul8bitLt

    state = state or bnb.MatmulLtState()
    if threshold > 0.0:
        state.threshold = threshold
    result: torch.Tensor = MatMul8bitLt.apply(A, B, out, bias, state)
    return result


@contextmanager
def patched(target: Any, name: str, value: Any) -> Iterator[None]:
    """Set `target.name = value` for the duration of the block."""
    before = getattr(target, name)
    setattr(target, name, value)
    try:
        yield
    finally:
        setattr(target, name, before)


@contextmanager
def quiet_logger(name: str) -> Iterator[None]:
    """Silence logger `name` below ERROR for the duration of the block."""
    logger = logging.getLogger(name)
    before = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(before)


def make_dropout(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`F.dropout` taking the CUDA branch of aten's `dropout`: `native_dropout`, bool mask.

    On CPU tensors aten multiplies by a noise tensor of the input's dtype and saves it; on CUDA
    (`is_fused_kernel_acceptable`, aten/src/ATen/native/Dropout.cpp) it runs `native_dropout`,
    which saves a one-byte mask. In-place dropout takes the noise path on both.
    """

    def dropout(
        input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
    ) -> torch.Tensor:
        if inplace or not training or not 0.0 < p < 1.0 or input.numel() == 0:
            return original(input, p, training, inplace)
        return torch.ops.aten.native_dropout.default(input, p, True)[0]

    return dropout


def unpacked_batch(position_ids: torch.Tensor) -> None:
    """transformers' packed-sequence detection, answered as a real run of unpacked rows answers.

    The real function reads the position ids (a few 512-byte transients, then `.all()`), which a
    fake tensor cannot; it treats fake tensors as "tracing" and would build a block mask instead.
    """
    del position_ids


def packed_batch(position_ids: torch.Tensor) -> torch.Tensor:
    """transformers' packed-sequence detection on a packed row (position_ids restarting at each
    sequence), answered as a real run answers: each token's sequence index, from the position
    ids' steps (their difference from the previous one, prepended with the first id less one)
    that are not 1, counted along the row. The check that finds no restart is left out: a packed
    row has them."""
    steps = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
    return (steps != 1).cumsum(-1)


def _relaxed_grouped_mm() -> None:
    """Let fake tensors run `aten._grouped_mm` in any floating dtype, as CUDA does.

    torch 2.13's meta kernel (torch/_meta_registrations.py, _meta_grouped_mm_common) accepts bf16
    only, but CUDA's `_grouped_mm_cuda` (aten/src/ATen/native/cuda/GroupedBlas.cpp) runs other
    dtypes through `_grouped_mm_fallback`, one mm per group into the one output tensor; so MoE
    experts cast to fp32 (PEFT's prepare_model_for_kbit_training casts every half parameter
    bitsandbytes left unquantized) train on a GPU. The output is the meta kernel's own
    (`_create_grouped_mm_output_tensor`); the autograd formula stays aten's. Registered once per
    process: it only widens what the meta kernel accepts.
    """
    global _GROUPED_MM_RELAXED
    if _GROUPED_MM_RELAXED:
        return
    from torch._meta_registrations import _create_grouped_mm_output_tensor

    def grouped_mm_meta(
        mat_a: torch.Tensor,
        mat_b: torch.Tensor,
        offs: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        if mat_a.dtype != mat_b.dtype or not mat_a.is_floating_point():
            raise RuntimeError(
                f"grouped_mm needs two floating inputs of one dtype, got {mat_a.dtype} and "
                f"{mat_b.dtype}"
            )
        out: torch.Tensor = _create_grouped_mm_output_tensor(
            mat_a, mat_b, offs, out_dtype or mat_a.dtype
        )
        return out

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
        _META_OVERRIDES.impl("_grouped_mm", grouped_mm_meta, "Meta")
    _GROUPED_MM_RELAXED = True


@contextmanager
def gpu_kernels(
    requested: SdpaKernel, *, cpu_flash: bool = False, packed: bool = False
) -> Iterator[None]:
    """Route SDPA and dropout through their CUDA choices; see each row as one sequence, or with
    `packed` as the sequences of a padding-free row."""
    from transformers import masking_utils

    _relaxed_grouped_mm()
    with ExitStack() as stack:
        stack.enter_context(
            patched(F, "scaled_dot_product_attention", make_sdpa(requested, cpu_flash=cpu_flash))
        )
        stack.enter_context(patched(F, "dropout", make_dropout(F.dropout)))
        detection = packed_batch if packed else unpacked_batch
        stack.enter_context(patched(masking_utils, "find_packed_sequence_indices", detection))
        yield
