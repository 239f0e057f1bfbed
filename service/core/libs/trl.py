"""TRL (trl 1.16.0): the shapes its trainers' steps take, read by the estimator and the
allocator schedule."""

from __future__ import annotations

# trl/kernels/chunked_logprob.py TOKEN_CHUNK_SIZE and trl/trainer/utils.py
# _CHUNKED_LOGPROB_CHUNK_SIZE: a tile of the fused head's logits.
DPO_TILE_TOKENS = 4096
DPO_TILE_VOCAB = 32768
# ChunkedLogProbFunction.forward's fp32 running statistics per scored position.
DPO_RUNNING_STATS = 7
# ORPO's [chosen; rejected] rows on the batch axis (trl/experimental/orpo/orpo_trainer.py
# concatenated_inputs): the chosen half is the NLL's.
PAIR_SIDES = 2
