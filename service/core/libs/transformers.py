"""transformers: what model.generate holds, read by the estimator's generation moment and the
allocator schedule's generation (GRPO)."""

from __future__ import annotations

# One decoder layer's no-grad prefill at its MLP product, in tokens x intermediate_size and
# tokens x hidden_size elements of the compute dtype (reference trace
# qwen2_5-0_5b__lora__grpo__g8-p480__r16-all-linear__b8-s512: the generation's peak at the MLP
# product, 266 MB over 3840 prompt tokens).
PREFILL_INTERMEDIATES = 7
PREFILL_HIDDEN = 1
# The key and the value tensor each layer's DynamicCache holds (cache_utils.DynamicLayer).
KV_TENSORS = 2
