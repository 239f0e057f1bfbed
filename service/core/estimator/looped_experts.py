"""A MoE decoder as transformers 4 builds it: one nn.Linear per expert, looped over.

transformers 4 (4.48.0 read) builds a sparse MoE block's router as an nn.Linear `gate` and each
routed expert as an MLP of three nn.Linear (models/mixtral/modeling_mixtral.py
MixtralBlockSparseTop2MLP: w1, w2, w3; models/qwen2_moe/modeling_qwen2_moe.py Qwen2MoeMLP:
gate_proj, up_proj, down_proj; Qwen3-MoE's likewise). bitsandbytes' 4-bit load therefore
quantizes every expert's linears and the router (integrations/bitsandbytes.py
replace_with_bnb_linear swaps each nn.Linear; only the LM head is kept), and PEFT adapts them by
name; its "all-linear" (PEFT 0.14 tuners_utils.py `_maybe_include_all_linear_layers`: the base
name of every nn.Linear but the output embedding) takes the experts' linears, the router `gate`
and Qwen2-MoE's `shared_expert_gate` too.

The forward (MixtralSparseMoeBlock.forward, Qwen2MoeSparseMoeBlock.forward) runs the router,
its fp32 softmax and top-k, then each expert in turn on the tokens routed to it: `torch.where`
of its one-hot mask, the tokens gathered, the expert's MLP, the product with the routing
weights, `index_add_` into the output. What each expert saves is what a dense MLP of its width
saves, on its tokens only. Routing: every saved tensor of an expert has one row per token routed
to it, so the layer's saved bytes depend on the b*s*k routed rows alone, not on how the router
splits them (up to each tensor's 512-byte rounding); the estimate takes an even split,
b*s*k/E rows per expert, which the tracer's stand-in also assumes (its fake tensors carry no
router scores). A skewed router changes only the transients of one expert's forward and
backward, a small part of the step.
"""

from __future__ import annotations

from dataclasses import replace

from service.core.arch import EXPERTS_PREFIX, Linear, LinearKind, ModelArch
from service.core.errors import InvalidSpecError
from service.core.spec import Method, QuantType, TrainingSpec
from service.core.stack import check_stack

# Each expert's (gate, up, down) linears as transformers 4 names them, by model type.
EXPERT_LINEAR_NAMES: dict[str, tuple[str, str, str]] = {
    "mixtral": ("w1", "w3", "w2"),
    "qwen2_moe": ("gate_proj", "up_proj", "down_proj"),
    "qwen3_moe": ("gate_proj", "up_proj", "down_proj"),
}
# Model types whose block renormalises the top-k routing weights always (Mixtral); the others
# do when the config's norm_topk_prob says so (not a field of the architecture: Qwen2-MoE's
# default is False, Qwen3-MoE's published configs set True).
ALWAYS_RENORMALISED = frozenset({"mixtral"})
# The methods the transformers 4 layout is modelled for (the reference traces *transformers4*).
LOOPED_METHODS = (Method.LORA, Method.QLORA)


def looped_arch(arch: ModelArch, spec: TrainingSpec) -> ModelArch:
    """`arch` as `spec.stack` builds it: on transformers 4 a MoE block's router and experts
    become looped nn.Linear modules; `arch` itself otherwise (and when already looped).
    Refuses (naming `stack`) what that layout is not modelled for."""
    if not (arch.is_moe and spec.stack.experts_are_linears) or is_looped(arch):
        return arch
    check_stack(spec.stack, arch.is_moe, model_type=arch.model_type)
    if spec.method not in LOOPED_METHODS:
        raise InvalidSpecError(
            "stack",
            f"transformers {spec.stack.transformers}'s per-expert MoE layout is modelled for "
            f"LoRA and QLoRA, not method {spec.method.value!r}: use a stack with "
            "transformers 5, e.g. 'hf-5.24'",
        )
    if spec.parallel.gpus != 1:
        raise InvalidSpecError(
            "stack",
            f"transformers {spec.stack.transformers}'s per-expert MoE layout is modelled on "
            "one GPU: use a stack with transformers 5, e.g. 'hf-5.24'",
        )
    quant = spec.quantization
    if quant is not None and quant.type is QuantType.INT8:
        raise InvalidSpecError(
            "stack",
            f"LLM.int8 on transformers {spec.stack.transformers}'s per-expert linears is not "
            "modelled (4-bit is): use a stack with transformers 5, e.g. 'hf-5.24'",
        )
    if spec.lora is not None and spec.lora.use_dora:
        raise InvalidSpecError(
            "stack",
            f"DoRA on transformers {spec.stack.transformers}'s per-expert linears is not "
            "modelled: use a stack with transformers 5, e.g. 'hf-5.24'",
        )
    gate, up, down = EXPERT_LINEAR_NAMES[arch.model_type]
    width = arch.expert_intermediate_size
    linears: list[Linear] = []
    for lin in arch.linears:
        if not lin.expert:
            linears.append(lin)
        elif lin.kind is LinearKind.ROUTER:
            linears.append(replace(lin, looped=True))
        elif lin.kind is LinearKind.MLP_IN:
            for name in (gate, up):
                linears.append(
                    replace(lin, name=EXPERTS_PREFIX + name, out_features=width, looped=True)
                )
        else:
            linears.append(replace(lin, name=EXPERTS_PREFIX + down, looped=True))
    return replace(arch, linears=tuple(linears))


def looped_note(arch: ModelArch, spec: TrainingSpec) -> str:
    """The answer's line on the looped layout it modelled."""
    return (
        f"transformers {spec.stack.transformers}'s MoE layout modelled (the tracer checks it on "
        "a stand-in of that block in the installed transformers): the router and each of the "
        f"{arch.num_experts} experts' linears are nn.Linear modules, quantized and adapted one "
        f"by one and run expert by expert; routing taken as an even split, "
        f"b*s*{arch.num_experts_per_tok}/{arch.num_experts} tokens per expert (the saved bytes "
        "depend only on the total); the reserved level replays the experts' weights one by "
        "one but their forward and backward as transformers 5's grouped block"
    )


def looped_linears(arch: ModelArch) -> dict[LinearKind, list[Linear]]:
    """The looped experts' linears by kind (MLP_IN: gate then up; MLP_OUT: down; ROUTER)."""
    found: dict[LinearKind, list[Linear]] = {}
    for lin in arch.linears:
        if lin.looped:
            found.setdefault(lin.kind, []).append(lin)
    return found


def is_looped(arch: ModelArch) -> bool:
    return any(lin.looped for lin in arch.linears)
