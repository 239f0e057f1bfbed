"""TRL's reward-model step (trl 1.16.0, trl/trainer/reward_trainer.py `compute_loss`) on the
tracer's fake tensors.

RewardTrainer trains `AutoModelForSequenceClassification` with `num_labels=1`: for a decoder,
transformers' GenericForSequenceClassification (modeling_layers.py), whose `score` linear maps
every position's hidden state to one logit before the last non-padding token's is pooled. The
collator (reward_trainer.py DataCollatorForPreference) stacks the chosen sequences, then the
rejected ones, into one batch of 2 x batch_size rows: one forward, then
-logsigmoid(chosen - rejected), averaged, with RewardConfig.center_rewards_coefficient's term
when it is set (None by default).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from service.core.result import Component, Phase
from service.trace.preference import TrainerRun, trainer_steps

# A token id other than the padding one the model's config is given
# (service/trace/model.py REWARD_PAD_TOKEN_ID: RewardTrainer.__init__ sets config.pad_token_id
# from the tokenizer, and which id changes no memory): the trace's batch holds no padding,
# every sequence of seq_len tokens, so the pooled position is the last.
TOKEN_ID = 1


def note() -> str:
    """What a reward trace ran, with the installed TRL's version."""
    from importlib.metadata import version

    return (
        f"reward model: trl {version('trl')} RewardTrainer's step (one label, "
        "-logsigmoid(chosen - rejected)) on [chosen; rejected] in one forward; the batch "
        "unpadded"
    )


def prepare(model: torch.nn.Module) -> None:
    """What RewardTrainer.__init__ does to the model: dropout off
    (RewardConfig.disable_dropout, True by default)."""
    from trl.trainer.utils import disable_dropout_in_model

    disable_dropout_in_model(model)


def run_reward_steps(run: TrainerRun) -> None:
    """`steps` optimizer steps of RewardTrainer: per micro-batch `compute_loss` (one forward of
    the [chosen; rejected] batch, the pairwise loss), backward, then HF Trainer's clipping,
    optimizer step and zero_grad as in service/trace/runner.py. The score head's output carries
    the steering's hook that opens the layers' backward."""
    model, tracker, spec = run.model, run.tracker, run.spec
    rows = 2 * spec.batch_size
    with tracker.labelling(Component.INPUTS):
        # DataCollatorForPreference's batch: int64 ids and attention mask, chosen rows then
        # rejected rows; the mask of an unpadded batch is all ones, which the model's mask
        # creation skips, so it is held but not passed
        input_ids = torch.full((rows, spec.seq_len), TOKEN_ID, dtype=torch.long)
        attention_mask = torch.ones(rows, spec.seq_len, dtype=torch.long)

    def micro_batch(step: int) -> torch.Tensor:
        loss = compute_loss(model, input_ids, tracker)
        tracker.mark(step, Phase.FORWARD_END)
        return loss

    trainer_steps(run, micro_batch)
    del attention_mask


def compute_loss(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    tracker: Any,
    center_rewards_coefficient: float | None = None,
) -> torch.Tensor:
    """RewardTrainer.compute_loss's tensors in its order (no margin column); the metrics'
    no-grad scalars are left out."""
    outputs = model(input_ids=input_ids, use_cache=False)
    tracker.component = Component.LOGITS_LOSS
    rewards_chosen, rewards_rejected = torch.chunk(outputs.logits.squeeze(-1), chunks=2)
    loss: torch.Tensor = -F.logsigmoid(rewards_chosen - rewards_rejected).mean()
    if center_rewards_coefficient is not None:
        loss = loss + center_rewards_coefficient * torch.mean(
            (rewards_chosen + rewards_rejected) ** 2
        )
    return loss
