"""The options of PEFT's methods besides LoRA in a job request, by PEFT's config names and
defaults: (IA)^3, LN tuning, prompt and prefix tuning (service/core/spec/prompt.py), VeRA,
LoHa, LoKr, AdaLoRA, OFT and BOFT (service/core/spec/delta.py), where each field is declared;
and the module names every adapter option takes."""

from __future__ import annotations

from service.api.schemas.declared import DeclaredIn, ModuleList, ModuleName, declared_model
from service.core.spec.delta import AdaLoraSpec, BoftSpec, LohaSpec, LokrSpec, OftSpec, VeraSpec
from service.core.spec.prompt import IA3Spec, LnTuningSpec, PrefixTuningSpec, PromptTuningSpec

__all__ = [
    "AdaLoraIn",
    "BoftIn",
    "IA3In",
    "LnTuningIn",
    "LohaIn",
    "LokrIn",
    "ModuleList",
    "ModuleName",
    "OftIn",
    "PrefixTuningIn",
    "PromptTuningIn",
    "VeraIn",
]

IA3In = declared_model(
    "IA3In", IA3Spec, doc="PEFT IA3Config; the defaults are PEFT's.", base=DeclaredIn
)
LnTuningIn = declared_model(
    "LnTuningIn", LnTuningSpec, doc="PEFT LNTuningConfig; the defaults are PEFT's.", base=DeclaredIn
)
PromptTuningIn = declared_model(
    "PromptTuningIn",
    PromptTuningSpec,
    doc="PEFT PromptTuningConfig; num_virtual_tokens has no PEFT default.",
    base=DeclaredIn,
)
PrefixTuningIn = declared_model(
    "PrefixTuningIn",
    PrefixTuningSpec,
    doc="PEFT PrefixTuningConfig; num_virtual_tokens has no PEFT default.",
    base=DeclaredIn,
)
VeraIn = declared_model(
    "VeraIn", VeraSpec, doc="PEFT VeraConfig; the defaults are PEFT's.", base=DeclaredIn
)
LohaIn = declared_model(
    "LohaIn", LohaSpec, doc="PEFT LoHaConfig; the defaults are PEFT's.", base=DeclaredIn
)
LokrIn = declared_model(
    "LokrIn", LokrSpec, doc="PEFT LoKrConfig; the defaults are PEFT's.", base=DeclaredIn
)
AdaLoraIn = declared_model(
    "AdaLoraIn",
    AdaLoraSpec,
    doc="""PEFT AdaLoraConfig; the defaults are PEFT's (total_step, which PEFT requires, may be left
    out: the memory does not depend on it).""",
    base=DeclaredIn,
)
OftIn = declared_model(
    "OftIn",
    OftSpec,
    doc="PEFT OFTConfig; the defaults are PEFT's (exactly one of r and oft_block_size non-zero).",
    base=DeclaredIn,
)
BoftIn = declared_model(
    "BoftIn",
    BoftSpec,
    doc="""PEFT BOFTConfig; the defaults are PEFT's (exactly one of boft_block_size and
    boft_block_num non-zero). A butterfly factor above 1 is PEFT's fbd_cuda path.""",
    base=DeclaredIn,
)
