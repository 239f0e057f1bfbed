"""Liger Kernel's patches (liger-kernel 0.8.2) as HF Trainer's `use_liger_kernel=True` applies
them, with stand-ins for its Triton kernels that run on the CPU and on fake tensors.

transformers 5.24's Trainer calls `liger_kernel.transformers._apply_liger_kernel_to_instance`
on the PEFT model's base model (transformers/integrations/liger.py apply_liger_kernel), which
runs the model type's `apply_liger_kernel_to_*` with its defaults (liger_kernel/transformers/
monkey_patch.py): the modeling module's `apply_rotary_pos_emb` replaced, every RMSNorm's and
every MLP's forward rebound on the instance, the causal LM's forward replaced by one that
feeds the final hidden states to the fused linear cross-entropy.

Each stand-in Function allocates the buffers its Liger counterpart allocates through torch
(`torch.empty`, `zeros_like`, the GEMMs), writes them in place the way the Triton kernel does
(without bumping the version counter, as a Triton store does not), and saves for backward
exactly what the Liger Function saves. The arithmetic a Triton kernel does in registers runs
inside `kernel_scope()`, which the tracer points at its `off_device` block: those temporaries
are not device memory on a GPU run. Values follow the kernels' formulas, so the stand-ins
compute what the unpatched transformers modules compute (tests/trace/test_liger.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from types import MethodType
from typing import Any

import torch
import torch.nn.functional as F

from service.core.liger import (
    LIGER_VERSION,
    REFERENCE_SM_COUNT,
    LigerPatches,
    liger_chunk_rows,
    liger_patches,
)

# transformers' causal-LM labels ignore this index (liger_kernel/transformers/model/
# loss_utils.py LigerForCausalLMLoss: ignore_index=-100).
IGNORE_INDEX = -100
TRACE_NOTE = (
    f"liger-kernel {LIGER_VERSION}'s patches as HF Trainer applies them, its Triton kernels run "
    "as stand-ins that allocate and save what they do (service/trace/liger.py)"
)
# The tanh approximation of GELU (liger_kernel/ops/geglu.py _geglu_tanh_forward_kernel).
GELU_TANH_COEFF = 0.044715

_scope: list[Callable[[], AbstractContextManager[Any]]] = [nullcontext]


def kernel_scope() -> AbstractContextManager[Any]:
    """Where a Triton kernel's register arithmetic runs (not device memory on a GPU)."""
    return _scope[-1]()


@contextmanager
def registers(scope: Callable[[], AbstractContextManager[Any]]) -> Iterator[None]:
    """Run the stand-ins' register arithmetic inside `scope()` (the tracker's `off_device`)."""
    _scope.append(scope)
    try:
        yield
    finally:
        _scope.pop()


def _store(dst: torch.Tensor, src: torch.Tensor) -> None:
    """A Triton store into `dst`: in place, invisible to autograd's version counter."""
    version = dst._version
    with torch.no_grad():
        dst.copy_(src)
    torch._C._autograd._unsafe_set_version_counter((dst,), (version,))


# -- RMSNorm --------------------------------------------------------------------------------


def _rms_values(
    x: torch.Tensor, w: torch.Tensor | None, eps: float, offset: float, casting: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """_rms_norm_forward_kernel's output and rstd for the 'llama' and 'gemma' casting modes."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
    normed = xf * rstd.unsqueeze(-1)
    if w is None:
        return normed.to(x.dtype), rstd
    if casting == "gemma":
        return (normed * (offset + w.float())).to(x.dtype), rstd
    return normed.to(x.dtype) * (offset + w), rstd


class RmsNormFunction(torch.autograd.Function):
    """LigerRMSNormFunction: saves the input (no fp32 copy) and an fp32 rstd per row; backward
    writes dX into dY's storage (in_place, Llama's default) or a zeroed new one (Gemma-2), and
    reduces an fp32 (sm_count, hidden) partial weight gradient."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        w: torch.Tensor | None,
        eps: float,
        offset: float,
        casting: str,
        in_place: bool,
    ) -> torch.Tensor:
        x = x.contiguous()  # liger's ensure_contiguous
        shape = x.shape
        rows = x.view(-1, shape[-1])
        y = torch.empty_like(rows)
        rstd = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
        with kernel_scope():
            values, rstd_values = _rms_values(rows, w, eps, offset, casting)
            _store(y, values)
            _store(rstd, rstd_values)
        ctx.eps, ctx.offset, ctx.casting, ctx.in_place = eps, offset, casting, in_place
        ctx.save_for_backward(rows, w, rstd)
        return y.view(shape)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        rows, w, _ = ctx.saved_tensors
        dy = dy.contiguous()
        shape = dy.shape
        dy_rows = dy.view(-1, shape[-1])
        dx = dy_rows if ctx.in_place else torch.zeros_like(dy_rows)
        partial_dw = None
        if w is not None:
            partial_dw = torch.empty(
                (REFERENCE_SM_COUNT, rows.shape[1]), dtype=torch.float32, device=w.device
            )
        with kernel_scope(), torch.enable_grad():
            x_leaf = rows.detach().requires_grad_(True)
            w_leaf = None if w is None else w.detach().requires_grad_(True)
            out, _ = _rms_values(x_leaf, w_leaf, ctx.eps, ctx.offset, ctx.casting)
            wanted = [x_leaf] if w_leaf is None else [x_leaf, w_leaf]
            grads = torch.autograd.grad(out, wanted, dy_rows)
            dx_values = grads[0]
            if partial_dw is not None:
                _store(partial_dw[0], grads[1].float())
                partial_dw[1:].zero_()
        _store(dx, dx_values)
        dw = None
        if w is not None and partial_dw is not None:
            dw = partial_dw.sum(dim=0).to(w.dtype)
        return dx.view(shape), dw, None, None, None, None


def rms_norm_forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """LigerRMSNorm.forward, bound on an existing norm by `_patch_rms_norm_module`."""
    return RmsNormFunction.apply(  # type: ignore[no-any-return]
        hidden_states,
        self.weight,
        self.variance_epsilon,
        self.offset,
        self.casting_mode,
        self.in_place,
    )


# -- SwiGLU / GEGLU -------------------------------------------------------------------------


def _silu_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """_swiglu_forward_kernel: silu of the fp32 gate, cast to up's dtype, times up."""
    return F.silu(a.float()).to(b.dtype) * b


def _gelu_tanh_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """_geglu_tanh_forward_kernel: tanh-approximated GELU of the fp32 gate, cast, times up."""
    af = a.float()
    inner = math.sqrt(2.0 / math.pi) * (af + GELU_TANH_COEFF * af.pow(3))
    return (0.5 * af * (1.0 + torch.tanh(inner))).to(b.dtype) * b


class _GatedMulFunction(torch.autograd.Function):
    """LigerSiLUMulFunction / LigerGELUMulFunction: saves the gate and up projections' outputs
    (not the activation, which backward recomputes) and writes their gradients into those
    same storages (ops/swiglu.py swiglu_backward, ops/geglu.py geglu_backward)."""

    act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = staticmethod(_silu_mul)

    @classmethod
    def forward(cls, ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        a, b = a.contiguous(), b.contiguous()
        c = torch.empty_like(a)
        with kernel_scope():
            _store(c, cls.act(a, b))
        ctx.save_for_backward(a, b)
        return c

    @classmethod
    def backward(cls, ctx: Any, dc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        a, b = ctx.saved_tensors
        dc = dc.contiguous()
        with kernel_scope(), torch.enable_grad():
            a_leaf = a.detach().requires_grad_(True)
            b_leaf = b.detach().requires_grad_(True)
            da, db = torch.autograd.grad(cls.act(a_leaf, b_leaf), (a_leaf, b_leaf), dc)
        _store(a, da)
        _store(b, db)
        return a, b


class SiluMulFunction(_GatedMulFunction):
    act = staticmethod(_silu_mul)


class GeluMulFunction(_GatedMulFunction):
    act = staticmethod(_gelu_tanh_mul)


def swiglu_mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """LigerSwiGLUMLP.forward on the layer's own projections."""
    return self.down_proj(SiluMulFunction.apply(self.gate_proj(x), self.up_proj(x)))  # type: ignore[no-any-return]


def geglu_mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """LigerGEGLUMLP.forward on the layer's own projections."""
    return self.down_proj(GeluMulFunction.apply(self.gate_proj(x), self.up_proj(x)))  # type: ignore[no-any-return]


# -- RoPE -----------------------------------------------------------------------------------


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    """_triton_rope on the (b, s, heads, d) physical layout; sign -1 is the backward pass."""
    half = x.shape[-1] // 2
    c = cos.unsqueeze(2)
    s = sin.unsqueeze(2) * sign
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat(
        (x1 * c[..., :half] - x2 * s[..., :half], x2 * c[..., half:] + x1 * s[..., half:]), -1
    ).to(x.dtype)


class RopeFunction(torch.autograd.Function):
    """LigerRopeFunction: rotates q and k in place in their projection's (b, s, heads, d)
    storage and saves only cos and sin; backward rotates dq and dk back in place."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q_phys = q.transpose(1, 2).contiguous()
        k_phys = k.transpose(1, 2).contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        with kernel_scope():
            _store(q_phys, _rotate(q_phys, cos, sin, 1.0))
            _store(k_phys, _rotate(k_phys, cos, sin, 1.0))
        ctx.save_for_backward(cos, sin)
        return q_phys.transpose(1, 2), k_phys.transpose(1, 2)

    @staticmethod
    def backward(ctx: Any, dq: torch.Tensor, dk: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        dq_phys = dq.transpose(1, 2).contiguous()
        dk_phys = dk.transpose(1, 2).contiguous()
        with kernel_scope():
            _store(dq_phys, _rotate(dq_phys, cos, sin, -1.0))
            _store(dk_phys, _rotate(dk_phys, cos, sin, -1.0))
        return dq_phys.transpose(1, 2), dk_phys.transpose(1, 2), None, None


def rotary_pos_emb(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: Any = None,
    unsqueeze_dim: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """liger_rotary_pos_emb, in place of the modeling module's apply_rotary_pos_emb."""
    return RopeFunction.apply(q, k, cos, sin)  # type: ignore[no-any-return]


# -- Fused linear cross-entropy -------------------------------------------------------------


def _ce_chunk(
    logits: torch.Tensor, target: torch.Tensor, count: torch.Tensor, softcap: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """liger_cross_entropy_kernel on one chunk (reduction 'mean'): each row's loss over the
    non-ignored count, and the logits' gradient (softmax - one-hot, through the softcap) over
    that count, in the logits' dtype."""
    x = logits.float()
    capped = softcap * torch.tanh(x / softcap) if softcap is not None else x
    valid = target != IGNORE_INDEX
    safe = torch.where(valid, target, torch.zeros_like(target))
    logp = torch.log_softmax(capped, -1)
    loss = -logp.gather(-1, safe.unsqueeze(-1)).squeeze(-1) * valid / count
    grad = torch.softmax(capped, -1)
    grad = grad - F.one_hot(safe, x.shape[-1]).to(grad.dtype)
    grad = grad * (valid.unsqueeze(-1) / count)
    if softcap is not None:
        grad = grad * (1.0 - torch.tanh(x / softcap).pow(2))
    return loss, grad.to(logits.dtype)


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """LigerFusedLinearCrossEntropyFunction (reduction 'mean', no bias, accum_dtype None): the
    gradients are computed in forward, chunk by chunk, and saved; backward hands them on
    (scaled in place when the loss's gradient is not 1)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        softcap: float | None,
    ) -> torch.Tensor:
        tokens, width = hidden.shape
        vocab = weight.shape[0]
        chunk = liger_chunk_rows(tokens, vocab, width)
        grad_input = torch.zeros_like(hidden)
        grad_weight = torch.zeros_like(weight) if weight.requires_grad else None
        loss_1d = torch.zeros(tokens, dtype=torch.float32, device=hidden.device)
        target_mask = target != IGNORE_INDEX
        with kernel_scope():
            # `target_mask.sum().item()`: a host number on a GPU run
            count = target_mask.sum().clamp(min=1).float()
        for start in range(0, tokens, chunk):
            end = min(start + chunk, tokens)
            hidden_chunk = hidden[start:end]
            logits_chunk = (hidden_chunk @ weight.t()).contiguous()
            with kernel_scope():
                loss_values, grad_values = _ce_chunk(
                    logits_chunk, target[start:end].contiguous(), count, softcap
                )
                _store(loss_1d[start:end], loss_values)
                _store(logits_chunk, grad_values)
            grad_input[start:end] = logits_chunk @ weight
            if grad_weight is not None:
                # the CUDA fp32-out addmm needs an fp32 accumulator; with accum_dtype None it
                # takes this path: the product in the weight's dtype, its fp32 copy, the add
                grad_weight += torch.mm(logits_chunk.t(), hidden_chunk).float()
            del logits_chunk
        loss = torch.sum(loss_1d)
        ctx.save_for_backward(
            grad_input.detach(), grad_weight.detach() if grad_weight is not None else None
        )
        return loss

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        grad_input, grad_weight = ctx.saved_tensors
        # element_mul_kernel scales the saved gradients in place (a no-op for a gradient of 1)
        with kernel_scope():
            scaled = grad_input * grad_output
        _store(grad_input, scaled)
        if grad_weight is not None:
            with kernel_scope():
                scaled_w = grad_weight * grad_output
            _store(grad_weight, scaled_w)
        return grad_input, grad_weight, None, None


def causal_lm_loss(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    softcap: float | None = None,
) -> torch.Tensor:
    """LigerForCausalLMLoss: labels padded by one ignored position and shifted, the hidden
    states flattened, then the fused linear cross-entropy."""
    padded = F.pad(labels, (0, 1), value=IGNORE_INDEX)
    shift = padded[..., 1:].contiguous().view(-1)
    flat = hidden_states.view(-1, hidden_states.shape[-1])
    return FusedLinearCrossEntropyFunction.apply(flat, weight, shift, softcap)  # type: ignore[no-any-return]


def lce_forward(
    self: Any,
    input_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    **kwargs: Any,
) -> Any:
    """The `*_lce_forward` Liger binds on the causal LM: the model's hidden states, and in
    training with labels the fused loss on the LM head's weight; no logits."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    kwargs.pop("num_items_in_batch", None)
    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    hidden = outputs[0][:, slice(0, None), :]
    if not (self.training and labels is not None):
        return CausalLMOutputWithPast(logits=self.lm_head(hidden))
    lm_head = self.lm_head
    if hasattr(lm_head, "modules_to_save"):  # peft ModulesToSaveWrapper
        lm_head = lm_head.modules_to_save["default"]
    softcap = getattr(self.config, "final_logit_softcapping", None)
    loss = causal_lm_loss(hidden, lm_head.weight, labels, softcap)
    return CausalLMOutputWithPast(loss=loss)


# -- applying the patches -------------------------------------------------------------------


def backbone(model: Any) -> Any:
    """The decoder stack whose output the fused loss takes (the causal LM's `model`)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model


def _bind(module: Any, name: str, function: Callable[..., Any]) -> None:
    module.__dict__[name] = MethodType(function, module)


def _rms_modules(base: Any, patches: LigerPatches) -> Iterator[Any]:
    yield base.model.norm
    for layer in base.model.layers:
        for name in patches.layer_norms:
            yield getattr(layer, name)


@contextmanager
def applied(model: Any) -> Iterator[LigerPatches]:
    """`_apply_liger_kernel_to_instance` on the PEFT model's base model (what HF Trainer does
    with use_liger_kernel=True), restoring the modeling module's RoPE function on exit."""
    import importlib

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    patches = liger_patches(base.config.model_type)
    if patches is None:
        raise ValueError(
            f"liger-kernel {LIGER_VERSION} has no patches modelled for {base.config.model_type!r}"
        )
    modeling = importlib.import_module(
        f"transformers.models.{patches.module}.modeling_{patches.module}"
    )
    with ExitStack() as stack:
        if patches.rope:
            original = modeling.apply_rotary_pos_emb
            modeling.apply_rotary_pos_emb = rotary_pos_emb
            stack.callback(setattr, modeling, "apply_rotary_pos_emb", original)
        for norm in _rms_modules(base, patches):
            norm.offset = patches.rms_offset
            norm.casting_mode = patches.rms_casting
            norm.variance_epsilon = getattr(norm, "variance_epsilon", None) or norm.eps
            norm.in_place = patches.rms_in_place
            _bind(norm, "forward", rms_norm_forward)
        for layer in base.model.layers:
            if patches.mlp == "swiglu":
                _bind(layer.mlp, "forward", swiglu_mlp_forward)
            elif patches.mlp == "geglu":
                _bind(layer.mlp, "forward", geglu_mlp_forward)
        _bind(base, "forward", lce_forward)
        yield patches
