"""CUDA's autocast on the tracer's CPU tensors.

The tracer runs the step on fake CPU tensors, where `torch.autocast("cuda")` does not act and
CPU autocast casts a different list of ops. Inside `cuda_autocast_policy()`, CPU autocast acts
as CUDA autocast does in the pinned torch:

- The ops CUDA registers autocast kernels for (aten/src/ATen/autocast_mode.cpp,
  `TORCH_LIBRARY_IMPL(aten, AutocastCUDA, m)`: the `AT_FORALL_*` lists of
  ATen/autocast_mode.h and cudnn_convolution(_transpose)) get CUDA's policy for each:
  `lower_precision_fp` (floating inputs cast to the autocast dtype), `fp32` (cast to fp32),
  `fp32_set_opt_dtype` (the op's optional dtype set to fp32 when its first input is eligible),
  `fp32_append_dtype` (norm redispatched with dtype fp32), `promote` (inputs cast to their
  widest floating type), and binary_cross_entropy refused.
- Every other op that CPU autocast would cast runs uncast, as CUDA's fallthrough runs it.
- `lower_precision_fp` casts of fp32 leaf tensors that require grad (the weights) are cached
  until the outermost autocast region exits (autocast_mode.cpp `cached_cast`), so each weight is
  cast once per forward and the copy lives as long as the region or autograd needs it.
- The CUDA autocast queries libraries make (`torch.is_autocast_enabled()`,
  `torch.get_autocast_dtype("cuda")`, `torch.get_autocast_gpu_dtype()`) answer with CPU
  autocast's state, so PEFT and transformers take their autocast branches.

Limits: a tensor is eligible when floating point and not fp64 (every tracer tensor is on the
CPU, the device CUDA's eligibility also checks); ops called outside the ATen dispatcher (custom
ops such as bitsandbytes') fall through, as they do on CUDA.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils import _pytree as pytree

from service.core.spec import TrainingSpec
from service.core.units import DType

# The AutocastCUDA registrations of the pinned torch, by policy (ATen/autocast_mode.h lists).
LOWER_PRECISION_FP = (
    "_convolution.deprecated",
    "_convolution",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_tbc",
    "conv_transpose1d",
    "conv_transpose2d.input",
    "conv_transpose3d.input",
    "convolution",
    "prelu",
    "addmm",
    "addmv",
    "addr",
    "matmul",
    "einsum",
    "mm",
    "mv",
    "linalg_vecdot",
    "linear",
    "addbmm",
    "baddbmm",
    "bmm",
    "chain_matmul",
    "linalg_multi_dot",
    "_thnn_fused_lstm_cell",
    "_thnn_fused_gru_cell",
    "lstm_cell",
    "gru_cell",
    "rnn_tanh_cell",
    "rnn_relu_cell",
    "_scaled_dot_product_flash_attention",
    "scaled_dot_product_attention",
    "cudnn_convolution",
    "cudnn_convolution_transpose",
)
FP32 = (
    "acos",
    "asin",
    "cosh",
    "erfinv",
    "exp",
    "expm1",
    "log",
    "log10",
    "log2",
    "log1p",
    "reciprocal",
    "rsqrt",
    "sinh",
    "tan",
    "pow.Tensor_Scalar",
    "pow.Tensor_Tensor",
    "pow.Scalar",
    "softplus",
    "layer_norm",
    "native_layer_norm",
    "rms_norm",
    "group_norm",
    "frobenius_norm.dim",
    "nuclear_norm",
    "nuclear_norm.dim",
    "cosine_similarity",
    "poisson_nll_loss",
    "cosine_embedding_loss",
    "nll_loss",
    "nll_loss2d",
    "hinge_embedding_loss",
    "kl_div",
    "l1_loss",
    "smooth_l1_loss",
    "huber_loss",
    "mse_loss",
    "margin_ranking_loss",
    "multilabel_margin_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "multi_margin_loss",
    "binary_cross_entropy_with_logits",
    "dist",
    "pdist",
    "cdist",
    "renorm",
    "logsumexp",
    "upsample_nearest1d",
    "_upsample_nearest_exact1d",
    "upsample_nearest2d",
    "_upsample_nearest_exact2d",
    "upsample_nearest3d",
    "_upsample_nearest_exact3d",
    "upsample_linear1d",
    "upsample_bilinear2d",
    "_upsample_bilinear2d_aa",
    "upsample_trilinear3d",
    "upsample_bicubic2d",
    "_upsample_bicubic2d_aa",
)
FP32_SET_OPT_DTYPE = (
    "prod",
    "prod.dim_int",
    "softmax.int",
    "log_softmax.int",
    "cumprod",
    "cumsum",
    "linalg_vector_norm",
    "linalg_matrix_norm",
    "linalg_matrix_norm.str_ord",
    "sum",
    "sum.dim_IntList",
)
# norm without a dtype, redispatched to the overload that takes one (fp32_append_dtype).
FP32_APPEND_DTYPE = {
    "norm.Scalar": "norm.ScalarOpt_dtype",
    "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype",
}
PROMOTE = (
    "addcdiv",
    "addcmul",
    "atan2",
    "bilinear",
    "cross",
    "dot",
    "vdot",
    "grid_sampler",
    "index_put",
    "tensordot",
    "scatter_add",
)
BANNED = ("binary_cross_entropy",)

_EXCLUDE = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


def cuda_ops() -> frozenset[str]:
    """Every op this module gives CUDA's policy, as `name` or `name.overload`."""
    return frozenset(
        (*LOWER_PRECISION_FP, *FP32, *FP32_SET_OPT_DTYPE, *FP32_APPEND_DTYPE, *PROMOTE, *BANNED)
    )


def registered(dispatch_key: str) -> frozenset[str]:
    """The aten ops with a kernel for `dispatch_key` in this torch, as `cuda_ops` names them."""
    names = torch._C._dispatch_get_all_op_names()
    return frozenset(
        name.removeprefix("aten::")
        for name in names
        if name.startswith("aten::")
        and torch._C._dispatch_has_kernel_for_dispatch_key(name, dispatch_key)
    )


def _overload(name: str) -> torch._ops.OpOverload:
    base, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, base)
    return getattr(packet, overload or "default")


class _CastCache:
    """autocast_mode.cpp's cache of lower-precision casts of fp32 leaf weights."""

    def __init__(self) -> None:
        self._casts: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}

    def clear(self) -> None:
        self._casts.clear()

    def cast(self, to: torch.dtype, arg: torch.Tensor, lower: torch.dtype) -> torch.Tensor:
        if not _eligible(arg) or arg.dtype == to:
            return arg
        cacheable = (
            to == lower
            and arg.dtype == torch.float32
            and arg.requires_grad
            and arg.is_leaf
            and not arg._is_view()
            and torch.is_autocast_cache_enabled()
        )
        if not cacheable:
            return arg.to(to)
        found = self._casts.get(id(arg))
        if found is not None and found[0]() is arg:
            return found[1]
        casted = arg.to(to)
        self._casts[id(arg)] = (weakref.ref(arg), casted)
        return casted


def _eligible(arg: Any) -> bool:
    return isinstance(arg, torch.Tensor) and arg.is_floating_point() and arg.dtype != torch.float64


class _Policy:
    """The kernels, over one cast cache."""

    def __init__(self) -> None:
        self.cache = _CastCache()

    def lower_precision_fp(self, op: torch._ops.OpOverload) -> Callable[..., Any]:
        def kernel(*args: Any, **kwargs: Any) -> Any:
            lower = torch.get_autocast_dtype("cpu")
            with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
                args, kwargs = pytree.tree_map_only(
                    torch.Tensor, lambda t: self.cache.cast(lower, t, lower), (args, kwargs)
                )
                return op(*args, **kwargs)

        return kernel

    def fp32(self, op: torch._ops.OpOverload) -> Callable[..., Any]:
        def kernel(*args: Any, **kwargs: Any) -> Any:
            lower = torch.get_autocast_dtype("cpu")
            with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
                args, kwargs = pytree.tree_map_only(
                    torch.Tensor,
                    lambda t: self.cache.cast(torch.float32, t, lower),
                    (args, kwargs),
                )
                return op(*args, **kwargs)

        return kernel

    def fp32_set_opt_dtype(self, op: torch._ops.OpOverload) -> Callable[..., Any]:
        names = [a.name for a in op._schema.arguments]
        at = names.index("dtype")

        def kernel(*args: Any, **kwargs: Any) -> Any:
            with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
                if _eligible(args[0]):
                    given = args[at] if len(args) > at else kwargs.get("dtype")
                    if given is None:
                        if len(args) > at:
                            args = (*args[:at], torch.float32, *args[at + 1 :])
                        else:
                            kwargs = {**kwargs, "dtype": torch.float32}
                return op(*args, **kwargs)

        return kernel

    def fp32_append_dtype(
        self, op: torch._ops.OpOverload, with_dtype: torch._ops.OpOverload
    ) -> Callable[..., Any]:
        def kernel(*args: Any, **kwargs: Any) -> Any:
            with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
                if _eligible(args[0]):
                    return with_dtype(*args, **kwargs, dtype=torch.float32)
                return op(*args, **kwargs)

        return kernel

    def promote(self, op: torch._ops.OpOverload) -> Callable[..., Any]:
        def kernel(*args: Any, **kwargs: Any) -> Any:
            lower = torch.get_autocast_dtype("cpu")
            with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
                to = lower
                for leaf in pytree.tree_leaves((args, kwargs)):
                    if _eligible(leaf):
                        to = torch.promote_types(to, leaf.dtype)
                args, kwargs = pytree.tree_map_only(
                    torch.Tensor, lambda t: self.cache.cast(to, t, lower), (args, kwargs)
                )
                return op(*args, **kwargs)

        return kernel

    @staticmethod
    def banned(name: str) -> Callable[..., Any]:
        def kernel(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(
                f"torch.nn.functional.{name} and torch.nn.BCELoss are unsafe to autocast "
                "(autocast_mode.cpp binary_cross_entropy_banned)"
            )

        return kernel

    @staticmethod
    def passthrough(op: torch._ops.OpOverload) -> Callable[..., Any]:
        def kernel(*args: Any, **kwargs: Any) -> Any:
            with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
                return op(*args, **kwargs)

        return kernel


@contextmanager
def cuda_autocast_policy() -> Iterator[None]:
    """CPU autocast acts as CUDA autocast inside this block (enter `torch.autocast("cpu",
    dtype=...)` for the regions that autocast, as the training step does)."""
    policy = _Policy()
    library = torch.library.Library("aten", "IMPL")
    kernels: dict[str, Callable[..., Any]] = {}
    for name in LOWER_PRECISION_FP:
        kernels[name] = policy.lower_precision_fp(_overload(name))
    for name in FP32:
        kernels[name] = policy.fp32(_overload(name))
    for name in FP32_SET_OPT_DTYPE:
        kernels[name] = policy.fp32_set_opt_dtype(_overload(name))
    for name, with_dtype in FP32_APPEND_DTYPE.items():
        kernels[name] = policy.fp32_append_dtype(_overload(name), _overload(with_dtype))
    for name in PROMOTE:
        kernels[name] = policy.promote(_overload(name))
    for name in BANNED:
        kernels[name] = policy.banned(name)
    for name in registered("AutocastCPU") - cuda_ops():
        kernels[name] = policy.passthrough(_overload(name))

    saved = {
        name: getattr(torch, name)
        for name in (
            "is_autocast_enabled",
            "get_autocast_dtype",
            "get_autocast_gpu_dtype",
            "clear_autocast_cache",
        )
    }

    def is_autocast_enabled(device_type: str | None = None) -> bool:
        on_cpu = "cpu" if device_type in (None, "cuda") else device_type
        return bool(saved["is_autocast_enabled"](on_cpu))

    def get_autocast_dtype(device_type: str) -> torch.dtype:
        on_cpu = "cpu" if device_type == "cuda" else device_type
        return saved["get_autocast_dtype"](on_cpu)  # type: ignore[no-any-return]

    def get_autocast_gpu_dtype() -> torch.dtype:
        return saved["get_autocast_dtype"]("cpu")  # type: ignore[no-any-return]

    def clear_autocast_cache() -> None:
        policy.cache.clear()
        saved["clear_autocast_cache"]()

    try:
        with warnings.catch_warnings():
            # "Overriding a previously registered kernel": CPU's own autocast kernels.
            warnings.simplefilter("ignore", UserWarning)
            for name, kernel in kernels.items():
                library.impl(name, kernel, "AutocastCPU")
        torch.is_autocast_enabled = is_autocast_enabled  # type: ignore[assignment]
        torch.get_autocast_dtype = get_autocast_dtype  # type: ignore[assignment]
        torch.get_autocast_gpu_dtype = get_autocast_gpu_dtype  # type: ignore[assignment]
        torch.clear_autocast_cache = clear_autocast_cache
        yield
    finally:
        for name, original in saved.items():
            setattr(torch, name, original)
        policy.cache.clear()
        library._destroy()


def autocast_dtype(spec: TrainingSpec) -> torch.dtype:
    """HF Trainer's mixed precision: fp16 for an fp16 model (fp16=True), else bf16."""
    return torch.float16 if spec.dtype is DType.FP16 else torch.bfloat16


@contextmanager
def accelerate_forward(models: Iterable[torch.nn.Module], spec: TrainingSpec) -> Iterator[None]:
    """Each model's forward as accelerate 1.15 prepares it under mixed precision
    (accelerate/accelerator.py `prepare_model`, `native_amp`): the forward inside autocast, its
    half-precision outputs converted to fp32 (accelerate/utils/operations.py
    `convert_outputs_to_fp32`). TRL's trainers call the prepared policy and reference models
    this way, with their losses computed outside; without mixed precision nothing changes."""
    if not spec.autocast:
        yield
        return
    from accelerate.utils import convert_outputs_to_fp32

    dtype = autocast_dtype(spec)
    wrapped = list(models)
    for model in wrapped:
        forward = model.forward

        def autocast_forward(*args: Any, _forward: Any = forward, **kwargs: Any) -> Any:
            with torch.autocast("cpu", dtype=dtype):
                return _forward(*args, **kwargs)

        model.forward = convert_outputs_to_fp32(autocast_forward)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for model in wrapped:
            del model.forward  # the class's forward again
