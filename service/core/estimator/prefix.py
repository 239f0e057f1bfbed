"""PEFT's prefix tuning: its trainable tensors and the keys every layer's attention runs over.

get_prompt (peft/peft_model.py) runs the PrefixEncoder (peft/tuners/prefix_tuning/model.py) on
the virtual token ids, casts its output to the base model's dtype and splits it into each
layer's keys and values, (batch, num_key_value_heads, num_virtual_tokens, head_dim) each
(utils/other.py _prepare_prompt_learning_config sizes the prefix by the key/value heads for
grouped-query attention), handed to the model as a DynamicCache. Each layer's
DynamicLayer.update (transformers cache_utils.py) concatenates its own keys and values behind
the prefix's (torch.cat): the attention's queries stay seq_len long while its keys and values
are seq_len + num_virtual_tokens, and transformers builds an explicit mask for that
(masking_utils.sdpa_mask: a causal mask is skipped only for equal query and key lengths), so
SDPA runs the mem-efficient kernel with key and value repeated to the query heads.
"""

from __future__ import annotations

from service.core.arch import ModelArch
from service.core.errors import InvalidSpecError
from service.core.estimator.ledger import _blk
from service.core.spec import AttnImpl, Method, SdpaKernel, TrainingSpec
from service.core.spec.prompt import PrefixTuningSpec
from service.core.units import FP32_BYTES


def prefix_options(spec: TrainingSpec) -> PrefixTuningSpec | None:
    """Prefix tuning's options; None for other methods."""
    return spec.prefix_tuning if spec.method is Method.PREFIX_TUNING else None


def prefix_tokens(spec: TrainingSpec) -> int:
    """The virtual tokens in front of every layer's keys and values (0 for other methods)."""
    options = prefix_options(spec)
    return 0 if options is None else options.num_virtual_tokens


def prefix_width(arch: ModelArch) -> int:
    """PrefixEncoder's output per virtual token: every layer's key and value (num_layers * 2 *
    token_dim, token_dim = num_key_value_heads * head_dim)."""
    return arch.num_hidden_layers * 2 * arch.kv_dim


def encoder_width(arch: ModelArch, options: PrefixTuningSpec) -> int:
    """The projection MLP's hidden width: PEFT's default is token_dim (utils/other.py
    _prepare_prompt_learning_config)."""
    return options.encoder_hidden_size or arch.kv_dim


def prefix_encoder_width(arch: ModelArch, spec: TrainingSpec) -> int:
    """The projection MLP's hidden width; 0 without the projection (or prefix tuning)."""
    options = prefix_options(spec)
    if options is None or not options.prefix_projection:
        return 0
    return encoder_width(arch, options)


def prefix_tensors(arch: ModelArch, spec: TrainingSpec) -> tuple[tuple[int, int, int, int], ...]:
    """PrefixEncoder's parameters as (rows, cols, itemsize, count), fp32 (built in torch's
    default dtype; cast_adapter_dtype leaves prompt encoders): the embedding of the keys and
    values, or with prefix_projection an embedding of token_dim and Linear(token_dim, E),
    Tanh, Linear(E, num_layers * 2 * token_dim)."""
    options = prefix_options(spec)
    if options is None:
        return ()
    p, width = options.num_virtual_tokens, prefix_width(arch)
    if not options.prefix_projection:
        return ((p, width, FP32_BYTES, 1),)
    kv, e = arch.kv_dim, encoder_width(arch, options)
    return (
        (p, kv, FP32_BYTES, 1),
        (e, kv, FP32_BYTES, 1),
        (e, 0, FP32_BYTES, 1),
        (width, e, FP32_BYTES, 1),
        (width, 0, FP32_BYTES, 1),
    )


def projection_saved_bytes(arch: ModelArch, spec: TrainingSpec, batch: int) -> int:
    """What the projection MLP saves for backward, fp32: the virtual tokens' embedding (the
    first linear's input, its weight trains) and the tanh output (saved by tanh and by the
    second linear). The cast, view, permute and split that follow save nothing."""
    options = prefix_options(spec)
    if options is None or not options.prefix_projection:
        return 0
    rows = batch * options.num_virtual_tokens
    return _blk(rows * arch.kv_dim * FP32_BYTES) + _blk(
        rows * encoder_width(arch, options) * FP32_BYTES
    )


def check_prefix_attention(spec: TrainingSpec) -> None:
    """Prefix tuning is modelled on SDPA with the kernel CUDA picks for the explicit mask,
    mem-efficient: flash takes no mask (service/trace/kernels.py choose_sdpa_kernel), and the
    eager and math paths' scores over the longer keys are not modelled."""
    if prefix_options(spec) is None:
        return
    if spec.attn_implementation is not AttnImpl.SDPA:
        raise InvalidSpecError(
            "attn_implementation",
            f"prefix tuning is modelled with sdpa, not {spec.attn_implementation.value}",
        )
    if spec.sdpa_kernel not in (SdpaKernel.AUTO, SdpaKernel.EFFICIENT):
        raise InvalidSpecError(
            "sdpa_kernel",
            f"prefix tuning's mask runs on the mem-efficient kernel, not {spec.sdpa_kernel.value}",
        )
