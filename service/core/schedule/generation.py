"""GRPO's generation in the allocator replay: model.generate's prefill and decode steps with a
transformers DynamicCache, which grows each layer's key and value by torch.cat a token at a
time (cache_utils.DynamicLayer.update: the grown tensor is made before the old one goes)."""

from __future__ import annotations

from service.core.libs.transformers import KV_TENSORS, PREFILL_HIDDEN, PREFILL_INTERMEDIATES
from service.core.schedule.program import _Program
from service.core.schedule.shapes import StepShape
from service.core.units import FP32_BYTES, INT32_BYTES, INT64_BYTES


def generation_events(sh: StepShape, prog: _Program) -> list[int]:
    """Append one generation's events to `prog`: the prompt batch, the prefill layer by layer
    (each layer's transients freed before the next, its key and value kept), then every decode
    step's cache growth. Returns the buffered batch the step keeps (freed by the caller)."""
    rows, prompt, new = sh.generation_rows, sh.generation_prompt, sh.generation_tokens
    alloc, free = prog.alloc, prog.free
    ids = alloc(rows * prompt * INT64_BYTES)
    mask = alloc(rows * prompt * INT64_BYTES)
    kv_row = sh.kv_heads * sh.head_dim * sh.generation_kv_bytes
    x = alloc(rows * prompt * sh.hidden * sh.residual)
    cache: list[list[int]] = []
    for _ in range(sh.layers):
        cache.append([alloc(rows * prompt * kv_row) for _ in range(KV_TENSORS)])
        transients = [
            alloc(rows * prompt * sh.intermediate * sh.residual)
            for _ in range(PREFILL_INTERMEDIATES)
        ]
        hidden = rows * prompt * sh.hidden * sh.residual
        transients += [alloc(hidden) for _ in range(PREFILL_HIDDEN)]
        out = alloc(rows * prompt * sh.hidden * sh.residual)
        free(*transients, x)
        x = out
    free(x)
    for t in range(1, new):
        for layer in cache:
            step = alloc(rows * sh.hidden * sh.residual)
            for j in range(KV_TENSORS):
                grown = alloc(rows * (prompt + t) * kv_row)
                free(layer[j])
                layer[j] = grown
            free(step)
    free(*(key for layer in cache for key in layer), ids, mask)
    # _generate_and_score_completions' batch, kept for the step (estimator/grpo.py
    # buffered_inputs): prompt ids and mask, completion ids (int64) and mask (int32), the
    # advantages
    return [
        alloc(rows * prompt * INT64_BYTES),
        alloc(rows * prompt * INT64_BYTES),
        alloc(rows * new * INT64_BYTES),
        alloc(rows * new * INT32_BYTES),
        alloc(rows * FP32_BYTES),
    ]
