"""What PEFT's OFT keeps for backward on an adapted linear (peft/tuners/oft/layer.py, PEFT
0.21): the input rotated block by block, the rotation built by the Cayley–Neumann series."""

from __future__ import annotations

from service.core.arch import Linear
from service.core.estimator.ledger import _Kind, _Ledger
from service.core.spec.delta import BoftSpec, OftSpec
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


def _boft_saves(
    led: _Ledger, boft: BoftSpec, lin: Linear, x_key: str, x_bytes: int, input_grad: bool
) -> None:
    """PEFT's BOFT linear (peft/tuners/boft/layer.py Linear.forward, fbd_cuda's block
    diagonal): the permutations' half copy boft_P.to(x) both bmms keep; with several factors
    the bmms' product (its slices the chained matmuls keep) and each partial product but the
    last; the identity the rotation's matmul with torch.eye keeps; the input (for the
    rotation's gradient) and, when it takes a gradient, the rotation; the base linear's
    output, which the multiplication by boft_s keeps. The Cayley transform's and the block
    diagonal's tensors are block-sized (blocks · size² fp32 each): not counted."""
    factors, _, _ = boft.blocks(lin.in_features)
    square = lin.in_features * lin.in_features * x_bytes
    led.add(f"{lin.name}.boft_perms", factors * square, _Kind.CONSTANT)
    if factors > 1:
        led.add(f"{lin.name}.boft_factors", factors * square, _Kind.CONSTANT)
        for index in range(factors - 2):
            led.add(f"{lin.name}.boft_partial{index}", square, _Kind.CONSTANT)
    led.add(f"{lin.name}.boft_eye", square, _Kind.CONSTANT)
    led.add(x_key, lin.in_features * x_bytes)
    if input_grad:
        led.add(f"{lin.name}.boft_rotation", square, _Kind.CONSTANT)
    led.add(f"{lin.name}.boft_base_out", lin.out_features * lin.count * x_bytes)


def rotation_saves(
    led: _Ledger,
    oft: OftSpec | None,
    boft: BoftSpec | None,
    lin: Linear,
    x_key: str,
    x_bytes: int,
    input_grad: bool,
) -> bool:
    """OFT's or BOFT's saves on an adapted linear; False when the job runs neither."""
    if oft is not None:
        _oft_saves(led, oft, lin, x_key, x_bytes, input_grad)
    elif boft is not None:
        _boft_saves(led, boft, lin, x_key, x_bytes, input_grad)
    return oft is not None or boft is not None
