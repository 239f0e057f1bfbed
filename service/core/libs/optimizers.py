"""The optimizers a step runs, one descriptor each: the state it keeps per parameter, where
that state lives, the temporaries its step makes and the updater the allocation schedule runs.

`OPTIMIZERS` maps each HF `TrainingArguments.optim` name (`Optim`) to its descriptor; the
estimator's optimizer-state bytes and the allocator schedule's updater read it. An optimizer
is added by adding its `Optim` member and its descriptor here.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from service.core.libs.bitsandbytes import optim_8bit_states
from service.core.spec import Optim
from service.core.units import FP32_BYTES


class Updater(StrEnum):
    """What an optimizer's step allocates in the allocation schedule (`service.core.schedule`):
    the optimizers grouped by memory behaviour."""

    ADAMW_FUSED = "adamw_fused"  # two states per parameter, no temporaries
    ADAMW_FOREACH = "adamw_foreach"  # two states, and one state-sized list of temporaries
    STATELESS = "stateless"  # SGD without momentum
    BNB_8BIT = "bnb_8bit"  # uint8 states with fp32 absmax blocks
    ADAFACTOR = "adafactor"  # factored second moment; fp32 copies of one parameter
    OUTSIDE = "outside"  # paged optimizers: state in managed memory, outside the allocator
    LORA_FA = "lora_fa"  # PEFT's LoraFAOptimizer: AdamW states for B, per-B temporaries


class States(StrEnum):
    """The state tensors an optimizer keeps per parameter."""

    NONE = "none"  # no state
    MOMENTS = "moments"  # exp_avg and exp_avg_sq, zeros_like the parameter (its dtype)
    FP32_MOMENTS = "fp32_moments"  # two fp32 states whatever the parameter's dtype
    BLOCKWISE_8BIT = "blockwise_8bit"  # bitsandbytes' uint8 states with fp32 absmax blocks
    FACTORED = "factored"  # Adafactor's row and column second moments (a full one for 1-D)


class Temporaries(StrEnum):
    """What an optimizer's step allocates beyond its state."""

    NONE = "none"
    STATE_COPY = "state_copy"  # one state-sized list of tensors (the trainable bytes)
    FP32_COPIES = "fp32_copies"  # fp32 copies of the largest parameter (FP32_COPIES of them)


# Adafactor's step() works one parameter at a time on fp32 copies of its gradient and of the
# parameter, and an fp32 update (transformers/optimization.py Adafactor.step).
FP32_COPIES = 3


@dataclass(frozen=True, slots=True, kw_only=True)
class Optimizer:
    """One optimizer as the memory model sees it."""

    optim: Optim | None  # its HF TrainingArguments.optim name (None: not selectable by name)
    states: States
    updater: Updater  # what its step allocates in the allocation schedule
    paged: bool = False  # state in CUDA managed memory, outside torch's allocator counters
    # each parameter's `step` kept as an fp32 scalar on the device (torch/optim/adamw.py
    # _init_group: device=p.device if capturable or fused); otherwise a host scalar
    device_step: bool = False
    temporaries: Temporaries = Temporaries.NONE
    source: str

    @property
    def eight_bit(self) -> bool:
        """Its state is bitsandbytes' blockwise 8-bit."""
        return self.states is States.BLOCKWISE_8BIT

    def state_sizes(
        self, nbytes: int, elements: int, factors: tuple[int, int, int] | None = None
    ) -> tuple[int, ...]:
        """The state tensors' bytes for one parameter of `elements` elements taking `nbytes`,
        in creation order (the device `step` scalar left out). Adafactor's factored moments
        are exact given `factors` (rows, cols, bytes per element; cols 0 for a 1-D parameter),
        otherwise taken as two vectors of sqrt(elements) each."""
        if self.states is States.MOMENTS:
            return nbytes, nbytes
        if self.states is States.FP32_MOMENTS:
            return elements * FP32_BYTES, elements * FP32_BYTES
        if self.states is States.BLOCKWISE_8BIT:
            return optim_8bit_states(elements)
        if self.states is States.FACTORED:
            if factors is None:
                return (nbytes // max(1, elements) * int(elements**0.5) * 2,)
            rows, cols, itemsize = factors
            return (rows * itemsize, cols * itemsize) if cols else (rows * itemsize,)
        return ()


_DESCRIPTORS = (
    Optimizer(
        optim=Optim.ADAMW_TORCH,
        states=States.MOMENTS,
        updater=Updater.ADAMW_FOREACH,
        # foreach AdamW's torch._foreach_sqrt(exp_avg_sqs) allocates one state-sized copy
        temporaries=Temporaries.STATE_COPY,
        source="torch/optim/adamw.py _init_group, _multi_tensor_adamw",
    ),
    Optimizer(
        optim=Optim.ADAMW_TORCH_FUSED,
        states=States.MOMENTS,
        updater=Updater.ADAMW_FUSED,
        device_step=True,
        source="torch/optim/adamw.py _init_group, _fused_adamw",
    ),
    Optimizer(
        optim=Optim.ADAMW_BNB_8BIT,
        states=States.BLOCKWISE_8BIT,
        updater=Updater.BNB_8BIT,
        source="bitsandbytes/optim/adamw.py AdamW8bit; optim/optimizer.py Optimizer2State",
    ),
    Optimizer(
        optim=Optim.PAGED_ADAMW_8BIT,
        states=States.BLOCKWISE_8BIT,
        updater=Updater.OUTSIDE,
        paged=True,
        source="bitsandbytes/optim/adamw.py PagedAdamW8bit; optim/optimizer.py Optimizer2State",
    ),
    Optimizer(
        optim=Optim.PAGED_ADAMW_32BIT,
        states=States.FP32_MOMENTS,
        updater=Updater.OUTSIDE,
        paged=True,
        source="bitsandbytes/optim/adamw.py PagedAdamW32bit; optim/optimizer.py Optimizer2State",
    ),
    Optimizer(
        optim=Optim.ADAFACTOR,
        states=States.FACTORED,
        updater=Updater.ADAFACTOR,
        temporaries=Temporaries.FP32_COPIES,
        # beta1=None as HF Trainer builds it: no first moment; second moments in the
        # gradient's dtype
        source="transformers/optimization.py Adafactor",
    ),
    Optimizer(
        optim=Optim.SGD,
        states=States.NONE,
        updater=Updater.STATELESS,
        source="torch/optim/sgd.py with momentum 0 (transformers/trainer.py)",
    ),
)

OPTIMIZERS: dict[Optim, Optimizer] = {d.optim: d for d in _DESCRIPTORS if d.optim is not None}
