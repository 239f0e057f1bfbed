"""PEFT's prefix tuning in the step's schedule: the prefix made into a cache before the layers,
each layer's keys and values concatenated behind it, their gradients held to the end.

get_prompt (peft/peft_model.py) embeds the virtual token ids (through the projection MLP when
there is one), casts the result to the model's dtype and hands its per-layer views to
DynamicCache, whose update copies each (torch.cat onto an empty tensor, transformers
cache_utils.py DynamicLayer). Each layer's update concatenates its own keys and values behind
them; the cache holds the results until the model's forward returns. In backward the
concatenation's gradient is a view of the whole (seq + virtual) gradient, which waits for the
prefix's UnbindBackward (created before every layer, so run after all of them) and keeps that
storage until the layers' backward ends; then the prefix's gradient is stacked, cast back to
fp32 and made the embedding's.
"""

from __future__ import annotations

from service.core.schedule.program import _StepBase
from service.core.units import FP32_BYTES, INT64_BYTES


class _Prefix(_StepBase):
    """Prefix tuning's events (`StepShape.prefix_tokens`)."""

    prefix_cache: list[int]
    prefix_keys: list[int]
    prefix_grads: list[int]
    prefix_saved: list[int]

    def _prefix_rows(self) -> int:
        return self.sh.batch * self.sh.prefix_tokens

    def prefix_forward(self) -> None:
        """The PrefixEncoder's output, its cast, and the cache's copy of each layer's keys and
        values; the token ids' expand is a view of the arange the model keeps."""
        sh = self.sh
        rows = self._prefix_rows()
        kvd = sh.kv_heads * sh.head_dim
        self.prefix_cache, self.prefix_keys, self.prefix_grads = [], [], []
        ids = self.p.alloc(rows * INT64_BYTES)  # the arange moved to the device (.to)
        if sh.prefix_encoder:
            tokens = self.p.alloc(rows * kvd * FP32_BYTES)
            hidden = self.p.alloc(rows * sh.prefix_encoder * FP32_BYTES)
            self.gemm(bias=True)
            tanh = self.p.alloc(rows * sh.prefix_encoder * FP32_BYTES)
            self.f(hidden)
            wide = self.p.alloc(rows * sh.prefix_width * FP32_BYTES)
            self.f(ids)
            self.prefix_saved = [tokens, tanh]  # the first linear's input, tanh's output
        else:
            wide = self.p.alloc(rows * sh.prefix_width * FP32_BYTES)
            self.prefix_saved = [ids]  # embedding's backward keeps the indices
        cast = self.p.alloc(rows * sh.prefix_width * sh.residual)
        self.f(wide)
        for _ in range(2 * sh.layers):
            self.prefix_cache.append(self.p.alloc(rows * kvd * sh.residual))
        self.f(cast)

    def prefix_concat(self, nbytes: int) -> tuple[int, int]:
        """A layer's DynamicLayer.update: keys and values behind the prefix's (new tensors the
        cache holds until the forward returns); the prefix's copies are let go."""
        sh = self.sh
        kvd = sh.kv_heads * sh.head_dim
        width = sh.batch * (sh.seq + sh.prefix_tokens) * kvd * nbytes
        k_prefix, v_prefix = self.prefix_cache.pop(0), self.prefix_cache.pop(0)
        keys = self.p.alloc(width)
        self.f(k_prefix)
        values = self.p.alloc(width)
        self.f(v_prefix)
        self.prefix_keys += [keys, values]
        return keys, values

    def prefix_forward_end(self) -> None:
        """The model's forward returns: its output's cache goes."""
        self.f(*self.prefix_keys)
        self.prefix_keys = []

    def prefix_backward_end(self) -> None:
        """After the layers: each layer's prefix gradient stacked (the views' storages let go),
        all concatenated, cast to fp32 and through the encoder's backward to its weights'
        gradients."""
        sh = self.sh
        rows = self._prefix_rows()
        kvd = sh.kv_heads * sh.head_dim
        stacked = []
        for index in range(0, len(self.prefix_grads), 2):
            stacked.append(self.p.alloc(2 * rows * kvd * sh.residual))
            self.f(*self.prefix_grads[index : index + 2])
        self.prefix_grads = []
        joined = self.p.alloc(rows * sh.prefix_width * sh.residual)
        self.f(*stacked)
        wide = self.p.alloc(rows * sh.prefix_width * FP32_BYTES)
        self.f(joined)
        p = sh.prefix_tokens
        if sh.prefix_encoder:
            # the second linear's weight and bias, tanh's and the first linear's backward
            e = sh.prefix_encoder
            self.grad(sh.prefix_width * e * FP32_BYTES)
            self.grad(sh.prefix_width * FP32_BYTES)
            g_tanh = self.p.alloc(rows * e * FP32_BYTES)
            self.f(wide)
            g_hidden = self.p.alloc(rows * e * FP32_BYTES)
            self.f(g_tanh)
            self.grad(e * kvd * FP32_BYTES)
            self.grad(e * FP32_BYTES)
            g_tokens = self.p.alloc(rows * kvd * FP32_BYTES)
            self.f(g_hidden, *self.prefix_saved)
            self.grad(p * kvd * FP32_BYTES)  # the embedding's
            self.f(g_tokens)
        else:
            self.grad(p * sh.prefix_width * FP32_BYTES)
            self.f(wide, *self.prefix_saved)
        self.prefix_saved = []
