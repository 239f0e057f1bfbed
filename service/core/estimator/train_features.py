"""torchtune's optimizer in backward and activation offloading, as they change the step.

Optimizer in backward (torchtune training/memory.py register_optim_in_bwd_hooks): each
parameter's optimizer steps in its post-accumulate-grad hook and sets its gradient to None, so
no gradient outlives its parameter's AccumulateGrad; a gradient that reaches a tied table
twice waits in the autograd engine's input buffer until the table's last use (the embedding,
at the end of backward). Optimizer state is made lazily at the first step, as without it.

Activation offloading (torchtune training/_activation_offloading.py OffloadActivations, its
defaults): every tensor autograd saves outside a checkpointed layer that is at least
MIN_OFFLOAD_BYTES and not a parameter is copied to pinned host memory; under non-reentrant
checkpointing that is each layer's input (torch.utils.checkpoint's _NoopSaveInputs saves the
layer's positional tensors) and the final norm's saves. The GPU copy lives on only while one
of the last MAX_FWD_STASH packed tensors (the forward stash) or while something else holds
it.
"""

from __future__ import annotations

from service.core.errors import InvalidSpecError
from service.core.units import FP32_BYTES, INT64_BYTES

# OffloadActivations.__init__ defaults (torchtune training/_activation_offloading.py):
MIN_OFFLOAD_BYTES = 1024  # min_offload_size: smaller saved tensors stay on the GPU
MAX_FWD_STASH = 5  # max_fwd_stash_size: offloaded tensors kept alive on the GPU in forward
# Packs of an HF RMSNorm with its fp32 upcast (transformers LlamaRMSNorm.forward): pow and the
# product save the fp32 input (twice), rsqrt and the product its output (twice); the weight's
# product saves the weight, a parameter, kept on the GPU.
NORM_OFFLOADED_PACKS = 4
# Layer-input-sized tensors still on the GPU when backward starts: one in the forward stash
# (the last layer's input, its pack within the last MAX_FWD_STASH behind the norm's
# NORM_OFFLOADED_PACKS, or the normed input a trained norm weight's product saves) and, where
# the embedding is
# frozen under checkpointing, the embedding output that enable_input_require_grads makes a leaf,
# this step's and the last step's, whose graph the offloader's current-node reference keeps
# (OffloadActivations.curr_autograd_node; reference traces
# qwen2_5-0_5b__lora__*__torchtune__offload-acts, llama-3_2-1b__lora__*__offload-acts).
STASHED_LAYER_INPUTS = 1
LEAF_INPUTS_KEPT = 2


def pinned_size(nbytes: int) -> int:
    """Bytes the pinned-memory caching allocator takes for a request: the next power of two
    (aten/src/ATen/core/CachingHostAllocator.h allocate rounds with PowerOf2Ceil)."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


def resident_layer_inputs(embed_trains: bool) -> int:
    """The checkpointed layers' inputs on the GPU from the forward's end on, offloaded."""
    return STASHED_LAYER_INPUTS + (0 if embed_trains else LEAF_INPUTS_KEPT)


def _offloaded(nbytes: int) -> int:
    return pinned_size(nbytes) if nbytes >= MIN_OFFLOAD_BYTES else 0


def host_pinned_bytes(
    *,
    layers: int,
    tokens: int,
    hidden: int,
    layer_input_bytes: int,
    embed_trains: bool,
    norm_trains: bool,
) -> int:
    """The pinned host memory offloading holds at the end of the forward: each layer's input,
    the final norm's fp32 input and inverse RMS (twice each) and, when its weight trains, the
    normed input its product saves, and the token ids the embedding saves when it trains."""
    norm = 2 * _offloaded(tokens * hidden * FP32_BYTES) + 2 * _offloaded(tokens * FP32_BYTES)
    if norm_trains:
        norm += _offloaded(layer_input_bytes)
    embedding = _offloaded(tokens * INT64_BYTES) if embed_trains else 0
    return layers * _offloaded(layer_input_bytes) + norm + embedding


def check_offloadable(rms_norm: bool) -> None:
    """The offloaded saves are modelled for RMSNorm decoders (Llama-family)."""
    if not rms_norm:
        raise InvalidSpecError(
            "activation_offloading", "is modelled for decoders with RMSNorm (Llama-family)"
        )


def in_backward_gradients(gradients: int, *, held_head: int) -> int:
    """A backward moment's gradients with the optimizer in backward: none but a tied head's,
    which waits for the embedding's."""
    return min(gradients, held_head)
