"""Which specs the tracer can run faithfully, and the notes it adds on the rest."""

from __future__ import annotations

from service.core.spec import (
    AttnImpl,
    Framework,
    LossImpl,
    Optim,
    ResolvedSpec,
)
from service.core.stack import PINNED_STACK, stack_behaviours
from service.trace import liger, parallel
from service.trace.autocast import autocast_dtype

STEPS = 2  # step 1: no optimizer state yet; step 2: the steady state


class NotTraceableError(ValueError):
    """The spec asks for something the tracer cannot reproduce faithfully."""


def check_traceable(resolved: ResolvedSpec) -> list[str]:
    """Raise `NotTraceableError` for options the tracer cannot run; return notes on the rest."""
    spec = resolved.spec
    notes: list[str] = []
    if spec.parallel.gpus != 1:
        reason = parallel.refusal(spec)
        if reason is not None:
            raise NotTraceableError(reason)
        notes.extend(parallel.notes(spec))
    if spec.stack != PINNED_STACK:
        if stack_behaviours(spec.stack) or not spec.stack.experts_are_linears:
            raise NotTraceableError(
                f"the tracer runs the installed stack ({PINNED_STACK.describe()}), not "
                f"{spec.stack.describe()}"
            )
        # The one difference of such a stack the estimate models, emulated.
        notes.append(
            f"stack {spec.stack.describe()}: transformers 4's MoE layout (one nn.Linear per "
            "expert, looped over) emulated on the installed libraries "
            "(service/trace/linear_experts.py), PEFT's targets matched as on transformers 4"
        )
    torchtune_step = spec.optimizer_in_backward or spec.activation_offloading
    if spec.framework is not Framework.HF and not (
        spec.framework is Framework.TORCHTUNE and torchtune_step
    ):
        raise NotTraceableError(f"framework {spec.framework!r} is not traced, only HF + PEFT")
    if spec.framework is Framework.TORCHTUNE:
        notes.append(
            "torchtune's step traced on transformers' layers (PEFT's LoRA in the model dtype), "
            "with its optimizer in backward or activation offloading (service/trace/"
            "train_features.py)"
        )
    quant = resolved.quantization
    if quant is not None and quant.type.packed:
        # modelled from their libraries' sources (service/core/quant_formats.py): their kernels
        # need CUDA and their libraries are not in the traced stack
        raise NotTraceableError(
            f"{quant.type.value} bases are not traced (bitsandbytes' nf4, fp4 and int8 are)"
        )
    if resolved.loss not in (LossImpl.HF, LossImpl.PLAIN) and not spec.liger_kernel:
        raise NotTraceableError(
            f"loss {resolved.loss!r} is not traced (hf and plain are; fused with liger_kernel)"
        )
    if spec.liger_kernel:
        notes.append(liger.TRACE_NOTE)
    if spec.autocast:
        notes.append(
            "autocast traced with CUDA's policy on the CPU (service/trace/autocast.py): "
            f"{autocast_dtype(spec)} for the forward and the loss, as HF Trainer runs them"
        )
    if spec.optim in (Optim.PAGED_ADAMW_8BIT, Optim.PAGED_ADAMW_32BIT):
        raise NotTraceableError(
            "paged optimizers keep their state in CUDA managed memory, outside the allocated level"
        )
    if spec.optim is Optim.ADAFACTOR:
        raise NotTraceableError("adafactor is not traced")
    adalora = resolved.adalora
    if adalora is not None and adalora.tinit < STEPS:
        # RankAllocator.mask_to_budget reads its threshold with .item(), which fake tensors
        # cannot answer: the traced steps must fall in the warm-up
        raise NotTraceableError(f"AdaLoRA is traced with tinit >= {STEPS} (no masking step)")
    if spec.attn_implementation is AttnImpl.FLASH_ATTENTION_2:
        notes.append(
            "flash_attention_2 traced as SDPA's flash kernel (the same saved tensors: q, k, v, "
            "output, fp32 log-sum-exp)"
        )
    return notes
