"""Padding-free packing (TRL's SFTTrainer), what is modelled of it.

With `padding_free=True`, or `packing=True` under its default "bfd" strategy (TRL 1.16.0
trl/trainer/sft_trainer.py SFTTrainer.__init__: `args.padding_free or (args.packing and
args.packing_strategy in {"bfd", "bfd_split"})`), DataCollatorForLanguageModeling concatenates
the micro-batch's sequences into one row, with `position_ids` restarting at each sequence and no
attention mask. The spec's `batch_size` stays the sequences (or packs) per micro-batch and
`seq_len` each one's longest length, so the row holds at most batch_size x seq_len tokens: the
bound the estimate takes.
"""

from __future__ import annotations

from service.core.errors import InvalidSpecError

# The methods that lengthen every row by virtual tokens (PEFT's prompt learning): the flattened
# row would carry one prefix for several sequences, which PEFT does not do.
VIRTUAL_TOKEN_METHODS = frozenset({"prompt-tuning", "prefix-tuning"})


def check_packing(*, objective: str, method: str, framework: str) -> None:
    """Packing is TRL's SFTTrainer collator: supervised fine-tuning through HF Trainer (the
    spec's objective, method and framework by their values)."""
    if framework != "hf":
        raise InvalidSpecError(
            "packing",
            "padding-free packing is modelled as TRL's SFTTrainer collator (framework 'hf'), "
            f"not {framework!r}'s",
        )
    if objective != "sft":
        raise InvalidSpecError(
            "packing",
            f"padding-free packing is modelled for objective 'sft' (SFTTrainer), not {objective!r}",
        )
    if method in VIRTUAL_TOKEN_METHODS:
        raise InvalidSpecError(
            "packing",
            f"{method} puts virtual tokens in front of each row: one packed row of "
            "several sequences is not modelled",
        )
