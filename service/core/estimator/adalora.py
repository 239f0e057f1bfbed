"""What PEFT's AdaLoRA holds beyond LoRA's tensors at its initial rank: the orthogonality
penalty its model adds to the loss, and the RankAllocator's buffers.

AdaLoraModel.forward (peft/tuners/adalora/model.py, PEFT 0.21) adds `orth_reg_weight` times
the mean of ||P Pᵀ − I||_F over every lora_A (P = A, r x in) and every lora_B (P = Bᵀ): per
parameter an r x r product, the difference the norm keeps for backward, and the norm itself.
Those nodes were recorded after the language-model loss, so backward runs them first: the
penalty's gradient of every lora_A and lora_B waits in its AccumulateGrad node's input buffer
from the start of backward until the layer's own gradient joins it.

The training loop calls `update_and_allocate` after each optimizer step
(method_comparison/MetaMathQA/run.py; peft/tuners/adalora/layer.py RankAllocator.update_ipt):
for every adapter parameter (lora_A, lora_B, lora_E) it keeps three tensors of the parameter's
shape and dtype (the importance |p * p.grad|, its moving average and its uncertainty) until
step total_step - tfinal, and updates them through three such temporaries at a time.
"""

from __future__ import annotations

from typing import NamedTuple

from service.core.arch import ModelArch
from service.core.estimator.ledger import _blk
from service.core.estimator.weights import adapted_linears
from service.core.spec import Method, ResolvedSpec
from service.core.units import DTYPE_BYTES

# RankAllocator.update_ipt: ipt, exp_avg_ipt, exp_avg_unc per adapter parameter.
ALLOCATOR_BUFFERS = 3
# Live at once while one parameter's buffer is rebuilt (`beta * avg`, `(1 - beta) * ipt` and
# their sum; reference traces *__adalora__*, optimizer step).
ALLOCATOR_TEMPORARIES = 3
# What each penalty term keeps for backward: the difference P Pᵀ − I (r x r) and the norm
# (one element); the running sum of the terms adds one element per term.
PENALTY_SCALARS = 2


class AdaLoraParts(NamedTuple):
    penalty_saved: int  # kept from the loss until backward starts
    penalty_gradients: int  # the penalty's gradients of lora_A and lora_B, made first
    allocator_state: int  # the RankAllocator's buffers, from the first optimizer step on
    allocator_temporaries: int  # inside the optimizer step


NO_PARTS = AdaLoraParts(0, 0, 0, 0)


def adalora_parts(arch: ModelArch, rs: ResolvedSpec) -> AdaLoraParts:
    """AdaLoRA's parts of a step; zeros for every other method."""
    if rs.spec.method is not Method.ADALORA or rs.lora is None:
        return NO_PARTS
    L = arch.num_hidden_layers
    r = rs.lora.r
    ad = DTYPE_BYTES[rs.adapter_dtype]
    saved = 0
    grads = 0
    state = 0
    largest = 0
    for lin in adapted_linears(arch, rs):
        a = _blk(r * lin.in_features * ad)
        b = _blk(lin.out_features * r * ad)
        e = _blk(r * ad)
        saved += 2 * (_blk(r * r * ad) + PENALTY_SCALARS * _blk(ad))
        grads += a + b
        state += ALLOCATOR_BUFFERS * (a + b + e)
        largest = max(largest, a, b)
    return AdaLoraParts(
        penalty_saved=L * saved,
        penalty_gradients=L * grads,
        allocator_state=L * state,
        allocator_temporaries=ALLOCATOR_TEMPORARIES * largest,
    )
