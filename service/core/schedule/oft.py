"""PEFT's OFT in a step's events: the input rotated block by block before the base linear
(peft/tuners/oft/layer.py Linear.forward, OFTRotationModule.forward and _cayley_batch with
the default five-term Cayley–Neumann series), as the reference traces *__oft__* record it."""

from __future__ import annotations

from service.core.schedule.adalora import _AdaLora
from service.core.schedule.program import _Grad, _Saved, _Stop
from service.core.schedule.shapes import LinearShape
from service.core.units import FP32_BYTES

# The series' batched products Q², Q³, Q⁴ (each block's); the first two are kept for backward
# with Q, the last let go when the series returns.
SERIES_PRODUCTS = 3


class _Oft(_AdaLora):
    """Appends OFT's events."""

    def _oft(self, x: int, nbytes: int, lin: LinearShape, saved: _Saved | None, stop: bool) -> int:
        """The input cast to fp32; the rotation: the skew-symmetric blocks (zeros filled, minus
        their transpose), an identity repeated per block, the series' products; the einsum's
        batched matmul (keeping the cast, and the rotation when the input takes a gradient)
        and the copy its reshape makes; the rotated input cast back for the base linear."""
        blocks, size = lin.oft_blocks
        square = blocks * size * size * FP32_BYTES
        cast = self.p.hold(x) if nbytes == FP32_BYTES else self.a(FP32_BYTES * lin.d_in)
        zeros = self.p.alloc(square)
        skew = self.p.alloc(square)
        self.f(zeros)
        eye = self.p.alloc(size * size * FP32_BYTES)
        rotation = self.p.alloc(square)
        self.f(eye)
        self.gemm()
        products = [self.p.alloc(square) for _ in range(SERIES_PRODUCTS)]
        self.f(products[-1])
        if saved is not None:
            saved.save(f"{lin.name}.oft_skew", skew)
            saved.save(f"{lin.name}.oft_square", products[0])
            saved.save(f"{lin.name}.oft_cube", products[1])
            saved.save(f"{lin.name}.cast", cast)
            if self._input_grad or lin not in self.sh.qkv:
                saved.save(f"{lin.name}.oft_rotation", rotation)
            if stop:
                raise _Stop
        self.f(skew, products[0], products[1])
        rotated = self.a(FP32_BYTES * lin.d_in)
        copy = self.a(FP32_BYTES * lin.d_in)
        self.f(rotation, rotated)
        half = self.a(nbytes * lin.d_in) if nbytes != FP32_BYTES else self.p.hold(copy)
        self.gemm()
        out = self.a(nbytes * lin.d_out)  # (OFT is modelled without autocast)
        self.f(half, copy, cast)
        return out

    def _oft_backward(self, c: _Grad) -> int:
        """The base linear's input gradient (g let go), cast to fp32; the einsum's batched
        matmul (the rotation's gradient, the input's) and its copy back to the input's shape;
        the series' backward (two products per power, summed into Q's gradient), the skew
        construction's, the weight's gradient gathered from the upper triangles; the input's
        gradient cast back, added to `acc`."""
        g, nbytes, lin, saved = c.g, c.nbytes, c.lin, c.saved
        x_grad, acc, before_saved, in_bytes = c.x_grad, c.acc, c.before_saved, c.in_bytes
        blocks, size = lin.oft_blocks
        square = blocks * size * size * FP32_BYTES
        if before_saved is not None:
            before_saved()
        gin = self.a(nbytes * lin.d_in)
        self.gemm()
        self.f(g)
        g32 = self.a(FP32_BYTES * lin.d_in) if nbytes != FP32_BYTES else self.p.hold(gin)
        self.f(gin)
        g_rotation = self.p.alloc(square)
        self.gemm()
        gx = self.a(FP32_BYTES * lin.d_in)
        self.f(g32)
        saved.release(f"{lin.name}.oft_rotation", f"{lin.name}.cast")
        gx_copy = self.a(FP32_BYTES * lin.d_in)
        self.f(gx)
        g_skew = 0
        powers = (f"{lin.name}.oft_cube", f"{lin.name}.oft_square", f"{lin.name}.oft_skew")
        for name in powers:
            left = self.p.alloc(square)
            right = self.p.alloc(square)
            saved.release(name)
            total = self.p.alloc(square)
            self.f(left, right, g_skew)
            g_skew = total
        negated = self.p.alloc(square)
        summed = self.p.alloc(square)
        self.f(negated, g_skew, g_rotation)
        triangle = size * (size - 1) // 2
        self.grad(blocks * triangle * FP32_BYTES)
        self.f(summed)
        if not x_grad:
            self.f(gx_copy)
            return acc
        result = self.a(in_bytes * lin.d_in) if in_bytes != FP32_BYTES else gx_copy
        if result != gx_copy:
            self.f(gx_copy)
        result = self._plus(acc, result, in_bytes * lin.d_in)
        return result
