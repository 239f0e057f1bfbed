"""DeepSeek-V2/V3 weights as transformers 5.24 and PEFT 0.21 hold them: which tensors train
and the bytes of frozen and trainable ones. The step's activations are not modelled yet (the
estimate refuses these models, estimator/step.py); the traced references check these bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from service.core.architecture import Linear, LinearKind, ModelArch
from service.core.errors import InvalidSpecError
from service.core.estimator.ledger import _blk
from service.core.estimator.weights import (
    _optimizer_state,
    _Params,
    _quantized_weight_bytes,
    _Tensor,
    default_target_modules,
)
from service.core.spec import ALL_LINEAR, LoraSpec, Method, QuantSpec, TrainingSpec, resolve
from service.core.units import DTYPE_BYTES, FP32_BYTES, DType

# transformers 5.24 conversion_mapping.py maps deepseek_v2/v3 to the qwen2_moe conversion
# pattern, so PEFT 0.21 (utils/transformers_weight_conversion.py _convert_peft_config_moe)
# turns these LoRA module targets into `target_parameters` of the MoE block: the router's
# weight and the routed experts' 3-D parameters, in every MoE layer. The dense MLP and the
# shared experts, nn.Linear modules of the same names, then get no adapter.
EXPERT_TARGETS = {
    "gate": "gate.weight",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
    "down_proj": "down_proj",
}
# Fused into gate_up_proj: PEFT needs both and doubles their rank and alpha (rank_pattern).
FUSED_TARGETS = ("gate_proj", "up_proj")
# _keep_in_fp32_modules_strict of DeepseekV2/V3PreTrainedModel: the router's weight (and V3's
# e_score_correction_bias buffer) stay fp32 whatever the model's dtype.
ROUTER_BYTES = FP32_BYTES
# The model's rotary embedding keeps inv_freq and original_inv_freq, fp32, qk_rope_head_dim / 2
# each (DeepseekV2RotaryEmbedding: its dim is config.head_dim = qk_rope_head_dim).
ROTARY_BUFFERS = 2


@dataclass(frozen=True, slots=True, kw_only=True)
class LoraTargets:
    """Where PEFT puts adapters on a DeepSeek model."""

    modules: frozenset[str]  # nn.Linear names wrapped by lora.Linear, in every layer
    router: bool  # the MoE router's weight (a ParamWrapper, rank r)
    gate_up: bool  # the experts' gate_up_proj (rank 2r, one adapter per expert)
    down: bool  # the experts' down_proj (rank r, one adapter per expert)


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
    rs = resolve(spec)
    p = deepseek_weights(arch, spec.method, spec.dtype, rs.lora, rs.quantization, rs.adapter_dtype)
    return ModelStates(
        frozen=p.frozen,
        trainable=p.trainable,
        optimizer_state=_optimizer_state(p, spec.optim)[0],
        total_count=p.total_count,
        trainable_count=p.trainable_count,
    )


def deepseek_lora_targets(arch: ModelArch, lora: LoraSpec) -> LoraTargets:
    """PEFT 0.21's targets for `lora.target_modules` on `arch` (deepseek_v2 / deepseek_v3)."""
    linears = {lin.name for lin in (*arch.linears, *arch.dense_linears) if not lin.expert}
    if lora.target_modules == ALL_LINEAR:
        # "all-linear" resolves to every nn.Linear's name plus the v4 names of the experts and
        # the router (_resolve_string_target_modules).
        names = linears | set(EXPERT_TARGETS)
    elif lora.target_modules is None:
        names = set(default_target_modules(arch))
    else:
        names = set(lora.target_modules)
    fused = names & set(FUSED_TARGETS)
    if len(fused) == 1:
        raise InvalidSpecError(
            "lora.target_modules",
            f"PEFT fuses {' and '.join(FUSED_TARGETS)} into the experts' gate_up_proj on "
            f"{arch.model_type}: name both or neither",
        )
    modules = names - set(EXPERT_TARGETS)
    unknown = sorted(modules - linears)
    if unknown:
        raise InvalidSpecError(
            "lora.target_modules",
            f"{', '.join(unknown)} not in this model (its linear layers: "
            f"{', '.join(sorted(linears | set(EXPERT_TARGETS)))})",
        )
    moe = arch.is_moe
    return LoraTargets(
        modules=frozenset(modules),
        router=moe and "gate" in names,
        gate_up=moe and bool(fused),
        down=moe and "down_proj" in names,
    )


def deepseek_weights(
    arch: ModelArch,
    method: Method,
    dtype: DType,
    lora: LoraSpec | None,
    quant: QuantSpec | None,
    adapter_dtype: DType,
) -> _Params:
    """The weights of a DeepSeek model under `method`: bitsandbytes quantizes its nn.Linear
    modules (not the router or the 3-D experts), kbit preparation casts every other parameter
    to fp32, PEFT's adapters take `adapter_dtype`. `total_count` counts the adapters too (the
    parameters of the model PEFT returns); `layer` is a MoE layer's bytes."""
    md = DTYPE_BYTES[dtype]
    kbit = method is Method.QLORA
    prep = kbit and quant is not None and quant.prepare_kbit
    other = FP32_BYTES if prep else md
    full = method is Method.FULL
    moe_layers = arch.num_hidden_layers - arch.dense_layers
    groups: list[tuple[int, tuple[Linear, ...]]] = [(moe_layers, arch.linears)]
    if arch.dense_layers:
        groups.append((arch.dense_layers, arch.dense_linears))

    frozen = 0
    tensors: list[_Tensor] = []

    def put(elements: int, itemsize: int, count: int, train: bool) -> None:
        nonlocal frozen
        if train:
            tensors.append(_Tensor(elements, 0, itemsize, count))
        else:
            frozen += count * _blk(elements * itemsize)

    for layers, linears in groups:
        for lin in linears:
            if lin.kind is LinearKind.ROUTER:
                put(lin.weight_elements, ROUTER_BYTES, layers, full)
            elif lin.expert:
                put(lin.weight_elements, other, layers, full)
            elif kbit:
                frozen += layers * _quantized_weight_bytes(lin, quant)
            else:
                put(lin.weight_elements, md, layers, full)
            if lin.bias:
                put(lin.out_features * lin.count, other, layers, full)
        for width in (arch.hidden_size, arch.hidden_size, arch.kv_lora_rank, arch.q_lora_rank):
            if width:
                put(width, other, layers, full)
    layers_frozen = frozen
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
        targets = deepseek_lora_targets(arch, lora)
        ad = DTYPE_BYTES[adapter_dtype]
        r = lora.r
        for layers, linears in groups:
            for lin in linears:
                if not lin.expert and lin.name in targets.modules:
                    put(r * lin.in_features, ad, layers, True)  # lora_A
                    put(lin.out_features * r, ad, layers, True)  # lora_B
        experts = {lin.kind: lin for lin in arch.linears if lin.expert}
        e = arch.num_experts
        if targets.router:
            put(r * arch.hidden_size, ad, moe_layers, True)
            put(e * r, ad, moe_layers, True)
        # PEFT's ParamWrapper on a 3-D parameter: lora_A nn.Linear(in, rank * E) and lora_B
        # nn.Linear(rank * E, out) (peft/tuners/lora/layer.py ParamWrapper.update_layer).
        for chosen, kind, rank in (
            (targets.gate_up, LinearKind.MLP_IN, 2 * r),
            (targets.down, LinearKind.MLP_OUT, r),
        ):
            stack = experts.get(kind)
            if chosen and stack is not None:
                put(rank * e * stack.in_features, ad, moe_layers, True)
                put(stack.out_features * rank * e, ad, moe_layers, True)

    def size(chosen: list[_Tensor]) -> int:
        return sum(t.nbytes for t in chosen)

    adapters = tensors[head_end:]
    in_layers = tensors[:layers_end] + adapters
    return _Params(
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
