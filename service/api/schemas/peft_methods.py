"""The options of PEFT's methods besides LoRA in a job request, by PEFT's config names and
defaults: (IA)^3, LN tuning, prompt and prefix tuning (service/core/spec_prompt.py), VeRA,
LoHa, LoKr, AdaLoRA and OFT (service/core/spec_delta.py); and the module names every adapter
option takes."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StringConstraints

from service.api.schemas.base import Boolean, In, Number, integers
from service.core.limits import (
    MAX_ENCODER_HIDDEN_SIZE,
    MAX_LORA_ALPHA,
    MAX_LORA_R,
    MAX_MODULE_NAME_CHARS,
    MAX_MODULES,
    MAX_PRNG_KEY,
    MAX_TRAINING_STEPS,
    MAX_VIRTUAL_TOKENS,
    MODULE_NAME_PATTERN,
)
from service.core.spec import ALL_LINEAR
from service.core.spec_delta import AdaLoraSpec, BoftSpec, LohaSpec, LokrSpec, OftSpec, VeraSpec
from service.core.spec_prompt import IA3Spec, LnTuningSpec, PrefixTuningSpec, PromptTuningSpec

ModuleName = Annotated[
    str,
    StringConstraints(min_length=1, max_length=MAX_MODULE_NAME_CHARS, pattern=MODULE_NAME_PATTERN),
    Field(description="A module name as transformers names it, e.g. 'q_proj'."),
]
ModuleList = Annotated[list[ModuleName], Field(min_length=1, max_length=MAX_MODULES)]


def _names(value: list[str] | None) -> tuple[str, ...] | None:
    return None if value is None else tuple(value)


class IA3In(In):
    """PEFT IA3Config; the defaults are PEFT's."""

    target_modules: ModuleList | None = Field(
        default=None,
        description="Linears that get a scaling vector; null: PEFT's default for the model.",
    )
    feedforward_modules: list[ModuleName] | None = Field(
        default=None,
        max_length=MAX_MODULES,
        description="Targets whose input is scaled instead of their output; null: PEFT's "
        "default for the model, [] none.",
    )

    def to_spec(self) -> IA3Spec:
        return IA3Spec(
            target_modules=_names(self.target_modules),
            feedforward_modules=_names(self.feedforward_modules),
        )


class LnTuningIn(In):
    """PEFT LNTuningConfig; the defaults are PEFT's."""

    target_modules: ModuleList | None = Field(
        default=None,
        description="Norm layers trained (as copies); null: PEFT's default for the model.",
    )

    def to_spec(self) -> LnTuningSpec:
        return LnTuningSpec(target_modules=_names(self.target_modules))


class PromptTuningIn(In):
    """PEFT PromptTuningConfig; num_virtual_tokens has no PEFT default."""

    integer_fields = integers("num_virtual_tokens")

    num_virtual_tokens: int = Field(
        ge=1,
        le=MAX_VIRTUAL_TOKENS,
        description="Virtual tokens prepended to every sequence (trainable embeddings).",
    )

    def to_spec(self) -> PromptTuningSpec:
        return PromptTuningSpec(num_virtual_tokens=self.num_virtual_tokens)


class PrefixTuningIn(In):
    """PEFT PrefixTuningConfig; num_virtual_tokens has no PEFT default."""

    integer_fields = integers("num_virtual_tokens", "encoder_hidden_size")

    num_virtual_tokens: int = Field(
        ge=1,
        le=MAX_VIRTUAL_TOKENS,
        description="Virtual tokens whose keys and values every layer's attention sees first.",
    )
    prefix_projection: Boolean = Field(
        default=False,
        description="A two-layer MLP between the virtual tokens and the keys and values.",
    )
    encoder_hidden_size: int | None = Field(
        default=None,
        ge=1,
        le=MAX_ENCODER_HIDDEN_SIZE,
        description="The projection's hidden width (prefix_projection only); null: PEFT's "
        "default, the keys' width per layer.",
    )

    def to_spec(self) -> PrefixTuningSpec:
        return PrefixTuningSpec(
            num_virtual_tokens=self.num_virtual_tokens,
            prefix_projection=self.prefix_projection,
            encoder_hidden_size=self.encoder_hidden_size,
        )


class VeraIn(In):
    """PEFT VeraConfig; the defaults are PEFT's."""

    integer_fields = integers("r", "projection_prng_key")

    r: int = Field(default=256, ge=1, le=MAX_LORA_R, description="VeRA rank.")
    target_modules: Literal["all-linear"] | ModuleList | None = Field(
        default=None,
        description="Adapted modules, or 'all-linear'; null: PEFT's default for the model.",
    )
    vera_dropout: Number = Field(default=0.0, ge=0.0, lt=1.0, description="Dropout on the input.")
    d_initial: Number = Field(
        default=0.1, ge=-1e6, le=1e6, description="lambda_d's initial value (no memory)."
    )
    projection_prng_key: int = Field(
        default=0, ge=0, le=MAX_PRNG_KEY, description="vera_A / vera_B init seed (no memory)."
    )
    save_projection: Boolean = Field(
        default=True, description="Checkpoints hold vera_A / vera_B (no memory)."
    )

    def to_spec(self) -> VeraSpec:
        targets: tuple[str, ...] | str | None
        if self.target_modules is None or self.target_modules == ALL_LINEAR:
            targets = self.target_modules
        else:
            targets = tuple(self.target_modules)
        return VeraSpec(
            r=self.r,
            target_modules=targets,
            vera_dropout=self.vera_dropout,
            d_initial=self.d_initial,
            projection_prng_key=self.projection_prng_key,
            save_projection=self.save_projection,
        )


class LohaIn(In):
    """PEFT LoHaConfig; the defaults are PEFT's."""

    integer_fields = integers("r", "alpha")

    r: int = Field(default=8, ge=1, le=MAX_LORA_R, description="LoHa rank.")
    alpha: int = Field(
        default=8, ge=1, le=MAX_LORA_ALPHA, description="LoHa scaling numerator (no memory)."
    )
    rank_dropout: Number = Field(default=0.0, ge=0.0, lt=1.0, description="Rank dropout.")
    module_dropout: Number = Field(default=0.0, ge=0.0, lt=1.0, description="Module dropout.")
    target_modules: Literal["all-linear"] | ModuleList | None = Field(
        default=None,
        description="Adapted modules, or 'all-linear'; null: PEFT's default for the model.",
    )

    def to_spec(self) -> LohaSpec:
        targets: tuple[str, ...] | str | None
        if self.target_modules is None or self.target_modules == ALL_LINEAR:
            targets = self.target_modules
        else:
            targets = tuple(self.target_modules)
        return LohaSpec(
            r=self.r,
            alpha=self.alpha,
            rank_dropout=self.rank_dropout,
            module_dropout=self.module_dropout,
            target_modules=targets,
        )


class LokrIn(In):
    """PEFT LoKrConfig; the defaults are PEFT's."""

    integer_fields = integers("r", "alpha", "decompose_factor")

    r: int = Field(default=8, ge=1, le=MAX_LORA_R, description="LoKr rank.")
    alpha: int = Field(
        default=8, ge=1, le=MAX_LORA_ALPHA, description="LoKr scaling numerator (no memory)."
    )
    rank_dropout: Number = Field(default=0.0, ge=0.0, lt=1.0, description="Rank dropout.")
    module_dropout: Number = Field(default=0.0, ge=0.0, lt=1.0, description="Module dropout.")
    decompose_both: Boolean = Field(default=False, description="w1 as a rank-r pair too.")
    decompose_factor: int = Field(
        default=-1, ge=-1, le=MAX_LORA_R, description="Kronecker factor; -1: near the square root."
    )
    rank_dropout_scale: Boolean = Field(default=False, description="Rank dropout scaling.")
    target_modules: Literal["all-linear"] | ModuleList | None = Field(
        default=None,
        description="Adapted modules, or 'all-linear'; null: PEFT's default for the model.",
    )

    def to_spec(self) -> LokrSpec:
        targets: tuple[str, ...] | str | None
        if self.target_modules is None or self.target_modules == ALL_LINEAR:
            targets = self.target_modules
        else:
            targets = tuple(self.target_modules)
        return LokrSpec(
            r=self.r,
            alpha=self.alpha,
            rank_dropout=self.rank_dropout,
            module_dropout=self.module_dropout,
            decompose_both=self.decompose_both,
            decompose_factor=self.decompose_factor,
            rank_dropout_scale=self.rank_dropout_scale,
            target_modules=targets,
        )


class AdaLoraIn(In):
    """PEFT AdaLoraConfig; the defaults are PEFT's (total_step, which PEFT requires, may be left
    out: the memory does not depend on it)."""

    integer_fields = integers(
        "init_r", "target_r", "lora_alpha", "tinit", "tfinal", "deltaT", "total_step"
    )

    init_r: int = Field(
        default=12, ge=1, le=MAX_LORA_R, description="Initial rank of each triplet."
    )
    target_r: int = Field(
        default=8, ge=1, le=MAX_LORA_R, description="Target average rank (masking, no memory)."
    )
    lora_alpha: int = Field(
        default=8, ge=1, le=MAX_LORA_ALPHA, description="Scaling numerator (no memory)."
    )
    lora_dropout: Number = Field(default=0.0, ge=0.0, lt=1.0, description="Dropout (0 only).")
    target_modules: Literal["all-linear"] | ModuleList | None = Field(
        default=None,
        description="Adapted modules, or 'all-linear'; null: PEFT's default for the model.",
    )
    orth_reg_weight: Number = Field(
        default=0.5, ge=0.0, le=1e6, description="Orthogonality penalty weight (no memory)."
    )
    tinit: int = Field(default=0, ge=0, le=MAX_TRAINING_STEPS, description="Warm-up steps.")
    tfinal: int = Field(
        default=0, ge=0, le=MAX_TRAINING_STEPS, description="Final fine-tuning steps."
    )
    deltaT: int = Field(
        default=1, ge=1, le=MAX_TRAINING_STEPS, description="Steps between rank maskings."
    )
    beta1: Number = Field(default=0.85, ge=0.0, lt=1.0, description="Importance smoothing.")
    beta2: Number = Field(default=0.85, ge=0.0, lt=1.0, description="Uncertainty smoothing.")
    total_step: int | None = Field(
        default=None, ge=1, le=MAX_TRAINING_STEPS, description="Total training steps."
    )

    def to_spec(self) -> AdaLoraSpec:
        targets: tuple[str, ...] | str | None
        if self.target_modules is None or self.target_modules == ALL_LINEAR:
            targets = self.target_modules
        else:
            targets = tuple(self.target_modules)
        return AdaLoraSpec(
            init_r=self.init_r,
            target_r=self.target_r,
            lora_alpha=self.lora_alpha,
            lora_dropout=self.lora_dropout,
            target_modules=targets,
            orth_reg_weight=self.orth_reg_weight,
            tinit=self.tinit,
            tfinal=self.tfinal,
            deltaT=self.deltaT,
            beta1=self.beta1,
            beta2=self.beta2,
            total_step=self.total_step,
        )


class OftIn(In):
    """PEFT OFTConfig; the defaults are PEFT's (exactly one of r and oft_block_size non-zero)."""

    integer_fields = integers("r", "oft_block_size", "num_cayley_neumann_terms")

    r: int = Field(default=0, ge=0, le=MAX_LORA_R, description="Blocks per adapted linear.")
    oft_block_size: int = Field(default=32, ge=0, le=MAX_LORA_R, description="Block size.")
    module_dropout: Number = Field(
        default=0.0, ge=0.0, lt=1.0, description="Multiplicative dropout (0 only)."
    )
    target_modules: Literal["all-linear"] | ModuleList | None = Field(
        default=None,
        description="Adapted modules, or 'all-linear'; null: PEFT's default for the model.",
    )
    coft: Boolean = Field(default=False, description="Constrained OFT (not modelled).")
    eps: Number = Field(default=6e-5, ge=0.0, le=1.0, description="COFT's constraint.")
    block_share: Boolean = Field(default=False, description="One block shared (not modelled).")
    use_cayley_neumann: Boolean = Field(default=True, description="Cayley-Neumann series.")
    num_cayley_neumann_terms: int = Field(
        default=5, ge=1, le=64, description="Terms of the series (5 only)."
    )

    def to_spec(self) -> OftSpec:
        targets: tuple[str, ...] | str | None
        if self.target_modules is None or self.target_modules == ALL_LINEAR:
            targets = self.target_modules
        else:
            targets = tuple(self.target_modules)
        return OftSpec(
            r=self.r,
            oft_block_size=self.oft_block_size,
            module_dropout=self.module_dropout,
            target_modules=targets,
            coft=self.coft,
            eps=self.eps,
            block_share=self.block_share,
            use_cayley_neumann=self.use_cayley_neumann,
            num_cayley_neumann_terms=self.num_cayley_neumann_terms,
        )


class BoftIn(In):
    """PEFT BOFTConfig; the defaults are PEFT's (exactly one of boft_block_size and
    boft_block_num non-zero). A butterfly factor above 1 is PEFT's fbd_cuda path."""

    integer_fields = integers("boft_block_size", "boft_block_num", "boft_n_butterfly_factor")

    boft_block_size: int = Field(default=4, ge=0, le=MAX_LORA_R, description="Block size.")
    boft_block_num: int = Field(
        default=0, ge=0, le=MAX_LORA_R, description="Blocks per adapted linear."
    )
    boft_n_butterfly_factor: int = Field(
        default=1, ge=1, le=16, description="Butterfly factors (1: OFT's blocks)."
    )
    boft_dropout: Number = Field(
        default=0.0, ge=0.0, lt=1.0, description="Multiplicative dropout (0 only)."
    )
    bias: Literal["none", "all", "boft_only"] = Field(
        default="none", description="Trained biases ('none' only)."
    )
    target_modules: Literal["all-linear"] | ModuleList | None = Field(
        default=None,
        description="Adapted modules, or 'all-linear'; null: PEFT's default for the model.",
    )

    def to_spec(self) -> BoftSpec:
        targets: tuple[str, ...] | str | None
        if self.target_modules is None or self.target_modules == ALL_LINEAR:
            targets = self.target_modules
        else:
            targets = tuple(self.target_modules)
        return BoftSpec(
            boft_block_size=self.boft_block_size,
            boft_block_num=self.boft_block_num,
            boft_n_butterfly_factor=self.boft_n_butterfly_factor,
            boft_dropout=self.boft_dropout,
            bias=self.bias,
            target_modules=targets,
        )
