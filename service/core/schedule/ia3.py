"""PEFT's (IA)^3 on a linear (peft/tuners/ia3/layer.py Linear.forward): its forward and
backward, tensor by tensor."""

from __future__ import annotations

from service.core.schedule.dora import _Dora
from service.core.schedule.program import _Grad, _Saved
from service.core.schedule.shapes import LinearShape


class _IA3(_Dora):
    """Appends the events of (IA)^3's forward and backward. The scaling vector
    (`1 * ia3_l.flatten()`) and the vector's gradient before it lands are per-feature
    tensors, left out as the schedule leaves out every tensor that scales with neither
    tokens nor weights; the gradient itself is held like any trainable tensor's."""

    def ia3_forward(self, x: int, nbytes: int, lin: LinearShape, saved: _Saved | None) -> int:
        """The scaled linear on `x` (`nbytes` per element): a feedforward module casts its
        input to the vector's dtype (the product keeps that cast), multiplies and casts the
        product back for the base layer; any other multiplies the base output (kept) and
        casts the product back."""
        ad = self.sh.adapter
        if lin.scales_input:
            cast = self.p.hold(x) if ad == nbytes else self.a(ad * lin.d_in)
            if saved is not None:
                saved.save(f"{lin.name}.ia3_x", cast)
            product = self.a(ad * lin.d_in)
            interm = self.p.hold(product) if ad == nbytes else self.a(nbytes * lin.d_in)
            self.f(product)
            self.gemm()
            out = self.a(nbytes * lin.d_out)
            self.f(interm, cast)
            return out
        self.gemm()
        base = self.a(nbytes * lin.d_out)
        if saved is not None:
            saved.save(f"{lin.name}.ia3_base", base)
        product = self.a(ad * lin.d_out)
        out = self.p.hold(product) if ad == nbytes else self.a(nbytes * lin.d_out)
        self.f(product, base)
        return out

    def ia3_backward(self, c: _Grad) -> int:
        """(IA)^3's backward from the output's gradient `g` (released); returns the input's
        gradient (0 when the input takes none; `c.acc` is left to the caller). The products'
        two gradients come in autograd's order (MulBackward0: the first operand's, then the
        vector's, summed to its shape); the casts' backward casts the gradient between the
        dtypes."""
        g, nbytes, lin, saved, x_grad = c.g, c.nbytes, c.lin, c.saved, c.x_grad
        before_saved = c.before_saved
        ad = self.sh.adapter
        if before_saved is not None:
            before_saved()
        if lin.scales_input:
            g_interm = self.a(nbytes * lin.d_in)
            self.gemm()
            self.f(g)
            g_product = self.p.hold(g_interm) if ad == nbytes else self.a(ad * lin.d_in)
            self.f(g_interm)
            g_cast = self.a(ad * lin.d_in)
            self.f(self.a(ad * lin.d_in))  # g * cast, summed into the vector's gradient
            self.grad(ad * lin.d_in)
            saved.release(f"{lin.name}.ia3_x")
            self.f(g_product)
            gx = self.p.hold(g_cast) if ad == nbytes else self.a(nbytes * lin.d_in)
            self.f(g_cast)
            return gx
        g_product = self.p.hold(g) if ad == nbytes else self.a(ad * lin.d_out)
        self.f(g)
        g_base = 0
        if x_grad:
            # (g * scaling), cast to the base output's dtype
            wide = self.a(ad * lin.d_out)
            g_base = self.p.hold(wide) if ad == nbytes else self.a(nbytes * lin.d_out)
            self.f(wide)
        self.f(self.a(ad * lin.d_out))  # g * base output, summed into the vector's gradient
        self.grad(ad * lin.d_out)
        saved.release(f"{lin.name}.ia3_base")
        self.f(g_product)
        if not x_grad:
            return 0
        gin = self.a(nbytes * lin.d_in)
        self.gemm()
        self.f(g_base)
        return gin
