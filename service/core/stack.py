"""The library stack a job runs on, and what of it the estimator models.

Memory depends on library versions where they change a model's layout. The estimator models
one stack, the one the reference tracer runs (`PINNED_STACK`, the versions `pyproject.toml`'s
`trace` extra pins). A job may name another, by preset or by versions: the answer says which
stack it modelled, and a job whose memory is known to differ on that stack in a way the
estimator does not model is refused, naming the field.

What differs between the stacks the presets name (each from the library's source):
- MoE experts: transformers 5 keeps a block's experts as 3-D parameters (MixtralExperts,
  Qwen2MoeExperts) run by grouped GEMMs, which bitsandbytes does not quantize and PEFT's
  "all-linear" does not adapt; transformers 4 builds one nn.Linear per expert
  (MixtralBlockSparseTop2MLP, Qwen2MoeMLP), looped over in Python, which bitsandbytes quantizes
  and "all-linear" adapts. Only the first layout is modelled.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from service.core.errors import InvalidSpecError

# X, X.Y or X.Y.Z, with an optional suffix (".dev0", "rc1", "+cu124").
VERSION_PATTERN = re.compile(r"^(\d+)(?:\.(\d+))?(?:\.(\d+))?(?:[.+\-]?[0-9A-Za-z.+\-]*)?$")


@dataclass(frozen=True, slots=True, kw_only=True)
class Stack:
    """Versions of the libraries whose behaviour sets a step's memory."""

    transformers: str = "5.24.0"
    peft: str = "0.21.2"
    bitsandbytes: str = "0.50.2"
    torch: str = "2.13.0"

    def __post_init__(self) -> None:
        for name in ("transformers", "peft", "bitsandbytes", "torch"):
            value = getattr(self, name)
            if not isinstance(value, str) or not VERSION_PATTERN.match(value):
                raise InvalidSpecError(
                    f"stack.{name}", f"must be a version such as '1.2.3', got {value!r}"
                )

    @property
    def transformers_major(self) -> int:
        match = VERSION_PATTERN.match(self.transformers)
        assert match is not None  # checked on construction
        return int(match.group(1))

    @property
    def experts_are_linears(self) -> bool:
        """transformers 4 builds a MoE's experts as one nn.Linear each (see the module doc)."""
        return self.transformers_major < FIRST_FUSED_EXPERTS_MAJOR

    def describe(self) -> str:
        return (
            f"transformers {self.transformers}, PEFT {self.peft}, "
            f"bitsandbytes {self.bitsandbytes}, torch {self.torch}"
        )


# transformers 5.0 moved MoE experts to 3-D parameters (models/mixtral/modeling_mixtral.py).
FIRST_FUSED_EXPERTS_MAJOR = 5
# The stack the reference tracer runs (pyproject.toml, the `trace` extra).
PINNED_STACK = Stack()
# Named stacks: the pinned one, and transformers 4.48 with the PEFT, bitsandbytes and torch
# releases current when it came out (transformers 4.48.0, 2025-01-10; PEFT 0.14.0, 2024-12-06;
# bitsandbytes 0.45.0, 2024-12-05; torch 2.5.1, 2024-10-29; each project's release page).
STACK_PRESETS: dict[str, Stack] = {
    "hf-5.24": PINNED_STACK,
    "hf-4.48": Stack(transformers="4.48.0", peft="0.14.0", bitsandbytes="0.45.0", torch="2.5.1"),
}


def preset(name: str, field: str = "stack") -> Stack:
    """The stack a preset names; a 422 listing the presets otherwise."""
    if name not in STACK_PRESETS:
        known = ", ".join(STACK_PRESETS)
        raise InvalidSpecError(field, f"{name!r} is not a stack preset (known: {known})")
    return STACK_PRESETS[name]


def stack_note(stack: Stack) -> str:
    """The answer's line on the stack it modelled."""
    if stack == PINNED_STACK:
        return f"stack: {stack.describe()} (the traced one)"
    return (
        f"stack: {stack.describe()} requested, modelled as the traced stack "
        f"({PINNED_STACK.describe()}) runs the job; the differences known to change memory "
        "(MoE experts) are refused, others are not modelled"
    )


def check_stack(stack: Stack, is_moe: bool) -> None:
    """Refuse a job whose memory on `stack` differs from the modelled stack's, naming why."""
    if is_moe and stack.experts_are_linears:
        raise InvalidSpecError(
            "stack",
            f"transformers {stack.transformers} builds a MoE's experts as one nn.Linear each, "
            "looped over per expert, which bitsandbytes quantizes and LoRA's all-linear "
            "adapts; that layout is not modelled (transformers 5 keeps them as 3-D "
            "parameters run by grouped GEMMs): use a stack with transformers 5, e.g. "
            "'hf-5.24'",
        )
