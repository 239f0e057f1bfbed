"""What a decoder layer saves for backward, tensor by tensor."""

from __future__ import annotations

from functools import lru_cache

from service.core.arch import (
    COMPOSITE_TANH_GELU,
    Linear,
    LinearKind,
    MlpKind,
    ModelArch,
    NormKind,
)
from service.core.estimator.adapter import (
    adapter_attention_saves,
    norm_product_bytes,
    v2_linear_saves,
)
from service.core.estimator.attention_saves import _AttnChoice, attention_saves
from service.core.estimator.deepseek import (
    deepseek_moe_saves,
    mla_attention_saves,
)
from service.core.estimator.layer_flow import LayerFlow, layer_flow
from service.core.estimator.ledger import _Kind, _Ledger, _recipe_bytes
from service.core.estimator.looped_experts import ALWAYS_RENORMALISED, is_looped, looped_linears
from service.core.estimator.oft import rotation_saves
from service.core.estimator.weights import (
    FUSED_GATE_UP_RANK_FACTOR,
    adapted_linears,
    lokr_shape,
)
from service.core.quant_formats import AWQ
from service.core.spec import (
    AttnImpl,
    ResolvedSpec,
    SdpaKernel,
)
from service.core.spec.delta import LokrSpec
from service.core.units import (
    AUTOCAST_BYTES,
    BOOL_BYTES,
    FP32_BYTES,
    HALF_BYTES,
    INT64_BYTES,
)


def _linear_saves(
    led: _Ledger, f: LayerFlow, lin: Linear, x_key: str, x_bytes: int, *, input_grad: bool = True
) -> None:
    """What one linear keeps for backward, given its input tensor `x_key` (`input_grad`: whether
    that input needs a gradient; bitsandbytes 0.41.1 keeps it only then)."""
    if f.packed == AWQ and input_grad and x_bytes != HALF_BYTES:
        # AwqGEMMLinear.forward casts a wider input to fp16 (`x.to(compute_dtype)`), one copy
        # per linear, which AwqGemmFn saves
        led.add(f"{x_key}>awq>{lin.name}", lin.in_features * HALF_BYTES)
    elif f.full or (f.quant_saves_input and input_grad and lin.nn_linear):
        led.add(x_key, lin.in_features * x_bytes)  # weight grad needs the input
    if f.dequant_saved and input_grad and not lin.expert:
        # the matmul on the dequantized weight keeps it for the input's gradient
        # (derivatives.yaml mm: mat1's gradient reads mat2); see quant_formats.py
        weight = lin.in_features * lin.out_features * lin.count * f.dequant_saved
        led.add(f"{lin.name}.dequantized", weight, _Kind.CONSTANT)
    _ia3_saves(led, f, lin, x_key, x_bytes, input_grad)
    if f.adapter_v2:
        v2_linear_saves(led, lin.name, lin.out_features * lin.count, f.norm_out)
    if lin.name not in f.lora_targets:
        return
    if f.vera:
        _vera_saves(led, f, lin)
        return
    if f.loha:
        _loha_saves(led, f, lin, x_key, x_bytes, input_grad)
        return
    if f.lokr is not None:
        _lokr_saves(led, f, f.lokr, lin, x_key, x_bytes, input_grad)
        return
    if rotation_saves(led, f.oft, f.boft, lin, x_key, x_bytes, input_grad):
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
        peft_dtype = x_bytes if f.quantized and lin.nn_linear else f.adapter
        shared = x_bytes == peft_dtype == AUTOCAST_BYTES
    cast_key = x_key if shared else f"{x_key}>{lin_key}"
    if f.dropout:
        if not f.frozen_a:
            led.add(f"{lin_key}.dropout_out", lin.in_features * in_bytes)
        led.add(f"{lin_key}.dropout_mask", lin.in_features * BOOL_BYTES)
    elif not f.frozen_a:
        # autograd saves an mm's input only for its weight's gradient
        # (tools/autograd/derivatives.yaml mm: mat2's formula alone reads self)
        led.add(cast_key, lin.in_features * in_bytes)
    led.add(f"{lin.name}.lora_a_out", f.r * in_bytes)
    if f.adalora:
        # peft/tuners/adalora/layer.py SVDLinear.forward, `x @ (lora_A * lora_E).T @ lora_B.T
        # * scaling / (ranknum + 1e-5)`: the first matmul keeps the product A * E for the
        # input's gradient (when it takes one); the division by a tensor keeps its dividend,
        # the scaled output (reference traces *__adalora__*), and its one-element divisor.
        led.add(f"{lin.name}.adalora_scaled", lin.out_features * f.adapter)
        if input_grad:
            led.add(f"{lin.name}.adalora_ae", f.r * lin.in_features * f.adapter, _Kind.CONSTANT)
        led.add(f"{lin.name}.adalora_ranknum", f.adapter, _Kind.CONSTANT)
    if f.autocast and f.adapter != AUTOCAST_BYTES:
        # Autocast casts the wider adapter weights to half precision for their matmuls, and
        # each matmul keeps its copy of A and of B for backward.
        led.add(f"{lin.name}.lora_a_half", f.r * lin.in_features * AUTOCAST_BYTES, _Kind.CONSTANT)
        led.add(f"{lin.name}.lora_b_half", f.r * lin.out_features * AUTOCAST_BYTES, _Kind.CONSTANT)
    if lin.kind is LinearKind.ATTN_QKV and f.zero_pad_width:
        led.add("qkv.zero_pad_source", f.zero_pad_width * in_bytes)
    if f.dora:
        peft_dtype = x_bytes if f.autocast and f.quantized and lin.nn_linear else f.adapter
        _dora_saves(led, f, lin, x_bytes, in_bytes, peft_dtype)


def _ia3_saves(
    led: _Ledger, f: LayerFlow, lin: Linear, x_key: str, x_bytes: int, input_grad: bool
) -> None:
    """(IA)^3 on a linear (peft/tuners/ia3/layer.py Linear.forward). A feedforward module
    casts its input to the vector's dtype and multiplies: the product keeps that cast (the
    input itself when the dtypes agree) for the vector's gradient. Otherwise the base output
    is multiplied, and kept for the same reason; the product is cast back, a new tensor.
    The product also keeps the scaling (`1 * ia3_l.flatten()`, a new vector) for the other
    operand's gradient, when that operand takes one."""
    if lin.name in f.ia3_in:
        key = x_key if f.adapter == x_bytes else f"{x_key}>ia3"
        led.add(key, lin.in_features * f.adapter)
        led.add(f"{lin.name}.ia3_scaling", lin.in_features * f.adapter, _Kind.CONSTANT)
    elif lin.name in f.ia3_out:
        led.add(f"{lin.name}.base_out", lin.out_features * x_bytes)
        if input_grad:
            led.add(f"{lin.name}.ia3_scaling", lin.out_features * f.adapter, _Kind.CONSTANT)


def kept_past_checkpoints(arch: ModelArch, f: LayerFlow) -> tuple[tuple[int, _Kind, int], ...]:
    """What a checkpointed layer keeps through the whole step all the same: the inputs its
    LLM.int8 linears hold on their autograd node (MatMul8bitLt.forward's `ctx.tensors`, an
    attribute that checkpointing's saved-tensor hooks never see), freed only when backward
    reaches the node (reference traces *__int8__*ckpt). Empty for every other base."""
    led = _Ledger()
    if not (f.quantized and f.quant_saves_input and f.hf_modules) or f.packed:
        return led.recipe()
    mlp_key = "norm1.out" if arch.parallel_residual and arch.norms_per_layer == 1 else "norm2.out"
    inputs = {
        LinearKind.ATTN_QKV: ("norm1.out", f.norm_out),
        LinearKind.ATTN_OUT: ("attn_out", f.attn),
        LinearKind.MLP_IN: (mlp_key, f.norm_out),
        LinearKind.MLP_OUT: ("mlp.product", f.norm_out),
    }
    for lin in arch.linears:
        if lin.expert or lin.kind not in inputs:
            continue
        key, nbytes = inputs[lin.kind]
        led.add(key, lin.in_features * nbytes)
    return led.recipe()


def _vera_saves(led: _Ledger, f: LayerFlow, lin: Linear) -> None:
    """PEFT's VeRA linear (peft/tuners/vera/layer.py Linear.forward): `result + lambda_b *
    F.linear(lambda_d * F.linear(x, vera_A), vera_B)` on the input cast to the vectors' dtype.
    vera_A and vera_B are frozen, so their matmuls keep no input; each product with a trained
    vector keeps the other factor: vera_A's output (r) and vera_B's (out) per token."""
    led.add(f"{lin.name}.vera_a_out", f.r * f.adapter)
    led.add(f"{lin.name}.vera_b_out", lin.out_features * f.adapter)


def _loha_saves(
    led: _Ledger, f: LayerFlow, lin: Linear, x_key: str, x_bytes: int, input_grad: bool
) -> None:
    """PEFT's LoHa linear (peft/tuners/loha/layer.py Linear._get_delta_activations):
    F.linear(x cast to the adapters' dtype, delta) with the delta weight HadaWeight builds:
    the matmul keeps this linear's own cast of the input for the delta's gradient, and the
    full-size delta for the input's, when the input takes one. (HadaWeight also saves its
    scale, a 0-d host tensor: torch.tensor(self.scaling) on the CPU.)"""
    cast_key = x_key if f.adapter == x_bytes else f"{x_key}>{lin.name}"
    led.add(cast_key, lin.in_features * f.adapter)
    if input_grad:
        delta = lin.in_features * lin.out_features * lin.count * f.adapter
        led.add(f"{lin.name}.loha_delta", delta, _Kind.CONSTANT)


def _lokr_saves(
    led: _Ledger,
    f: LayerFlow,
    lokr: LokrSpec,
    lin: Linear,
    x_key: str,
    x_bytes: int,
    input_grad: bool,
) -> None:
    """PEFT's LoKr linear (peft/tuners/lokr/layer.py Linear._get_delta_activations): the
    delta weight is `torch.kron(w1, w2) * scale`, w1 and w2 built as products where they are
    rank-r pairs; F.linear keeps the input's cast and the full-size delta (as LoHa's), and
    kron's broadcast product keeps each built factor for the other's gradient."""
    _loha_saves(led, f, lin, x_key, x_bytes, input_grad)
    shape = lokr_shape(lin, f.r, lokr.decompose_both, lokr.decompose_factor)
    if not shape.w1_whole:
        led.add(f"{lin.name}.lokr_w1", shape.out1 * shape.in1 * f.adapter, _Kind.CONSTANT)
    if not shape.w2_whole:
        led.add(f"{lin.name}.lokr_w2", shape.out2 * shape.in2 * f.adapter, _Kind.CONSTANT)


def _dora_saves(
    led: _Ledger, f: LayerFlow, lin: Linear, x_bytes: int, lora_bytes: int, peft_dtype: int
) -> None:
    """What PEFT 0.21's DoRA adds to a linear's saves (peft/tuners/lora/dora.py
    DoraLinearLayer.forward): `(m / ||W + s*BA||_c - 1) * base + (m / ||.||_c) * lora * s`.

    The two products keep the base result and the adapter result (`lora_bytes`: the adapter
    dtype, or half under autocast) and the two scale vectors; the division keeps the detached
    column norm. The norm is computed in the dtype PEFT casts the input to (`peft_dtype`), like
    the magnitude. Without dropout the base result is the base layer's output (less its bias, a
    new tensor when there is one); with dropout PEFT runs F.linear(dropout(x), W) again with W
    cast to that dtype, and that product keeps the cast weight for the input gradient."""
    out = lin.out_features
    for name in ("weight_norm", "scale_minus_one", "scale"):
        led.add(f"{lin.name}.dora_{name}", out * peft_dtype, _Kind.CONSTANT)
    led.add(f"{lin.name}.dora_lora_result", out * lora_bytes)
    if f.dropout:
        led.add(f"{lin.name}.dora_weight_cast", out * lin.in_features * peft_dtype, _Kind.CONSTANT)
        led.add(f"{lin.name}.dora_base_result", out * lora_bytes)
    else:
        base_bytes = AUTOCAST_BYTES if f.autocast and not f.quantized else x_bytes
        led.add(f"{lin.name}.dora_base_result", out * base_bytes)


def _norm_saves(led: _Ledger, f: LayerFlow, key: str, x_key: str, h: int, arch: ModelArch) -> None:
    """RMSNorm (LlamaRMSNorm): saves an fp32 copy of its input and the rsqrt per token."""
    if arch.norm is NormKind.RMS and f.liger:
        # LigerRMSNormFunction.forward (liger_kernel/ops/rms_norm.py, 0.8.2):
        # save_for_backward(X, W, RSTD), X the input itself and RSTD one fp32 per row; the
        # weight's gradient is reduced from X in the backward kernel, so nothing else is kept.
        led.add(x_key, h * f.residual)
        led.add(f"{key}.rstd", FP32_BYTES)
    elif arch.norm is NormKind.RMS:
        fp32_key = x_key if f.residual == FP32_BYTES else f"{key}.fp32"
        led.add(fp32_key, h * FP32_BYTES)
        led.add(f"{key}.rstd", FP32_BYTES)
        if f.full or key in f.trained_norms:
            # the weight's gradient needs it
            led.add(f"{key}.normed", h * norm_product_bytes(arch, f.adapter_v2, f.residual))
    elif f.autocast and f.residual != FP32_BYTES:
        # nn.LayerNorm under autocast runs in fp32 (layer_norm is on autocast's fp32 list):
        # it saves the fp32 copy of its input (reference traces *bloom*autocast*).
        led.add(f"{key}.fp32", h * FP32_BYTES)
        led.add(f"{key}.mean", FP32_BYTES)
        led.add(f"{key}.rstd", FP32_BYTES)
    else:
        # nn.LayerNorm: saves its input, mean and rstd (fp32) per token. Autocast runs
        # layer_norm in fp32: it saves its input's fp32 copy, and the weight's and bias's.
        if f.autocast and f.residual != FP32_BYTES:
            led.add(f"{key}.fp32", h * FP32_BYTES)
            led.add(f"{key}.weight_fp32", h * FP32_BYTES, _Kind.CONSTANT)
            led.add(f"{key}.bias_fp32", h * FP32_BYTES, _Kind.CONSTANT)
        else:
            led.add(x_key, h * f.residual)
        led.add(f"{key}.mean", FP32_BYTES)
        led.add(f"{key}.rstd", FP32_BYTES)


def _qk_norm_saves(led: _Ledger, f: LayerFlow, arch: ModelArch) -> None:
    """Per-head RMSNorm on q and k (Qwen3's q_norm/k_norm, Gemma-3's): an fp32 copy of the
    projection's output and the rsqrt per head, as for the layer's norms; with trainable
    weights also the normed output the weight multiplies (Gemma3RMSNorm applies (1 + weight)
    in fp32, Qwen3MoeRMSNorm the weight after the cast back)."""
    normed = FP32_BYTES if arch.model_type.startswith("gemma") else f.attn
    for key, width, heads in (
        ("q_norm", arch.q_dim, arch.num_attention_heads),
        ("k_norm", arch.kv_dim, arch.num_key_value_heads),
    ):
        led.add(f"{key}.fp32", width * FP32_BYTES)
        led.add(f"{key}.rstd", heads * FP32_BYTES)
        if f.full:
            led.add(f"{key}.normed", width * normed)


def _mlp_saves(
    led: _Ledger,
    f: LayerFlow,
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
    if arch.is_moe and arch.is_mla:
        deepseek_moe_saves(led, f, arch, x_key, _linear_saves)
        return
    if arch.is_moe:
        _moe_saves(led, f, arch, x_key)
        return
    if arch.mlp is MlpKind.GATED:
        fused = len(mlp_in) == 1  # one gate_up projection (Phi-3): its act comes after it
        if f.liger:
            # LigerSiLUMulFunction (liger_kernel/ops/swiglu.py, 0.8.2) runs after both
            # projections and saves their outputs (a, b) alone: the activation is recomputed
            # in backward and never kept.
            led.add("mlp.gate_out", i_size * out)
        elif not fused or not at_up_proj:
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
    elif arch.hidden_act in COMPOSITE_TANH_GELU and f.hf_modules:
        # transformers' NewGELUActivation, 0.5 * x * (1 + tanh(c * (x + 0.044715 * x**3))),
        # op by op: pow keeps x, tanh its output, the last product both its factors. Under
        # autocast pow runs in fp32 (CUDA's fp32 list): x's copy and what follows from it are
        # fp32, only 0.5 * x keeps the half dtype.
        wide = FP32_BYTES if f.autocast else out
        for key in ("mlp.fc1_out", "mlp.tanh_out", "mlp.one_plus_tanh"):
            led.add(key, i_size * wide)
        led.add("mlp.half_x", i_size * out)
    else:
        led.add("mlp.fc1_out", i_size * out)  # GELU saves its input
    if down is not None:
        _linear_saves(led, f, down, "mlp.product", out)


def _residual_dropout_saves(led: _Ledger, f: LayerFlow, arch: ModelArch) -> None:
    """Dropout on the attention and the MLP outputs (Phi's resid_dropout): CUDA's
    native_dropout keeps a one-byte mask per element of each (service/trace/kernels.py)."""
    if arch.residual_dropout > 0 and f.hf_modules:
        led.add("attn.dropout_mask", arch.hidden_size * BOOL_BYTES)
        led.add("mlp.dropout_mask", arch.hidden_size * BOOL_BYTES)


def _moe_saves(led: _Ledger, f: LayerFlow, arch: ModelArch, x_key: str) -> None:
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
    if is_looped(arch):
        _looped_expert_saves(led, f, arch, x_key)
        _shared_expert_saves(led, f, arch, x_key)
        return
    if f.expert_lora:
        # PEFT's ParamWrapper runs each adapted module on its weight plus the adapters' delta
        # (torch.nn.utils.parametrize, cached for the call): the matmuls keep those merged
        # weights, and with them trainable, their inputs: the router's and the tokens
        # gathered per expert, and down_proj's input.
        md = f.norm_out
        led.add("moe.gate_up_merged", e * 2 * i_size * arch.hidden_size * md, _Kind.CONSTANT)
        led.add("moe.down_merged", e * i_size * arch.hidden_size * md, _Kind.CONSTANT)
        led.add("moe.router_merged", e * arch.hidden_size * md, _Kind.CONSTANT)
        led.add(x_key, arch.hidden_size * out)
        led.add("moe.gathered", k * arch.hidden_size * out)
        led.add("moe.product", k * i_size * out)
        # The delta's einsum ("o r e, e r i -> e i o", peft ParamWrapper.get_delta_weight)
        # runs as a batched matmul over experts: B, viewed (out, rank, experts), is copied
        # expert-major for it and kept for backward (A's view already is expert-major).
        rank = f.r * FUSED_GATE_UP_RANK_FACTOR
        led.add("moe.gate_up_b_copy", e * 2 * i_size * rank * f.adapter, _Kind.CONSTANT)
        led.add("moe.down_b_copy", e * arch.hidden_size * f.r * f.adapter, _Kind.CONSTANT)
    led.add("moe.topk_indices", k * INT64_BYTES)
    led.add("moe.gate_up", k * 2 * i_size * out)
    led.add("moe.act", k * i_size * out)
    led.add("moe.down_out", k * arch.hidden_size * out)
    _shared_expert_saves(led, f, arch, x_key)


def _looped_expert_saves(led: _Ledger, f: LayerFlow, arch: ModelArch, x_key: str) -> None:
    """transformers 4's routed experts (estimator/looped_experts.py), per token: the router's
    nn.Linear (its LoRA's saves), top-k's indices (its backward scatters by them) and, for
    Mixtral, the renormalising in-place division's saves; then for each of the token's k
    routed rows what its expert keeps: its three linears' saves (PEFT's casts of the gathered
    row and of the product, lora_A's outputs), the activation's input, output and the up
    projection's output, the expert's output and its routing weight (their product's
    operands), the row's two int64 indices (one (rows, 2) tensor from CUDA's nonzero, kept by
    the gather, the weight's index and index_add_), and index_add_'s source (its backward
    expands the gradient's rows to the source: derivatives.yaml index_add, `expand_as(source)`)."""
    k, h = arch.num_experts_per_tok, arch.hidden_size
    out = f.norm_out
    linears = looped_linears(arch)
    (router,) = linears[LinearKind.ROUTER]
    _linear_saves(led, f, router, x_key, out)
    led.add("moe.topk_indices", k * INT64_BYTES)
    if arch.model_type in ALWAYS_RENORMALISED:
        # `weights /= weights.sum(-1, keepdim=True)`: the in-place division keeps a copy of its
        # dividend and the divisor (autograd's original self of an in-place op), fp32
        led.add("moe.topk_dividend", k * FP32_BYTES)
        led.add("moe.topk_divisor", FP32_BYTES)
    row = _Ledger()
    gate, up = linears[LinearKind.MLP_IN]
    (down,) = linears[LinearKind.MLP_OUT]
    _linear_saves(row, f, gate, "expert.gathered", out)
    _linear_saves(row, f, up, "expert.gathered", out)
    i_size = gate.out_features
    row.add("expert.gate_out", i_size * out)  # the activation's input
    row.add("expert.act_out", i_size * out)
    row.add("expert.up_out", i_size * out)
    _linear_saves(row, f, down, "expert.product", out)
    row.add("expert.out", h * out)
    row.add("expert.weight", out)
    row.add("expert.rows", 2 * INT64_BYTES)
    row.add("expert.weighted", h * out)
    for key, (per_row, kind) in row.items.items():
        # a weight-sized save is one per expert, a row's one per routed row
        scale = arch.num_experts if kind is _Kind.CONSTANT else k
        led.add(f"moe.{key}", per_row * scale, kind)


def _shared_expert_saves(led: _Ledger, f: LayerFlow, arch: ModelArch, x_key: str) -> None:
    """Qwen2-MoE's shared expert, a dense MLP whose output the sigmoid of its gate scales."""
    out = f.norm_out
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
    f = layer_flow(arch, rs, adapted_linears(arch, rs))
    return _recipe_bytes(
        _layer_recipe(arch, f, rs.spec.attn_implementation, rs.spec.sdpa_kernel, input_needs_grad),
        b,
        s,
    )


def _input_norm_saves(led: _Ledger, f: LayerFlow, arch: ModelArch, input_needs_grad: bool) -> None:
    """The layer's first norm."""
    h = arch.hidden_size
    norm1_trains = "norm1" in f.trained_norms
    if input_needs_grad or (norm1_trains and arch.norm is NormKind.LAYER):
        # (nn.LayerNorm keeps its input, mean and rstd for its weight's gradient too)
        _norm_saves(led, f, "norm1", "x_in", h, arch)
    elif norm1_trains:
        # a trained norm whose input takes no gradient (LN tuning's copy, LLaMA-Adapter v2):
        # only the weight's product records, keeping the normed input
        led.add("norm1.normed", h * norm_product_bytes(arch, f.adapter_v2, f.residual))


def _mlp_alone_saves(led: _Ledger, f: LayerFlow, arch: ModelArch, at_up_proj: bool) -> None:
    """A layer where nothing before the MLP's norm takes a gradient (LN tuning of
    post_attention_layernorm alone)."""
    h = arch.hidden_size
    norm2_trains = "norm2" in f.trained_norms
    if norm2_trains:
        led.add("norm2.normed", h * f.residual)
    # the MLP's input takes a gradient only through a trained norm before it
    _mlp_saves(led, f, arch, "norm2.out", at_up_proj=at_up_proj, input_grad=norm2_trains)
    # The MLP's output takes a gradient: Gemma-2's post-feedforward norm on it records,
    # and Phi's residual dropout keeps its mask; the attention's counterparts record
    # nothing (reference traces gemma-2-2b__lora__r16-gate_proj+up_proj+down_proj__*,
    # phi-2__lora__r16-fc1+fc2__*).
    if arch.norms_per_layer == 4:
        _norm_saves(led, f, "norm4", "mlp_proj", h, arch)
    if arch.residual_dropout > 0 and f.hf_modules:
        led.add("mlp.dropout_mask", h * BOOL_BYTES)


def _attention_block_saves(
    led: _Ledger, f: LayerFlow, arch: ModelArch, choice: _AttnChoice, input_needs_grad: bool
) -> None:
    """The attention's input projections, its own saves and LitGPT's adapter prompt."""
    input_grad = input_needs_grad or "norm1" in f.trained_norms
    if arch.is_mla:
        mla_attention_saves(led, f, arch, _linear_saves, input_grad)
    else:
        for lin in arch.linears:
            if lin.kind is LinearKind.ATTN_QKV:
                _linear_saves(led, f, lin, "norm1.out", f.norm_out, input_grad=input_grad)
        if arch.qk_norm:
            _qk_norm_saves(led, f, arch)
        attention_saves(led, f, arch, choice)
    if f.adapter_prompt:
        adapter_attention_saves(led, arch, f.attn, main_records=input_needs_grad or f.adapter_v2)


def _consumed_before_scores(led: _Ledger, attn: AttnImpl) -> None:
    """What the scores' backward still finds: o_proj's backward has consumed its input, and
    probs @ v's backward the repeated value (eager: and the probabilities' copy in the
    attention dtype, or the fused projection's output that the value view held)."""
    for key in ("attn_out", "v_rep", "probs", "qkv_out"):
        if key != "probs" or attn is AttnImpl.EAGER:
            led.items.pop(key, None)


def _mlp_block_saves(
    led: _Ledger, f: LayerFlow, arch: ModelArch, input_needs_grad: bool, at_up_proj: bool
) -> None:
    """The attention's output projection, the MLP's norm(s) and the MLP."""
    h = arch.hidden_size
    proj_key = "attn_out.reshaped" if f.proj_input_copy else "attn_out"
    for lin in arch.linears:
        if lin.kind is LinearKind.ATTN_OUT:
            _linear_saves(led, f, lin, proj_key, f.attn)
    # A parallel-residual MLP reads the layer input: in a first layer whose input takes no
    # gradient, the MLP records nothing for backward unless one of its linears trains.
    mlp_trains = (
        f.full
        or f.adapter_v2
        or any(
            lin.name in f.lora_targets
            for lin in arch.linears
            if lin.kind in (LinearKind.MLP_IN, LinearKind.MLP_OUT)
        )
    )
    mlp_input_grad = input_needs_grad or not arch.parallel_residual or "norm2" in f.trained_norms
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
    _residual_dropout_saves(led, f, arch)


@lru_cache(maxsize=4096)
def _layer_recipe(
    arch: ModelArch,
    f: LayerFlow,
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
    _input_norm_saves(led, f, arch, input_needs_grad)
    if not (input_needs_grad or f.attention_trains):
        _mlp_alone_saves(led, f, arch, at_up_proj)
        return led.recipe()
    choice = _AttnChoice(attn, kernel, windowed, single)
    _attention_block_saves(led, f, arch, choice, input_needs_grad)
    if until_attention:
        _consumed_before_scores(led, attn)
        return led.recipe()
    _mlp_block_saves(led, f, arch, input_needs_grad, at_up_proj)
    return led.recipe()
