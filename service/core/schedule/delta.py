"""PEFT's methods beside LoRA on an adapted linear: their forward and backward events, as the
reference traces record them. VeRA (peft/tuners/vera/layer.py Linear.forward), LoHa
(peft/tuners/loha/layer.py Linear._get_delta_activations, HadaWeight)."""

from __future__ import annotations

from service.core.schedule.dora import _Dora
from service.core.schedule.program import _Grad, _Saved, _Stop
from service.core.schedule.shapes import LinearShape
from service.core.units import FP32_BYTES


class _Delta(_Dora):
    """Appends the events of the PEFT methods beside LoRA."""

    def _vera(
        self, x: int, nbytes: int, lin: LinearShape, saved: _Saved | None, base: int, stop: bool
    ) -> int:
        """`result + lambda_b * F.linear(lambda_d * F.linear(x, vera_A), vera_B)` on x cast
        to the vectors' dtype (the cast held by the forward's `x` until it returns): the
        frozen projections' matmuls keep no input; each product with a trained vector keeps
        the other factor. The sum promotes to fp32, cast back to the result's dtype."""
        ad = FP32_BYTES
        cast = self.p.hold(x) if ad == nbytes else self.a(ad * lin.d_in)
        a_out = self.a(ad * self.sh.rank)
        scaled_d = self.a(ad * self.sh.rank)
        b_out = self.a(ad * lin.d_out)
        if saved is not None:
            saved.save(f"{lin.name}.vera_a", a_out)
            saved.save(f"{lin.name}.vera_b", b_out)
            if stop:
                raise _Stop
        self.f(a_out, scaled_d)
        scaled_b = self.a(ad * lin.d_out)
        self.f(b_out)
        out = self.add_and_cast_back(base, scaled_b, lin.d_out, nbytes, ad)
        self.f(cast)
        return out

    def _vera_backward(self, c: _Grad) -> tuple[int, int, int]:
        """VeRA's backward (g, in `nbytes`, released): the output cast's and the promoting
        add's; lambda_b's product (its gradient summed from a full-size product, then vera_B's
        output gradient), vera_B's matmul, lambda_d's product, vera_A's matmul when the input
        takes a gradient, the input cast's. Returns the base branch's gradient, the adapter
        branch's input gradient and the accumulator."""
        g, nbytes, lin, saved = c.g, c.nbytes, c.lin, c.saved
        x_grad, acc, before_saved = c.x_grad, c.acc, c.before_saved
        ad = FP32_BYTES
        r = self.sh.rank
        dout = lin.d_out
        g32 = self.a(ad * dout) if ad != nbytes else self.p.hold(g)
        self.f(g)
        g_base = self.a(nbytes * dout) if ad != nbytes else self.p.hold(g32)
        if before_saved is not None:
            before_saved()
        # lambda_b * b_out: lambda_b's gradient (g * b_out summed over the tokens), b_out's
        full = self.a(ad * dout)
        self.grad(ad * dout)  # vera_lambda_b.grad
        self.f(full)
        g_b = self.a(ad * dout)
        saved.release(f"{lin.name}.vera_b")
        self.f(g32)
        g_scaled = self.a(ad * r)  # through vera_B
        self.f(g_b)
        full = self.a(ad * r)
        self.grad(ad * r)  # vera_lambda_d.grad
        self.f(full)
        g_a = self.a(ad * r)
        saved.release(f"{lin.name}.vera_a")
        self.f(g_scaled)
        if not x_grad:
            self.f(g_a)
            return g_base, 0, acc
        gx32 = self.a(ad * lin.d_in)  # through vera_A
        self.f(g_a)
        gx = gx32
        if ad != nbytes:
            gx = self.a(nbytes * lin.d_in)
            self.f(gx32)
        gx, acc = self._plus(acc, gx, nbytes * lin.d_in), 0
        return g_base, gx, acc

    def _loha(
        self, x: int, nbytes: int, lin: LinearShape, saved: _Saved | None, base: int, stop: bool
    ) -> int:
        """HadaWeight's forward, `((w1a @ w1b) * (w2a @ w2b)) * scale`: two full-size
        products, theirs, the scaled delta; then `_delta_linear`."""
        weight = FP32_BYTES * lin.d_in * lin.d_out
        first = self.p.alloc(weight)
        second = self.p.alloc(weight)
        product = self.p.alloc(weight)
        self.f(first, second)
        delta = self.p.alloc(weight)
        self.f(product)
        return self._delta_linear(x, nbytes, lin, saved, base, stop, delta)

    def _lokr(
        self, x: int, nbytes: int, lin: LinearShape, saved: _Saved | None, base: int, stop: bool
    ) -> int:
        """LoKr's delta, `torch.kron(w1, w2) * scale` (peft/tuners/lokr/layer.py make_kron):
        w1 and w2 built where they are rank-r pairs (kron's broadcast product keeps them),
        kron's full-size product, the scaled delta; then `_delta_linear`."""
        factors = [self.p.alloc(n) for n in lin.lokr_factors]
        if saved is not None:
            for index, key in enumerate(factors):
                saved.save(f"{lin.name}.lokr_factor{index}", key)
        self.f(*factors)
        weight = FP32_BYTES * lin.d_in * lin.d_out
        product = self.p.alloc(weight)
        delta = self.p.alloc(weight)
        self.f(product)
        return self._delta_linear(x, nbytes, lin, saved, base, stop, delta)

    def _delta_linear(
        self,
        x: int,
        nbytes: int,
        lin: LinearShape,
        saved: _Saved | None,
        base: int,
        stop: bool,
        delta: int,
    ) -> int:
        """F.linear on the input cast to the adapters' dtype with a built delta weight: it
        keeps the cast (for the delta's gradient) and the delta (for the input's, when the
        input takes one); the promoting add and the cast back."""
        ad = FP32_BYTES
        cast = self.p.hold(x) if ad == nbytes else self.a(ad * lin.d_in)
        if saved is not None:
            saved.save(f"{lin.name}.delta_cast", cast)
            if self._input_grad or lin not in self.sh.qkv:
                saved.save(f"{lin.name}.delta_weight", delta)
            if stop:
                raise _Stop
        self.gemm()
        delta_out = self.a(ad * lin.d_out)
        self.f(delta, cast)
        out = self.add_and_cast_back(base, delta_out, lin.d_out, nbytes, ad)
        return out

    def _delta_backward(self, c: _Grad) -> tuple[int, int, int]:
        """The backward of a built delta weight's linear (g, in `nbytes`, released): the output
        cast's and the promoting add's; F.linear's (the input's gradient through the delta,
        the delta's gradient); the input cast's; then the delta's own backward (`_loha_weight`
        or `_lokr_weight`). Returns the base branch's gradient, the adapter branch's input
        gradient and the accumulator."""
        g, nbytes, lin, saved = c.g, c.nbytes, c.lin, c.saved
        x_grad, acc, before_saved = c.x_grad, c.acc, c.before_saved
        ad = FP32_BYTES
        din, dout = lin.d_in, lin.d_out
        weight = ad * din * dout
        g32 = self.a(ad * dout) if ad != nbytes else self.p.hold(g)
        self.f(g)
        g_base = self.a(nbytes * dout) if ad != nbytes else self.p.hold(g32)
        if before_saved is not None:
            before_saved()
        gx = 0
        if x_grad:
            gx = self.a(ad * din)
            self.gemm()
        g_delta = self.p.alloc(weight)
        saved.release(f"{lin.name}.delta_cast", f"{lin.name}.delta_weight")
        self.f(g32)
        if gx and ad != nbytes:
            narrow = self.a(nbytes * din)
            self.f(gx)
            gx = narrow
        if self.sh.loha:
            self._loha_weight(lin, weight)
        else:
            self._lokr_weight(lin, saved, weight)
        self.f(g_delta)
        if gx and acc:
            total = self.a(nbytes * din)
            self.f(acc, gx)
            gx, acc = total, 0
        return g_base, gx, acc

    def _loha_weight(self, lin: LinearShape, weight: int) -> None:
        """HadaWeight.backward: the scaled gradient, then for each pair the other pair's
        product and its product with the gradient, the pair's two gradients (the first
        product held until the second replaces it)."""
        ad, r = FP32_BYTES, self.sh.rank
        scaled = self.p.alloc(weight)
        other = self.p.alloc(weight)
        temp = self.p.alloc(weight)
        self.f(other)
        self.grad(ad * lin.d_out * r)  # hada_w1_a.grad
        self.grad(ad * r * lin.d_in)  # hada_w1_b.grad
        other = self.p.alloc(weight)
        second = self.p.alloc(weight)
        self.f(temp, other)
        self.grad(ad * lin.d_out * r)  # hada_w2_a.grad
        self.grad(ad * r * lin.d_in)  # hada_w2_b.grad
        self.f(second, scaled)

    def _lokr_weight(self, lin: LinearShape, saved: _Saved, weight: int) -> None:
        """kron's backward: the scaled gradient, then for each factor the full-size product
        of the gradient with the other factor, summed to the factor's shape (its gradient, or
        through the pair's matmul its two)."""
        scaled = self.p.alloc(weight)
        for index, grads in enumerate(lin.lokr_grads):
            temp = self.p.alloc(weight)
            built = self.p.alloc(lin.lokr_factors[index])  # the sum to a built factor's shape
            self.f(temp)
            for nbytes in grads:
                self.grad(nbytes)
            self.f(built)
            saved.release(f"{lin.name}.lokr_factor{index}")
        self.f(scaled)
