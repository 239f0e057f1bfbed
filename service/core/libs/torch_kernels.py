"""PyTorch's CUDA kernels (aten): the limits and paddings of the attention kernels and what
the loss keeps, read by the estimator and the allocator schedule."""

from __future__ import annotations

# FlashAttention's largest head dim (aten sdp_utils check_head_dim_size_flash).
FLASH_MAX_HEAD_DIM = 256
# The mem-efficient kernel pads its fp32 log-sum-exp to a multiple of 32 queries
# (aten/src/ATen/native/transformers/cuda/attention.cu _efficient_attention_forward, kAlignLSE).
EFFICIENT_LSE_PAD = 32
# nll_loss's forward returns the loss and its total weight, one fp32 scalar each
# (aten nll_loss_forward); HF's loss keeps both until backward.
LOSS_SCALARS = 2
