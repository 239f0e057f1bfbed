"""PEFT's DoRA on an adapted linear (peft/tuners/lora/dora.py DoraLinearLayer, variants.py
DoraLinearVariant): its forward and backward, as the reference traces record them."""

from __future__ import annotations

from service.core.libs.bitsandbytes import nf4_absmax_bytes
from service.core.schedule.program import _Grad, _Saved, _StepBase, _Stop
from service.core.schedule.shapes import HALF_BYTES, LinearShape


class _Dora(_StepBase):
    """Appends the events of DoRA's forward and backward."""

    def _dropout(self, x: int, nbytes: int, lin: LinearShape, saved: _Saved | None) -> int:
        """PEFT's lora_dropout on an adapter's input `x` (`nbytes` per element, let go): its
        mask, saved for the backward, and the dropped copy; `x` itself without dropout."""
        if not self.sh.dropout:
            return x
        mask = self.a(lin.d_in)
        dropped = self.a(nbytes * lin.d_in)
        if saved is not None:
            saved.save(f"{lin.name}.mask", mask)
        self.f(mask, x)
        return dropped

    def _dora_base_result(self, lin: LinearShape, base: int, dropped: int, out: int) -> int:
        """DoRA's base result: with dropout F.linear(dropout(x), W) again (`dropped` bytes per
        element), else the base output less its bias (`out` bytes), or the base output."""
        if self.sh.dropout:
            self.gemm()
            return self.a(dropped * lin.d_out)
        if lin.bias:
            return self.a(out * lin.d_out)  # base_result - bias
        return self.p.hold(base)

    def _dora(
        self, x: int, nbytes: int, lin: LinearShape, saved: _Saved | None, base: int, stop: bool
    ) -> int:
        """PEFT's DoRA on a linear whose base output is `base` (peft/tuners/lora/dora.py
        DoraLinearLayer.forward, variants.py DoraLinearVariant.forward): the input cast to the
        adapters' dtype; B @ A as lora_B(lora_A(eye)); the base weight (dequantized) cast to
        that dtype; the column norm of W + scaling * BA; magnitude / norm; lora_B(lora_A(x));
        `(scale - 1) * base + scale * lora * scaling`, added to the base output and cast back.
        With dropout the base result is F.linear(dropout(x), W) again."""
        sh = self.sh
        ad = sh.adapter
        din, dout = lin.d_in, lin.d_out
        weight_elements = din * dout
        cast = self.p.hold(x) if ad == nbytes else self.a(ad * din)
        cast = self._dropout(cast, ad, lin, saved)
        # get_lora_weight: torch.eye, lora_A, lora_B; the graph keeps eye and A(eye)
        eye = self.p.alloc(ad * din * din)
        eye_a = self.p.alloc(ad * din * sh.rank)
        self.gemm()
        lora_weight = self.p.alloc(ad * weight_elements)
        if sh.checkpointing:
            # checkpointing keeps nothing for a saved tensor whose graph dies in the forward
            self.f(eye_a, eye)
            eye_a = eye = 0
        weight, norm, scale = self._dora_norm(lin, ad, ad)
        if saved is not None:
            saved.save(f"{lin.name}.cast", cast)
            saved.save(f"{lin.name}.dora_norm", norm)
        lora_a = self.a(ad * sh.rank)
        if saved is not None:
            saved.save(f"{lin.name}.lora_a", lora_a)
        lora_out = self.a(ad * dout)
        self.f(lora_a)
        base_result = self._dora_base_result(lin, base, ad, nbytes)
        if sh.dropout and saved is not None:
            saved.save(f"{lin.name}.dora_weight", weight)
        factors = (lora_weight, eye_a, eye, weight, norm)
        result = self._dora_combine(lin, saved, stop, nbytes, base_result, scale, lora_out, factors)
        # `result + dora` promotes (bitsandbytes' layer too), then the cast back
        wide_out = max(nbytes, ad)
        summed = self.a(wide_out * dout)
        self.f(result, base)
        out = summed
        if wide_out != nbytes:
            out = self.a(nbytes * dout)
            self.f(summed)
        self.f(cast)
        return out

    def _dora_autocast(
        self, x: int, nbytes: int, lin: LinearShape, saved: _Saved | None, base: int, stop: bool
    ) -> int:
        """`_dora` under autocast: lora_A and lora_B run in half precision (on a half copy of
        the eye, and of the input, which their matmuls save); B @ A is cast to the input's
        dtype for the norm; the products promote to the magnitude's dtype. PEFT's 4-bit
        layers neither cast the input to the adapters' dtype nor the result back."""
        sh = self.sh
        ad = sh.adapter
        din, dout = lin.d_in, lin.d_out
        weight_elements = din * dout
        srcb = nbytes if lin.quantized else ad
        src = self.p.hold(x) if srcb == nbytes else self.a(srcb * din)
        src = self._dropout(src, srcb, lin, saved)
        eye = self.p.alloc(ad * din * din)
        eye_half = self.p.alloc(HALF_BYTES * din * din) if ad != HALF_BYTES else self.p.hold(eye)
        eye_a = self.p.alloc(HALF_BYTES * din * sh.rank)
        self.gemm()
        if sh.checkpointing:
            self.f(eye_half)
            eye_half = 0
        lora_half = self.p.alloc(HALF_BYTES * weight_elements)
        if sh.checkpointing:
            self.f(eye_a)
            eye_a = 0
        self.f(eye)
        lora_weight = self.p.hold(lora_half)
        if srcb != HALF_BYTES:
            lora_weight = self.p.alloc(srcb * weight_elements)
            self.f(lora_half)
        self.f(lora_half)
        weight, norm, scale = self._dora_norm(lin, srcb, max(ad, srcb))
        half = self.p.hold(src) if srcb == HALF_BYTES else self.a(HALF_BYTES * din)
        if saved is not None:
            saved.save(f"{lin.name}.dora_norm", norm)
            saved.save(f"{lin.name}.cast", half)
        lora_a = self.a(HALF_BYTES * sh.rank)
        self.f(half)
        if saved is not None:
            saved.save(f"{lin.name}.lora_a", lora_a)
        lora_out = self.a(HALF_BYTES * dout)
        self.f(lora_a)
        # autocast's output dtype: half, but a 4-bit base's is its input's (_Forward.out_bytes)
        out_b = max(nbytes, HALF_BYTES) if lin.quantized else HALF_BYTES
        base_result = self._dora_base_result(lin, base, HALF_BYTES, out_b)
        factors = (lora_weight, eye_a, eye_half, weight, norm)
        result = self._dora_combine(lin, saved, stop, out_b, base_result, scale, lora_out, factors)
        wide_out = max(out_b, ad)
        out = self.a(wide_out * dout)
        self.f(result, base)
        if wide_out != out_b and not lin.quantized:
            narrow = self.a(out_b * dout)
            self.f(out)
            out = narrow
        self.f(src)
        return out

    def _dora_norm(self, lin: LinearShape, nbytes: int, scale_bytes: int) -> tuple[int, int, int]:
        """The base weight (`_dora_weight`, in `nbytes`), then get_weight_norm: weight +
        scaling * lora_weight, its norm over the input features; then magnitude / weight_norm
        (in `scale_bytes`). Returns the weight, the norm and the scale."""
        elements = lin.d_in * lin.d_out
        weight = self._dora_weight(lin, nbytes)
        scaled_w = self.p.alloc(nbytes * elements)
        combined = self.p.alloc(nbytes * elements)
        self.f(scaled_w)
        norm = self.p.alloc(nbytes * lin.d_out)
        self.f(combined)
        scale = self.p.alloc(scale_bytes * lin.d_out)
        return weight, norm, scale

    def _dora_weight(self, lin: LinearShape, nbytes: int) -> int:
        """dequantize_module_weight (a 4-bit base's absmax rebuilt first when nested), then
        the weight's cast to `nbytes` per element: the base weight DoRA's norm reads."""
        sh = self.sh
        elements = lin.d_in * lin.d_out
        weight_bytes = sh.compute if lin.quantized else sh.param_bytes
        weight = 0
        if lin.quantized:
            absmax = []
            if sh.double_quant:
                blocks = nf4_absmax_bytes(elements)
                absmax = [self.p.alloc(blocks), self.p.alloc(blocks)]
            weight = self.p.alloc(weight_bytes * elements)
            self.f(*reversed(absmax))
        if weight_bytes != nbytes:
            wide = self.p.alloc(nbytes * elements)
            self.f(weight)
            weight = wide
        return weight

    def _dora_combine(
        self,
        lin: LinearShape,
        saved: _Saved | None,
        stop: bool,
        out_bytes: int,
        base_result: int,
        scale: int,
        lora_out: int,
        transients: tuple[int, int, int, int, int],
    ) -> int:
        """`(scale - 1) * base_result + scale * lora * scaling`, each product saving what its
        backward needs; then the forward's locals go. `transients`: B @ A, A(eye) and the eye
        its graph kept, the cast weight and the norm."""
        ad = self.sh.adapter
        dout = lin.d_out
        lora_weight, eye_a, eye, weight, norm = transients
        minus_one = self.p.alloc(ad * dout)
        first = self.a(max(ad, out_bytes) * dout)
        if saved is not None:
            saved.save(f"{lin.name}.dora_minus_one", minus_one)
            saved.save(f"{lin.name}.dora_base", base_result)
        else:
            self.f(minus_one)
            minus_one = 0
        second = self.a(ad * dout)
        if saved is not None:
            saved.save(f"{lin.name}.dora_scale", scale)
            saved.save(f"{lin.name}.dora_lora", lora_out)
            if stop:
                # the unwinding lets go of the product, then of B @ A's graph and the weight
                self.f(second, eye_a, eye, lora_weight, weight)
                raise _Stop
        scaled = self.a(ad * dout)
        self.f(second)
        result = self.a(ad * dout)
        self.f(first, scaled)
        # the forward's locals go: B @ A (and the eye and A(eye) its graph kept), the cast
        # weight, the norm, the scale, the adapter's output, (scale - 1), the base result
        self.f(lora_weight, eye_a, eye, weight, norm, scale, lora_out, minus_one, base_result)
        return result

    def _dora_backward(self, c: _Grad) -> tuple[int, int, int]:
        """DoRA's backward (g, in `nbytes`, released; `forward._dora`): the output cast's and
        the promoting add's, the scaling's, then each product's two gradients (its saved
        tensors released before the scale's is summed to its shape), the base result's
        gradient added to the add's and (through the subtraction) the two scale gradients
        added, lora_B and lora_A, the magnitude's gradient through the division, the input
        cast's. Returns the base branch's gradient, the adapter branch's input gradient and
        the accumulator."""
        g, nbytes, lin, saved = c.g, c.nbytes, c.lin, c.saved
        x_grad, acc, before_saved = c.x_grad, c.acc, c.before_saved
        sh = self.sh
        ad = sh.adapter
        din, dout = lin.d_in, lin.d_out
        g32 = self.a(ad * dout) if ad != nbytes else self.p.hold(g)
        self.f(g)
        g_base = self.a(nbytes * dout) if ad != nbytes else self.p.hold(g32)
        g_scaled = self.a(ad * dout)  # the scaling's backward
        if before_saved is not None:
            before_saved()
        # scale * lora: the scale's gradient (then summed to its shape) and the adapter's
        full = self.a(ad * dout)
        g_lora = self.a(ad * dout)
        saved.release(f"{lin.name}.dora_scale", f"{lin.name}.dora_lora")
        g_scale = self.p.alloc(ad * dout)
        self.f(full, g_scaled)
        # (scale - 1) * base result: the same, the base result's gradient cast to its dtype
        base_bytes = ad if sh.dropout else nbytes
        wide = max(ad, nbytes)
        full = self.a(wide * dout)
        g_result = self.a(wide * dout)
        saved.release(f"{lin.name}.dora_minus_one", f"{lin.name}.dora_base")
        g_result, g_minus = self._minus_one_grads(full, g_result, dout, wide, base_bytes)
        self.f(g32)
        gx_dropped = 0
        if sh.dropout:
            # F.linear(dropout(x), W) again: its input's gradient, through the cast weight
            gx_dropped = self.a(ad * din)
            self.gemm()
            self.f(g_result)
            saved.release(f"{lin.name}.dora_weight")
            g_scale = self._added(g_scale, g_minus, ad * dout)
        elif lin.bias:  # the subtraction of (scale - 1) runs before that of the bias
            g_scale = self._added(g_scale, g_minus, ad * dout)
            g_base = self._added(g_base, g_result, self.t * nbytes * dout)
        else:
            g_base = self._added(g_base, g_result, self.t * nbytes * dout)
            g_scale = self._added(g_scale, g_minus, ad * dout)
        self.grad(ad * dout * sh.rank)  # lora_B.weight.grad
        g_a = self.a(ad * sh.rank)
        saved.release(f"{lin.name}.lora_a")
        self.f(g_lora)
        self.grad(ad * din * sh.rank)  # lora_A.weight.grad
        gx32 = 0
        if x_grad:
            gx32 = self.a(ad * din)
        saved.release(f"{lin.name}.cast", f"{lin.name}.mask")
        self.f(g_a, gx_dropped)
        self.grad(ad * dout)  # lora_magnitude_vector's gradient: the division's backward
        self.f(g_scale)
        saved.release(f"{lin.name}.dora_norm")
        gx_lora = 0
        if x_grad:
            gx_lora = gx32
            if ad != nbytes:
                gx_lora = self.a(nbytes * din)
                self.f(gx32)
            gx_lora, acc = self._plus(acc, gx_lora, nbytes * din), 0
        return g_base, gx_lora, acc

    def _minus_one_grads(
        self, full: int, g_result: int, dout: int, wide: int, base_bytes: int
    ) -> tuple[int, int]:
        """The (scale - 1) * base result product's backward, past its full product `full`
        (released) and the base result's gradient `g_result` (in `wide`): the (scale - 1)
        factor's gradient, the base result's cast to `base_bytes`. Returns both gradients."""
        g_minus = self.p.alloc(self.sh.adapter * dout)
        self.f(full)
        if wide != base_bytes:
            narrow = self.a(base_bytes * dout)
            self.f(g_result)
            g_result = narrow
        return g_result, g_minus

    def _added(self, first: int, second: int, nbytes: int) -> int:
        """Autograd's input buffer adding a second gradient to a first: a new tensor."""
        total = self.p.alloc(nbytes)
        self.f(first, second)
        return total

    def _dora_autocast_backward(self, c: _Grad) -> tuple[int, int, int]:
        """`_dora_backward` under autocast (`forward._dora_autocast`): the products' gradients
        in the magnitude's dtype, cast to the half adapter output's and the base result's;
        lora_B's and lora_A's in half; the input's cast back through autocast's copy, the
        magnitude's gradient, then PEFT's cast (`in_bytes`)."""
        g, nbytes, lin, saved = c.g, c.nbytes, c.lin, c.saved
        x_grad, acc, before_saved, in_bytes = c.x_grad, c.acc, c.before_saved, c.in_bytes
        sh = self.sh
        ad = sh.adapter
        din, dout = lin.d_in, lin.d_out
        srcb = in_bytes if lin.quantized else ad
        wide = max(nbytes, ad)
        g_wide = self.a(wide * dout) if wide != nbytes and not lin.quantized else self.p.hold(g)
        self.f(g)
        g_base = self.a(nbytes * dout) if wide != nbytes else self.p.hold(g_wide)
        g_scaled = self.a(ad * dout)
        if before_saved is not None:
            before_saved()
        full = self.a(ad * dout)
        g_lora_wide = self.a(ad * dout)
        g_scale = self.p.alloc(ad * dout)
        self.f(full)
        g_lora = g_lora_wide
        if ad != HALF_BYTES:
            g_lora = self.a(HALF_BYTES * dout)
            self.f(g_lora_wide)
        saved.release(f"{lin.name}.dora_scale", f"{lin.name}.dora_lora")
        self.f(g_scaled)
        base_bytes = HALF_BYTES if sh.dropout else nbytes
        full = self.a(wide * dout)
        g_result = self.a(wide * dout)
        g_result, g_minus = self._minus_one_grads(full, g_result, dout, wide, base_bytes)
        saved.release(f"{lin.name}.dora_minus_one", f"{lin.name}.dora_base")
        self.f(g_wide)
        self.f(g_minus)
        if sh.dropout or g_base == g_result or wide == nbytes:
            total = self.a(nbytes * dout)
            self.f(g_base, g_result)
            g_base = total
        else:
            self.f(g_result)  # added in place into the add's gradient
        self.grad(ad * dout * sh.rank)  # lora_B.weight.grad
        g_a = self.a(HALF_BYTES * sh.rank)
        self.f(g_lora)
        saved.release(f"{lin.name}.lora_a")
        self.grad(ad * din * sh.rank)  # lora_A.weight.grad
        gx_lora = 0
        if x_grad:
            gx = self.a(HALF_BYTES * din)
            self.f(g_a)
            saved.release(f"{lin.name}.cast", f"{lin.name}.mask")
            if srcb != HALF_BYTES:
                nxt = self.a(srcb * din)
                self.f(gx)
                gx = nxt
        else:
            self.f(g_a)
            saved.release(f"{lin.name}.cast", f"{lin.name}.mask")
        self.grad(ad * dout)  # lora_magnitude_vector's gradient: the division's backward
        self.f(g_scale)
        saved.release(f"{lin.name}.dora_norm")
        if x_grad:
            if srcb != in_bytes:
                nxt = self.a(in_bytes * din)
                self.f(gx)
                gx = nxt
            gx_lora = gx
            gx_lora, acc = self._plus(acc, gx_lora, in_bytes * din), 0
        return g_base, gx_lora, acc
