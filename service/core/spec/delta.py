"""Options of the PEFT methods beside LoRA, by PEFT's config field names and defaults
(peft/tuners/<method>/config.py of PEFT 0.21). Only the fields that change what a training
step holds are taken; the rest (init keys, init schemes, saving switches) change no memory.

LoRA-FA takes LoRA's options (`LoraSpec`): it is LoRA with every lora_A frozen, trained by
PEFT's LoraFAOptimizer (peft/optimizers/lorafa.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from service.core.errors import InvalidSpecError
from service.core.fields import job_field
from service.core.limits import MAX_LORA_ALPHA, MAX_LORA_R, MAX_PRNG_KEY, MAX_TRAINING_STEPS

# service.core.spec.ALL_LINEAR: PEFT's INCLUDE_LINEAR_LAYERS_SHORTHAND
ALL_LINEAR = "all-linear"


def check_targets(field: str, target_modules: tuple[str, ...] | str | None) -> None:
    """A list of module names, 'all-linear', or None (PEFT's default for the model type)."""
    if isinstance(target_modules, str) and target_modules != ALL_LINEAR:
        raise InvalidSpecError(
            f"{field}.target_modules", f"must be a list of module names or {ALL_LINEAR!r}"
        )
    if isinstance(target_modules, tuple) and not target_modules:
        raise InvalidSpecError(f"{field}.target_modules", "must not be empty")


@dataclass(frozen=True, slots=True, kw_only=True)
class VeraSpec:
    """PEFT VeraConfig (peft/tuners/vera/config.py): one pair of frozen random projections
    vera_A (r x largest in_features) and vera_B (largest out_features x r) shared by every
    adapted linear, and per linear two trained vectors, lambda_d (r) and lambda_b (out)."""

    r: int = job_field(256, doc="VeRA rank.", mirrors="VeraConfig.r", ge=1, le=MAX_LORA_R)
    # None: PEFT's per-architecture default (TRANSFORMERS_MODELS_TO_VERA_TARGET_MODULES_MAPPING,
    # q_proj and v_proj for Llama-family models).
    target_modules: tuple[str, ...] | str | None = job_field(
        None,
        doc="Adapted modules, or 'all-linear'; null: PEFT's default for the model.",
        mirrors="VeraConfig.target_modules",
    )
    vera_dropout: float = job_field(
        0.0, doc="Dropout on the input.", mirrors="VeraConfig.vera_dropout", ge=0.0, lt=1.0
    )
    # lambda_d's initial value: no memory
    d_initial: float = job_field(
        0.1,
        doc="lambda_d's initial value (no memory).",
        mirrors="VeraConfig.d_initial",
        ge=-1e6,
        le=1e6,
    )
    # vera_A / vera_B's init seed: no memory
    projection_prng_key: int = job_field(
        0,
        doc="vera_A / vera_B init seed (no memory).",
        mirrors="VeraConfig.projection_prng_key",
        ge=0,
        le=MAX_PRNG_KEY,
    )
    # whether checkpoints hold vera_A / vera_B: no memory
    save_projection: bool = job_field(
        True,
        doc="Checkpoints hold vera_A / vera_B (no memory).",
        mirrors="VeraConfig.save_projection",
    )

    def __post_init__(self) -> None:
        if self.r < 1:
            raise InvalidSpecError("vera.r", "must be at least 1")
        if not 0.0 <= self.vera_dropout < 1.0:
            raise InvalidSpecError("vera.vera_dropout", "must be in [0, 1)")
        if self.vera_dropout:
            raise InvalidSpecError(
                "vera.vera_dropout", "VeRA with dropout is not modelled yet: use 0.0"
            )
        check_targets("vera", self.target_modules)


@dataclass(frozen=True, slots=True, kw_only=True)
class LohaSpec:
    """PEFT LoHaConfig (peft/tuners/loha/config.py): per adapted linear two rank-r pairs
    (hada_w1_a, hada_w1_b, hada_w2_a, hada_w2_b) whose Hadamard product is a full-size delta
    weight, built every forward (peft/tuners/loha/layer.py HadaWeight)."""

    r: int = job_field(8, doc="LoHa rank.", mirrors="LoHaConfig.r", ge=1, le=MAX_LORA_R)
    # scaling alpha / r: no memory
    alpha: int = job_field(
        8,
        doc="LoHa scaling numerator (no memory).",
        mirrors="LoHaConfig.alpha",
        ge=1,
        le=MAX_LORA_ALPHA,
    )
    rank_dropout: float = job_field(
        0.0, doc="Rank dropout.", mirrors="LoHaConfig.rank_dropout", ge=0.0, lt=1.0
    )
    module_dropout: float = job_field(
        0.0, doc="Module dropout.", mirrors="LoHaConfig.module_dropout", ge=0.0, lt=1.0
    )
    # None: PEFT's per-architecture default (TRANSFORMERS_MODELS_TO_LOHA_TARGET_MODULES_MAPPING,
    # a copy of LoRA's: q_proj and v_proj for Llama-family models).
    target_modules: tuple[str, ...] | str | None = job_field(
        None,
        doc="Adapted modules, or 'all-linear'; null: PEFT's default for the model.",
        mirrors="LoHaConfig.target_modules",
    )

    def __post_init__(self) -> None:
        if self.r < 1:
            raise InvalidSpecError("loha.r", "must be at least 1")
        if self.alpha < 1:
            raise InvalidSpecError("loha.alpha", "must be at least 1")
        for name in ("rank_dropout", "module_dropout"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise InvalidSpecError(f"loha.{name}", "must be in [0, 1)")
            if value:
                raise InvalidSpecError(f"loha.{name}", "LoHa with dropout is not modelled yet")
        check_targets("loha", self.target_modules)


@dataclass(frozen=True, slots=True, kw_only=True)
class LokrSpec:
    """PEFT LoKrConfig (peft/tuners/lokr/config.py): per adapted linear a Kronecker product
    of a small w1 and a w2 (each kept whole or as a rank-r pair) over the factorised
    dimensions, a full-size delta weight built every forward (peft/tuners/lokr/layer.py)."""

    r: int = job_field(8, doc="LoKr rank.", mirrors="LoKrConfig.r", ge=1, le=MAX_LORA_R)
    # scaling alpha / r: no memory
    alpha: int = job_field(
        8,
        doc="LoKr scaling numerator (no memory).",
        mirrors="LoKrConfig.alpha",
        ge=1,
        le=MAX_LORA_ALPHA,
    )
    rank_dropout: float = job_field(
        0.0, doc="Rank dropout.", mirrors="LoKrConfig.rank_dropout", ge=0.0, lt=1.0
    )
    module_dropout: float = job_field(
        0.0, doc="Module dropout.", mirrors="LoKrConfig.module_dropout", ge=0.0, lt=1.0
    )
    # w1 as a rank-r pair too
    decompose_both: bool = job_field(
        False, doc="w1 as a rank-r pair too.", mirrors="LoKrConfig.decompose_both"
    )
    # -1: factors near the square root of each dimension
    decompose_factor: int = job_field(
        -1,
        doc="Kronecker factor; -1: near the square root.",
        mirrors="LoKrConfig.decompose_factor",
        ge=-1,
        le=MAX_LORA_R,
    )
    # no memory without rank dropout
    rank_dropout_scale: bool = job_field(
        False, doc="Rank dropout scaling.", mirrors="LoKrConfig.rank_dropout_scale"
    )
    # None: PEFT's per-architecture default (TRANSFORMERS_MODELS_TO_LOKR_TARGET_MODULES_MAPPING,
    # a copy of LoRA's: q_proj and v_proj for Llama-family models).
    target_modules: tuple[str, ...] | str | None = job_field(
        None,
        doc="Adapted modules, or 'all-linear'; null: PEFT's default for the model.",
        mirrors="LoKrConfig.target_modules",
    )

    def __post_init__(self) -> None:
        if self.r < 1:
            raise InvalidSpecError("lokr.r", "must be at least 1")
        if self.alpha < 1:
            raise InvalidSpecError("lokr.alpha", "must be at least 1")
        if self.decompose_factor == 0 or self.decompose_factor < -1:
            raise InvalidSpecError("lokr.decompose_factor", "must be -1 or at least 1")
        for name in ("rank_dropout", "module_dropout"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise InvalidSpecError(f"lokr.{name}", "must be in [0, 1)")
            if value:
                raise InvalidSpecError(f"lokr.{name}", "LoKr with dropout is not modelled yet")
        check_targets("lokr", self.target_modules)


@dataclass(frozen=True, slots=True, kw_only=True)
class AdaLoraSpec:
    """PEFT AdaLoraConfig (peft/tuners/adalora/config.py): per adapted linear an SVD-shaped
    triplet, lora_A (init_r x in), lora_E (init_r x 1) and lora_B (out x init_r), all trained
    (peft/tuners/adalora/layer.py SVDLinear); AdaLoraModel.forward adds an orthogonality
    penalty over every lora_A and lora_B to the loss, and the training loop's
    `update_and_allocate` keeps three fp32 copies of every adapter parameter (the
    RankAllocator's importance, its moving average and its uncertainty). Ranks are pruned by
    masking lora_E in place: no tensor changes size during training."""

    init_r: int = job_field(
        12, doc="Initial rank of each triplet.", mirrors="AdaLoraConfig.init_r", ge=1, le=MAX_LORA_R
    )
    # the pruned average rank: lora_E masked, no memory
    target_r: int = job_field(
        8,
        doc="Target average rank (masking, no memory).",
        mirrors="AdaLoraConfig.target_r",
        ge=1,
        le=MAX_LORA_R,
    )
    # scaling: no memory
    lora_alpha: int = job_field(
        8,
        doc="Scaling numerator (no memory).",
        mirrors="AdaLoraConfig.lora_alpha",
        ge=1,
        le=MAX_LORA_ALPHA,
    )
    lora_dropout: float = job_field(
        0.0, doc="Dropout (0 only).", mirrors="AdaLoraConfig.lora_dropout", ge=0.0, lt=1.0
    )
    # None: PEFT's per-architecture default (TRANSFORMERS_MODELS_TO_ADALORA_TARGET_MODULES_MAPPING,
    # q_proj and v_proj for Llama-family models).
    target_modules: tuple[str, ...] | str | None = job_field(
        None,
        doc="Adapted modules, or 'all-linear'; null: PEFT's default for the model.",
        mirrors="AdaLoraConfig.target_modules",
    )
    # the penalty is built at any weight (0 included)
    orth_reg_weight: float = job_field(
        0.5,
        doc="Orthogonality penalty weight (no memory).",
        mirrors="AdaLoraConfig.orth_reg_weight",
        ge=0.0,
        le=1e6,
    )
    # The RankAllocator's schedule: steps of warm-up, of final fine-tuning, and in all. Its
    # buffers exist from the first step to step total_step - tfinal whatever the schedule; the
    # masking steps' scores are one parameter-sized temporary at a time.
    tinit: int = job_field(
        0, doc="Warm-up steps.", mirrors="AdaLoraConfig.tinit", ge=0, le=MAX_TRAINING_STEPS
    )
    tfinal: int = job_field(
        0,
        doc="Final fine-tuning steps.",
        mirrors="AdaLoraConfig.tfinal",
        ge=0,
        le=MAX_TRAINING_STEPS,
    )
    # PEFT's field name and default
    deltaT: int = job_field(
        1,
        doc="Steps between rank maskings.",
        mirrors="AdaLoraConfig.deltaT",
        ge=1,
        le=MAX_TRAINING_STEPS,
    )
    # moving averages' factors: no memory
    beta1: float = job_field(
        0.85, doc="Importance smoothing.", mirrors="AdaLoraConfig.beta1", ge=0.0, lt=1.0
    )
    beta2: float = job_field(
        0.85, doc="Uncertainty smoothing.", mirrors="AdaLoraConfig.beta2", ge=0.0, lt=1.0
    )
    # PEFT requires it (AdaLoraConfig.__post_init__); None: not given, the memory does not
    # depend on it while the RankAllocator runs.
    total_step: int | None = job_field(
        None,
        doc="Total training steps.",
        mirrors="AdaLoraConfig.total_step",
        ge=1,
        le=MAX_TRAINING_STEPS,
    )

    @property
    def r(self) -> int:
        """The rank every adapted linear is built with."""
        return self.init_r

    def __post_init__(self) -> None:
        if self.init_r < 1:
            raise InvalidSpecError("adalora.init_r", "must be at least 1")
        if not 1 <= self.target_r <= self.init_r:
            raise InvalidSpecError("adalora.target_r", "must be between 1 and init_r")
        if self.lora_alpha < 1:
            raise InvalidSpecError("adalora.lora_alpha", "must be at least 1")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise InvalidSpecError("adalora.lora_dropout", "must be in [0, 1)")
        if self.lora_dropout:
            raise InvalidSpecError(
                "adalora.lora_dropout", "AdaLoRA with dropout is not modelled yet: use 0.0"
            )
        if self.orth_reg_weight < 0:
            raise InvalidSpecError("adalora.orth_reg_weight", "must be at least 0")
        if self.tinit < 0 or self.tfinal < 0:
            raise InvalidSpecError("adalora.tinit", "tinit and tfinal must be at least 0")
        if self.deltaT < 1:
            raise InvalidSpecError("adalora.deltaT", "must be at least 1")
        for name in ("beta1", "beta2"):
            if not 0.0 < getattr(self, name) < 1.0:
                raise InvalidSpecError(f"adalora.{name}", "must be in (0, 1)")
        if self.total_step is not None and self.tinit >= self.total_step - self.tfinal:
            # peft/tuners/adalora/config.py: no budgeting phase left
            raise InvalidSpecError(
                "adalora.total_step", "must exceed tinit + tfinal (PEFT's budgeting phase)"
            )
        check_targets("adalora", self.target_modules)


def oft_blocks(in_features: int, wanted: int) -> int:
    """PEFT's OFTLayer.adjust_oft_parameters: `wanted` (a block count or size) moved to the
    nearest divisor of `in_features` (the lower one on a tie), at most `in_features`."""
    if wanted >= in_features:
        return in_features
    higher = wanted
    while higher <= in_features and in_features % higher:
        higher += 1
    lower = wanted
    while lower > 1 and in_features % lower:
        lower -= 1
    return lower if wanted - lower <= higher - wanted else higher


@dataclass(frozen=True, slots=True, kw_only=True)
class OftSpec:
    """PEFT OFTConfig (peft/tuners/oft/config.py): per adapted linear `r` orthogonal blocks of
    `oft_block_size` (exactly one of the two given, the other 0), each trained as the
    block_size·(block_size − 1)/2 entries of a skew-symmetric matrix, turned into a rotation by
    the Cayley–Neumann series; the forward rotates the linear's input block by block
    (peft/tuners/oft/layer.py OFTRotationModule.forward)."""

    r: int = job_field(
        0, doc="Blocks per adapted linear.", mirrors="OFTConfig.r", ge=0, le=MAX_LORA_R
    )
    oft_block_size: int = job_field(
        32, doc="Block size.", mirrors="OFTConfig.oft_block_size", ge=0, le=MAX_LORA_R
    )
    module_dropout: float = job_field(
        0.0,
        doc="Multiplicative dropout (0 only).",
        mirrors="OFTConfig.module_dropout",
        ge=0.0,
        lt=1.0,
    )
    # None: PEFT's per-architecture default (TRANSFORMERS_MODELS_TO_OFT_TARGET_MODULES_MAPPING,
    # a copy of LoRA's: q_proj and v_proj for Llama-family models).
    target_modules: tuple[str, ...] | str | None = job_field(
        None,
        doc="Adapted modules, or 'all-linear'; null: PEFT's default for the model.",
        mirrors="OFTConfig.target_modules",
    )
    coft: bool = job_field(False, doc="Constrained OFT (not modelled).", mirrors="OFTConfig.coft")
    # COFT's constraint: no memory
    eps: float = job_field(6e-5, doc="COFT's constraint.", mirrors="OFTConfig.eps", ge=0.0, le=1.0)
    block_share: bool = job_field(
        False, doc="One block shared (not modelled).", mirrors="OFTConfig.block_share"
    )
    use_cayley_neumann: bool = job_field(
        True, doc="Cayley-Neumann series.", mirrors="OFTConfig.use_cayley_neumann"
    )
    num_cayley_neumann_terms: int = job_field(
        5,
        doc="Terms of the series (5 only).",
        mirrors="OFTConfig.num_cayley_neumann_terms",
        ge=1,
        le=64,
    )

    def __post_init__(self) -> None:
        if self.r < 0 or self.oft_block_size < 0:
            raise InvalidSpecError("oft.r", "r and oft_block_size must be at least 0")
        if (self.r == 0) == (self.oft_block_size == 0):
            # peft/tuners/oft/config.py OFTConfig.__post_init__
            raise InvalidSpecError(
                "oft.r", "give exactly one of r and oft_block_size (the other 0)"
            )
        if not 0.0 <= self.module_dropout < 1.0:
            raise InvalidSpecError("oft.module_dropout", "must be in [0, 1)")
        if self.module_dropout:
            raise InvalidSpecError("oft.module_dropout", "OFT with dropout is not modelled yet")
        for name in ("coft", "block_share"):
            if getattr(self, name):
                raise InvalidSpecError(f"oft.{name}", f"OFT with {name} is not modelled yet")
        if not self.use_cayley_neumann:
            raise InvalidSpecError(
                "oft.use_cayley_neumann", "the exact Cayley transform is not modelled yet"
            )
        if self.num_cayley_neumann_terms != 5:
            raise InvalidSpecError(
                "oft.num_cayley_neumann_terms", "only PEFT's default of 5 terms is modelled"
            )
        check_targets("oft", self.target_modules)

    def blocks(self, in_features: int) -> tuple[int, int]:
        """(block count, block size) on a linear of `in_features` inputs, as PEFT adjusts them
        (OFTLayer.update_layer)."""
        if self.r:
            r = oft_blocks(in_features, self.r)
            return r, in_features // r
        size = oft_blocks(in_features, self.oft_block_size)
        return in_features // size, size


@dataclass(frozen=True, slots=True, kw_only=True)
class BoftSpec:
    """PEFT BOFTConfig (peft/tuners/boft/config.py): per adapted linear `boft_n_butterfly_factor`
    butterfly factors, each `boft_block_num` orthogonal blocks of `boft_block_size` (exactly one
    of the two given, the other 0) trained as full square matrices turned orthogonal by the
    Cayley transform, composed with fixed permutations into a dense in × in rotation of the
    input (peft/tuners/boft/layer.py Linear.forward). A butterfly factor above 1 needs PEFT's
    CUDA extension fbd_cuda (without it PEFT falls back to 1): the GPU path is modelled."""

    boft_block_size: int = job_field(
        4, doc="Block size.", mirrors="BOFTConfig.boft_block_size", ge=0, le=MAX_LORA_R
    )
    boft_block_num: int = job_field(
        0,
        doc="Blocks per adapted linear.",
        mirrors="BOFTConfig.boft_block_num",
        ge=0,
        le=MAX_LORA_R,
    )
    boft_n_butterfly_factor: int = job_field(
        1,
        doc="Butterfly factors (1: OFT's blocks).",
        mirrors="BOFTConfig.boft_n_butterfly_factor",
        ge=1,
        le=16,
    )
    boft_dropout: float = job_field(
        0.0,
        doc="Multiplicative dropout (0 only).",
        mirrors="BOFTConfig.boft_dropout",
        ge=0.0,
        lt=1.0,
    )
    bias: str = job_field(
        "none",
        doc="Trained biases ('none' only).",
        mirrors="BOFTConfig.bias",
        choices=("none", "all", "boft_only"),
    )
    # None: PEFT's per-architecture default (TRANSFORMERS_MODELS_TO_BOFT_TARGET_MODULES_MAPPING,
    # a copy of LoRA's: q_proj and v_proj for Llama-family models).
    target_modules: tuple[str, ...] | str | None = job_field(
        None,
        doc="Adapted modules, or 'all-linear'; null: PEFT's default for the model.",
        mirrors="BOFTConfig.target_modules",
    )

    def __post_init__(self) -> None:
        if self.boft_block_size < 0 or self.boft_block_num < 0:
            raise InvalidSpecError("boft.boft_block_size", "block size and count must be >= 0")
        if (self.boft_block_size == 0) == (self.boft_block_num == 0):
            # peft/tuners/boft/config.py BOFTConfig.__post_init__
            raise InvalidSpecError(
                "boft.boft_block_size",
                "give exactly one of boft_block_size and boft_block_num (the other 0)",
            )
        if self.boft_n_butterfly_factor < 1:
            raise InvalidSpecError("boft.boft_n_butterfly_factor", "must be at least 1")
        if not 0.0 <= self.boft_dropout < 1.0:
            raise InvalidSpecError("boft.boft_dropout", "must be in [0, 1)")
        if self.boft_dropout:
            raise InvalidSpecError("boft.boft_dropout", "BOFT with dropout is not modelled yet")
        if self.bias != "none":
            raise InvalidSpecError("boft.bias", "only bias='none' is modelled")
        check_targets("boft", self.target_modules)

    @property
    def r(self) -> int:
        """The block count given (0: a block size is given), LoRA-shaped placement's rank."""
        return self.boft_block_num

    def blocks(self, in_features: int) -> tuple[int, int, int]:
        """(factors, block count, block size) on a linear of `in_features` inputs, or a 422 for
        a combination PEFT refuses (BOFTLayer.update_layer)."""
        factors, field = self.boft_n_butterfly_factor, "boft.boft_block_size"
        wanted = self.boft_block_size or self.boft_block_num
        if in_features % wanted:
            raise InvalidSpecError(field, f"in_features {in_features} is not divisible by {wanted}")
        num = self.boft_block_num or in_features // self.boft_block_size
        size = in_features // num
        if factors > 1 and (num % 2 ** (factors - 1) or num % 2 or size % 2):
            raise InvalidSpecError(
                "boft.boft_n_butterfly_factor",
                f"{num} blocks of {size} on in_features {in_features} take no "
                f"{factors} butterfly factors (blocks and size even, blocks a multiple of "
                f"2^{factors - 1})",
            )
        return factors, num, size


# The options of any one PEFT method beside LoRA (service.core.spec DELTA_OPTIONS).
DeltaSpec = VeraSpec | LohaSpec | LokrSpec | AdaLoraSpec | OftSpec | BoftSpec
# The PEFT defaults a job of each without options takes, and the note saying so, by the
# TrainingSpec field of its options.
DELTA_DEFAULTS: dict[str, tuple[type[DeltaSpec], str]] = {
    "vera": (VeraSpec, "VeRA options not given: r=256, default target modules"),
    "loha": (LohaSpec, "LoHa options not given: r=8, alpha=8, default target modules"),
    "lokr": (LokrSpec, "LoKr options not given: r=8, alpha=8, default target modules"),
    "adalora": (
        AdaLoraSpec,
        "AdaLoRA options not given: init_r=12, target_r=8, default target modules",
    ),
    "oft": (OftSpec, "OFT options not given: oft_block_size=32, default target modules"),
    "boft": (
        BoftSpec,
        "BOFT options not given: boft_block_size=4, one butterfly factor, default targets",
    ),
}
