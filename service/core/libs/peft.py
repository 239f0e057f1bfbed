"""PEFT (peft 0.21): its LoRA-FA optimizer, read by the estimator and the allocator schedule."""

from __future__ import annotations

from service.core.libs.optimizers import Optimizer, States, Updater

# LoraFAOptimizer.step projects B's gradient under torch.autocast(dtype=torch.bfloat16) where
# bf16 is available (peft/optimizers/lorafa.py): half-precision temporaries.
LORAFA_AUTOCAST_BYTES = 2

# PEFT's LoraFAOptimizer (peft/optimizers/lorafa.py LoraFAOptimizer.step): exp_avg_B and
# exp_avg_sq_B, zeros_like each lora_B; `step` a Python int. It stands in for the AdamW a
# LoRA-FA job names.
LORA_FA = Optimizer(
    optim=None,
    states=States.MOMENTS,
    updater=Updater.LORA_FA,
    source="peft/optimizers/lorafa.py LoraFAOptimizer",
)
