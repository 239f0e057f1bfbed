"""Each module's backward: the gradients it allocates and what it frees."""

from __future__ import annotations

from collections.abc import Callable

from service.core.libs.bitsandbytes import nf4_absmax_bytes
from service.core.liger import REFERENCE_SM_COUNT
from service.core.schedule.forward import _Forward
from service.core.schedule.program import _Grad, _Saved
from service.core.schedule.shapes import HALF_BYTES, Kernel, LinearShape
from service.core.units import FP32_BYTES


class _Backward(_Forward):
    """Appends the events of each module's backward."""

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
        call = _Grad(g, nbytes, lin, saved, x_grad, acc, before_saved, in_bytes or nbytes)
        return self._linear_backward(call)

    def _linear_backward(self, c: _Grad) -> int:
        """`linear_backward`'s arguments as one call, the input's bytes resolved."""
        sh = self.sh
        g, nbytes, lin, saved, x_grad = c.g, c.nbytes, c.lin, c.saved, c.x_grad
        acc, before_saved, in_bytes = c.acc, c.before_saved, c.in_bytes
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
        if lin.scales_input or lin.scales_output:
            gin = self.ia3_backward(c)
            if not x_grad:
                return acc
            gin = self._plus(acc, gin, in_bytes * lin.d_in)
            return gin
        if lin.adapted and sh.oft:
            return self._oft_backward(c)
        g_base, gx_lora = g, 0
        if lin.adapted and sh.autocast:
            adapter_backward = (
                self._dora_autocast_backward if sh.dora else self._lora_autocast_backward
            )
            g_base, gx_lora, acc = adapter_backward(c)
        elif lin.adapted:
            g_base, gx_lora, acc = ADAPTER_BACKWARDS[sh.peft_method](self, c)
        elif before_saved is not None:
            before_saved()
        return self._base_backward(g_base, gx_lora, acc, nbytes, lin, saved, x_grad, in_bytes)

    def _base_backward(
        self,
        g_base: int,
        gx_lora: int,
        acc: int,
        nbytes: int,
        lin: LinearShape,
        saved: _Saved,
        x_grad: bool,
        in_bytes: int,
    ) -> int:
        """The base linear's backward from its branch's gradient `g_base` (released here):
        the weight's gradient when it trains, the input's, summed with the adapter branch's
        `gx_lora` and `acc`."""
        if lin.trainable:
            self.grad(lin.weight_bytes)
        gin = 0
        if x_grad:
            if lin.quantized:
                gin = self._grad_4bit(g_base, nbytes, lin)
            elif lin.int8:
                gin = self._grad_8bit(nbytes, lin)
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
            gin = self._plus(other, gin, in_bytes * lin.d_in)
        return gin

    def _lora_backward(self, c: _Grad) -> tuple[int, int, int]:
        """LoRA's adapter backward (g, in `nbytes`, released): the output cast's backward (g
        in the adapters' dtype; autograd lets go of g), then the promoting add's (g cast back
        for the base branch), the scaling's, lora_B's and lora_A's. Returns the base branch's
        gradient, the adapter branch's input gradient and the accumulator."""
        g, nbytes, lin, saved = c.g, c.nbytes, c.lin, c.saved
        x_grad, acc, before_saved = c.x_grad, c.acc, c.before_saved
        sh = self.sh
        ad = sh.adapter
        gx_lora = 0
        g32 = self.a(ad * lin.d_out) if ad != nbytes else self.p.hold(g)
        self.f(g)
        g_base = self.a(nbytes * lin.d_out) if ad != nbytes else self.p.hold(g32)
        scaled = self.a(ad * lin.d_out)
        self.f(g32)
        if before_saved is not None:
            before_saved()
        self.grad(ad * lin.d_out * sh.rank)  # lora_B.weight.grad
        # a frozen lora_A (LoRA-FA) takes no gradient: its backward runs only for x's
        g_a = self.a(ad * sh.rank) if x_grad or not sh.frozen_a else 0
        self.f(scaled)
        saved.release(f"{lin.name}.lora_a")
        if not sh.frozen_a:
            self.grad(ad * lin.d_in * sh.rank)  # lora_A.weight.grad
        if x_grad:
            gx32 = self.a(ad * lin.d_in)
            self.f(g_a)
            saved.release(f"{lin.name}.cast", f"{lin.name}.mask")
            gx_lora = gx32
            if ad != nbytes:
                gx_lora = self.a(nbytes * lin.d_in)
                self.f(gx32)
            gx_lora, acc = self._plus(acc, gx_lora, nbytes * lin.d_in), 0
        else:
            self.f(g_a)
            saved.release(f"{lin.name}.cast", f"{lin.name}.mask")
        return g_base, gx_lora, acc

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
        elif self.accumulated and sh.grads_kept:
            self.f(half_grad)  # added into the .grad the last step's zero_grad kept
        else:
            self.grads.append(half_grad)
        if x_grad and in_bytes != HALF_BYTES:
            wide = self.a(in_bytes * lin.d_in)
            self.f(gin)
            gin = wide
        if not x_grad:
            return acc
        gin = self._plus(acc, gin, in_bytes * lin.d_in)
        return gin

    def _lora_autocast_backward(self, c: _Grad) -> tuple[int, int, int]:
        """The adapter's backward under autocast (g, in `nbytes`, released): the add's gradient
        cast to half for the adapter branch when the result is wider, the scaling's, lora_B's
        and lora_A's in half, the casts' backwards back to the input's dtype (`in_bytes`).
        Returns the base branch's gradient, the adapter branch's input gradient and the
        accumulator."""
        g, nbytes, lin, saved = c.g, c.nbytes, c.lin, c.saved
        x_grad, acc, before_saved, in_bytes = c.x_grad, c.acc, c.before_saved, c.in_bytes
        sh = self.sh
        ad = sh.adapter
        srcb = in_bytes if lin.bnb else ad
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
            gx_lora, acc = self._plus(acc, gx_lora, in_bytes * lin.d_in), 0
        else:
            self.f(g_a)
            saved.release(f"{lin.name}.cast", f"{lin.name}.mask")
        return g_base, gx_lora, acc

    def _grad_8bit(self, nbytes: int, lin: LinearShape) -> int:
        """MatMul8bitLt.backward's input gradient: the int8 weight copied to the input's dtype
        and scaled in place by SCB / 127 (a per-row temporary), then one matmul."""
        weight = self.p.alloc(lin.d_in * lin.d_out * nbytes)
        scale = self.p.alloc(lin.d_out * FP32_BYTES)
        self.f(scale)
        out = self.a(nbytes * lin.d_in)
        self.gemm()
        self.f(weight)
        return out

    def _grad_4bit(self, g: int, nbytes: int, lin: LinearShape) -> int:
        sh = self.sh
        compute = sh.compute
        cast = self.a(compute * lin.d_out) if nbytes != compute else 0
        elements = lin.d_in * lin.d_out
        absmax = self.p.alloc(nf4_absmax_bytes(elements)) if sh.double_quant else 0
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

    def norm_backward(
        self,
        g: int,
        saved: _Saved,
        name: str,
        residual: int = 0,
        *,
        width: int = 0,
        nbytes: int = 0,
        weight: int = 0,
    ) -> int:
        """RMSNorm's backward (g released here); returns the input's gradient. In fp32 no
        cast ends it: the first product's gradient reaches the input's buffer directly and
        is added to the `residual` branch's gradient waiting there (released), the second's
        then to that sum, which is returned. `width` features in `nbytes` and a `weight` of
        that many elements (by default the residual stream's)."""
        sh = self.sh
        h = width or sh.hidden
        r = nbytes or sh.residual
        if sh.liger:
            # LigerRMSNormFunction.backward: dX is written into dY's storage (in_place) or into
            # a zeros_like of it; the weight's gradient is reduced from an fp32 (sm_count,
            # hidden) buffer of partials (liger_kernel/ops/rms_norm.py rms_norm_backward)
            dx = g if sh.liger_norm_in_place else self.a(r * h)
            self.f(self.p.alloc(REFERENCE_SM_COUNT * h * FP32_BYTES))
            if self.norm_trains(name):
                self.grad((weight or h) * r)
            saved.release(f"{name}.x")
            if dx != g:
                self.f(g)
            return dx
        g1 = self.a((FP32_BYTES if sh.gemma_norm else r) * h)  # grad * weight (or its cast)
        if self.norm_trains(name):
            self.f(self.a(r * h))  # grad * normed, summed into the weight's gradient
            self.grad((weight or h) * r)
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
            keys = sh.batch * (sh.seq + sh.prefix_tokens)  # prefix tuning's in front
            dq = self.a(nbytes * qd)
            dk, dv = self.p.alloc(keys * nbytes * qd), self.p.alloc(keys * nbytes * qd)
            self.f(g)
            saved.release("k", "q", "v", "lse", "out", "bias")
            if gqa:
                sk = self.p.alloc(keys * nbytes * kvd)
                self.f(dv)
                sv = self.p.alloc(keys * nbytes * kvd)
                self.f(dk)
                dk, dv = sv, sk
            if sh.prefix_tokens:  # the prefix's views keep them to the layers' end
                self.prefix_grads += [self.p.hold(dk), self.p.hold(dv)]
            return dq, dk, dv
        if kernel is Kernel.MATH:
            return self._math_backward(g, nbytes, saved)
        if sh.half_softmax:
            return self._falcon_eager_backward(g, nbytes, saved)
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
        if sh.gated and sh.liger:
            # LigerSiLUMulFunction.backward writes the gate's and up's gradients into their
            # saved outputs and returns those storages (liger_kernel/ops/swiglu.py)
            g_up = self.p.hold(saved.slots[f"{prefix}up"])
            g_gate = self.p.hold(saved.slots[f"{prefix}gate"])
            saved.release(f"{prefix}up", f"{prefix}gate")
            self.f(g_prod)
            acc = self.linear_backward(g_up, mb, sh.mlp_in[1], saved, x_grad=True, in_bytes=nb)
            return self.linear_backward(
                g_gate, mb, sh.mlp_in[0], saved, x_grad=True, acc=acc, in_bytes=nb
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
        # a MoE without a shared expert has no dense MLP: its output keeps the residual's dtype
        db = self.out_bytes(sh.mlp_out, self.out_bytes(sh.mlp_in[0], nb)) if sh.mlp_in else nb
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
        if nb == FP32_BYTES and not sh.liger:
            # the residual's gradient is added inside the norm's backward
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
        if sh.alibi:
            joined = self._alibi_attention_backward(g_attn, qb, saved)
            gx = self.linear_backward(joined, qb, sh.qkv[0], saved, x_grad=x_grad, in_bytes=nb)
            return self._input_gradient(gx, g_r1, saved, x_grad=x_grad)
        rb = max(qb, nb)  # RoPE's products' dtype, as in the forward
        dq, dk, dv = self.attention_backward(g_attn, rb, saved, v_bytes=qb)
        qd = sh.heads * sh.head_dim
        kvd = sh.kv_heads * sh.head_dim
        if sh.liger:  # LigerRopeFunction.backward rotates dq and dk in place
            gk, gq = dk, dq
        else:
            gk = self.rope_backward(dk, kvd, qb, rb)
            gq = self.rope_backward(dq, qd, qb, rb)
        if sh.qk_norm and len(sh.qkv) > 1:
            d = sh.head_dim
            gk = self.norm_backward(gk, saved, "k_norm", width=kvd, nbytes=qb, weight=d)
            gq = self.norm_backward(gq, saved, "q_norm", width=qd, nbytes=qb, weight=d)
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
                # the rotated gradient back to the projection's layout: a copy, except from
                # Liger's RoPE, which leaves it in that layout
                contiguous = self.p.hold(g) if sh.liger else self.a(qb * lin.d_out)
                self.f(g)
                gx = self.linear_backward(
                    contiguous, qb, lin, saved, x_grad=x_grad, acc=gx, in_bytes=nb
                )
        return self._input_gradient(gx, g_r1, saved, x_grad=x_grad)

    def _alibi_attention_backward(self, g: int, nbytes: int, saved: _Saved) -> int:
        """BloomAttention's backward (g, the merged output's gradient, released): the
        gradient made contiguous for the bmm, v's and the probabilities' gradients, the casts'
        and softmax's backwards (fp32), baddbmm's two bmm products scaled by alpha, then q, k
        and v's gradients put back into the fused layout one select at a time and summed.
        Returns the fused projection's output gradient."""
        sh = self.sh
        qd = sh.heads * sh.head_dim
        scores = sh.heads * sh.seq
        g_c = self.a(nbytes * qd)
        self.f(g)
        dv = self.a(nbytes * qd)
        self.gemm()
        dprobs = self.a(nbytes * scores)
        saved.release("probs")
        self.f(g_c)
        saved.release("v")
        d32 = self.a(FP32_BYTES * scores) if nbytes != FP32_BYTES else self.p.hold(dprobs)
        self.f(dprobs)
        dsm = self.a(FP32_BYTES * scores)
        self.f(d32)
        saved.release("probs32")
        ds = self.a(nbytes * scores) if nbytes != FP32_BYTES else self.p.hold(dsm)
        self.f(dsm)
        grads = []
        for _ in range(2):  # q's and k's: a bmm, then * alpha
            raw = self.a(nbytes * qd)
            grads.append(self.a(nbytes * qd))
            self.f(raw)
        saved.release("q_copy", "k_copy")
        self.f(ds)
        total = 0
        for grad in (*grads, dv):  # select_backward into (b, s, heads, 3, d), summed
            spread = self.a(nbytes * 3 * qd)
            self.f(grad)
            if total:
                summed = self.a(nbytes * 3 * qd)
                self.f(total, spread)
                spread = summed
            total = spread
        return total

    def _input_gradient(self, gx: int, g_r1: int, saved: _Saved, *, x_grad: bool) -> int:
        """A layer's input gradient: the first norm's backward added to the residual's (none
        when the layer's input takes no gradient); the layer's saved tensors are let go."""
        sh = self.sh
        nb = sh.residual
        if not x_grad:
            self.f(g_r1)
            saved.release_all()
            return 0
        if nb == FP32_BYTES and not sh.liger:
            g_in = self.norm_backward(gx, saved, "norm1", residual=g_r1)
        else:
            g_n1 = self.norm_backward(gx, saved, "norm1")
            g_in = self.a(nb * sh.hidden)
            self.f(g_r1, g_n1)
        saved.release_all()
        return g_in

    def _falcon_eager_backward(self, g: int, nbytes: int, saved: _Saved) -> tuple[int, int, int]:
        """FalconAttention's eager backward (g released): v's gradient at every head, then
        summed to the key/value heads; the probabilities' gradient, softmax's backward in the
        model's dtype, the in-place scaling's (a new tensor); q's and k's gradients, k's
        summed to its heads."""
        sh = self.sh
        qd = sh.heads * sh.head_dim
        kvd = sh.kv_heads * sh.head_dim
        scores = sh.heads * sh.seq
        gqa = sh.heads > sh.kv_heads
        dv_rep = self.a(nbytes * qd)
        self.gemm()
        dprobs = self.a(nbytes * scores)
        saved.release("v")
        self.f(g)
        dv = dv_rep
        if gqa:
            dv = self.a(nbytes * kvd)
            self.f(dv_rep)
        ds = self.a(nbytes * scores)
        self.f(dprobs)
        saved.release("probs")
        scaled = self.a(nbytes * scores)
        self.f(ds)
        dq = self.a(nbytes * qd)
        dk = self.a(nbytes * qd)
        saved.release("q", "k")
        self.f(scaled)
        if gqa:
            summed = self.a(nbytes * kvd)
            self.f(dk)
            dk = summed
        return dq, dk, dv


# Each PEFT method's adapter backward on an adapted linear (`StepShape.peft_method`; OFT's and
# those under autocast are taken before it): the base branch's gradient, the adapter branch's
# input gradient and the accumulator.
ADAPTER_BACKWARDS: dict[str, Callable[[_Backward, _Grad], tuple[int, int, int]]] = {
    "loha": _Backward._delta_backward,
    "lokr": _Backward._delta_backward,
    "adalora": _Backward._adalora_backward,
    "vera": _Backward._vera_backward,
    "dora": _Backward._dora_backward,
    "lora": _Backward._lora_backward,
}
