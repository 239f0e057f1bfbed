"""`--objective grpo`'s options (TRL GRPOConfig's names, service/core/spec_grpo.py)."""

from __future__ import annotations

import argparse
from typing import Any

# The option each GRPO field is given by, for errors naming the option.
GRPO_OPTIONS = {
    "grpo.num_generations": "--num-generations",
    "grpo.max_prompt_length": "--max-prompt-length",
    "grpo.max_completion_length": "--max-completion-length",
    "grpo.beta": "--grpo-beta",
    "grpo.use_vllm": "--use-vllm",
    "grpo.num_iterations": "--objective grpo (num_iterations 1 is modelled)",
}


def add_grpo_options(group: Any) -> None:
    """GRPOConfig's memory settings; --max-completion-length is shared with DPO's."""
    group.add_argument(
        "--num-generations",
        type=int,
        help="grpo: GRPOConfig.num_generations, completions per prompt (default 8); "
        "--batch-size counts completions",
    )
    group.add_argument(
        "--max-prompt-length",
        type=int,
        help="grpo: the prompts' padded length (default: --seq-len less --max-completion-length)",
    )
    group.add_argument(
        "--grpo-beta",
        type=float,
        help="grpo: GRPOConfig.beta (default 0.0; above 0 is not modelled)",
    )
    group.add_argument(
        "--use-vllm",
        action="store_true",
        default=None,
        help="grpo: GRPOConfig.use_vllm (not modelled: refused with the reason)",
    )


def grpo_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The GRPO settings the options give, GRPOConfig's defaults left out."""
    given = {
        "num_generations": getattr(args, "num_generations", None),
        "max_prompt_length": getattr(args, "max_prompt_length", None),
        "max_completion_length": getattr(args, "max_completion_length", None),
        "beta": getattr(args, "grpo_beta", None),
        "use_vllm": getattr(args, "use_vllm", None),
    }
    return {k: v for k, v in given.items() if v is not None}
