"""What an answer says of a compiled step (`TrainingSpec.torch_compile`), which is not traced."""

from __future__ import annotations

from service.core.spec import TrainingSpec

# What a `torch_compile` job's answer assumes. HF Trainer compiles the model with inductor's
# default mode (TrainingArguments.torch_compile_mode None: no CUDA graphs); AOTAutograd's
# min-cut partitioner (torch/_functorch/partitioners.py min_cut_rematerialization_partition)
# picks the cheapest set of forward tensors to keep, of which eager autograd's saved set is one
# candidate, and inductor fuses the elementwise temporaries away.
COMPILE_NOTE = (
    "torch_compile: the eager step is estimated (a compiled step is not traced); inductor's "
    "partitioner keeps at most about what eager autograd saves and fuses elementwise "
    "temporaries, so compiled activations are usually at or below these; compile-time "
    "autotuning buffers are not modelled"
)


def compile_notes(spec: TrainingSpec) -> tuple[str, ...]:
    """The note a compiled job's answer carries; none for an eager one."""
    return (COMPILE_NOTE,) if spec.torch_compile else ()
