"""The libraries' facts (service/core/libs): every optimizer has a descriptor, and the states
they lay out."""

from __future__ import annotations

from service.core.libs.bitsandbytes import OPTIM_MIN_8BIT_SIZE, optim_8bit_states
from service.core.libs.optimizers import OPTIMIZERS, States, Updater
from service.core.spec import Optim
from service.core.units import FP32_BYTES


def test_every_optimizer_has_a_descriptor() -> None:
    assert set(OPTIMIZERS) == set(Optim)
    for optim, opt in OPTIMIZERS.items():
        assert opt.optim is optim
        assert opt.source
        # a paged optimizer's state is outside the allocator: its step allocates nothing there
        assert opt.paged == (opt.updater is Updater.OUTSIDE)


def test_state_layouts() -> None:
    n = OPTIM_MIN_8BIT_SIZE
    assert OPTIMIZERS[Optim.SGD].state_sizes(2 * n, n) == ()
    assert OPTIMIZERS[Optim.ADAMW_TORCH].state_sizes(2 * n, n) == (2 * n, 2 * n)
    assert OPTIMIZERS[Optim.PAGED_ADAMW_32BIT].state_sizes(2 * n, n) == (4 * n, 4 * n)
    # uint8 states with one fp32 absmax per 256 elements; fp32 ones below the minimum size
    assert optim_8bit_states(n) == (n, n, n // 256 * FP32_BYTES, n // 256 * FP32_BYTES)
    assert optim_8bit_states(n - 1) == ((n - 1) * FP32_BYTES,) * 2
    assert OPTIMIZERS[Optim.ADAMW_BNB_8BIT].eight_bit
    adafactor = OPTIMIZERS[Optim.ADAFACTOR]
    assert adafactor.states is States.FACTORED
    assert adafactor.state_sizes(2 * 64 * 32, 64 * 32, (64, 32, 2)) == (128, 64)
    assert adafactor.state_sizes(2 * 64, 64, (64, 0, 2)) == (128,)
