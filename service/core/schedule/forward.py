"""Each module's forward: the tensors it allocates, saves and frees."""

from __future__ import annotations

from service.core.libs.bitsandbytes import nf4_absmax_bytes, uses_dequant_fallback
from service.core.schedule.ia3 import _IA3
from service.core.schedule.oft import _Oft
from service.core.schedule.prefix import _Prefix
from service.core.schedule.program import _Saved, _Stop
from service.core.schedule.shapes import HALF_BYTES, Kernel, LinearShape
from service.core.units import BOOL_BYTES, FP32_BYTES, INT8_BYTES, INT32_BYTES, INT64_BYTES


class _Forward(_IA3, _Oft, _Prefix):
    """Appends the events of each module's forward."""

    # -- forward ----------------------------------------------------------------------------

    def norm(self, x: int, saved: _Saved | None, name: str, width: int = 0, nbytes: int = 0) -> int:
        """RMSNorm (LlamaRMSNorm): x.float(), pow(2).mean, x * rsqrt, .to(dtype), weight *;
        over `width` features in `nbytes` (by default the residual stream's)."""
        sh = self.sh
        h = width or sh.hidden
        nb = nbytes or sh.residual
        if sh.liger:
            # LigerRMSNormFunction: Y = empty_like(X), one fp32 rstd per row (a per-token
            # scalar, left out); X itself is saved (liger_kernel/ops/rms_norm.py)
            out = self.a(nb * h)
            if saved is not None:
                saved.save(f"{name}.x", x)
            return out
        fp32 = nb == FP32_BYTES
        x32 = x if fp32 else self.a(FP32_BYTES * h)
        self.f(self.a(FP32_BYTES * h))  # pow
        normed = self.a(FP32_BYTES * h)
        if saved is not None:
            saved.save(f"{name}.x", x32)
        if not fp32:
            self.f(x32)
        if fp32:
            out = self.a(FP32_BYTES * h)
            if saved is not None and self.norm_trains(name):
                saved.save(f"{name}.normed", normed)
            self.f(normed)
            return out
        if sh.gemma_norm:
            # Gemma2RMSNorm: output * (1 + weight.float()), then type_as(x).
            scaled = self.a(FP32_BYTES * h)
            if saved is not None and self.norm_trains(name):
                saved.save(f"{name}.normed", normed)
            self.f(normed)
            out = self.a(nb * h)
            self.f(scaled)
            return out
        cast = self.a(nb * h)
        out = self.a(nb * h)
        if saved is not None and self.norm_trains(name):
            saved.save(f"{name}.normed", cast)
        self.f(cast, normed)
        return out

    def out_bytes(self, lin: LinearShape, nbytes: int) -> int:
        """The dtype of `lin`'s output for an input of `nbytes`: half under autocast, but a
        4-bit base casts its output back to its input's dtype (bitsandbytes Linear4bit)."""
        if not self.sh.autocast:
            return nbytes
        return max(nbytes, HALF_BYTES) if lin.bnb else HALF_BYTES

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
        if lin.scales_input or lin.scales_output:
            return self.ia3_forward(x, nbytes, lin, saved)
        if lin.adapted and sh.oft:
            return self._oft(x, nbytes, lin, saved, stop)
        if lin.quantized:
            base = self._linear_4bit(x, nbytes, lin)
        elif lin.int8:
            base = self._linear_8bit(x, nbytes, lin, saved)
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
        if sh.vera:
            return self._vera(x, nbytes, lin, saved, base, stop)
        if sh.loha:
            return self._loha(x, nbytes, lin, saved, base, stop)
        if sh.lokr:
            return self._lokr(x, nbytes, lin, saved, base, stop)
        if sh.adalora:
            return self._adalora(x, nbytes, lin, saved, base, stop)
        if sh.autocast and sh.dora:
            return self._dora_autocast(x, nbytes, lin, saved, base, stop)
        if sh.autocast:
            return self._lora_autocast(x, nbytes, lin, saved, base, stop)
        if sh.dora:
            return self._dora(x, nbytes, lin, saved, base, stop)
        cast = self.p.hold(x) if ad == nbytes else self.a(ad * lin.d_in)
        cast = self._dropout(cast, ad, lin, saved)
        if saved is not None and not sh.frozen_a:  # a frozen lora_A keeps no input
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
        if lin.bnb:
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
        out = self.add_and_cast_back(base, scaled, lin.d_out, nbytes, ad)
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
        srcb = nbytes if lin.bnb else sh.adapter
        src = self.p.hold(x) if srcb == nbytes else self.a(srcb * lin.d_in)
        src = self._dropout(src, srcb, lin, saved)
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
            blocks = nf4_absmax_bytes(elements)
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

    def _linear_8bit(self, x: int, nbytes: int, lin: LinearShape, saved: _Saved | None) -> int:
        """bitsandbytes' LLM.int8 linear (autograd/_functions.py MatMul8bitLt.forward, frozen
        weight): the input cast to fp16 and quantized row-wise on CUDA (backends/cuda/ops.py
        int8_vectorwise_quant: `A.abs() >= threshold`, a bool mask held to the kernel's end,
        the fp32 row scales, the int8 rows), then int8_scaled_mm's default kernel: the int32
        product, int8_mm_dequant's fp16 output and its cast to the input's dtype. The node
        keeps the input itself for backward (`ctx.tensors`), which checkpointing's hooks do
        not see: without a saved slot (a checkpointed first pass) it is held to the layer's
        backward all the same. No outlier columns (service/trace/kernels.py)."""
        fp16 = nbytes == HALF_BYTES and self.sh.half_is_fp16
        half = self.p.hold(x) if fp16 else self.a(HALF_BYTES * lin.d_in)
        magnitude = self.a(HALF_BYTES * lin.d_in)
        mask = self.a(BOOL_BYTES * lin.d_in)
        self.f(magnitude)
        scales = self.a(FP32_BYTES)
        rows = self.a(INT8_BYTES * lin.d_in)
        self.f(mask, half)
        product = self.a(INT32_BYTES * lin.d_out)
        out = self.a(HALF_BYTES * lin.d_out)
        if not fp16:
            cast = self.a(nbytes * lin.d_out)
            self.f(out)
            out = cast
        self.f(product, rows, scales)
        if saved is not None:
            saved.save(f"{lin.name}.x", x)
        elif self.pinned is not None:
            self.pinned.append(self.p.hold(x))
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
            # with a mask transformers' repeat_kv expands k and v: a view from one head
            copies = gqa and not (sh.kv_heads == 1 and sh.window_mask)
            keys = sh.batch * (sh.seq + sh.prefix_tokens)  # prefix tuning's in front
            k_rep = self.p.alloc(keys * nbytes * qd) if copies else self.p.hold(k)
            v_rep = self.p.alloc(keys * nbytes * qd) if copies else self.p.hold(v)
            # A boolean mask (a window's, prefix tuning's) becomes an additive (b, 1, s, keys)
            # bias in the query's dtype on every call (attention.cpp
            # convert_boolean_attn_mask), which the kernel saves.
            masked = sh.window_mask or sh.prefix_tokens
            bias = self.p.alloc(nbytes * sh.seq * keys) if masked else 0
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
        if sh.half_softmax:
            return self._falcon_eager(q, k, v, nbytes, saved)
        # eager (transformers' eager_attention_forward): repeat_kv copies, q @ k^T (q made
        # contiguous), * scaling, (softcap), + mask, fp32 softmax, cast, probs @ v, transpose.
        # One key/value head (Gemma-3-1B) expands to the query heads as a view: the reshape
        # merges a size-one dimension, so nothing is copied.
        copies = gqa and sh.kv_heads > 1
        k_rep = self.a(nbytes * qd) if copies else self.p.hold(k)
        v_rep = self.a(nbytes * qd) if copies else self.p.hold(v)
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
        if sh.alibi:
            return self._alibi_layer(x, n1, outs[0], saved)
        qd = sh.heads * sh.head_dim
        kvd = sh.kv_heads * sh.head_dim
        if len(outs) == 1:  # one fused projection: q, k and v are its views
            q = k = v = outs[0]
        else:
            q, k, v = outs
        if sh.qk_norm and len(outs) > 1:
            # q_norm(q), k_norm(k): each projection's output rebound to its normed copy
            q = self._rebind(q, self.norm(q, saved, "q_norm", qd, qb))
            k = self._rebind(k, self.norm(k, saved, "k_norm", kvd, qb))
        rb = max(qb, nb)  # RoPE's products' dtype: q's promoted with the embeddings'
        if sh.liger:
            # LigerRopeFunction rotates q and k in their projections' storage
            q_e, k_e = self.p.hold(q), self.p.hold(k)
        else:
            q_e = self.rope(q, qd, qb, rb)
            k_e = self.rope(k, kvd, qb, rb)
        fused = len(outs) == 1
        if not fused:
            self.f(q, k)  # the projections' outputs, rebound to the rotated ones
        elif sh.kernel in (Kernel.EAGER, Kernel.MATH) and (sh.batch > 1 or sh.heads != sh.kv_heads):
            v = self.a(qb * kvd)  # the strided value view made contiguous for the matmul
        else:
            v = self.p.hold(v)  # the fused kernels take the strided view as it is
        if sh.prefix_tokens:  # prefix tuning: the cache's keys and values, longer
            attn = self.attention(q_e, *self.prefix_concat(rb), rb, saved, v_bytes=qb)
        else:
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
        if self.pending:  # what the layer returned besides its output (`_falcon_eager`)
            if self.handle == "forward":
                self.f(self.held)
                self.held = self.pending
            else:
                self.f(self.pending)
            self.pending = 0
        return out

    def _falcon_eager(self, q: int, k: int, v: int, nbytes: int, saved: _Saved | None) -> int:
        """FalconAttention's eager branch (transformers 5.24): q @ k^T (one key head folded
        as a stride-0 batch for one sequence, copied to every head for several), scaled in
        place, + mask, softmax in the model's dtype, probs @ v, heads merged (a copy). The
        probabilities are returned as the layer's attention weights (`pending`)."""
        sh = self.sh
        qd = sh.heads * sh.head_dim
        scores = sh.heads * sh.seq
        expand = sh.heads > sh.kv_heads and sh.batch > 1
        k_rep = self.a(nbytes * qd) if expand else self.p.hold(k)
        s1 = self.a(nbytes * scores)
        self.gemm()
        s2 = self.a(nbytes * scores)
        probs = self.a(nbytes * scores)
        self.f(s2, s1)
        v_rep = self.a(nbytes * qd) if expand else self.p.hold(v)
        out = self.a(nbytes * qd)
        if saved is not None:
            for name, key in (("q", q), ("k", k_rep), ("probs", probs), ("v", v_rep)):
                saved.save(name, key)
        self.f(k_rep, v_rep)
        self.pending = probs
        merged = self.a(nbytes * qd)
        self.f(out)
        return merged

    def _alibi_layer(self, x: int, n1: int, qkv: int, saved: _Saved | None) -> int:
        """The rest of a BloomBlock after its fused projection (transformers 5.24
        modeling_bloom.py): its attention, the residual add inside it, post-attention norm
        and MLP. The attention's locals (the scores and the masked scores) live until it
        returns, the probabilities until the block returns (its attention weights)."""
        sh = self.sh
        nb = sh.residual
        merged, held, probs = self._alibi_attention(self.out_bytes(sh.qkv[0], nb), saved)
        o = self.linear(merged, self.out_bytes(sh.qkv[0], nb), sh.out_proj, saved)
        r1 = self.a(nb * sh.hidden)  # dropout_add: residual + output
        self.f(o, qkv, *held, merged)
        n2 = self.norm(r1, saved, "norm2")
        self.f(n1)  # `layernorm_output` rebound
        d = self.mlp(n2, saved)
        self.f(n2)
        out = self.a(nb * sh.hidden)
        self.f(d, r1)
        del x
        if self.handle == "forward":  # the model's loop keeps the block's outputs a layer on
            self.f(self.held)
            self.held = probs
        else:  # a recomputation's outputs are dropped at once
            self.f(probs)
        return out

    def _alibi_attention(self, nbytes: int, saved: _Saved | None) -> tuple[int, list[int], int]:
        """BloomAttention.forward on the fused projection's output: q, k and v reshaped into
        contiguous copies, alibi.baddbmm(q, k^T), + mask, softmax in fp32 (an fp32 copy of
        bf16 scores first: aten's softmax upcasts only fp16 in its kernel), cast back,
        probs @ v, heads merged (a copy). Returns the merged output, the tensors the
        attention's locals hold until it returns, and the probabilities."""
        sh = self.sh
        qd = sh.heads * sh.head_dim
        scores = sh.heads * sh.seq
        q, k, v = self.a(nbytes * qd), self.a(nbytes * qd), self.a(nbytes * qd)
        s1 = self.a(nbytes * scores)
        self.gemm()
        s2 = self.a(nbytes * scores)
        up = self.a(FP32_BYTES * scores) if nbytes != FP32_BYTES else 0
        probs32 = self.a(FP32_BYTES * scores)
        self.f(up)
        probs = self.a(nbytes * scores) if nbytes != FP32_BYTES else self.p.hold(probs32)
        if saved is not None:
            for name, key in (("q_copy", q), ("k_copy", k), ("probs32", probs32)):
                saved.save(name, key)
            saved.save("probs", probs)
            saved.save("v", v)
        self.f(probs32)
        ctx = self.a(nbytes * qd)
        self.gemm()
        merged = self.a(nbytes * qd)
        self.f(ctx)
        return merged, [q, k, v, s1, s2], probs

    def _composite_gelu(
        self, x: int, mb: int, saved: _Saved | None, prefix: str
    ) -> tuple[int, int]:
        """transformers' NewGELUActivation, 0.5 * x * (1 + tanh(c * (x + 0.044715 * x**3))),
        as Python evaluates it (x released here); returns the output and its bytes per
        element. Under autocast pow runs in fp32 (CUDA's fp32 list): what follows is fp32 but
        0.5 * x."""
        sh = self.sh
        i = sh.intermediate
        wide = FP32_BYTES if sh.autocast else mb
        half_x = self.a(mb * i)
        x_pow = self.a(FP32_BYTES * i) if wide != mb else self.p.hold(x)  # pow's cast
        chain = self.a(wide * i)  # pow, then 0.044715 *, x +, c *: each frees the previous
        if saved is not None:
            saved.save(f"{prefix}gelu.x", x_pow)
        self.f(x_pow)
        for _ in range(3):
            nxt = self.a(wide * i)
            self.f(chain)
            chain = nxt
        tanh = self.a(wide * i)
        self.f(chain)
        one_plus = self.a(wide * i)
        if saved is not None:
            saved.save(f"{prefix}gelu.tanh", tanh)
        self.f(tanh)
        out = self.a(wide * i)
        if saved is not None:
            saved.save(f"{prefix}gelu.one_plus", one_plus)
            saved.save(f"{prefix}gelu.half_x", half_x)
        self.f(one_plus, half_x, x)
        return out, wide

    def _rebind(self, old: int, new: int) -> int:
        self.f(old)
        return new

    def mlp(self, n2: int, saved: _Saved | None, prefix: str = "") -> int:
        """The gated (or plain) MLP: act(gate) * up, then down."""
        sh = self.sh
        nb = sh.residual
        mb = self.out_bytes(sh.mlp_in[0], nb)  # the intermediate activations' dtype
        # down(act(gate(x)) * up(x)): Python evaluates act(gate(x)) before up(x), and without
        # autograd saving them, gate(x) dies once act returns and act and up once multiplied.
        # A fused gate_up (Phi-3) is chunked into views that keep it alive until the return.
        gate = self.linear(n2, nb, sh.mlp_in[0], saved)
        if sh.liger:
            return self._liger_mlp(n2, gate, saved, prefix)
        act = self.a(mb * sh.intermediate)  # act(gate): SiLU / GELU keeps its input
        fused = len(sh.mlp_in) == 1
        if saved is not None:
            saved.save(f"{prefix}gate", gate)
        if not sh.gated and sh.composite_gelu:
            self.f(act)
            act, wide = self._composite_gelu(gate, mb, saved, prefix)
            d = self.linear(act, wide, sh.mlp_out, saved)
            self.f(act)
            return d
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

    def _liger_mlp(self, n2: int, gate: int, saved: _Saved | None, prefix: str) -> int:
        """LigerSwiGLUMLP.forward: down(LigerSiLUMulFunction(gate(x), up(x))); the Function
        saves both projections' outputs and writes its product into an empty_like of the
        gate's (liger_kernel/ops/swiglu.py swiglu_forward)."""
        sh = self.sh
        nb = sh.residual
        mb = self.out_bytes(sh.mlp_in[0], nb)
        up = self.linear(n2, nb, sh.mlp_in[1], saved)
        if saved is not None:
            saved.save(f"{prefix}gate", gate)
            saved.save(f"{prefix}up", up)
        product = self.a(mb * sh.intermediate)
        self.f(gate, up)
        d = self.linear(product, mb, sh.mlp_out, saved)
        self.f(product)
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
