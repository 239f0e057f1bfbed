"""DeepSeek-V2/V3 as transformers 5.24 and PEFT 0.21 run them: which tensors train, the bytes
of frozen and trainable ones, and what multi-head latent attention and DeepSeekMoE save for
backward (`mla_attention_saves`, `deepseek_moe_saves`, called by estimator/activations.py;
the expert adapters' backward moment is in estimator/step.py). The reference traces
tests/data/traces/deepseek-* check them; settings no trace checked are refused
(`check_deepseek_spec`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, replace

from service.core.arch import Linear, LinearKind, ModelArch
from service.core.errors import InvalidSpecError
from service.core.estimator.layer_flow import LayerFlow
from service.core.estimator.ledger import _blk, _Kind, _Ledger
from service.core.estimator.lora_targets import FUSED_TARGETS, deepseek_lora_targets
from service.core.estimator.weights import (
    _optimizer_state,
    _Params,
    _quantized_weight_bytes,
    _Tensor,
)
from service.core.spec import ResolvedSpec, TrainingSpec, resolve
from service.core.spec.choices import (
    AttnImpl,
    Framework,
    LossImpl,
    Method,
    Objective,
    Optim,
    SdpaKernel,
)
from service.core.spec.lora import LoraSpec, QuantSpec, QuantType
from service.core.units import DTYPE_BYTES, FP32_BYTES, INT32_BYTES, INT64_BYTES, DType

# _keep_in_fp32_modules_strict of DeepseekV2/V3PreTrainedModel: the router's weight (and V3's
# e_score_correction_bias buffer) stay fp32 whatever the model's dtype.
ROUTER_BYTES = FP32_BYTES
# The model's rotary embedding keeps inv_freq and original_inv_freq, fp32, qk_rope_head_dim / 2
# each (DeepseekV2RotaryEmbedding: its dim is config.head_dim = qk_rope_head_dim).
ROTARY_BUFFERS = 2


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelStates:
    """A job's model states on one GPU, bytes, and its parameter counts."""

    frozen: int
    trainable: int
    optimizer_state: int  # inside the allocator, from the first optimizer step on
    total_count: int  # the parameters of the model PEFT returns (its adapters included)
    trainable_count: int


def deepseek_model_states(arch: ModelArch, spec: TrainingSpec) -> ModelStates:
    """The weights and optimizer state of `spec` on a DeepSeek model (`deepseek_weights`)."""
    p = deepseek_weights(arch, resolve(spec))
    return ModelStates(
        frozen=p.frozen,
        trainable=p.trainable,
        optimizer_state=_optimizer_state(p, spec.optim)[0],
        total_count=p.total_count,
        trainable_count=p.trainable_count,
    )


def deepseek_weights(arch: ModelArch, rs: ResolvedSpec) -> _Params:
    """The weights of a DeepSeek model under `rs` (`_deepseek_params`)."""
    return _deepseek_params(arch, rs)[0]


def deepseek_layer_trainable(arch: ModelArch, rs: ResolvedSpec) -> tuple[int, int]:
    """The trainable bytes of one MoE layer and of one dense layer (their gradients' bytes)."""
    per_layer = _deepseek_params(arch, rs)[1]
    return per_layer["moe"], per_layer["dense"]


@dataclasses.dataclass(slots=True)
class _DeepseekTally:
    """The weights counted so far: frozen bytes, the trainable tensors, and one layer's
    trainable bytes by kind of layer ("moe", "dense")."""

    frozen: int = 0
    tensors: list[_Tensor] = dataclasses.field(default_factory=list)
    per_layer: dict[str, int] = dataclasses.field(default_factory=lambda: {"moe": 0, "dense": 0})

    def put(self, elements: int, itemsize: int, count: int, train: bool, kind: str = "") -> None:
        if train:
            self.tensors.append(_Tensor(elements, 0, itemsize, count))
            if kind:
                self.per_layer[kind] += _blk(elements * itemsize)
        else:
            self.frozen += count * _blk(elements * itemsize)


_LayerGroups = list[tuple[int, tuple[Linear, ...], str]]


def _deepseek_layer_weights(
    tally: _DeepseekTally,
    arch: ModelArch,
    groups: _LayerGroups,
    method: Method,
    md: int,
    other: int,
    quant: QuantSpec | None,
) -> None:
    """The MoE and dense layers' linears, router and norms."""
    full, kbit = method is Method.FULL, method is Method.QLORA
    put = tally.put
    for layers, linears, group in groups:
        for lin in linears:
            if lin.kind is LinearKind.ROUTER:
                put(lin.weight_elements, ROUTER_BYTES, layers, full, group)
            elif lin.expert:
                put(lin.weight_elements, other, layers, full, group)
            elif kbit:
                tally.frozen += layers * _quantized_weight_bytes(lin, quant)
            else:
                put(lin.weight_elements, md, layers, full, group)
            if lin.bias:
                put(lin.out_features * lin.count, other, layers, full, group)
        for width in (arch.hidden_size, arch.hidden_size, arch.kv_lora_rank, arch.q_lora_rank):
            if width:
                put(width, other, layers, full, group)


def _deepseek_adapters(
    tally: _DeepseekTally,
    arch: ModelArch,
    groups: _LayerGroups,
    lora: LoraSpec,
    adapter_dtype: DType,
) -> None:
    """PEFT's adapters on the layers' linears, the router and the experts' parameters."""
    put = tally.put
    moe_layers = arch.num_hidden_layers - arch.dense_layers
    targets = deepseek_lora_targets(arch, lora)
    ad = DTYPE_BYTES[adapter_dtype]
    r = lora.r
    for layers, linears, group in groups:
        for lin in linears:
            if not lin.expert and lin.name in targets.modules:
                put(r * lin.in_features, ad, layers, True, group)  # lora_A
                put(lin.out_features * r, ad, layers, True, group)  # lora_B
    experts = {lin.kind: lin for lin in arch.linears if lin.expert}
    e = arch.num_experts
    if targets.router:
        put(r * arch.hidden_size, ad, moe_layers, True, "moe")
        put(e * r, ad, moe_layers, True, "moe")
    # PEFT's ParamWrapper on a 3-D parameter: lora_A nn.Linear(in, rank * E) and lora_B
    # nn.Linear(rank * E, out) (peft/tuners/lora/layer.py ParamWrapper.update_layer).
    for chosen, kind, rank in (
        (targets.gate_up, LinearKind.MLP_IN, 2 * r),
        (targets.down, LinearKind.MLP_OUT, r),
    ):
        stack = experts.get(kind)
        if chosen and stack is not None:
            put(rank * e * stack.in_features, ad, moe_layers, True, "moe")
            put(stack.out_features * rank * e, ad, moe_layers, True, "moe")


def _deepseek_params(arch: ModelArch, rs: ResolvedSpec) -> tuple[_Params, dict[str, int]]:
    """The weights of a DeepSeek model under `rs`'s method: bitsandbytes quantizes its
    nn.Linear modules (not the router or the 3-D experts), kbit preparation casts every other
    parameter to fp32, PEFT's adapters take the adapter dtype. `total_count` counts the
    adapters too (the parameters of the model PEFT returns); `layer` is a MoE layer's bytes."""
    method, dtype, lora, quant = rs.spec.method, rs.spec.dtype, rs.lora, rs.quantization
    adapter_dtype = rs.adapter_dtype
    md = DTYPE_BYTES[dtype]
    prep = method is Method.QLORA and quant is not None and quant.prepare_kbit
    other = FP32_BYTES if prep else md
    full = method is Method.FULL
    moe_layers = arch.num_hidden_layers - arch.dense_layers
    groups: _LayerGroups = [(moe_layers, arch.linears, "moe")]
    if arch.dense_layers:
        groups.append((arch.dense_layers, arch.dense_linears, "dense"))

    tally = _DeepseekTally()
    put, tensors = tally.put, tally.tensors
    _deepseek_layer_weights(tally, arch, groups, method, md, other, quant)
    layers_frozen = tally.frozen
    layers_end = len(tensors)
    if arch.model_type == "deepseek_v3" and arch.is_moe:
        put(arch.num_experts, ROUTER_BYTES, moe_layers, False)  # e_score_correction_bias
    put(arch.qk_rope_head_dim // 2, FP32_BYTES, ROTARY_BUFFERS, False)
    put(arch.vocab_size * arch.hidden_size, other, 1, full)  # embed_tokens
    head_start = len(tensors)
    put(arch.hidden_size, other, 1, full)  # the final norm
    if not arch.tie_word_embeddings:
        put(arch.vocab_size * arch.hidden_size, other, 1, full)  # lm_head, never quantized
    head_end = len(tensors)
    if lora is not None:
        _deepseek_adapters(tally, arch, groups, lora, adapter_dtype)

    def size(chosen: list[_Tensor]) -> int:
        return sum(t.nbytes for t in chosen)

    frozen = tally.frozen
    adapters = tensors[head_end:]
    in_layers = tensors[:layers_end] + adapters
    params = _Params(
        frozen=frozen,
        trainable=size(tensors),
        tensors=tuple(tensors),
        total_count=arch.total_params + sum(t.elements * t.count for t in adapters),
        trainable_count=sum(t.elements * t.count for t in tensors),
        embed_trainable=size(tensors[layers_end:head_start]),
        head_trainable=size(tensors[head_start:head_end]),
        layer=(layers_frozen + size(in_layers)) // arch.num_hidden_layers,
        outside_layers=frozen - layers_frozen + size(tensors[layers_end:head_end]),
    )
    return params, tally.per_layer


# DeepseekV2RotaryEmbedding.forward returns freqs_cis = torch.polar(ones, freqs): complex64,
# (1, s, qk_rope_head_dim / 2), 8 bytes an element, whatever the model's dtype; computed once
# per forward, kept by every layer's rotation (apply_rotary_emb's complex product saves it).
COMPLEX64_BYTES = 8


def deepseek_rope_bytes(arch: ModelArch, s: int, residual: int) -> int:
    """The rotary tables one forward makes and every layer keeps: V2's complex one
    (`COMPLEX64_BYTES`); V3's cos and sin, (1, s, qk_rope_head_dim) in the residual dtype,
    whose first halves apply_rotary_pos_emb_interleave multiplies (views: the products keep
    the whole tables)."""
    if arch.model_type == "deepseek_v3":
        return 2 * _blk(s * arch.qk_rope_head_dim * residual)
    return _blk(s * (arch.qk_rope_head_dim // 2) * COMPLEX64_BYTES)


def dense_arch(arch: ModelArch) -> ModelArch:
    """One of the first `dense_layers` layers as a model of its own: MLA and the dense MLP."""
    return replace(
        arch,
        linears=arch.dense_linears,
        num_experts=0,
        num_experts_per_tok=0,
        expert_intermediate_size=0,
        shared_expert_intermediate_size=0,
        dense_layers=0,
        dense_linears=(),
    )


# What the activations module's `_linear_saves` is called with: (ledger, flow, linear, input
# key, input bytes per element); passed in, as activations.py imports this module.
LinearSaves = Callable[..., None]


def _latent_norm_saves(
    led: _Ledger, f: LayerFlow, key: str, source: str, width: int, source_width: int, grad: bool
) -> None:
    """DeepseekV2RMSNorm on a latent (q_a_layernorm, kv_a_layernorm): `x.to(float32)`, then
    pow and the product with rsqrt keep that fp32 copy and the rsqrt per token; the weight's
    product keeps the normed input cast back when the weight trains. With an fp32 flow the cast
    returns its input, a view of the projection's output, which it then keeps whole
    (`source_width` elements: kv_a_proj_with_mqa's output holds the rotary key part too)."""
    if not grad:
        return
    if f.attn == FP32_BYTES:
        led.add(source, source_width * FP32_BYTES)
    else:
        led.add(f"{key}.fp32", width * FP32_BYTES)
    led.add(f"{key}.rstd", FP32_BYTES)
    if f.full:
        led.add(f"{key}.normed", width * f.attn)


def mla_attention_saves(
    led: _Ledger, f: LayerFlow, arch: ModelArch, linear_saves: LinearSaves, input_grad: bool
) -> None:
    """Multi-head latent attention (transformers 5.24 DeepseekV2Attention.forward) under SDPA's
    mem-efficient kernel (service/trace/kernels.py choose_sdpa_kernel: flash needs the value's
    head dim to equal the query's), per token:

    - each projection as a linear (`linear_saves`): q_proj (or q_a_proj, q_a_layernorm,
      q_b_proj), kv_a_proj_with_mqa on the layer's normed input, kv_b_proj on the normed
      latent; kv_a_layernorm on the latent part of kv_a_proj_with_mqa's output;
    - the rotary part (apply_rotary_emb): q_pe and k_pe go through an fp32 copy viewed as
      complex, multiplied by freqs_cis (which the product keeps, `deepseek_rope_bytes`), and
      cast back; nothing per token is kept;
    - query_states = cat(q_nope, q_pe) and key_states (new_empty, filled by copy_ with k_nope
      and the rotary key expanded over the heads): new tensors of heads x (nope + rope); the
      value is a view of kv_b_proj's output (heads x (nope + v)), which the kernel keeps whole;
    - the kernel keeps query, key, value, its output (heads x v, laid out (b, s, heads, v), so
      sdpa_attention_forward's transpose and contiguous and the attention's reshape copy
      nothing: it is o_proj's input) and its fp32 log-sum-exp padded to 32 queries.
    """
    by_name = {lin.name: lin for lin in arch.linears}
    attn = f.attn
    x = "norm1.out"

    def trains(*names: str) -> bool:
        return f.full or any(n in f.lora_targets for n in names)

    if arch.q_lora_rank:
        linear_saves(led, f, by_name["q_a_proj"], x, f.norm_out)
        q_grad = input_grad or trains("q_a_proj")
        _latent_norm_saves(
            led, f, "q_a_norm", "q_a.out", arch.q_lora_rank, arch.q_lora_rank, q_grad
        )
        linear_saves(led, f, by_name["q_b_proj"], "q_a_norm.out", attn)
        q_grad = q_grad or trains("q_b_proj")
    else:
        linear_saves(led, f, by_name["q_proj"], x, f.norm_out)
        q_grad = input_grad or trains("q_proj")
    linear_saves(led, f, by_name["kv_a_proj_with_mqa"], x, f.norm_out)
    kv_grad = input_grad or trains("kv_a_proj_with_mqa")
    rope = arch.qk_rope_head_dim
    latent = arch.kv_lora_rank
    _latent_norm_saves(led, f, "kv_a_norm", "kv_a.out", latent, latent + rope, kv_grad)
    linear_saves(led, f, by_name["kv_b_proj"], "kv_a_norm.out", attn)
    kv_grad = kv_grad or trains("kv_b_proj")
    if not (q_grad or kv_grad):
        return
    heads = arch.num_attention_heads
    qk = arch.head_dim  # qk_nope_head_dim + qk_rope_head_dim
    value = arch.v_head_dim
    nope = qk - rope
    led.add("q_cat", heads * qk * attn)
    led.add("k_cat", heads * qk * attn)
    led.add("kv_b.out", heads * (nope + value) * attn)
    led.add("attn_out", heads * value * attn)
    led.add("lse", heads * FP32_BYTES, _Kind.TOKENS_PAD32)


def deepseek_moe_saves(
    led: _Ledger, f: LayerFlow, arch: ModelArch, x_key: str, linear_saves: LinearSaves
) -> None:
    """DeepSeekMoE (transformers 5.24 DeepseekV2Moe.forward) beyond its shared experts' input
    projections, per token:

    - the router (DeepseekV2TopkRouter): F.linear on the input cast to fp32 (a new tensor
      unless the flow is fp32) and the fp32 weight, kept when that weight trains (full
      fine-tuning, or PEFT's ParamWrapper, whose merged fp32 weight the matmul keeps too);
      softmax in fp32 keeps its output; topk its int64 indices. ("group_limited_greedy"
      routing also keeps a one-byte mask per expert, not counted: under 0.1 % of a layer.)
    - the routed experts (transformers integrations/moe.py grouped_mm_experts_forward): the
      gathered tokens (kept by the gate_up grouped GEMM when its weight trains), the index
      tensors of the three gathers (perm // top_k, perm, inv_perm: int64 per slot), gate_up's
      output (kept whole by the act and the product through its chunked views), the activation,
      the product (kept by the down GEMM when its weight trains), the down output and the fp32
      routing weight its product with the routing weights keeps;
    - PEFT's ParamWrapper on gate_up_proj / down_proj: the merged weight the GEMM keeps, and
      the factors' casts its baddbmm keeps;
    - the shared experts as a dense gated MLP: gate's output (SiLU), act and up (their product)
      and the product down_proj keeps when it trains.
    """
    e, k = arch.num_experts, arch.num_experts_per_tok
    ie, h = arch.expert_intermediate_size, arch.hidden_size
    out = f.norm_out  # the experts' dtype: the model's, fp32 after kbit preparation
    parts = f.expert_parts
    if f.full or "router" in parts:
        led.add(x_key if out == FP32_BYTES else "router.fp32_in", h * FP32_BYTES)
    if "router" in parts:
        led.add("moe.router_merged", e * h * ROUTER_BYTES, _Kind.CONSTANT)
    led.add("moe.router_probs", e * FP32_BYTES)  # V2's softmax, V3's sigmoid: the output
    led.add("moe.topk_indices", k * INT64_BYTES)  # V2's topk; V3's scores.gather index
    if arch.model_type == "deepseek_v3":
        # DeepseekV3TopkRouter normalises the gathered weights in place (norm_topk_prob:
        # true in DeepSeek-V3's config and transformers' default; a config without it keeps
        # these 4 * (k + 1) bytes less): the division keeps its fp32 divisor and the weights.
        # Its group-limited choice runs on tensors no output depends on, freed at once.
        led.add("router.norm_divisor", FP32_BYTES)
        led.add("router.normed_weights", k * FP32_BYTES)
    for key in ("moe.gather_index", "moe.weight_index", "moe.inv_perm"):
        led.add(key, k * INT64_BYTES)
    if f.full or "gate_up" in parts:
        led.add("moe.gathered", k * h * out)
    led.add("moe.gate_up", k * 2 * ie * out)
    led.add("moe.act", k * ie * out)
    if f.full or "down" in parts:
        led.add("moe.product", k * ie * out)
    led.add("moe.down_out", k * h * out)
    led.add("moe.routing_weights", k * FP32_BYTES)
    # grouped_mm's group offsets (torch.cumsum(..., dtype=torch.int32), one per expert),
    # shared by both GEMMs
    led.add("moe.offsets", e * INT32_BYTES, _Kind.CONSTANT)
    # PEFT's _LoraFactorsProxy folds the update into the stack with one baddbmm on the factors
    # ParamWrapper.get_delta_factors casts to the stack's dtype: copies the baddbmm keeps (each
    # factor's gradient needs the other) unless the adapters already have that dtype (fp32
    # experts after kbit preparation), when they are views of the adapters themselves.
    casts = f.adapter != out
    rank = f.r
    if "gate_up" in parts:
        fused = rank * len(FUSED_TARGETS)
        led.add("moe.gate_up_merged", e * 2 * ie * h * out, _Kind.CONSTANT)
        if casts:
            led.add("moe.gate_up_a_cast", e * fused * h * out, _Kind.CONSTANT)
            led.add("moe.gate_up_b_cast", e * 2 * ie * fused * out, _Kind.CONSTANT)
    if "down" in parts:
        led.add("moe.down_merged", e * ie * h * out, _Kind.CONSTANT)
        if casts:
            led.add("moe.down_a_cast", e * rank * ie * out, _Kind.CONSTANT)
            led.add("moe.down_b_cast", e * h * rank * out, _Kind.CONSTANT)
    si = arch.shared_expert_intermediate_size
    if si:
        for key in ("shared.gate_out", "shared.up_out", "shared.act_out"):
            led.add(key, si * out)
        for lin in arch.linears:
            if lin.kind is LinearKind.MLP_OUT and not lin.expert:
                linear_saves(led, f, lin, "shared.product", out)


# What the DeepSeek-V2 step is checked against (the reference traces deepseek-v2-lite__*): one
# GPU, transformers' model under HF's Trainer without autocast, SDPA, bf16 weights, HF's loss.
_TRACED_METHODS = (Method.FULL, Method.LORA, Method.QLORA)


def check_deepseek_spec(spec: TrainingSpec) -> None:
    """Refuse, naming the field, the settings of a DeepSeek-V2 job that no reference trace has
    checked: the estimate models the traced step (`mla_attention_saves`,
    `deepseek_moe_saves`, the expert adapters' backward in estimator/step.py) and nothing
    around it yet."""

    def refuse(field: str, what: str) -> None:
        raise InvalidSpecError(
            field, f"{what} is not modelled for DeepSeek (multi-head latent attention) models"
        )

    if spec.objective is not Objective.SFT:
        refuse("objective", f"objective {spec.objective.value!r}")
    if spec.method not in _TRACED_METHODS:
        refuse("method", f"method {spec.method.value!r}")
    if spec.framework is not Framework.HF:
        refuse("framework", f"framework {spec.framework.value!r}")
    if spec.parallel.gpus != 1:
        refuse("parallel.gpus", "more than one GPU")
    if spec.dtype is not DType.BF16:
        refuse("dtype", f"dtype {spec.dtype.value!r} (bf16 is)")
    if spec.autocast:
        refuse("autocast", "mixed-precision autocast")
    if spec.packing:
        refuse("packing", "padding-free packing")
    if spec.torch_compile:
        refuse("torch_compile", "torch.compile")
    if spec.optimizer_in_backward:
        refuse("optimizer_in_backward", "the optimizer step in backward")
    if spec.activation_offloading:
        refuse("activation_offloading", "activation offloading")
    if spec.gradient_accumulation_steps != 1:
        refuse("gradient_accumulation_steps", "gradient accumulation")
    if spec.attn_implementation is not AttnImpl.SDPA:
        refuse("attn_implementation", f"attention {spec.attn_implementation.value!r} (SDPA is)")
    if spec.sdpa_kernel not in (SdpaKernel.AUTO, SdpaKernel.EFFICIENT):
        # flash cannot run q/k and v of different head dims (check_head_dim_size_flash)
        refuse("sdpa_kernel", f"SDPA kernel {spec.sdpa_kernel.value!r} (the mem-efficient one is)")
    if spec.loss not in (None, LossImpl.HF):
        refuse("loss", f"loss {spec.loss.value!r}")
    if spec.optim not in (Optim.ADAMW_TORCH_FUSED, Optim.ADAMW_TORCH):
        refuse("optim", f"optimizer {spec.optim.value!r}")
    lora = spec.lora
    if lora is not None:
        if lora.lora_dropout:
            refuse("lora.lora_dropout", "LoRA dropout")
        if lora.use_dora:
            refuse("lora.use_dora", "DoRA")
        if lora.modules_to_save:
            refuse("lora.modules_to_save", "modules_to_save")
        if lora.adapter_dtype not in (None, DType.FP32):
            refuse("lora.adapter_dtype", f"{lora.adapter_dtype.value} adapters (fp32 are)")
    quant = spec.quantization
    if spec.method is Method.QLORA and quant is not None:
        if quant.type is QuantType.INT8:
            refuse("quantization.type", "LLM.int8")
        if not quant.prepare_kbit:
            refuse("quantization.prepare_kbit", "QLoRA without kbit preparation")
