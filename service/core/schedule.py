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

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from service.core.bnb import uses_dequant_fallback
from service.core.units import FP32_BYTES, INT64_BYTES

HALF_BYTES = 2  # autocast's bf16 / fp16

Event = tuple[int, int]


class Kernel(StrEnum):
    """The attention computation a layer runs (after SDPA's own backend choice)."""

    FLASH = "flash"  # flash / cuDNN: q, k, v, output and an fp32 log-sum-exp saved
    EFFICIENT = "efficient"  # mem-efficient: key/value repeated to the query heads
    MATH = "math"  # SDPA's math composite: fp32 scores materialised
    EAGER = "eager"  # transformers' eager attention: scores, fp32 softmax, cast


class Updater(StrEnum):
    """What the optimizer step allocates (`Optim` grouped by memory behaviour)."""

    ADAMW_FUSED = "adamw_fused"  # two states per parameter, no temporaries
    ADAMW_FOREACH = "adamw_foreach"  # two states, and one state-sized list of temporaries
    STATELESS = "stateless"  # SGD without momentum
    BNB_8BIT = "bnb_8bit"  # uint8 states with fp32 absmax blocks
    ADAFACTOR = "adafactor"  # factored second moment; fp32 copies of one parameter
    OUTSIDE = "outside"  # paged optimizers: state in managed memory, outside the allocator


@dataclass(frozen=True, slots=True, kw_only=True)
class LinearShape:
    """One linear call of a decoder layer."""

    name: str
    d_in: int
    d_out: int
    adapted: bool  # carries a LoRA adapter
    trainable: bool  # its weight trains (full fine-tuning)
    weight_bytes: int  # a trainable weight's gradient bytes
    quantized: bool = False  # a bitsandbytes 4-bit weight


@dataclass(frozen=True, slots=True, kw_only=True)
class StepShape:
    """Everything the schedule depends on; sizes per token unless named otherwise."""

    tokens: int  # b * s
    batch: int
    seq: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    qkv: tuple[LinearShape, ...]  # q, k, v (or one fused projection)
    out_proj: LinearShape
    mlp_in: tuple[LinearShape, ...]  # gate, up (or one fused gate_up, or fc1)
    mlp_out: LinearShape
    gated: bool
    intermediate: int  # the MLP's (a MoE's shared expert's; 0 without one)
    experts: int = 0  # routed experts of a MoE block (0: a dense MLP)
    top_k: int = 0
    expert_intermediate: int = 0
    shared_gate: LinearShape | None = None  # a MoE's shared-expert gate (h -> 1)
    experts_trainable: bool = False
    expert_gate_up_bytes: int = 0
    expert_down_bytes: int = 0
    residual: int  # bytes per element of the residual stream
    compute: int  # the 4-bit linears' compute dtype bytes
    adapter: int  # bytes per element of the LoRA adapters (0 without LoRA)
    rank: int
    dropout: bool
    double_quant: bool
    kernel: Kernel
    window_mask: bool  # an explicit (b, 1, s, s) mask is built for the model's forward
    masks: int  # how many (one per kind of layer: Gemma-2 has global and sliding ones)
    mask_bytes: int  # per element: 1 for SDPA's boolean mask, the attention dtype's for eager
    rope_pass_cat: bool  # RoPE concatenates the rotated and pass-through dimensions
    softcap: bool  # Gemma-2's attention-logit softcapping (eager)
    final_softcap: bool  # Gemma-2's final-logit softcapping
    gemma_norm: bool  # Gemma's RMSNorm: (1 + weight) applied in fp32, then the cast
    sandwich_norms: bool  # Gemma-2's norms after the attention and the MLP too
    embed_scale: bool  # Gemma scales the embedding output by sqrt(hidden_size)
    checkpointing: bool
    input_grad: bool  # the first layer's input needs a gradient
    norm_trainable: bool
    loss_upcast: bool  # HF's loss: logits.float() (no copy when they are fp32 already)
    loss_materialised: bool  # the loss builds b*s*V logits (not chunked or fused)
    head_bytes: int  # bytes per element of the logits
    head_trainable: bool
    embed_trainable: bool
    tied: bool  # the LM head is the embedding
    updater: Updater
    trainable: tuple[int, ...]  # trainable tensors' bytes, in parameter order
    states: tuple[int, ...]  # optimizer state tensors' bytes, in creation order
    largest_trainable: int  # elements of the largest trainable tensor (Adafactor)
    workspace: int  # one cuBLAS handle's workspace
    lt_workspace: int  # the cuBLASLt workspace (addmm with a bias), 0 when no linear has one
    # HF Trainer's mixed precision: matmuls and SDPA in half precision (autocast), the LM
    # head's half copy of a weight that is not half (0: none), and clipping's norms.
    autocast: bool = False
    head_weight_copy: int = 0
    clip: bool = False
    param_bytes: int = 2  # bytes per element of the model's (trainable) weights
    accumulation: int = 1  # micro-batches per optimizer step


@dataclass(slots=True)
class _Program:
    """The events and each live tensor's holders."""

    events: list[Event] = field(default_factory=list)
    refs: dict[int, int] = field(default_factory=dict)
    next_key: int = 1

    def alloc(self, nbytes: int) -> int:
        if nbytes <= 0:
            return 0
        key = self.next_key
        self.next_key += 1
        self.events.append((key, nbytes))
        self.refs[key] = 1
        return key

    def hold(self, key: int) -> int:
        if key:
            self.refs[key] += 1
        return key

    def free(self, *keys: int) -> None:
        refs = self.refs
        for key in keys:
            if not key:
                continue
            count = refs[key] - 1
            if count:
                refs[key] = count
            else:
                del refs[key]
                self.events.append((key, 0))


@dataclass(slots=True)
class _Saved:
    """What a layer's forward saved for its backward, by name (each slot holds its tensor)."""

    prog: _Program
    slots: dict[str, int] = field(default_factory=dict)

    def save(self, name: str, key: int) -> None:
        if key:
            self.slots[name] = self.prog.hold(key)

    def release(self, *names: str) -> None:
        for name in names:
            self.prog.free(self.slots.pop(name, 0))

    def release_all(self) -> None:
        self.prog.free(*self.slots.values())
        self.slots.clear()


class _Stop(Exception):
    """Non-reentrant checkpointing stops recomputing once the last saved tensor exists."""


class _Step:
    """Appends the events of training steps to a program."""

    def __init__(self, shape: StepShape, prog: _Program) -> None:
        self.sh = shape
        self.p = prog
        self.t = shape.tokens
        self.grads: list[int] = []
        self.handles: set[str] = set()
        self.handle = "forward"
        self.states: list[int] = []
        self.stop_at: str | None = None  # the linear where a recomputation stops
        self.softcap_tanh = 0
        self.head_copy = 0
        self.region: list[int] = []  # autocast's cached weight casts in the current region
        self.accumulated = False  # a previous micro-batch of this step made the gradients
        self.head_grad = 0  # a tied LM head's gradient waiting for the embedding's
        self._input_grad = True

    def a(self, per_token: int) -> int:
        return self.p.alloc(self.t * per_token)

    def f(self, *keys: int) -> None:
        self.p.free(*keys)

    def gemm(self, bias: bool = False) -> None:
        """A GEMM on the current handle: its workspaces the first time (after the output)."""
        handle = self.handle
        if handle not in self.handles:
            self.handles.add(handle)
            self.p.alloc(self.sh.workspace)
        if bias and self.sh.lt_workspace and f"{handle}.lt" not in self.handles:
            self.handles.add(f"{handle}.lt")
            self.p.alloc(self.sh.lt_workspace)

    def grad(self, nbytes: int) -> None:
        """A trainable tensor's gradient, held until `zero_grad`; a later micro-batch's is
        added into it in place and freed."""
        key = self.p.alloc(nbytes)
        if self.accumulated:
            self.f(key)
        elif key:
            self.grads.append(key)

    # -- forward ----------------------------------------------------------------------------

    def norm(self, x: int, saved: _Saved | None, name: str) -> int:
        """RMSNorm (LlamaRMSNorm): x.float(), pow(2).mean, x * rsqrt, .to(dtype), weight *."""
        sh = self.sh
        h = sh.hidden
        fp32 = sh.residual == FP32_BYTES
        x32 = x if fp32 else self.a(FP32_BYTES * h)
        self.f(self.a(FP32_BYTES * h))  # pow
        normed = self.a(FP32_BYTES * h)
        if saved is not None:
            saved.save(f"{name}.x", x32)
        if not fp32:
            self.f(x32)
        if fp32:
            out = self.a(FP32_BYTES * h)
            if saved is not None and sh.norm_trainable:
                saved.save(f"{name}.normed", normed)
            self.f(normed)
            return out
        if sh.gemma_norm:
            # Gemma2RMSNorm: output * (1 + weight.float()), then type_as(x).
            scaled = self.a(FP32_BYTES * h)
            if saved is not None and sh.norm_trainable:
                saved.save(f"{name}.normed", normed)
            self.f(normed)
            out = self.a(sh.residual * h)
            self.f(scaled)
            return out
        cast = self.a(sh.residual * h)
        out = self.a(sh.residual * h)
        if saved is not None and sh.norm_trainable:
            saved.save(f"{name}.normed", cast)
        self.f(cast, normed)
        return out

    def out_bytes(self, lin: LinearShape, nbytes: int) -> int:
        """The dtype of `lin`'s output for an input of `nbytes`: half under autocast, but a
        4-bit base casts its output back to its input's dtype (bitsandbytes Linear4bit)."""
        if not self.sh.autocast:
            return nbytes
        return max(nbytes, HALF_BYTES) if lin.quantized else HALF_BYTES

    def end_region(self) -> None:
        """An autocast region exits: its cache lets go of the weight casts."""
        self.f(*self.region)
        self.region.clear()

    def linear(self, x: int, nbytes: int, lin: LinearShape, saved: _Saved | None) -> int:
        """One linear call on `x` (`nbytes` per element); returns its output (in
        `out_bytes`)."""
        sh = self.sh
        stop = saved is not None and self.stop_at == lin.name
        if lin.trainable:
            if sh.autocast and (sh.param_bytes != HALF_BYTES or nbytes != HALF_BYTES):
                return self._trainable_autocast(x, nbytes, lin, saved, stop)
            if saved is not None:
                saved.save(f"{lin.name}.x", x)
            if stop:
                raise _Stop
            self.gemm()
            return self.a(nbytes * lin.d_out)
        if lin.quantized:
            base = self._linear_4bit(x, nbytes, lin)
        else:
            self.gemm()
            base = self.a(self.out_bytes(lin, nbytes) * lin.d_out)
        if not lin.adapted:
            return base
        ad = sh.adapter
        if lin.quantized:
            # PEFT's 4-bit LoRA layer clones the base output (peft/tuners/lora/bnb.py).
            clone = self.a(nbytes * lin.d_out)
            self.f(base)
            base = clone
        if sh.autocast:
            return self._lora_autocast(x, nbytes, lin, saved, base, stop)
        cast = self.p.hold(x) if ad == nbytes else self.a(ad * lin.d_in)
        if sh.dropout:
            mask = self.a(lin.d_in)
            dropped = self.a(ad * lin.d_in)
            if saved is not None:
                saved.save(f"{lin.name}.mask", mask)
            self.f(mask, cast)
            cast = dropped
        if saved is not None:
            saved.save(f"{lin.name}.cast", cast)
        lora_a = self.a(ad * sh.rank)
        if saved is not None:
            saved.save(f"{lin.name}.lora_a", lora_a)
            if stop:
                raise _Stop
        lora_b = self.a(ad * lin.d_out)
        self.f(lora_a)
        scaled = self.a(ad * lin.d_out)
        self.f(lora_b)
        if lin.quantized:
            # peft/tuners/lora/bnb.py: the adapter's output is cast to the result's dtype
            # before `result = result + output`.
            if ad != nbytes:
                back = self.a(nbytes * lin.d_out)
                self.f(scaled)
                scaled = back
            out = self.a(nbytes * lin.d_out)
            self.f(base, cast, scaled)
            return out
        # peft/tuners/lora/layer.py: `result + lora_B(...) * scaling` promotes to the wider
        # dtype, cast back to the result's afterwards.
        wide = max(nbytes, ad)
        summed = self.a(wide * lin.d_out)
        self.f(scaled, base)
        out = summed
        if wide != nbytes:
            out = self.a(nbytes * lin.d_out)
            self.f(summed)
        self.f(cast)
        return out

    def _trainable_autocast(
        self, x: int, nbytes: int, lin: LinearShape, saved: _Saved | None, stop: bool
    ) -> int:
        """A trained linear under autocast: its weight's half cast (cached until the region
        exits) and its input's, both saved by the matmul; a half output."""
        sh = self.sh
        weight = 0
        # autocast casts the linear's arguments in order: the input, then the weight
        half = self.p.hold(x) if nbytes == HALF_BYTES else self.a(HALF_BYTES * lin.d_in)
        if sh.param_bytes != HALF_BYTES:
            weight = self.p.alloc(lin.weight_bytes * HALF_BYTES // sh.param_bytes)
            self.region.append(weight)
        if saved is not None:
            saved.save(f"{lin.name}.x", half)
            saved.save(f"{lin.name}.w", weight)
        if stop:
            raise _Stop
        self.gemm()
        out = self.a(HALF_BYTES * lin.d_out)
        self.f(half)
        return out

    def _lora_autocast(
        self, x: int, nbytes: int, lin: LinearShape, saved: _Saved | None, base: int, stop: bool
    ) -> int:
        """The adapter under autocast: PEFT's lora.Linear casts the input to the adapters'
        dtype (its 4-bit layers do not, peft/tuners/lora/bnb.py requires_conversion); lora_A
        casts that to half precision (the copy it saves) and lora_A, lora_B and the scaling
        run in half; `result + output` promotes to the wider dtype."""
        sh = self.sh
        srcb = nbytes if lin.quantized else sh.adapter
        src = self.p.hold(x) if srcb == nbytes else self.a(srcb * lin.d_in)
        if sh.dropout:
            mask = self.a(lin.d_in)
            dropped = self.a(srcb * lin.d_in)
            if saved is not None:
                saved.save(f"{lin.name}.mask", mask)
            self.f(mask, src)
            src = dropped
        half = self.p.hold(src) if srcb == HALF_BYTES else self.a(HALF_BYTES * lin.d_in)
        if saved is not None:
            saved.save(f"{lin.name}.cast", half)
        lora_a = self.a(HALF_BYTES * sh.rank)
        self.f(half)  # the autocast kernel's cast, unless the matmul saved it
        if saved is not None:
            saved.save(f"{lin.name}.lora_a", lora_a)
            if stop:
                raise _Stop
        lora_b = self.a(HALF_BYTES * lin.d_out)
        self.f(lora_a)
        scaled = self.a(HALF_BYTES * lin.d_out)
        self.f(lora_b)
        out = self.a(self.out_bytes(lin, nbytes) * lin.d_out)
        self.f(scaled, base, src)
        return out

    def _linear_4bit(self, x: int, nbytes: int, lin: LinearShape) -> int:
        """bitsandbytes' 4-bit linear on a training-sized input (backends/cuda/ops.py
        _dequant_linear_fallback): the input in the compute dtype, the absmax rebuilt in fp32
        (double quant), the weight dequantized, F.linear, the output cast back."""
        sh = self.sh
        compute = sh.compute
        cast = self.a(compute * lin.d_in) if nbytes != compute else 0
        if not uses_dequant_fallback(sh.tokens, lin.d_out, lin.d_in):
            out = self.a(compute * lin.d_out)  # the fused kernel
            if nbytes != compute:
                back = self.a(nbytes * lin.d_out)
                self.f(out, cast)
                out = back
            return out
        elements = lin.d_in * lin.d_out
        absmax = []
        if sh.double_quant:
            blocks = -(-elements // 64) * FP32_BYTES
            absmax = [self.p.alloc(blocks), self.p.alloc(blocks)]
        weight = self.p.alloc(elements * compute)
        out = self.a(compute * lin.d_out)
        self.gemm()
        self.f(*reversed(absmax), weight)
        if nbytes != compute:
            back = self.a(nbytes * lin.d_out)
            self.f(out, cast)
            out = back
        return out

    def rope(self, x: int, dim: int, nbytes: int, out_bytes: int = 0) -> int:
        """x * cos + rotate_half(x) * sin (transformers' apply_rotary_pos_emb); where the
        model's version concatenates the pass-through dimensions back (Phi-3), that copy.
        The products promote to `out_bytes` (cos and sin come in the embeddings' dtype: a half
        x under autocast in an fp32 model gives fp32)."""
        wide = out_bytes or nbytes
        t1 = self.a(wide * dim)
        neg = self.a(nbytes * dim // 2)
        cat = self.a(nbytes * dim)
        self.f(neg)
        t2 = self.a(wide * dim)
        self.f(cat)
        out = self.a(wide * dim)
        self.f(t1, t2)
        if self.sh.rope_pass_cat:
            joined = self.a(wide * dim)
            self.f(out)
            out = joined
        return out

    def attention(
        self, q: int, k: int, v: int, nbytes: int, saved: _Saved | None, v_bytes: int = 0
    ) -> int:
        """The kernel on post-RoPE q, k and v (`v_bytes` per element of v, by default
        `nbytes`); returns the (b, s, heads x head_dim) output. Under autocast SDPA (and
        eager's matmuls) take half copies of wider inputs."""
        sh = self.sh
        if sh.autocast and nbytes != HALF_BYTES:
            qd = sh.heads * sh.head_dim
            kvd = sh.kv_heads * sh.head_dim
            q16, k16 = (self.a(HALF_BYTES * d) for d in (qd, kvd))
            v16 = self.p.hold(v) if v_bytes == HALF_BYTES else self.a(HALF_BYTES * kvd)
            out = self._attention(q16, k16, v16, HALF_BYTES, saved)
            self.f(q16, k16, v16)
            return out
        return self._attention(q, k, v, nbytes, saved)

    def _attention(self, q: int, k: int, v: int, nbytes: int, saved: _Saved | None) -> int:
        sh = self.sh
        qd = sh.heads * sh.head_dim
        scores = sh.heads * sh.seq  # per token: one row of scores per head
        gqa = sh.heads > sh.kv_heads
        kernel = sh.kernel
        if kernel is Kernel.FLASH:
            out = self.a(nbytes * qd)
            lse = self.a(FP32_BYTES * sh.heads)
            if saved is not None:
                for name, key in (("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse)):
                    saved.save(name, key)
            self.f(lse)
            return out
        if kernel is Kernel.EFFICIENT:
            k_rep = self.a(nbytes * qd) if gqa else self.p.hold(k)
            v_rep = self.a(nbytes * qd) if gqa else self.p.hold(v)
            # A boolean window mask becomes an additive (b, 1, s, s) bias in the query's dtype
            # on every call (attention.cpp convert_boolean_attn_mask), which the kernel saves.
            bias = self.a(nbytes * sh.seq) if sh.window_mask else 0
            out = self.a(nbytes * qd)
            lse = self.a(FP32_BYTES * sh.heads)
            if saved is not None:
                for name, key in (("q", q), ("k", k_rep), ("v", v_rep), ("out", out)):
                    saved.save(name, key)
                saved.save("lse", lse)
                saved.save("bias", bias)
            self.f(lse, k_rep, v_rep, bias)
            return out
        if kernel is Kernel.MATH:
            return self._math(q, k, v, nbytes, saved)
        # eager (transformers' eager_attention_forward): repeat_kv copies, q @ k^T (q made
        # contiguous), * scaling, (softcap), + mask, fp32 softmax, cast, probs @ v, transpose.
        k_rep = self.a(nbytes * qd) if gqa else self.p.hold(k)
        v_rep = self.a(nbytes * qd) if gqa else self.p.hold(v)
        # the query made contiguous for the score matmul (rope's output keeps the projection's
        # (batch, seq, heads, dim) layout): torch.matmul folds (batch, heads) into the bmm's
        # batch with a reshape, a view when the batch is one
        q_c = self.a(nbytes * qd) if sh.batch > 1 else self.p.hold(q)
        s1 = self.a(nbytes * scores)
        self.gemm()
        s2 = self.a(nbytes * scores)
        self.f(s1)
        if sh.softcap:
            div = self.a(nbytes * scores)
            self.f(s2)
            tanh = self.a(nbytes * scores)
            if saved is not None:
                saved.save("tanh", tanh)
            self.f(div)
            s2 = self.a(nbytes * scores)
            self.f(tanh)
        s3 = self.a(nbytes * scores)
        self.f(s2)
        up = self.a(FP32_BYTES * scores)
        probs32 = self.a(FP32_BYTES * scores)
        self.f(up)
        probs = self.a(nbytes * scores) if nbytes != FP32_BYTES else self.p.hold(probs32)
        self.f(s3)
        out = self.a(nbytes * qd)
        if saved is not None:
            for name, key in (("q", q_c), ("k", k_rep), ("probs32", probs32), ("probs", probs)):
                saved.save(name, key)
            saved.save("v", v_rep)
        self.f(q_c, k_rep, probs32, probs, v_rep)
        out_t = self.a(nbytes * qd)
        self.f(out)
        return out_t

    def _math(self, q: int, k: int, v: int, nbytes: int, saved: _Saved | None) -> int:
        """aten's composite on CUDA (attention.cpp _scaled_dot_product_attention_math): fp32
        (half inputs upcast), q scaled, a boolean causal tril made additive, key and value
        repeated for GQA, the key scaled, transposed and made contiguous, scores, the mask
        added in place, `_safe_softmax` (softmax and an eq(-inf) mask), probs @ v."""
        sh = self.sh
        qd = sh.heads * sh.head_dim
        kvd = sh.kv_heads * sh.head_dim
        scores = sh.heads * sh.seq
        gqa = sh.heads > sh.kv_heads
        ups = []
        if nbytes != FP32_BYTES:
            ups = [self.a(FP32_BYTES * qd), self.a(FP32_BYTES * kvd), self.a(FP32_BYTES * kvd)]
        q_s = self.a(FP32_BYTES * qd)
        ones = self.p.alloc(sh.seq * sh.seq)
        tril = self.p.alloc(sh.seq * sh.seq)
        self.f(ones)
        mask = self.p.alloc(sh.seq * sh.seq * FP32_BYTES)
        self.f(tril)
        k_rep = self.a(FP32_BYTES * qd) if gqa else 0
        v_rep = self.a(FP32_BYTES * qd) if gqa else 0
        k_s = self.a(FP32_BYTES * qd)
        k_c = self.a(FP32_BYTES * qd)
        self.gemm()
        s1 = self.a(FP32_BYTES * scores)
        if saved is None:
            self.f(k_c, k_s)
        probs = self.a(FP32_BYTES * scores)
        self.f(self.a(scores))  # _safe_softmax: eq(-inf)
        self.f(s1)
        out = self.a(FP32_BYTES * qd)
        if saved is not None:
            for name, key in (("k_s", k_s), ("k_c", k_c), ("probs", probs)):
                saved.save(name, key)
            saved.save("v", v_rep or (ups[2] if ups else v))
            self.f(k_s, k_c)
        self.f(q_s, k_rep, v_rep, mask, probs, *ups)
        out_t = self.a(FP32_BYTES * qd)
        self.f(out)
        if nbytes != FP32_BYTES:
            cast = self.a(nbytes * qd)
            self.f(out_t)
            out_t = cast
        return out_t

    def layer(self, x: int, saved: _Saved | None) -> int:
        """One decoder layer's forward; `saved` collects what its backward needs (None: no
        autograd). Raises _Stop where a recomputation would stop."""
        sh = self.sh
        n1 = self.norm(x, saved if (saved is not None and self.input_grad) else None, "norm1")
        outs = [self.linear(n1, sh.residual, lin, saved) for lin in sh.qkv]
        nb = sh.residual
        qb = self.out_bytes(sh.qkv[0], nb)  # q, k and v's dtype
        qd = sh.heads * sh.head_dim
        kvd = sh.kv_heads * sh.head_dim
        if len(outs) == 1:  # one fused projection: q, k and v are its views
            q = k = v = outs[0]
        else:
            q, k, v = outs
        rb = max(qb, nb)  # RoPE's products' dtype: q's promoted with the embeddings'
        q_e = self.rope(q, qd, qb, rb)
        k_e = self.rope(k, kvd, qb, rb)
        fused = len(outs) == 1
        if not fused:
            self.f(q, k)  # the projections' outputs, rebound to the rotated ones
        elif sh.kernel in (Kernel.EAGER, Kernel.MATH) and (sh.batch > 1 or sh.heads != sh.kv_heads):
            v = self.a(qb * kvd)  # the strided value view made contiguous for the matmul
        else:
            v = self.p.hold(v)  # the fused kernels take the strided view as it is
        attn = self.attention(q_e, k_e, v, rb, saved, v_bytes=qb)
        ab = HALF_BYTES if sh.autocast else qb  # the attention output's dtype
        o = self.linear(attn, ab, sh.out_proj, saved)
        self.f(attn)
        if fused:
            self.f(outs[0])  # the module's `qkv` local, until it returns
        self.f(q_e, k_e, v, n1)
        if sh.sandwich_norms:
            normed = self.norm(o, saved, "norm3")
            self.f(o)
            o = normed
        r1 = self.a(nb * sh.hidden)
        self.f(o)
        n2 = self.norm(r1, saved, "norm2")
        d = self.moe(n2, saved) if sh.experts else self.mlp(n2, saved)
        self.f(n2)  # `hidden_states = self.mlp(hidden_states)` rebinds the MLP's input
        if sh.sandwich_norms:
            normed = self.norm(d, saved, "norm4")
            self.f(d)
            d = normed
        out = self.a(nb * sh.hidden)
        self.f(d, r1)
        return out

    def mlp(self, n2: int, saved: _Saved | None, prefix: str = "") -> int:
        """The gated (or plain) MLP: act(gate) * up, then down."""
        sh = self.sh
        nb = sh.residual
        mb = self.out_bytes(sh.mlp_in[0], nb)  # the intermediate activations' dtype
        # down(act(gate(x)) * up(x)): Python evaluates act(gate(x)) before up(x), and without
        # autograd saving them, gate(x) dies once act returns and act and up once multiplied.
        # A fused gate_up (Phi-3) is chunked into views that keep it alive until the return.
        gate = self.linear(n2, nb, sh.mlp_in[0], saved)
        act = self.a(mb * sh.intermediate)  # act(gate): SiLU / GELU keeps its input
        fused = len(sh.mlp_in) == 1
        if saved is not None:
            saved.save(f"{prefix}gate", gate)
        if not sh.gated:
            if saved is not None:
                saved.save(f"{prefix}act", act)
            self.f(gate)
            d = self.linear(act, mb, sh.mlp_out, saved)
            self.f(act)
            return d
        if fused:
            up = self.p.hold(gate)
        else:
            self.f(gate)  # alive in `saved` when autograd keeps it
            up = self.linear(n2, nb, sh.mlp_in[1], saved)
        if saved is not None:
            saved.save(f"{prefix}act", act)
            saved.save(f"{prefix}up", up)
        product = self.a(mb * sh.intermediate)
        self.f(act, up)
        d = self.linear(product, mb, sh.mlp_out, saved)
        self.f(product)
        if fused:
            self.f(gate)
        return d

    def moe(self, n2: int, saved: _Saved | None) -> int:
        """A sparse MoE block (transformers 5 Qwen2MoeSparseMoeBlock with grouped GEMMs): the
        shared expert, the router's fp32 softmax and top-k, the tokens gathered per expert,
        the experts' gate_up, act, product and down, weighted and scattered back, summed; the
        shared expert's sigmoid gate."""
        sh = self.sh
        nb = sh.residual
        k, h, ie = sh.top_k, sh.hidden, sh.expert_intermediate
        shared = self.mlp(n2, saved, "shared.") if sh.intermediate else 0
        logits = self.a(nb * sh.experts)
        self.gemm()
        up32 = self.a(FP32_BYTES * sh.experts)
        probs = self.a(FP32_BYTES * sh.experts)
        self.f(up32, logits)
        weights = self.a(FP32_BYTES * k)
        index = self.a(INT64_BYTES * k)
        routing = self.a(nb * k)
        self.f(weights)
        order = [self.a(INT64_BYTES * k), self.a(INT64_BYTES * k)]
        gathered = self.a(nb * h * k)
        gate_up = self.a(nb * 2 * ie * k)
        self.gemm()
        act = self.a(nb * ie * k)
        product = self.a(nb * ie * k)
        down = self.a(nb * h * k)
        weighted = self.a(nb * h * k)
        scattered = self.a(nb * h * k)
        self.f(weighted)
        routed = self.a(nb * h)
        if saved is not None:
            for name, key in (
                ("moe.probs", probs),
                ("moe.index", index),
                ("moe.routing", routing),
                ("moe.order", order[0]),
                ("moe.gate_up", gate_up),
                ("moe.act", act),
                ("moe.down", down),
            ):
                saved.save(name, key)
            if sh.experts_trainable:
                saved.save("moe.gathered", gathered)
                saved.save("moe.product", product)
        self.f(probs, index, routing, *order, gathered, gate_up, act, product, down, scattered)
        if not shared:
            return routed
        gate_lin = sh.shared_gate
        g = self.linear(n2, nb, gate_lin, saved) if gate_lin is not None else 0
        sig = self.a(nb)
        mixed = self.a(nb * h)
        if saved is not None:
            saved.save("shared.sigmoid", sig)
            saved.save("shared.out", shared)
        self.f(g, sig, shared)
        out = self.a(nb * h)
        self.f(routed, mixed)
        return out

    @property
    def input_grad(self) -> bool:
        return self._input_grad

    # -- backward ---------------------------------------------------------------------------

    def linear_backward(
        self,
        g: int,
        nbytes: int,
        lin: LinearShape,
        saved: _Saved,
        *,
        x_grad: bool,
        acc: int = 0,
        before_saved: Callable[[], None] | None = None,
        in_bytes: int = 0,
    ) -> int:
        """The backward of one linear given its output's gradient `g` (released here, in
        `nbytes`); returns the input's gradient (in `in_bytes`, by default `nbytes`) added to
        `acc` (0 when the input takes none)."""
        sh = self.sh
        ad = sh.adapter
        gx_lora = 0
        g_base = g
        in_bytes = in_bytes or nbytes
        if (
            lin.trainable
            and sh.autocast
            and (sh.param_bytes != HALF_BYTES or in_bytes != HALF_BYTES)
        ):
            if before_saved is not None:  # a checkpoint's recomputation, before the matmul's
                before_saved()
            return self._trainable_autocast_backward(
                g, lin, saved, x_grad=x_grad, acc=acc, in_bytes=in_bytes
            )
        if lin.adapted and sh.autocast:
            g_base, gx_lora, acc = self._lora_autocast_backward(
                g,
                nbytes,
                lin,
                saved,
                x_grad=x_grad,
                acc=acc,
                before_saved=before_saved,
                in_bytes=in_bytes,
            )
            before_saved = None
        elif lin.adapted:
            # the output cast's backward (g in the adapters' dtype; autograd lets go of g),
            # then the promoting add's: g cast back for the base branch
            g32 = self.a(ad * lin.d_out) if ad != nbytes else self.p.hold(g)
            self.f(g)
            g_base = self.a(nbytes * lin.d_out) if ad != nbytes else self.p.hold(g32)
            scaled = self.a(ad * lin.d_out)
            self.f(g32)
            if before_saved is not None:
                before_saved()
                before_saved = None
            self.grad(ad * lin.d_out * sh.rank)  # lora_B.weight.grad
            g_a = self.a(ad * sh.rank)
            self.f(scaled)
            saved.release(f"{lin.name}.lora_a")
            self.grad(ad * lin.d_in * sh.rank)  # lora_A.weight.grad
            if x_grad:
                gx32 = self.a(ad * lin.d_in)
                self.f(g_a)
                saved.release(f"{lin.name}.cast", f"{lin.name}.mask")
                gx_lora = gx32
                if ad != nbytes:
                    gx_lora = self.a(nbytes * lin.d_in)
                    self.f(gx32)
                if acc:
                    total = self.a(nbytes * lin.d_in)
                    self.f(acc, gx_lora)
                    gx_lora, acc = total, 0
            else:
                self.f(g_a)
                saved.release(f"{lin.name}.cast", f"{lin.name}.mask")
        elif before_saved is not None:
            before_saved()
        if lin.trainable:
            self.grad(lin.weight_bytes)
        gin = 0
        if x_grad:
            if lin.quantized:
                gin = self._grad_4bit(g_base, nbytes, lin)
            else:
                gin = self.a(nbytes * lin.d_in)
                self.gemm()
                if in_bytes != nbytes:  # autocast's input cast, backwards
                    wide = self.a(in_bytes * lin.d_in)
                    self.f(gin)
                    gin = wide
        saved.release(f"{lin.name}.x")
        self.f(g_base)
        if not x_grad:
            return acc
        for other in (gx_lora, acc):
            if other:
                total = self.a(in_bytes * lin.d_in)
                self.f(other, gin)
                gin = total
        return gin

    def _trainable_autocast_backward(
        self, g: int, lin: LinearShape, saved: _Saved, *, x_grad: bool, acc: int, in_bytes: int
    ) -> int:
        """A trained linear's backward under autocast (g, half, released): the half weight
        gradient cast to the weight's dtype into its .grad, the half input gradient cast back
        to the input's dtype."""
        sh = self.sh
        # the matmul's node: the weight's and the input's half gradients; its saved tensors
        # and g go once it has run; then the casts' nodes: the weight's, the input's
        half_grad = self.p.alloc(lin.weight_bytes * HALF_BYTES // sh.param_bytes)
        gin = 0
        if x_grad:
            gin = self.a(HALF_BYTES * lin.d_in)
            self.gemm()
        saved.release(f"{lin.name}.x", f"{lin.name}.w")
        self.f(g)
        if sh.param_bytes != HALF_BYTES:
            self.grad(lin.weight_bytes)
            self.f(half_grad)
        else:
            self.grads.append(half_grad)
        if x_grad and in_bytes != HALF_BYTES:
            wide = self.a(in_bytes * lin.d_in)
            self.f(gin)
            gin = wide
        if not x_grad:
            return acc
        if acc:
            total = self.a(in_bytes * lin.d_in)
            self.f(acc, gin)
            gin = total
        return gin

    def _lora_autocast_backward(
        self,
        g: int,
        nbytes: int,
        lin: LinearShape,
        saved: _Saved,
        *,
        x_grad: bool,
        acc: int,
        before_saved: Callable[[], None] | None,
        in_bytes: int,
    ) -> tuple[int, int, int]:
        """The adapter's backward under autocast (g, in `nbytes`, released): the add's gradient
        cast to half for the adapter branch when the result is wider, the scaling's, lora_B's
        and lora_A's in half, the casts' backwards back to the input's dtype (`in_bytes`).
        Returns the base branch's gradient, the adapter branch's input gradient and the
        accumulator."""
        sh = self.sh
        ad = sh.adapter
        srcb = in_bytes if lin.quantized else ad
        g_half = self.a(HALF_BYTES * lin.d_out) if nbytes != HALF_BYTES else self.p.hold(g)
        g_base = self.p.hold(g)
        self.f(g)
        g_b = self.a(HALF_BYTES * lin.d_out)  # the scaling's backward
        self.f(g_half)
        if before_saved is not None:
            before_saved()
        self.grad(ad * lin.d_out * sh.rank)  # lora_B.weight.grad
        g_a = self.a(HALF_BYTES * sh.rank)
        self.f(g_b)
        saved.release(f"{lin.name}.lora_a")
        self.grad(ad * lin.d_in * sh.rank)  # lora_A.weight.grad
        gx_lora = 0
        if x_grad:
            gx = self.a(HALF_BYTES * lin.d_in)
            self.f(g_a)
            saved.release(f"{lin.name}.cast", f"{lin.name}.mask")
            if srcb != HALF_BYTES:
                nxt = self.a(srcb * lin.d_in)
                self.f(gx)
                gx = nxt
            if srcb != in_bytes:
                nxt = self.a(in_bytes * lin.d_in)
                self.f(gx)
                gx = nxt
            gx_lora = gx
            if acc:
                total = self.a(in_bytes * lin.d_in)
                self.f(acc, gx_lora)
                gx_lora, acc = total, 0
        else:
            self.f(g_a)
            saved.release(f"{lin.name}.cast", f"{lin.name}.mask")
        return g_base, gx_lora, acc

    def _grad_4bit(self, g: int, nbytes: int, lin: LinearShape) -> int:
        sh = self.sh
        compute = sh.compute
        cast = self.a(compute * lin.d_out) if nbytes != compute else 0
        elements = lin.d_in * lin.d_out
        absmax = self.p.alloc(-(-elements // 64) * FP32_BYTES) if sh.double_quant else 0
        weight = self.p.alloc(elements * compute)
        self.f(absmax)
        out = self.a(compute * lin.d_in)
        self.gemm()
        self.f(weight, cast)
        if nbytes != compute:
            back = self.a(nbytes * lin.d_in)
            self.f(out)
            out = back
        return out

    def norm_backward(self, g: int, saved: _Saved, name: str, residual: int = 0) -> int:
        """RMSNorm's backward (g released here); returns the input's gradient. In fp32 no
        cast ends it: the first product's gradient reaches the input's buffer directly and
        is added to the `residual` branch's gradient waiting there (released), the second's
        then to that sum, which is returned."""
        sh = self.sh
        h = sh.hidden
        r = sh.residual
        g1 = self.a((FP32_BYTES if sh.gemma_norm else r) * h)  # grad * weight (or its cast)
        if sh.norm_trainable:
            self.f(self.a(r * h))  # grad * normed, summed into the weight's gradient
            self.grad(h * r)
            saved.release(f"{name}.normed")
        self.f(g)
        g32 = g1
        if r != FP32_BYTES:
            g32 = self.a(FP32_BYTES * h)
            self.f(g1)
        t1 = self.a(FP32_BYTES * h)
        t2 = self.a(FP32_BYTES * h)
        self.f(t1, g32)
        if residual and r == FP32_BYTES:
            summed = self.a(FP32_BYTES * h)
            self.f(residual, t2)
            t2 = summed
        t3 = self.a(FP32_BYTES * h)
        t4 = self.a(FP32_BYTES * h)
        t5 = self.a(FP32_BYTES * h)
        t6 = self.a(FP32_BYTES * h)
        self.f(t5, t4, t3)
        saved.release(f"{name}.x")
        total = self.a(FP32_BYTES * h)
        self.f(t2, t6)
        if r == FP32_BYTES:
            return total
        out = self.a(r * h)
        self.f(total)
        return out

    def rope_backward(self, g: int, dim: int, nbytes: int, wide: int = 0) -> int:
        """RoPE's backward on g (in `wide`, by default `nbytes`, released); returns x's
        gradient in `nbytes` (each product's gradient cast back where it promoted)."""
        wide = wide or nbytes
        t1 = self.a(wide * dim)
        if wide != nbytes:
            back = self.a(nbytes * dim)
            self.f(t1)
            t1 = back
        neg = self.a(nbytes * dim // 2)
        s1 = self.a(nbytes * dim)
        self.f(neg)
        s2 = self.a(nbytes * dim)
        self.f(t1)
        added = self.a(nbytes * dim)
        self.f(s1, s2)
        t2 = self.a(wide * dim)
        if wide != nbytes:
            back = self.a(nbytes * dim)
            self.f(t2)
            t2 = back
        self.f(g)
        out = self.a(nbytes * dim)
        self.f(added, t2)
        return out

    def attention_backward(
        self, g: int, nbytes: int, saved: _Saved, v_bytes: int = 0
    ) -> tuple[int, int, int]:
        """The kernel's backward (g released); returns dq, dk, dv at the kv heads' width, in
        `nbytes` (dv in `v_bytes`, by default `nbytes`; under autocast the half gradients are
        cast back, v's first)."""
        sh = self.sh
        if sh.autocast and nbytes != HALF_BYTES:
            dq, dk, dv = self._attention_backward(g, HALF_BYTES, saved)
            qd = sh.heads * sh.head_dim
            kvd = sh.kv_heads * sh.head_dim
            grads = [(dk, kvd), (dq, qd)]
            if v_bytes != HALF_BYTES:
                grads.insert(0, (dv, kvd))
            wide = []
            for grad, dim in grads:
                wide.append(self.a(nbytes * dim))
                self.f(grad)
            if v_bytes == HALF_BYTES:
                wide.insert(0, dv)
            dv, dk, dq = wide
            return dq, dk, dv
        return self._attention_backward(g, nbytes, saved)

    def _attention_backward(self, g: int, nbytes: int, saved: _Saved) -> tuple[int, int, int]:
        sh = self.sh
        qd = sh.heads * sh.head_dim
        kvd = sh.kv_heads * sh.head_dim
        scores = sh.heads * sh.seq
        gqa = sh.heads > sh.kv_heads
        kernel = sh.kernel
        if kernel is Kernel.FLASH:
            dq, dk, dv = self.a(nbytes * qd), self.a(nbytes * kvd), self.a(nbytes * kvd)
            self.f(g)
            saved.release("v", "q", "k", "lse", "out")
            return dq, dk, dv
        if kernel is Kernel.EFFICIENT:
            dq, dk, dv = self.a(nbytes * qd), self.a(nbytes * qd), self.a(nbytes * qd)
            self.f(g)
            saved.release("k", "q", "v", "lse", "out", "bias")
            if gqa:
                sk = self.a(nbytes * kvd)
                self.f(dv)
                sv = self.a(nbytes * kvd)
                self.f(dk)
                dk, dv = sv, sk
            return dq, dk, dv
        if kernel is Kernel.MATH:
            return self._math_backward(g, nbytes, saved)
        # the transposed output's gradient made contiguous for the bmm (a view when the
        # batch is one, as in the forward)
        g_c = self.a(nbytes * qd) if sh.batch > 1 else self.p.hold(g)
        self.f(g)
        dv_rep = self.a(nbytes * qd)
        dprobs = self.a(nbytes * scores)
        self.gemm()
        self.f(g_c)
        saved.release("v", "probs")
        d32 = self.a(FP32_BYTES * scores)
        self.f(dprobs)
        dsm = self.a(FP32_BYTES * scores)
        self.f(d32)
        saved.release("probs32")
        ds = self.a(nbytes * scores)
        self.f(dsm)
        if sh.softcap:  # * cap, tanh's backward, / cap
            for release in (False, True, False):
                nxt = self.a(nbytes * scores)
                self.f(ds)
                if release:
                    saved.release("tanh")
                ds = nxt
        scaled = self.a(nbytes * scores)
        self.f(ds)
        dq = self.a(nbytes * qd)
        dk_rep = self.a(nbytes * qd)
        self.f(scaled)
        saved.release("k", "q")
        if gqa:
            dk = self.a(nbytes * kvd)
            self.f(dk_rep)
            dv = self.a(nbytes * kvd)
            self.f(dv_rep)
            return dq, dk, dv
        return dq, dk_rep, dv_rep

    def _math_backward(self, g: int, nbytes: int, saved: _Saved) -> tuple[int, int, int]:
        sh = self.sh
        qd = sh.heads * sh.head_dim
        kvd = sh.kv_heads * sh.head_dim
        scores = sh.heads * sh.seq
        gqa = sh.heads > sh.kv_heads
        g32 = self.a(FP32_BYTES * qd) if nbytes != FP32_BYTES else self.p.hold(g)
        g_c = self.a(FP32_BYTES * qd)
        self.f(g, g32)
        dv_rep = self.a(FP32_BYTES * qd)
        dprobs = self.a(FP32_BYTES * scores)
        self.gemm()
        self.f(g_c)
        dscores = self.a(FP32_BYTES * scores)
        self.f(self.a(FP32_BYTES * scores))  # the CUDA backward's scratch (kernels.py)
        self.f(dprobs)
        saved.release("probs")
        dq_s = self.a(FP32_BYTES * qd)
        dk_c = self.a(FP32_BYTES * qd)
        self.f(dscores)
        saved.release("k_s", "k_c")
        dq = self.a(FP32_BYTES * qd)
        self.f(dq_s)
        dk_t = self.a(FP32_BYTES * qd)
        self.f(dk_c)
        saved.release("v")
        dk = self.a(FP32_BYTES * kvd) if gqa else dk_t
        dv = self.a(FP32_BYTES * kvd) if gqa else dv_rep
        if gqa:
            self.f(dk_t, dv_rep)
        if nbytes != FP32_BYTES:
            casts = [self.a(nbytes * qd), self.a(nbytes * kvd), self.a(nbytes * kvd)]
            self.f(dq, dk, dv)
            dq, dk, dv = casts
        return dq, dk, dv

    def mlp_backward(
        self,
        g_d: int,
        saved: _Saved,
        recompute: Callable[[], None] | None,
        prefix: str = "",
    ) -> int:
        """The MLP's backward given its output's gradient (released); returns its input's."""
        sh = self.sh
        nb = sh.residual
        mb = self.out_bytes(sh.mlp_in[0], nb)
        db = self.out_bytes(sh.mlp_out, mb)
        g_prod = self.linear_backward(
            g_d, db, sh.mlp_out, saved, x_grad=True, before_saved=recompute, in_bytes=mb
        )
        if sh.gated:
            g_first = self.a(mb * sh.intermediate)  # grad of up = g * act
            g_second = self.a(mb * sh.intermediate)  # grad of act = g * up
            self.f(g_prod)
            saved.release(f"{prefix}up", f"{prefix}act")
            if len(sh.mlp_in) > 1:
                acc = self.linear_backward(
                    g_first, mb, sh.mlp_in[1], saved, x_grad=True, in_bytes=nb
                )
                g_gate = self.a(mb * sh.intermediate)  # act's backward
                self.f(g_second)
                saved.release(f"{prefix}gate")
                return self.linear_backward(
                    g_gate, mb, sh.mlp_in[0], saved, x_grad=True, acc=acc, in_bytes=nb
                )
            g_gate = self.a(mb * sh.intermediate)
            self.f(g_second)
            saved.release(f"{prefix}gate")
            joined = self.a(mb * 2 * sh.intermediate)  # the fused gate_up's gradient
            self.f(g_first, g_gate)
            return self.linear_backward(joined, mb, sh.mlp_in[0], saved, x_grad=True, in_bytes=nb)
        g_fc1 = self.a(mb * sh.intermediate)
        self.f(g_prod)
        saved.release(f"{prefix}act", f"{prefix}gate")
        return self.linear_backward(g_fc1, mb, sh.mlp_in[0], saved, x_grad=True, in_bytes=nb)

    def moe_backward(self, g: int, saved: _Saved) -> int:
        """The MoE block's backward (g released): the shared expert and its gate, then the
        routed experts in reverse, the router; returns the input's gradient."""
        sh = self.sh
        nb = sh.residual
        k, h, ie = sh.top_k, sh.hidden, sh.expert_intermediate
        gx = 0
        if sh.intermediate:
            g_shared = self.a(nb * h)  # g * sigmoid
            self.f(self.a(nb * h))  # g * shared out, summed into the gate's gradient
            saved.release("shared.sigmoid", "shared.out")
            if sh.shared_gate is not None:
                gx = self.linear_backward(self.a(nb), nb, sh.shared_gate, saved, x_grad=True)
            gs = self.mlp_backward(g_shared, saved, None, "shared.")
            if gx:
                total = self.a(nb * h)
                self.f(gx, gs)
                gx = total
            else:
                gx = gs
        expanded = self.a(nb * h * k)  # the scatter's backward: gather the gradient per slot
        zeros = self.a(nb * h * k)
        g_slots = self.a(nb * h * k)
        self.f(zeros, expanded, g)
        g_down = self.a(nb * h * k)  # * routing weights
        g_weights = self.a(nb * h * k)
        self.f(g_weights, g_slots)
        saved.release("moe.down", "moe.routing")
        if sh.experts_trainable:
            self.grad(sh.expert_down_bytes)
        g_product = self.a(nb * ie * k)
        self.gemm()
        self.f(g_down)
        g_act = self.a(nb * ie * k)
        g_up = self.a(nb * ie * k)
        self.f(g_product)
        saved.release("moe.product")
        g_gate = self.a(nb * ie * k)
        self.f(g_act)
        saved.release("moe.act")
        g_gate_up = self.a(nb * 2 * ie * k)
        self.f(g_gate, g_up)
        saved.release("moe.gate_up")
        if sh.experts_trainable:
            self.grad(sh.expert_gate_up_bytes)
        g_gathered = self.a(nb * h * k)
        self.f(g_gate_up)
        saved.release("moe.gathered")
        g_routed = self.a(nb * h)
        self.f(g_gathered)
        saved.release("moe.order", "moe.index", "moe.probs")
        g_router = self.a(nb * h)  # through the router's logits
        total = self.a(nb * h)
        self.f(g_routed, g_router)
        if gx:
            both = self.a(nb * h)
            self.f(total, gx)
            total = both
        return total

    def layer_backward(
        self, g_out: int, saved: _Saved, *, x_grad: bool, recompute: Callable[[], None] | None
    ) -> int:
        """One layer's backward given its output's gradient; returns its input's gradient
        (0 when it takes none). `recompute` runs the layer's forward again first (under
        checkpointing, when the first saved tensor is needed)."""
        sh = self.sh
        nb = sh.residual
        qb = self.out_bytes(sh.qkv[0], nb)
        db = self.out_bytes(sh.mlp_out, self.out_bytes(sh.mlp_in[0], nb))
        # the residual add's gradient, cast to the MLP output's dtype where narrower
        narrower = db != nb and not sh.sandwich_norms and not sh.experts
        g_d = self.a(db * sh.hidden) if narrower else self.p.hold(g_out)
        if sh.sandwich_norms:
            if recompute is not None:
                recompute()
                recompute = None
            g_d = self.norm_backward(g_d, saved, "norm4")
        if sh.experts:
            if recompute is not None:
                recompute()
            gx = self.moe_backward(g_d, saved)
        else:
            gx = self.mlp_backward(g_d, saved, recompute)
        if nb == FP32_BYTES:  # the residual's gradient is added inside the norm's backward
            g_r1 = self.norm_backward(gx, saved, "norm2", residual=g_out)
        else:
            g_n2 = self.norm_backward(gx, saved, "norm2")
            g_r1 = self.a(nb * sh.hidden)
            self.f(g_out, g_n2)
        ab = HALF_BYTES if sh.autocast else qb  # the attention output's dtype
        ob = self.out_bytes(sh.out_proj, ab)
        # the residual add's gradient, cast to the narrower o_proj output's dtype
        g_o = self.p.hold(g_r1) if ob == nb or sh.sandwich_norms else self.a(ob * sh.hidden)
        if sh.sandwich_norms:
            g_o = self.norm_backward(g_o, saved, "norm3")
        g_attn = self.linear_backward(g_o, ob, sh.out_proj, saved, x_grad=True, in_bytes=ab)
        rb = max(qb, nb)  # RoPE's products' dtype, as in the forward
        dq, dk, dv = self.attention_backward(g_attn, rb, saved, v_bytes=qb)
        qd = sh.heads * sh.head_dim
        kvd = sh.kv_heads * sh.head_dim
        gk = self.rope_backward(dk, kvd, qb, rb)
        gq = self.rope_backward(dq, qd, qb, rb)
        if len(sh.qkv) == 1:
            joined = self.a(qb * (qd + 2 * kvd))
            self.f(gq, gk, dv)
            gx = self.linear_backward(joined, qb, sh.qkv[0], saved, x_grad=x_grad, in_bytes=nb)
        else:
            if sh.kernel is Kernel.EAGER:
                # eager's value gradient comes out of the bmm in (batch, heads, seq, dim)
                # order: the view's backward copies it to the projection's layout
                contiguous = self.a(qb * sh.qkv[2].d_out)
                self.f(dv)
                dv = contiguous
            gx = self.linear_backward(dv, qb, sh.qkv[2], saved, x_grad=x_grad, in_bytes=nb)
            for g, lin in ((gk, sh.qkv[1]), (gq, sh.qkv[0])):
                contiguous = self.a(qb * lin.d_out)
                self.f(g)
                gx = self.linear_backward(
                    contiguous, qb, lin, saved, x_grad=x_grad, acc=gx, in_bytes=nb
                )
        if not x_grad:
            self.f(g_r1)
            saved.release_all()
            return 0
        if nb == FP32_BYTES:
            g_in = self.norm_backward(gx, saved, "norm1", residual=g_r1)
        else:
            g_n1 = self.norm_backward(gx, saved, "norm1")
            g_in = self.a(nb * sh.hidden)
            self.f(g_r1, g_n1)
        saved.release_all()
        return g_in

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> None:
        """One optimizer step: `accumulation` micro-batches, their gradients added up in
        .grad (the first creates it; later ones are added in place and freed), then the
        optimizer."""
        self.accumulated = False
        for _ in range(self.sh.accumulation):
            self._micro_batch()
            self.accumulated = True
        self.optimizer()

    def _micro_batch(self) -> None:
        sh = self.sh
        h = sh.hidden
        self.handle = "forward"
        embed = self.a(sh.residual * h)
        if sh.embed_scale:
            scaled = self.a(sh.residual * h)
            self.f(embed)
            embed = scaled
        mask_bytes = sh.batch * sh.seq * sh.seq * sh.mask_bytes
        bools = sh.batch * sh.seq * sh.seq
        masks = []
        for index in range(sh.masks if sh.window_mask else 0):
            if sh.mask_bytes != 1:
                # eager's additive mask (masking_utils eager_mask): the boolean one (the causal
                # comparison; a sliding one's window comparison and its ands too), then where
                boolean = self.p.alloc(bools)
                if index:
                    window = boolean
                    first = self.p.alloc(bools)
                    self.f(window)
                    causal = self.p.alloc(bools)
                    boolean = self.p.alloc(bools)
                    self.f(causal, first)
                masks.append(self.p.alloc(mask_bytes))
                self.f(boolean)
            else:
                # transformers' boolean sliding-window mask (masking_utils sdpa_mask): the
                # window's comparison, its and with the padding term, the causal comparison and
                # the final and
                window = self.p.alloc(mask_bytes)
                first = self.p.alloc(mask_bytes)
                self.f(window)
                causal = self.p.alloc(mask_bytes)
                masks.append(self.p.alloc(mask_bytes))
                self.f(causal, first)
        layers: list[_Saved] = []
        checkpoints: list[int] = []
        x = self.p.hold(embed)
        for index in range(sh.layers):
            self._input_grad = index > 0 or sh.input_grad
            if sh.checkpointing:
                checkpoints.append(self.p.hold(x))
                out = self.layer(x, None)
            else:
                saved = _Saved(self.p)
                out = self.layer(x, saved)
                layers.append(saved)
            self.f(x)
            x = out
        self._input_grad = True
        final = _Saved(self.p)
        fn = self.norm(x, final, "final")
        self.f(x, embed)
        if not sh.checkpointing:
            self.f(*masks)
        logits, logp = self.loss_forward(fn)
        self.end_region()  # the forward's autocast region exits
        self.handle = "backward"
        g = self.loss_backward(logits, logp, fn, final)
        for index in reversed(range(sh.layers)):
            self._input_grad = index > 0 or sh.input_grad
            x_grad = self._input_grad
            if sh.checkpointing:
                saved = _Saved(self.p)
                checkpoint = checkpoints[index]

                def recompute(saved: _Saved = saved, checkpoint: int = checkpoint) -> None:
                    self._recompute(checkpoint, saved)

                g = self.layer_backward(g, saved, x_grad=x_grad, recompute=recompute)
                self.f(checkpoint)
            else:
                g = self.layer_backward(g, layers[index], x_grad=x_grad, recompute=None)
        if g:
            if sh.embed_trainable and sh.tied and (self.grads or self.accumulated):
                # The tied weight's LM-head gradient waits in AccumulateGrad's input buffer (or
                # in .grad): the embedding's is added out of place (old, new and their sum
                # coexist).
                new = self.p.alloc(sh.vocab * h * sh.residual)
                self.f(g)
                total = self.p.alloc(sh.vocab * h * sh.residual)
                if self.accumulated:
                    self.f(self.head_grad, new, total)  # then added into .grad in place
                else:
                    self.f(self.grads.pop(0), new)
                    self.grads.append(total)
            elif sh.embed_trainable:
                self.grad(sh.vocab * h * sh.residual)
                self.f(g)
            else:
                self.f(g)
        if sh.checkpointing:
            self.f(*masks)

    def _recompute(self, checkpoint: int, saved: _Saved) -> None:
        """Run the layer again with autograd until its last saved tensor exists (non-reentrant
        checkpointing stops there), then drop everything it made that nothing saved."""
        down = self.sh.mlp_out
        self.stop_at = down.name if (down.adapted or down.trainable) else None
        live_before = set(self.p.refs)
        try:
            self.f(self.layer(checkpoint, saved))
            self.end_region()  # the recomputation's own autocast region
        except _Stop:
            # What the unwound forward held goes; what the saved slots hold stays.
            held: dict[int, int] = {}
            for key in saved.slots.values():
                held[key] = held.get(key, 0) + 1
            refs = self.p.refs
            for key in [k for k in refs if k not in live_before]:
                while refs.get(key, 0) > held.get(key, 0):
                    self.p.free(key)
            self.region.clear()
        finally:
            self.stop_at = None

    def loss_forward(self, fn: int) -> tuple[int, int]:
        sh = self.sh
        v = sh.vocab
        if not sh.loss_materialised:
            self.f(fn) if not sh.head_trainable else None
            return 0, 0
        x_half = 0
        if sh.autocast:
            # F.linear under autocast: the head's half weight copy (kept for the backward) and
            # the input's half copy (kept only when the head trains)
            self.head_copy = self.p.alloc(sh.head_weight_copy)
            x_half = self.a(HALF_BYTES * sh.hidden) if sh.residual != HALF_BYTES else 0
        logits = self.a(sh.head_bytes * v)
        self.gemm()
        if not sh.head_trainable:
            self.f(x_half)
        self.softcap_tanh = 0
        if sh.final_softcap:  # logits / cap, tanh (kept for backward), * cap
            divided = self.a(sh.head_bytes * v)
            self.f(logits)
            self.softcap_tanh = self.a(sh.head_bytes * v)
            self.f(divided)
            logits = self.a(sh.head_bytes * v)
        upcast = self.a(FP32_BYTES * v) if sh.loss_upcast and sh.head_bytes != FP32_BYTES else 0
        logp = self.a((FP32_BYTES if sh.loss_upcast else sh.head_bytes) * v)
        self.f(upcast)
        if not sh.head_trainable:
            self.f(fn)
        self.f(logits)  # the outputs object is dropped once `.loss` is read
        return logits, logp

    def loss_backward(self, logits: int, logp: int, fn: int, final: _Saved) -> int:
        sh = self.sh
        v = sh.vocab
        g = 0
        if sh.loss_materialised:
            lb = FP32_BYTES if sh.loss_upcast else sh.head_bytes
            g1 = self.a(lb * v)
            g2 = self.a(lb * v)
            self.f(g1, logp)
            g = g2
            if lb != sh.head_bytes:
                g = self.a(sh.head_bytes * v)
                self.f(g2)
            if sh.final_softcap:  # * cap, tanh's backward, / cap
                for release in (False, True, False):
                    nxt = self.a(sh.head_bytes * v)
                    self.f(g)
                    if release:
                        self.f(self.softcap_tanh)
                    g = nxt
        weight = sh.vocab * sh.hidden
        half_weight = sh.head_trainable and sh.autocast and sh.param_bytes != HALF_BYTES
        if sh.head_trainable and not half_weight:
            self._head_gradient(weight * (sh.param_bytes if sh.autocast else sh.head_bytes))
        gh = self.a(sh.head_bytes * sh.hidden)
        self.gemm()
        half = self.p.alloc(weight * HALF_BYTES) if half_weight else 0
        self.f(g)
        if half_weight:
            # the half weight's gradient, cast to the weight's dtype into its .grad
            self._head_gradient(weight * sh.param_bytes)
            self.f(half)
        if sh.head_trainable:
            self.f(fn)
        if sh.autocast:
            self.f(self.head_copy)
            self.head_copy = 0
            if sh.residual != sh.head_bytes:  # the input cast's backward
                wide = self.a(sh.residual * sh.hidden)
                self.f(gh)
                gh = wide
        return self.norm_backward(gh, final, "final")

    def _head_gradient(self, nbytes: int) -> None:
        """The LM head's weight gradient; a tied one that a later micro-batch makes waits
        for the embedding's (AccumulateGrad's input buffer)."""
        sh = self.sh
        if self.accumulated and sh.tied and sh.embed_trainable:
            self.head_grad = self.p.alloc(nbytes)
        else:
            self.grad(nbytes)

    def optimizer(self) -> None:
        sh = self.sh
        up = sh.updater
        if sh.clip and self.grads:
            # clip_grad_norm_ (foreach): a norm per gradient, their stack, the total norm, the
            # clip coefficient and its clamp; the gradients are scaled in place.
            norms = [self.p.alloc(FP32_BYTES) for _ in self.grads]
            stacked = self.p.alloc(FP32_BYTES * len(norms))
            total = self.p.alloc(FP32_BYTES)
            self.f(stacked, *norms)
            shifted = self.p.alloc(FP32_BYTES)
            coef = self.p.alloc(FP32_BYTES)
            self.f(shifted)
            clamped = self.p.alloc(FP32_BYTES)
            self.f(coef, clamped, total)
        if up not in (Updater.STATELESS, Updater.OUTSIDE) and not self.states:
            self.states = [key for key in map(self.p.alloc, sh.states) if key]
        if up is Updater.ADAMW_FOREACH:
            self.f(*[self.p.alloc(n) for n in sh.trainable])
        elif up is Updater.ADAFACTOR:
            self.f(*[self.p.alloc(sh.largest_trainable * FP32_BYTES) for _ in range(3)])
        self.f(*reversed(self.grads))
        self.grads.clear()


def step_events(shape: StepShape, steps: int = 2) -> tuple[list[Event], list[int]]:
    """The events of `steps` training steps once the weights exist (the inputs first), and
    where in them each step ends."""
    prog = _Program()
    builder = _Step(shape, prog)
    prog.alloc(shape.tokens * INT64_BYTES)  # input_ids
    prog.alloc(shape.tokens * INT64_BYTES)  # labels
    ends = []
    for _ in range(steps):
        builder.step()
        ends.append(len(prog.events))
    return prog.events, ends
