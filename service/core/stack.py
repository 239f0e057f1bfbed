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
  (MixtralBlockSparseTop2MLP, Qwen2MoeMLP) and the router as an nn.Linear, looped over in
  Python, which bitsandbytes quantizes and "all-linear" adapts. Both are modelled, the second
  for LoRA and QLoRA on one GPU (`service.core.estimator.looped_experts`); a model type that
  the stack's transformers does not implement yet is refused.

What differs with torch's version, modelled (each from torch's source):
- torch before 2.0: `zero_grad()` defaults to set_to_none=False (torch/optim/optimizer.py
  Optimizer.zero_grad, torch/nn/modules/module.py Module.zero_grad; 2.0 made True the default).
  HF Trainer calls `model.zero_grad()` after every optimizer step (trainer.py
  _inner_training_loop, in 4.x as in 5.24), so from step 2 on the gradients stay allocated,
  zeroed, through the forward, and backward adds each new gradient into them in place
  (torch/csrc/autograd/functions/accumulate_grad.h). The encoder's step models it; the
  decoder's is refused on such a stack.
- torch before 1.11: softmax's backward node keeps its input beside its output
  (tools/autograd/derivatives.yaml `_softmax`: `_softmax_backward_data(grad, result, dim,
  self)`); pytorch/pytorch#65242, relanded as #66018 on 2021-10-01, after the 1.10 release
  branch (#65434, 2021-09-21), saves only the input's dtype. The encoder's eager attention
  keeps the scores it normalises, one (b, heads, s, s) tensor per layer until backward.
- torch before 2.0 has no scaled_dot_product_attention: an encoder runs its eager attention
  whatever the job asks for.
- torch before 1.13: CUDA loads every kernel module eagerly at context creation; 1.13 sets
  CUDA_MODULE_LOADING=LAZY when the user has not (pytorch/pytorch#86509, the 1.13 cherry-pick
  of #85692), so the context holds only the kernels that run. The device level takes the
  eager context (`service.core.device`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from service.core.errors import InvalidSpecError
from service.core.fields import job_field

# X, X.Y or X.Y.Z, with an optional suffix (".dev0", "rc1", "+cu124").
VERSION_PATTERN = re.compile(r"^(\d+)(?:\.(\d+))?(?:\.(\d+))?(?:[.+\-]?[0-9A-Za-z.+\-]*)?$")


@dataclass(frozen=True, slots=True, kw_only=True)
class Stack:
    """Versions of the libraries whose behaviour sets a step's memory."""

    transformers: str = job_field("5.24.0", doc=None)
    peft: str = job_field("0.21.2", doc=None)
    bitsandbytes: str = job_field("0.50.2", doc=None)
    torch: str = job_field("2.13.0", doc=None)

    def __post_init__(self) -> None:
        for name in ("transformers", "peft", "bitsandbytes", "torch"):
            value = getattr(self, name)
            if not isinstance(value, str) or not VERSION_PATTERN.match(value):
                raise InvalidSpecError(
                    f"stack.{name}", f"must be a version such as '1.2.3', got {value!r}"
                )

    @property
    def transformers_major(self) -> int:
        return self.transformers_release[0]

    @property
    def transformers_release(self) -> tuple[int, int]:
        """transformers' (major, minor)."""
        return _release(self.transformers)

    @property
    def torch_release(self) -> tuple[int, int]:
        """torch's (major, minor)."""
        return _release(self.torch)

    @property
    def zero_grad_keeps_gradients(self) -> bool:
        """zero_grad() zeroes the gradients in place instead of dropping them (torch < 2.0)."""
        return self.torch_release < FIRST_SET_TO_NONE_TORCH

    @property
    def has_sdpa(self) -> bool:
        """torch.nn.functional.scaled_dot_product_attention exists (torch >= 2.0)."""
        return self.torch_release >= FIRST_SDPA_TORCH

    @property
    def softmax_saves_input(self) -> bool:
        """softmax's backward node keeps the softmax's input (torch < 1.11)."""
        return self.torch_release < FIRST_SOFTMAX_WITHOUT_INPUT_TORCH

    @property
    def eager_module_loading(self) -> bool:
        """CUDA loads every kernel module with the context (torch < 1.13)."""
        return self.torch_release < FIRST_LAZY_LOADING_TORCH

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
# The first transformers release of each MoE model type the transformers 4 layout is modelled
# for (the release notes: v4.36.0 added Mixtral, v4.40.0 Qwen2-MoE, v4.51.0 Qwen3-MoE).
FIRST_TRANSFORMERS_RELEASE: dict[str, tuple[int, int]] = {
    "mixtral": (4, 36),
    "qwen2_moe": (4, 40),
    "qwen3_moe": (4, 51),
}
# torch 2.0 made set_to_none=True zero_grad's default (torch/optim/optimizer.py).
FIRST_SET_TO_NONE_TORCH = (2, 0)
# torch 2.0 added torch.nn.functional.scaled_dot_product_attention (its release notes).
FIRST_SDPA_TORCH = (2, 0)
# torch 1.11 is the first release whose softmax saves its input's dtype, not the input
# (pytorch/pytorch#66018).
FIRST_SOFTMAX_WITHOUT_INPUT_TORCH = (1, 11)
# torch 1.13 sets CUDA_MODULE_LOADING=LAZY unless the user set it (pytorch/pytorch#86509).
FIRST_LAZY_LOADING_TORCH = (1, 13)
# The stack the reference tracer runs (pyproject.toml, the `trace` extra).
PINNED_STACK = Stack()
# Named stacks: the pinned one, and transformers 4.48 with the PEFT, bitsandbytes and torch
# releases current when it came out (transformers 4.48.0, 2025-01-10; PEFT 0.14.0, 2024-12-06;
# bitsandbytes 0.45.0, 2024-12-05; torch 2.5.1, 2024-10-29; each project's release page).
# And the stack of transformers' "Efficient Training on a Single GPU" page (docs v4.18 to v4.28,
# its figures measured once, when it was written: its nvidia-smi output is dated 2022-01-11):
# transformers 4.16.0 (2022-01-27, the first release with the TrainingArguments.optim the page
# uses, huggingface/transformers#14744), torch 1.10.1 (2021-12-15, the newest release that day)
# and bitsandbytes 0.26.0 (the 8-bit optimizers' release before 0.30.0, published then as
# bitsandbytes-cudaXXX; its CHANGELOG.md). The page's 1343 MB after one tiny tensor is an eager
# CUDA context, which rules out torch 1.13 and later. PEFT did not exist yet: its first
# release, 0.1.0 (2023-02-10), stands in for the field. (Release dates: PyPI.)
STACK_PRESETS: dict[str, Stack] = {
    "hf-5.24": PINNED_STACK,
    "hf-4.48": Stack(transformers="4.48.0", peft="0.14.0", bitsandbytes="0.45.0", torch="2.5.1"),
    "hf-4.16": Stack(transformers="4.16.0", peft="0.1.0", bitsandbytes="0.26.0", torch="1.10.1"),
}


def preset(name: str, field: str = "stack") -> Stack:
    """The stack a preset names; a 422 listing the presets otherwise."""
    if name not in STACK_PRESETS:
        known = ", ".join(STACK_PRESETS)
        raise InvalidSpecError(field, f"{name!r} is not a stack preset (known: {known})")
    return STACK_PRESETS[name]


def stack_behaviours(stack: Stack) -> tuple[str, ...]:
    """What the estimate models of `stack` that differs from the traced stack."""
    found = []
    if stack.zero_grad_keeps_gradients:
        found.append(
            f"torch {stack.torch}'s zero_grad() keeps the gradients (zeroed) from step 2 on"
        )
    if not stack.has_sdpa:
        found.append(f"torch {stack.torch} has no SDPA: eager attention")
    if stack.softmax_saves_input:
        found.append(f"torch {stack.torch}'s softmax keeps its input for backward")
    if stack.eager_module_loading:
        found.append(f"torch {stack.torch} loads CUDA's kernels eagerly with the context")
    return tuple(found)


def stack_note(stack: Stack) -> str:
    """The answer's line on the stack it modelled."""
    if stack == PINNED_STACK:
        return f"stack: {stack.describe()} (the traced one)"
    behaviours = stack_behaviours(stack)
    modelled = f"; modelled: {'; '.join(behaviours)}" if behaviours else ""
    return (
        f"stack: {stack.describe()} requested, modelled as the traced stack "
        f"({PINNED_STACK.describe()}) runs the job{modelled}; the differences known to change "
        "memory and not modelled (a decoder's step on torch before 2.0) are refused, others "
        "are not modelled"
    )


def check_stack(stack: Stack, is_moe: bool, *, encoder: bool = False, model_type: str = "") -> None:
    """Refuse a job whose memory on `stack` differs from the modelled stack's, naming why."""
    if stack.zero_grad_keeps_gradients and not encoder:
        raise InvalidSpecError(
            "stack",
            f"torch {stack.torch}'s zero_grad() keeps every gradient allocated (zeroed) from "
            "the second step on, through the forward (set_to_none=False, its default before "
            "2.0); that is modelled for encoder models only, not for a decoder's step: use a "
            "stack with torch 2.0 or later, e.g. 'hf-4.48'",
        )
    if is_moe and stack.experts_are_linears:
        first = FIRST_TRANSFORMERS_RELEASE.get(model_type)
        if first is None:
            raise InvalidSpecError(
                "stack",
                f"transformers {stack.transformers}'s per-expert layout of {model_type!r} (one "
                "nn.Linear per expert) is not modelled (only Mixtral, Qwen2-MoE and "
                "Qwen3-MoE's): use a stack with transformers 5, e.g. 'hf-5.24'",
            )
        if stack.transformers_release < first:
            raise InvalidSpecError(
                "stack",
                f"transformers {stack.transformers} cannot run {model_type!r}: it was added in "
                f"{first[0]}.{first[1]}.0; use a stack with transformers {first[0]}.{first[1]} "
                "or later",
            )


@lru_cache(maxsize=256)
def _release(version: str) -> tuple[int, int]:
    """A version's (major, minor); every estimate reads the stack's."""
    match = VERSION_PATTERN.match(version)
    assert match is not None  # checked on construction
    return int(match.group(1)), int(match.group(2) or 0)
