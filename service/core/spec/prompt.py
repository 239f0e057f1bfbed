"""Options of PEFT's (IA)^3, LayerNorm-, prompt- and prefix-tuning methods, by PEFT's config
field names and with PEFT 0.21's defaults, and the modules each targets by default per
architecture.

(IA)^3 (peft/tuners/ia3/config.py IA3Config) learns one scaling vector per targeted linear:
over its output features, or over its input features for a "feedforward" module. LN tuning
(peft/tuners/ln_tuning/config.py LNTuningConfig) trains a copy of each targeted norm layer.
Prompt tuning (peft/tuners/prompt_tuning/config.py PromptTuningConfig) prepends trainable
virtual token embeddings to every sequence. Prefix tuning
(peft/tuners/prefix_tuning/config.py PrefixTuningConfig) learns every layer's keys and values
for the virtual tokens, which each layer's attention sees in front of the sequence's.
"""

from __future__ import annotations

from dataclasses import dataclass

from service.core.errors import InvalidSpecError
from service.core.fields import job_field
from service.core.limits import MAX_ENCODER_HIDDEN_SIZE, MAX_VIRTUAL_TOKENS

# peft/utils/constants.py TRANSFORMERS_MODELS_TO_IA3_TARGET_MODULES_MAPPING and
# TRANSFORMERS_MODELS_TO_IA3_FEEDFORWARD_MODULES_MAPPING (PEFT 0.21), for the decoder families
# the estimator parses.
IA3_TARGET_MODULES: dict[str, tuple[str, ...]] = {
    "llama": ("k_proj", "v_proj", "down_proj"),
    "mistral": ("k_proj", "v_proj", "down_proj"),
    "mixtral": ("k_proj", "v_proj", "w2"),
    "qwen2": ("q_proj", "v_proj", "down_proj"),
    "qwen3": ("q_proj", "v_proj", "down_proj"),
    "gemma": ("q_proj", "v_proj", "down_proj"),
    "gemma2": ("q_proj", "v_proj", "down_proj"),
    "gemma3_text": ("q_proj", "v_proj", "down_proj"),
    "phi": ("q_proj", "v_proj", "fc2"),
    "falcon": ("query_key_value", "dense_4h_to_h"),
    "bloom": ("query_key_value", "mlp.dense_4h_to_h"),
    "gpt_neox": ("query_key_value", "dense_4h_to_h"),
    "bert": ("key", "value", "output.dense"),
}
IA3_FEEDFORWARD_MODULES: dict[str, tuple[str, ...]] = {
    "llama": ("down_proj",),
    "mistral": ("down_proj",),
    "mixtral": ("w2",),
    "qwen2": ("down_proj",),
    "qwen3": ("down_proj",),
    "gemma": ("down_proj",),
    "gemma2": ("down_proj",),
    "gemma3_text": ("down_proj",),
    "phi": ("fc2",),
    "falcon": ("dense_4h_to_h",),
    "bloom": ("mlp.dense_4h_to_h",),
    "gpt_neox": ("dense_4h_to_h",),
    "bert": ("output.dense",),
}
# peft/utils/constants.py TRANSFORMERS_MODELS_TO_LNTUNING_TARGET_MODULES_MAPPING (PEFT 0.21).
LN_TUNING_TARGET_MODULES: dict[str, tuple[str, ...]] = {
    "llama": ("input_layernorm", "post_attention_layernorm", "norm"),
    "mistral": ("input_layernorm", "post_attention_layernorm", "norm"),
    "gemma": ("input_layernorm", "post_attention_layernorm", "norm"),
    "gemma2": (
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
        "norm",
    ),
    "gemma3_text": (
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
        "norm",
    ),
    "qwen2": ("post_attention_layernorm",),
    "qwen3": ("post_attention_layernorm",),
    "falcon": ("input_layernorm", "post_attention_layernorm", "ln_f"),
    "bloom": ("input_layernorm", "post_attention_layernorm", "ln_f"),
    "phi": ("input_layernorm", "final_layernorm"),
}


def _names(field: str, value: tuple[str, ...] | None, *, empty: bool = False) -> None:
    if value is not None and not value and not empty:
        raise InvalidSpecError(field, "must not be empty (null takes PEFT's default)")
    if value is not None and any(not name for name in value):
        raise InvalidSpecError(field, "module names must not be empty")


@dataclass(frozen=True, slots=True, kw_only=True)
class IA3Spec:
    """PEFT IA3Config; defaults are PEFT's (peft/tuners/ia3/config.py)."""

    # None: PEFT's per-architecture default (IA3_TARGET_MODULES).
    target_modules: tuple[str, ...] | None = job_field(
        None,
        doc="Linears that get a scaling vector; null: PEFT's default for the model.",
        mirrors="IA3Config.target_modules",
        min_length=1,
    )
    # Targets whose input is scaled rather than their output; None: PEFT's default
    # (IA3_FEEDFORWARD_MODULES); empty: none. PEFT requires them to be among the targets.
    feedforward_modules: tuple[str, ...] | None = job_field(
        None,
        doc="Targets whose input is scaled instead of their output; null: PEFT's default for the "
        "model, [] none.",
        mirrors="IA3Config.feedforward_modules",
        min_length=0,
    )

    def __post_init__(self) -> None:
        _names("ia3.target_modules", self.target_modules)
        _names("ia3.feedforward_modules", self.feedforward_modules, empty=True)
        if self.target_modules is not None and self.feedforward_modules is not None:
            stray = [n for n in self.feedforward_modules if n not in self.target_modules]
            if stray:
                # peft/tuners/ia3/model.py IA3Model._check_target_module_feedforward raises
                raise InvalidSpecError(
                    "ia3.feedforward_modules",
                    f"{', '.join(map(repr, stray))} not among target_modules (PEFT requires "
                    "feedforward modules to be targets)",
                )


@dataclass(frozen=True, slots=True, kw_only=True)
class LnTuningSpec:
    """PEFT LNTuningConfig; defaults are PEFT's (peft/tuners/ln_tuning/config.py)."""

    # None: PEFT's per-architecture default (LN_TUNING_TARGET_MODULES).
    target_modules: tuple[str, ...] | None = job_field(
        None,
        doc="Norm layers trained (as copies); null: PEFT's default for the model.",
        mirrors="LNTuningConfig.target_modules",
        min_length=1,
    )

    def __post_init__(self) -> None:
        _names("ln_tuning.target_modules", self.target_modules)


@dataclass(frozen=True, slots=True, kw_only=True)
class PromptTuningSpec:
    """PEFT PromptTuningConfig's memory-relevant field. PEFT has no default for
    num_virtual_tokens (PromptLearningConfig: None, which get_peft_model cannot build), so it
    is required; the initialisation (prompt_tuning_init) changes no tensor's size."""

    num_virtual_tokens: int = job_field(
        doc="Virtual tokens prepended to every sequence (trainable embeddings).",
        mirrors="PromptTuningConfig.num_virtual_tokens",
        ge=1,
        le=MAX_VIRTUAL_TOKENS,
    )

    def __post_init__(self) -> None:
        if self.num_virtual_tokens < 1:
            raise InvalidSpecError("prompt_tuning.num_virtual_tokens", "must be at least 1")


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefixTuningSpec:
    """PEFT PrefixTuningConfig's memory-relevant fields. num_virtual_tokens has no PEFT
    default (PromptLearningConfig: None), so it is required. prefix_projection (default False)
    puts a two-layer MLP of width encoder_hidden_size between the virtual tokens' embedding and
    the keys and values (peft/tuners/prefix_tuning/model.py PrefixEncoder); None: PEFT's
    default, the keys' and values' width per layer (utils/other.py
    _prepare_prompt_learning_config). init_weights changes no tensor's size."""

    num_virtual_tokens: int = job_field(
        doc="Virtual tokens whose keys and values every layer's attention sees first.",
        mirrors="PrefixTuningConfig.num_virtual_tokens",
        ge=1,
        le=MAX_VIRTUAL_TOKENS,
    )
    prefix_projection: bool = job_field(
        False,
        doc="A two-layer MLP between the virtual tokens and the keys and values.",
        mirrors="PrefixTuningConfig.prefix_projection",
    )
    encoder_hidden_size: int | None = job_field(
        None,
        doc="The projection's hidden width (prefix_projection only); null: PEFT's default, the "
        "keys' width per layer.",
        mirrors="PrefixTuningConfig.encoder_hidden_size",
        ge=1,
        le=MAX_ENCODER_HIDDEN_SIZE,
    )

    def __post_init__(self) -> None:
        if self.num_virtual_tokens < 1:
            raise InvalidSpecError("prefix_tuning.num_virtual_tokens", "must be at least 1")
        if self.encoder_hidden_size is not None and self.encoder_hidden_size < 1:
            raise InvalidSpecError("prefix_tuning.encoder_hidden_size", "must be at least 1")
        if self.encoder_hidden_size is not None and not self.prefix_projection:
            # PrefixEncoder builds the MLP, the only user of the width, with the projection only
            raise InvalidSpecError(
                "prefix_tuning.encoder_hidden_size", "needs prefix_projection=True"
            )


def check_prompt_job(method: str, spec: object, checkpointing: bool) -> None:
    """Prompt and prefix tuning need their options (PEFT has no default num_virtual_tokens),
    and prefix tuning does not run under gradient checkpointing: PEFT refuses it
    (peft/peft_model.py _setup_prompt_encoder), and with checkpointing enabled after
    get_peft_model the recomputed layer concatenates its keys to the cache a second time
    (transformers 5.24 fails on the mismatched mask)."""
    for name in ("prompt-tuning", "prefix-tuning"):
        field = name.replace("-", "_")
        if method == name and getattr(spec, field) is None:
            raise InvalidSpecError(
                field, f"required for method {name!r}: num_virtual_tokens (PEFT has no default)"
            )
    if method == "prefix-tuning" and checkpointing:
        raise InvalidSpecError(
            "gradient_checkpointing", "PEFT's prefix tuning does not work with checkpointing"
        )
