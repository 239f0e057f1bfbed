"""Peak GPU memory of one training step, computed from tensor shapes and dtypes.

The allocated level is modelled tensor by tensor, as the HF Trainer + PEFT step creates and
frees them: each tensor's bytes rounded to the caching allocator's 512 B block, shared
storages counted once. The peak is the maximum over the step's phases, for step 1 (no
optimizer state yet) and the steady state. Reserved and device levels add priors that
calibration refines (`service.core.overhead`).

By concern: `weights` (which modules train; parameters, gradients, optimizer state),
`activations` (what a decoder layer saves for backward), `loss` (logits and loss), `plan`
(what does not depend on batch or sequence length, cached), `step` (the allocated bytes phase
by phase), `symbolic` and `pieces` (the step recorded on symbolic shapes, compiled per job),
`adalora` (AdaLoRA's penalty and rank allocator), `uncertainty` and `peak` (the
estimate and its levels), `preference` (DPO's step on top of the SFT one), `grpo` (GRPO's:
the generation, then DPO's fused head on the completions), `kto` (KTO's: DPO's fused-head
step on unpaired rows), `orpo` (ORPO's: the SFT step with the whole logits),
`reward` (a reward model's step: the SFT one with a score head); `deepseek` (DeepSeek-V2/V3's
latent attention, MoE layers and model states); `lora_targets` (which modules PEFT adapts).
Other code imports the names below from this package, not from its modules.
"""

from service.core.estimator.activations import layer_saved_bytes
from service.core.estimator.adalora import ALLOCATOR_BUFFERS, AdaLoraParts, adalora_parts
from service.core.estimator.deepseek import (
    ModelStates,
    deepseek_layer_trainable,
    deepseek_model_states,
    deepseek_weights,
)
from service.core.estimator.grpo import buffered_inputs, kv_cache_bytes
from service.core.estimator.kto import KL_BATCH_TENSORS, kto_policy_spec, kto_shape
from service.core.estimator.layer_flow import LayerFlow, layer_flow, litgpt_zero_pad_width
from service.core.estimator.lora_targets import (
    LoraTargets,
    deepseek_lora_targets,
    default_target_modules,
)
from service.core.estimator.oft import OFT_SERIES_SAVED
from service.core.estimator.orpo import ADDED_GRADIENTS, orpo_policy_spec, orpo_shape
from service.core.estimator.peak import (
    ESTIMATOR_VERSION,
    decoder_step,
    estimate,
    forget_compiled_steps,
    peak_levels,
    shape_estimates,
    shape_levels,
)
from service.core.estimator.pieces import MAX_PIECES, DecoderStep, Pieces
from service.core.estimator.preference import TILE_TOKENS, TILE_VOCAB, dpo_shape, policy_spec
from service.core.estimator.reward import reward_arch, reward_spec
from service.core.estimator.symbolic import Trace, compile_record
from service.core.estimator.weights import adapted_linears, kronecker_factors
from service.core.estimator.zero import ZeroSettings, gathered_elements, zero_settings

__all__ = [
    "ADDED_GRADIENTS",
    "ALLOCATOR_BUFFERS",
    "ESTIMATOR_VERSION",
    "KL_BATCH_TENSORS",
    "MAX_PIECES",
    "OFT_SERIES_SAVED",
    "TILE_TOKENS",
    "TILE_VOCAB",
    "AdaLoraParts",
    "DecoderStep",
    "LayerFlow",
    "LoraTargets",
    "ModelStates",
    "Pieces",
    "Trace",
    "ZeroSettings",
    "adalora_parts",
    "adapted_linears",
    "buffered_inputs",
    "compile_record",
    "decoder_step",
    "deepseek_layer_trainable",
    "deepseek_lora_targets",
    "deepseek_model_states",
    "deepseek_weights",
    "default_target_modules",
    "dpo_shape",
    "estimate",
    "forget_compiled_steps",
    "gathered_elements",
    "kronecker_factors",
    "kto_policy_spec",
    "kto_shape",
    "kv_cache_bytes",
    "layer_flow",
    "layer_saved_bytes",
    "litgpt_zero_pad_width",
    "orpo_policy_spec",
    "orpo_shape",
    "peak_levels",
    "policy_spec",
    "reward_arch",
    "reward_spec",
    "shape_estimates",
    "shape_levels",
    "zero_settings",
]
