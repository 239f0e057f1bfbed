"""What the estimate models of a stack older than the traced one: torch before 2.0 keeps the
gradients through zero_grad, torch before 1.13 creates an eager CUDA context."""

from __future__ import annotations

from dataclasses import replace

import pytest

from service.catalog.models import default_catalog
from service.core.device import EAGER_CONTEXT, H200_CONTEXT, H200_OUTSIDE
from service.core.errors import InvalidSpecError
from service.core.estimator import estimate
from service.core.result import Component, Estimate, Overhead, Phase
from service.core.spec import AttnImpl, Method, Optim, TrainingSpec
from service.core.stack import PINNED_STACK, Stack, preset
from service.core.units import DType

BERT = "google-bert/bert-base-uncased"
# a torch 1.13 stack: zero_grad keeps the gradients, CUDA loads its kernels lazily, softmax
# saves only its output
KEEPS_GRADIENTS = Stack(torch="1.13.1")
FULL = TrainingSpec(
    method=Method.FULL,
    batch_size=2,
    seq_len=128,
    dtype=DType.FP32,
    optim=Optim.ADAMW_TORCH_FUSED,
    attn_implementation=AttnImpl.EAGER,
)


def _bert(spec: TrainingSpec, stack: Stack = PINNED_STACK, cc: str | None = "9.0") -> Estimate:
    arch = default_catalog().resolve(BERT).arch
    return estimate(arch, replace(spec, stack=stack), compute_capability=cc)


def _phase(est: Estimate, step: int, phase: Phase) -> dict[Component, int]:
    (found,) = [p for p in est.phases if p.step == step and p.phase is phase]
    return found.components


def test_the_preset_of_the_single_gpu_page() -> None:
    old = preset("hf-4.16")
    assert (old.transformers, old.torch) == ("4.16.0", "1.10.1")
    assert old.zero_grad_keeps_gradients and old.eager_module_loading
    assert old.softmax_saves_input and not old.has_sdpa
    assert not Stack(torch="1.11.0").softmax_saves_input
    assert not PINNED_STACK.zero_grad_keeps_gradients and not PINNED_STACK.eager_module_loading
    assert Stack(torch="2.0.0").zero_grad_keeps_gradients is False
    assert Stack(torch="1.13.0+cu117").eager_module_loading is False
    assert Stack(torch="1.12.1").eager_module_loading is True


def test_torch_before_2_keeps_the_gradients_through_the_second_forward() -> None:
    """zero_grad(set_to_none=False): step 2's forward holds every gradient, step 1's none; the
    second step adds into them in place, so the optimizer step holds the same gradients."""
    pinned = _bert(FULL)
    old = _bert(FULL, KEEPS_GRADIENTS)
    grads = _phase(pinned, 1, Phase.OPTIMIZER_STEP).get(Component.GRADIENTS, 0)
    assert grads > 400 * 2**20  # bert-base's fp32 gradients
    assert _phase(pinned, 2, Phase.FORWARD_END).get(Component.GRADIENTS, 0) == 0
    assert _phase(old, 2, Phase.FORWARD_END).get(Component.GRADIENTS, 0) == grads
    assert _phase(old, 1, Phase.FORWARD_END) == _phase(pinned, 1, Phase.FORWARD_END)
    assert _phase(old, 1, Phase.OPTIMIZER_STEP).get(Component.GRADIENTS, 0) == grads
    # the step-2 forward's peak: the pinned one's plus the gradients
    before, after = (
        next(p for p in est.phases if p.step == 2 and p.phase is Phase.FORWARD_END)
        for est in (pinned, old)
    )
    assert after.allocated_bytes == before.allocated_bytes + grads
    assert old.allocated_bytes > pinned.allocated_bytes


def test_accumulation_already_holds_the_gradients() -> None:
    """Under gradient accumulation the later micro-batches hold the gradients anyway: the kept
    ones move step 2's first forward only, never past what accumulation holds."""
    spec = replace(FULL, gradient_accumulation_steps=4, batch_size=1)
    pinned, old = _bert(spec), _bert(spec, KEEPS_GRADIENTS)
    assert old.allocated_bytes == pinned.allocated_bytes


def test_the_cuda_context_by_torch_version() -> None:
    pinned = _bert(FULL)
    lazy = _bert(FULL, KEEPS_GRADIENTS)
    eager = _bert(FULL, Stack(torch="1.12.1"))
    assert pinned.overheads[Overhead.CUDA_CONTEXT] == H200_CONTEXT
    assert lazy.overheads[Overhead.CUDA_CONTEXT] == H200_CONTEXT
    assert eager.overheads[Overhead.CUDA_CONTEXT] == EAGER_CONTEXT == 1341 * 2**20
    assert lazy.device_bytes - lazy.reserved_bytes == H200_OUTSIDE
    # the eager context holds every kernel library: nothing else outside the allocator
    assert eager.device_bytes - eager.reserved_bytes == EAGER_CONTEXT
    assert eager.overheads[Overhead.OUTSIDE_ALLOCATOR] == 0
    assert any("eager-loading CUDA context" in a for a in eager.assumptions)


def test_the_pinned_answer_is_unchanged_by_a_torch_2_stack() -> None:
    pinned = _bert(FULL)
    newer = _bert(FULL, Stack(torch="2.0.0", transformers="4.48.0"))
    assert newer.allocated_bytes == pinned.allocated_bytes
    assert newer.device_bytes == pinned.device_bytes
    assert newer.phases == pinned.phases


def test_the_encoders_last_assumption_names_the_stack() -> None:
    assert _bert(FULL).assumptions[-1].startswith("stack: transformers 5.24.0")
    last = _bert(FULL, preset("hf-4.16")).assumptions[-1]
    assert last.startswith("stack: transformers 4.16.0, PEFT 0.1.0, bitsandbytes 0.26.0")
    assert "zero_grad() keeps the gradients" in last
    assert "loads CUDA's kernels eagerly" in last


def test_a_decoder_on_torch_before_2_is_refused_naming_the_stack() -> None:
    arch = default_catalog().resolve("Qwen/Qwen2.5-0.5B").arch
    spec = TrainingSpec(batch_size=1, seq_len=128, stack=preset("hf-4.16"))
    with pytest.raises(InvalidSpecError) as caught:
        estimate(arch, spec)
    assert caught.value.field == "stack"
    assert "set_to_none=False" in caught.value.reason


@pytest.mark.parametrize("autocast", [False, True])
def test_torch_before_1_11_keeps_each_attention_softmax_input(autocast: bool) -> None:
    """softmax's backward node holds its input (fp32 under autocast: the cast softmax runs in)
    until the layer's backward: one (b, heads, s, s) tensor per layer more at the end of the
    forward, the classifier's log_softmax input (one 512-byte block) beside them."""
    arch = default_catalog().resolve(BERT).arch
    spec = replace(FULL, autocast=autocast)
    newer, older = _bert(spec, Stack(torch="1.11.0")), _bert(spec, Stack(torch="1.10.2"))
    scores = spec.batch_size * arch.num_attention_heads * spec.seq_len**2 * 4
    gained = {
        phase: _phase(older, 1, phase).get(Component.ACTIVATIONS, 0)
        - _phase(newer, 1, phase).get(Component.ACTIVATIONS, 0)
        for phase in (Phase.FORWARD_END,)
    }
    assert gained[Phase.FORWARD_END] == arch.num_hidden_layers * scores
    assert older.allocated_bytes > newer.allocated_bytes
    # checkpointing keeps no layer's softmax input past its recomputation
    ckpt = replace(spec, gradient_checkpointing=True)
    first = _phase(_bert(ckpt, Stack(torch="1.10.2")), 1, Phase.FORWARD_END)
    assert first == _phase(_bert(ckpt, Stack(torch="1.11.0")), 1, Phase.FORWARD_END)


def test_torch_before_2_runs_an_encoders_eager_attention() -> None:
    sdpa = replace(FULL, attn_implementation=AttnImpl.SDPA)
    old = Stack(torch="1.13.1")
    assert _bert(sdpa, old).phases == _bert(FULL, old).phases
    # on the traced stack SDPA keeps no scores: less at the end of the forward
    forward = [_phase(_bert(spec), 1, Phase.FORWARD_END) for spec in (sdpa, FULL)]
    assert sum(forward[0].values()) < sum(forward[1].values())
    assert any("no scaled_dot_product_attention" in a for a in _bert(sdpa, old).assumptions)
