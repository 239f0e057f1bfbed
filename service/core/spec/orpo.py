"""ORPOConfig's settings that change memory (TRL 1.16.0 trl/experimental/orpo/orpo_config.py),
by its field names and defaults, for objective 'orpo'.

ORPOConfig.max_length (default 1024) is the job's `seq_len`: the collator pads the
[chosen; rejected] batch to its longest sequence, at most max_length. Its
max_completion_length truncates only an encoder-decoder's completions (orpo_trainer.py
tokenize_row), and no encoder-decoder is modelled, so it changes no modelled memory; beta and
the other fields change none either.
"""

from __future__ import annotations

from dataclasses import dataclass

from service.core.errors import InvalidSpecError
from service.core.fields import job_field


@dataclass(frozen=True, slots=True, kw_only=True)
class OrpoSpec:
    """ORPOConfig's memory settings; the batch is `batch_size` (prompt, chosen, rejected)
    triples, chosen and rejected each padded to `seq_len` tokens."""

    # ORPOConfig.disable_dropout (default True): ORPOTrainer.__init__ sets every nn.Dropout's
    # p to 0 (trl/trainer/utils.py disable_dropout_in_model), LoRA's included; False keeps
    # LoRA's dropout and the masks it saves.
    disable_dropout: bool = job_field(
        True,
        doc="ORPOConfig.disable_dropout: every dropout's p set to 0, LoRA's included; false keeps "
        "LoRA's dropout and the masks it saves.",
        mirrors="ORPOConfig.disable_dropout",
    )


def orpo_refusal(objective: str, method: str, autocast: bool) -> InvalidSpecError | None:
    """What ORPO is not modelled with beyond the preference objectives' shared limits: QLoRA
    under bf16 (ORPOTrainer.__init__ then runs trl/experimental/utils.py
    peft_module_casting_to_bf16, which recasts the norms, the embedding and the LM head, and
    compute_loss runs the whole loss under autocast)."""
    if objective == "orpo" and autocast and method == "qlora":
        return InvalidSpecError(
            "autocast",
            "objective 'orpo' with qlora under bf16 mixed precision is not modelled "
            "(ORPOTrainer's peft_module_casting_to_bf16 and its autocast around the loss)",
        )
    return None
