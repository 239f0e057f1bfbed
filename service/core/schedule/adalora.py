"""PEFT's AdaLoRA in a step's events: the SVD-shaped adapter on a linear (peft/tuners/adalora/
layer.py SVDLinear.forward), the orthogonality penalty its model adds to the loss
(peft/tuners/adalora/model.py AdaLoraModel.forward) and the RankAllocator's update after the
optimizer step (layer.py RankAllocator.update_ipt, called by the training loop)."""

from __future__ import annotations

from service.core.schedule.delta import _Delta
from service.core.schedule.program import _Grad, _Saved, _Stop
from service.core.schedule.shapes import LinearShape
from service.core.units import FP32_BYTES


class _AdaLora(_Delta):
    """Appends AdaLoRA's events."""

    def _adalora(
        self, x: int, nbytes: int, lin: LinearShape, saved: _Saved | None, base: int, stop: bool
    ) -> int:
        """`result += (x @ (A * E).T @ B.T) * scaling / (ranknum + 1e-5)` on x cast to the
        adapters' dtype: the divisor, the cast, A * E (kept by the first matmul when x takes a
        gradient), the rank-r product (kept by the second), its output, the scaled output
        (kept by the division), the quotient added into the base output in place."""
        ad = FP32_BYTES
        r = self.sh.rank
        divisor = self.p.alloc(ad)
        cast = self.p.hold(x) if ad == nbytes else self.a(ad * lin.d_in)
        scaled_a = self.p.alloc(ad * r * lin.d_in)
        if saved is not None:
            saved.save(f"{lin.name}.cast", cast)
            if self._input_grad or lin not in self.sh.qkv:
                saved.save(f"{lin.name}.ae", scaled_a)
        self.gemm()
        low = self.a(ad * r)
        self.f(scaled_a)
        if saved is not None:
            saved.save(f"{lin.name}.lora_a", low)
            if stop:
                raise _Stop
        self.gemm()
        out = self.a(ad * lin.d_out)
        self.f(low)
        scaled = self.a(ad * lin.d_out)
        self.f(out)
        if saved is not None:
            saved.save(f"{lin.name}.scaled", scaled)
            saved.save(f"{lin.name}.divisor", divisor)
        quotient = self.a(ad * lin.d_out)
        self.f(scaled, quotient, divisor, cast)
        return base

    def _adalora_backward(self, c: _Grad) -> tuple[int, int, int]:
        """The in-place add's backward hands g to the base branch as it is and a copy in the
        adapters' dtype to the adapter (reference traces *__adalora__*, op by op): the
        division's (the quotient, and the trainable divisor's gradient through three
        full-size temporaries summed to one element), the scaling's, B's matmul, A * E's
        matmul, the product's (A's gradient, E's summed from a full-size product), each
        gradient of A and B added out of place to the penalty's waiting for it, the input
        cast's. Returns the base branch's gradient, the adapter branch's input gradient and
        the accumulator."""
        g, nbytes, lin, saved = c.g, c.nbytes, c.lin, c.saved
        x_grad, acc, before_saved = c.x_grad, c.acc, c.before_saved
        ad = FP32_BYTES
        r = self.sh.rank
        din, dout = lin.d_in, lin.d_out
        g32 = self.a(ad * dout) if ad != nbytes else self.p.hold(g)
        if before_saved is not None:
            before_saved()
        quotient = self.a(ad * dout)
        ratio = self.a(ad * dout)
        negated = self.a(ad * dout)
        product = self.a(ad * dout)
        self.f(ratio, negated)
        saved.release(f"{lin.name}.scaled")
        divided = self.a(ad * dout)
        divisor_grad = self.p.alloc(ad)
        self.f(product, divided, divisor_grad, g32)
        saved.release(f"{lin.name}.divisor")
        g_scaled = self.a(ad * dout)
        self.f(quotient)
        g_b = self.p.alloc(ad * r * dout)
        self.gemm()
        g_low = self.a(ad * r)
        self.gemm()
        self.f(g_scaled)
        saved.release(f"{lin.name}.lora_a")
        self._join_penalty(g_b, ad * r * dout)
        g_ae = self.p.alloc(ad * r * din)
        self.gemm()
        gx32 = 0
        if x_grad:
            gx32 = self.a(ad * din)
            self.gemm()
        self.f(g_low)
        saved.release(f"{lin.name}.ae", f"{lin.name}.cast")
        g_a = self.p.alloc(ad * r * din)  # g_ae * E
        full = self.p.alloc(ad * r * din)  # g_ae * A, summed to lora_E's shape
        g_e = self.p.alloc(ad * r)
        self.f(full, g_ae)
        self._join_penalty(g_a, ad * r * din)
        if self.accumulated:
            self.f(g_e)
        else:
            self.grads.append(g_e)
        gx = gx32
        if gx32 and ad != nbytes:
            gx = self.a(nbytes * din)
            self.f(gx32)
        if gx and acc:
            total = self.a(nbytes * din)
            self.f(acc, gx)
            gx, acc = total, 0
        return g, gx, acc

    def _join_penalty(self, new: int, nbytes: int) -> None:
        """A layer's gradient of lora_A or lora_B (`new`, `nbytes`) added out of place to the
        penalty's waiting for it; AccumulateGrad takes the sum as the parameter's .grad (or
        adds it into the .grad an earlier micro-batch made)."""
        total = self.p.alloc(nbytes)
        self.f(self.waiting[nbytes].pop(), new)
        if self.accumulated:
            self.f(total)
        else:
            self.grads.append(total)

    def penalty_forward(self) -> None:
        """The penalty after the loss, one parameter P at a time: P Pᵀ (or Pᵀ P), an identity
        (each held until the next parameter's replaces it), their difference and its norm
        (both kept for backward), the running sum (one element); then its mean and weight."""
        ad = FP32_BYTES
        r = self.sh.rank
        self.penalty_saved = []
        product = identity = total = 0
        for _ in self.sh.penalty:
            new_product = self.p.alloc(ad * r * r)
            self.f(product)
            product = new_product
            new_identity = self.p.alloc(ad * r * r)
            self.f(identity)
            identity = new_identity
            difference = self.p.alloc(ad * r * r)
            norm = self.p.alloc(ad)
            self.penalty_saved += [difference, norm]
            if not total:
                total = self.p.alloc(ad)
        mean = self.p.alloc(ad)
        weighted = self.p.alloc(ad)
        self.f(total, mean, weighted, product, identity)

    def penalty_backward(self) -> None:
        """The penalty's backward, run first (its nodes are the newest), last parameter first:
        the loss's and the weighted mean's one-element gradients; per parameter the norm's
        gradient (its division, zero mask and product), the saved difference and norm let go,
        the product's two gradients (the first GEMM of backward's cuBLAS handle) and their
        sum, which waits for the layer's gradient (`_join_penalty`)."""
        ad = FP32_BYTES
        r = self.sh.rank
        self.waiting = {}
        ones = self.p.alloc(ad)
        weighted = self.p.alloc(ad)
        mean = self.p.alloc(ad)
        self.f(weighted)
        for nbytes in reversed(self.sh.penalty):
            norm = self.penalty_saved.pop()
            difference = self.penalty_saved.pop()
            divided = self.p.alloc(ad * r * r)
            zero = self.p.alloc(ad)
            g_diff = self.p.alloc(ad * r * r)
            self.f(zero, divided, difference, norm)
            first = self.p.alloc(nbytes)
            self.gemm()
            second = self.p.alloc(nbytes)
            self.f(g_diff)
            total = self.p.alloc(nbytes)
            self.f(first, second)
            self.waiting.setdefault(nbytes, []).insert(0, total)
        self.f(ones, mean)

    def allocate_ranks(self) -> None:
        """RankAllocator.update_ipt for every adapter parameter (lora_A, lora_B, lora_E in
        parameter order): zeros for its three buffers the first time; |p * grad| (the product
        let go), the moving average `beta1 * avg + (1 - beta1) * ipt`, the uncertainty
        `beta2 * unc + (1 - beta2) * |ipt - avg|`, each replacing its buffer."""
        first = not self.allocator_buffers
        for index, nbytes in enumerate(self.sh.ranked):
            if first:
                self.allocator_buffers.append([self.p.alloc(nbytes) for _ in range(3)])
            buffers = self.allocator_buffers[index]
            product = self.p.alloc(nbytes)
            ipt = self.p.alloc(nbytes)
            self.f(product, buffers[0])
            buffers[0] = ipt
            left = self.p.alloc(nbytes)
            right = self.p.alloc(nbytes)
            average = self.p.alloc(nbytes)
            self.f(left, right, buffers[1])
            buffers[1] = average
            left = self.p.alloc(nbytes)
            difference = self.p.alloc(nbytes)
            absolute = self.p.alloc(nbytes)
            self.f(difference)
            right = self.p.alloc(nbytes)
            self.f(absolute)
            uncertainty = self.p.alloc(nbytes)
            self.f(left, right, buffers[2])
            buffers[2] = uncertainty
