"""What PEFT's OFT keeps for backward on an adapted linear (peft/tuners/oft/layer.py, PEFT
0.21): the input rotated block by block, the rotation built by the Cayley–Neumann series."""

from __future__ import annotations

from service.core.architecture import Linear
from service.core.estimator.ledger import _Kind, _Ledger
from service.core.spec_delta import OftSpec
from service.core.units import FP32_BYTES

# The Cayley–Neumann series' products each forward keeps for backward (peft/tuners/oft/
# layer.py OFTRotationModule._cayley_batch, 5 terms): the skew-symmetric blocks Q and the
# powers Q², Q³ that the batched matmuls take.
OFT_SERIES_SAVED = 3


def _oft_saves(
    led: _Ledger, oft: OftSpec, lin: Linear, x_key: str, x_bytes: int, input_grad: bool
) -> None:
    """PEFT's OFT linear (peft/tuners/oft/layer.py Linear.forward, OFTRotationModule.forward):
    the input cast to fp32 (its own copy per adapted linear), rotated block by block by an
    einsum whose batched matmul keeps that cast (for the rotation's gradient) and, when the
    input takes a gradient, the rotation; the rotation's series keeps Q, Q² and Q³."""
    blocks, size = oft.blocks(lin.in_features)
    key = x_key if x_bytes == FP32_BYTES else f"{x_key}>{lin.name}"
    led.add(key, lin.in_features * FP32_BYTES)
    square = blocks * size * size * FP32_BYTES
    for index in range(OFT_SERIES_SAVED):
        led.add(f"{lin.name}.oft_series{index}", square, _Kind.CONSTANT)
    if input_grad:
        led.add(f"{lin.name}.oft_rotation", square, _Kind.CONSTANT)
