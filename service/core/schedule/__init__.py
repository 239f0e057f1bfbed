"""The allocation schedule of a training step: the tensors the HF + PEFT step allocates and frees,
in the order it does, sized from the architecture and the spec.

The caching allocator's reserved level depends on that order (`service.core.allocator`), so the
estimator replays this schedule through the allocator model. Each module's pattern below is the
one the reference tracer records for the real transformers 5.24 / PEFT 0.21 / bitsandbytes 0.50
step (`vramcast trace`, tests/data/traces/): RMSNorm's fp32 copy, PEFT's per-adapter input casts
and its 4-bit clone, bitsandbytes' dequantize + F.linear, RoPE, each attention kernel, the MLP,
the loss's fp32 log-probabilities, and each module's backward, autograd freeing what a node
saved once it has run. Tensors are reference-counted as Python holds them: a tensor is freed
when its last holder (the forward's locals, a saved slot, a checkpoint) lets go. Tensors that
scale with neither tokens nor weights (per-token scalars, RoPE tables, index tensors) are left
out: they live in the allocator's small pool and do not move the reserved level.

Events are `(key, nbytes)`: `nbytes > 0` allocates tensor `key`, `nbytes == 0` frees it.
"""

from __future__ import annotations

from service.core.libs.optimizers import Updater
from service.core.libs.trl import DPO_RUNNING_STATS, DPO_TILE_TOKENS, DPO_TILE_VOCAB, PAIR_SIDES
from service.core.schedule.shapes import HALF_BYTES, Event, Kernel, LinearShape, StepShape
from service.core.schedule.step import step_events

__all__ = [
    "DPO_RUNNING_STATS",
    "DPO_TILE_TOKENS",
    "DPO_TILE_VOCAB",
    "HALF_BYTES",
    "PAIR_SIDES",
    "Event",
    "Kernel",
    "LinearShape",
    "StepShape",
    "Updater",
    "step_events",
]
