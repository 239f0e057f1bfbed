"""A padding-free packed micro-batch (spec/packing.py) as the step the model runs: one row of
batch_size x seq_len tokens.

TRL's collator flattens the micro-batch into input_ids, labels and position_ids of shape
(1, T) (trl/trainer/sft_trainer.py DataCollatorForLanguageModeling.torch_call), so every
activation, the logits and the loss are those of one sequence of T tokens. What differs from an
unpacked sequence of T tokens is the attention's mask, by implementation:
- flash_attention_2 reads the sequences' boundaries (cu_seq_lens, passed by the collator) and
  runs the varlen kernel: no mask, the same saved tensors as one sequence of T tokens;
- SDPA and eager get no attention mask but position_ids that restart, from which transformers
  builds a block-diagonal causal mask of (1, 1, T, T) (masking_utils.py
  find_packed_sequence_indices, then create_causal_mask with allow_is_causal_skip=False): SDPA
  always runs with an explicit mask, as for a model that always builds one
  (`ModelArch.explicit_mask`), hence its mem-efficient kernel and the key/value heads repeated.
"""

from __future__ import annotations

from dataclasses import replace

from service.core.arch import ModelArch
from service.core.errors import InvalidSpecError
from service.core.spec import AttnImpl, SdpaKernel, TrainingSpec


def packed_job(
    arch: ModelArch, spec: TrainingSpec
) -> tuple[ModelArch, TrainingSpec, tuple[str, ...]]:
    """The model and the one-row spec a packed `spec` runs, with the note saying so; `arch`
    and `spec` themselves when the job is not packed."""
    if not spec.packing:
        return arch, spec, ()
    if arch.encoder or arch.encoder_decoder:
        raise InvalidSpecError(
            "packing",
            f"padding-free packing is modelled on decoder-only LMs, not {arch.model_type!r}",
        )
    tokens = spec.batch_size * spec.seq_len
    notes = [
        f"padding-free packing: the micro-batch's {spec.batch_size} sequence(s) of up to "
        f"{spec.seq_len} tokens run as one row of {tokens} tokens, with position_ids restarting "
        "at each sequence (TRL's padding-free collator)"
    ]
    if spec.attn_implementation is AttnImpl.SDPA:
        if spec.sdpa_kernel is SdpaKernel.FLASH:
            raise InvalidSpecError(
                "sdpa_kernel",
                "a packed row under SDPA has a block-diagonal mask, which SDPA's flash kernel "
                "does not take: use attn_implementation 'flash_attention_2' (varlen)",
            )
        if arch.global_layers:
            raise InvalidSpecError(
                "packing",
                f"a packed row under SDPA on {arch.model_type!r} (global layers among "
                "sliding-window ones, each with a mask of its own) is not modelled: use "
                "attn_implementation 'flash_attention_2'",
            )
        arch = replace(arch, explicit_mask=True)
        notes.append(
            f"packing under SDPA: transformers builds a (1, 1, {tokens}, {tokens}) "
            "block-diagonal causal mask from position_ids, so SDPA runs its mem-efficient "
            "kernel; flash_attention_2 runs varlen without one"
        )
    return arch, replace(spec, batch_size=1, seq_len=tokens), tuple(notes)
