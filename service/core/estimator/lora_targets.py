"""Which modules PEFT adapts: its default LoRA targets per model type, and DeepSeek's targets,
which PEFT 0.21 turns into adapters on the MoE block's parameters."""

from __future__ import annotations

from dataclasses import dataclass

from service.core.arch import ModelArch
from service.core.errors import InvalidSpecError
from service.core.spec import ALL_LINEAR, LoraSpec

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


def default_target_modules(arch: ModelArch, field: str = "lora") -> tuple[str, ...]:
    """PEFT's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING (peft/utils/constants.py);
    VeRA's, LoHa's and LoKr's are copies of it (VeRA's with phi's q_proj and v_proj alone)."""
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
        "falcon": ("query_key_value",),
        "bloom": ("query_key_value",),
        "bert": ("query", "value"),
        "t5": ("q", "v"),
        "mt5": ("q", "v"),
    }
    if field == "vera":
        defaults["phi"] = ("q_proj", "v_proj")
    if arch.model_type not in defaults:
        raise InvalidSpecError(
            f"{field}.target_modules",
            f"PEFT has no default target modules for model_type {arch.model_type!r}; name them",
        )
    return defaults[arch.model_type]


@dataclass(frozen=True, slots=True, kw_only=True)
class LoraTargets:
    """Where PEFT puts adapters on a DeepSeek model."""

    modules: frozenset[str]  # nn.Linear names wrapped by lora.Linear, in every layer
    router: bool  # the MoE router's weight (a ParamWrapper, rank r)
    gate_up: bool  # the experts' gate_up_proj (rank 2r, one adapter per expert)
    down: bool  # the experts' down_proj (rank r, one adapter per expert)


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
