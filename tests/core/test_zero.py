"""DeepSpeed ZeRO per rank (service/core/estimator/zero.py) against closed forms derived from
DeepSpeed v0.19.5's buffers, for a small Llama-style model trained in bf16. Each rank's states
are read from the estimate's phases: the parameters and optimizer state held throughout, the
gradients, scratch and buffers of the optimizer step, the buffers inside backward and at the
forward's end."""

from __future__ import annotations

from typing import NamedTuple

import pytest

from service.core.arch.hf_config import from_hf_config
from service.core.estimator import estimate, gathered_elements, zero_settings
from service.core.result import Component, Phase
from service.core.spec import (
    LoraSpec,
    Method,
    Offload,
    Optim,
    ParallelSpec,
    QuantSpec,
    Strategy,
    TrainingSpec,
)

CONFIG = {
    "model_type": "llama",
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "num_hidden_layers": 4,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
ARCH = from_hf_config(CONFIG)
H = ARCH.hidden_size
V = ARCH.vocab_size
P = ARCH.total_params  # every parameter trains in full fine-tuning
HALF = 2  # bf16
FP32 = 4
MIB = 1024**2
# DeepSpeed v0.19.5: stage_1_and_2.py nccl_start_alignment_factor; `_has_inf_or_nan` holds
# x.float(), isnan, isinf, their or and its .float() (4 + 1 + 1 + 1 + 4 bytes per element);
# zero/config.py max_reuse_distance default.
ALIGNMENT = 2
OVERFLOW_CHECK = 11
MAX_REUSE_DISTANCE = 10**9
# transformers/integrations/deepspeed.py: stage3_param_persistence_threshold "auto"
PERSISTENCE_FACTOR = 10


def _spec(strategy: str, gpus: int, **changes: object) -> TrainingSpec:
    parallel = ParallelSpec(
        gpus=gpus,
        strategy=Strategy(strategy),
        offload=changes.pop("offload", Offload.NONE),  # type: ignore[arg-type]
        **changes.pop("parallel", {}),
    )
    fields: dict[str, object] = {"method": Method.FULL, "batch_size": 1, "seq_len": 256}
    fields.update(changes)
    return TrainingSpec(parallel=parallel, **fields)  # type: ignore[arg-type]


class Rank(NamedTuple):
    frozen: int
    trainable: int
    optimizer_state: int
    gradients: int  # during the optimizer step
    optimizer_temporaries: int
    comm_forward: int
    comm_backward: int
    comm_step: int
    host: int


def _layout(spec: TrainingSpec) -> Rank:
    est = estimate(ARCH, spec)
    parts = {(p.step, p.phase): p.components for p in est.phases}
    step = parts[(1, Phase.OPTIMIZER_STEP)]
    forward = parts[(1, Phase.FORWARD_END)]
    backward = parts[(2, Phase.BACKWARD)]
    return Rank(
        frozen=step.get(Component.FROZEN_WEIGHTS, 0),
        trainable=step.get(Component.TRAINABLE_PARAMS, 0),
        optimizer_state=step.get(Component.OPTIMIZER_STATE, 0),
        gradients=step.get(Component.GRADIENTS, 0),
        optimizer_temporaries=step.get(Component.OPTIMIZER_TEMPORARIES, 0),
        comm_forward=forward.get(Component.COMMUNICATION, 0),
        comm_backward=backward.get(Component.COMMUNICATION, 0),
        comm_step=step.get(Component.COMMUNICATION, 0),
        host=est.host_bytes,
    )


def _close(actual: int, expected: float, slack: int = MIB) -> None:
    """Equal up to allocator blocks and the alignment padding (well under a MiB here)."""
    assert abs(actual - expected) <= slack, (actual, expected)


def _held_by_worst_rank(sizes: list[int], gpus: int) -> int:
    """Elements of the parameters (in model order) that overlap a rank's slice, whole, for the
    rank holding the most; slices of the group padded to 2 x gpus elements."""
    align = ALIGNMENT * gpus
    size = -(-sum(sizes) // align) * align // gpus
    held = []
    for rank in range(gpus):
        lo, hi = rank * size, (rank + 1) * size
        start, total = 0, 0
        for n in sizes:
            if start < hi and start + n > lo:
                total += n
            start += n
        held.append(total)
    return max(held)


# The model's trainable tensors in model.parameters() order, by HF Trainer's groups: matrices
# (the embedding, each layer's q, k, v, o, gate, up, down, the LM head) and the norms.
KV = ARCH.num_key_value_heads * ARCH.head_dim
MLP = ARCH.intermediate_size
MATRICES = [V * H] + [H * H, KV * H, KV * H, H * H, MLP * H, MLP * H, H * MLP] * 4 + [V * H]
NORMS = [H] * (2 * 4 + 1)


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
def test_zero2_full_fine_tuning_closed_form(gpus: int) -> None:
    """ZeRO-2, bf16, fused AdamW: 2P whole flat parameters; (4 + 4 + 4) P / N fp32 master slice
    and exp_avg/exp_avg_sq; a 2-byte gradient partition buffer holding every parameter that
    overlaps the rank's slice, whole."""
    assert sum(MATRICES) + sum(NORMS) == P
    lay = _layout(_spec("zero2", gpus))
    _close(lay.trainable, HALF * P)
    _close(lay.optimizer_state, (FP32 + FP32 + FP32) * P / gpus)
    held = _held_by_worst_rank(MATRICES, gpus) + _held_by_worst_rank(NORMS, gpus)
    assert HALF * P / gpus <= lay.gradients <= HALF * (P / gpus + 2 * V * H) + MIB
    if gpus == 1:
        _close(lay.gradients, HALF * P)
    else:
        # one rank holds both groups' worst parts at most; never less than its own
        _close(lay.gradients, HALF * held, slack=HALF * max(NORMS) * 2 + MIB)
    # one reduce bucket of hidden_size^2 elements (HF auto; no overlap_comm by default), the
    # newest gradient (the LM head's, V x H), and with several ranks the flat copy of it
    bucket = HALF * H * H
    collective = HALF * max(H * H, V * H) if gpus > 1 else 0
    _close(lay.comm_backward, bucket + HALF * V * H + collective)
    assert lay.frozen == 0
    assert lay.host == 0


def test_zero2_step_scratch_is_the_larger_of_the_conversion_and_the_overflow_check() -> None:
    """The step converts the matrices group's gradient slice, a flat bf16 copy beside its fp32
    conversion (6 bytes per element of the slice); before that, bf16's inf/nan check takes 11
    bytes per element of the largest gradient piece (the embedding's, cut to the slice)."""
    for gpus in (1, 4):
        lay = _layout(_spec("zero2", gpus))
        norms = ARCH.num_hidden_layers * ARCH.norms_per_layer * H + H
        slice_ = (P - norms) / gpus
        conversion = (HALF + FP32) * slice_
        check = OVERFLOW_CHECK * min(V * H, slice_)
        _close(lay.optimizer_temporaries, max(conversion, check))


def test_zero1_keeps_whole_gradients_until_the_step() -> None:
    one = _layout(_spec("zero1", 4))
    two = _layout(_spec("zero2", 4))
    _close(one.gradients, HALF * P)
    assert two.gradients < one.gradients
    # both keep the same whole parameters and the same optimizer state slices
    assert one.trainable == two.trainable
    assert one.optimizer_state == two.optimizer_state
    # with overlap_comm, ZeRO-1 reduces during backward like ZeRO-2
    overlapped = _layout(_spec("zero1", 4, parallel={"overlap_comm": True}))
    assert overlapped.gradients == two.gradients


def test_zero3_full_fine_tuning_closed_form() -> None:
    """ZeRO-3: 2P / N parameter shards (norms of hidden_size elements kept whole too, under the
    10 x hidden_size persistence threshold), 12 P / N fp32 master and Adam state, 2P / N
    gradient partition buffer."""
    gpus = 4
    lay = _layout(_spec("zero3", gpus))
    norms = ARCH.num_hidden_layers * ARCH.norms_per_layer * H + H
    _close(lay.trainable, HALF * P / gpus + HALF * norms)
    _close(lay.optimizer_state, (FP32 + FP32 + FP32) * P / gpus)
    _close(lay.gradients, HALF * P / gpus)
    # the reduce bucket is there for the whole run
    _close(lay.comm_step, HALF * H * H)


def test_zero3_shards_fall_with_gpus_while_zero1_2_parameters_do_not() -> None:
    sizes = {n: _layout(_spec("zero3", n)) for n in (1, 2, 4, 8)}
    for small, large in ((1, 2), (2, 4), (4, 8)):
        assert sizes[large].trainable < sizes[small].trainable
        assert sizes[large].optimizer_state < sizes[small].optimizer_state
        assert sizes[large].gradients < sizes[small].gradients
    for strategy in ("zero1", "zero2"):
        trainables = {_layout(_spec(strategy, n)).trainable for n in (1, 2, 4, 8)}
        assert max(trainables) - min(trainables) < MIB  # the alignment padding only


def test_offload_moves_the_optimizer_to_host() -> None:
    gpus = 4
    on_gpu = _layout(_spec("zero2", gpus))
    off = _layout(_spec("zero2", gpus, offload=Offload.OPTIMIZER))
    assert off.optimizer_state == 0 and off.optimizer_temporaries == 0
    assert off.gradients == 0  # gradients go to the host's fp32 buffer
    assert off.trainable == on_gpu.trainable  # the flat bf16 parameters stay on the GPU
    # host: fp32 master, its fp32 gradient, a bf16 copy and Adam's two fp32 states per element
    _close(off.host, (FP32 + FP32 + HALF + 2 * FP32) * P / gpus, slack=HALF * V * H + MIB)

    z3 = _layout(_spec("zero3", gpus, offload=Offload.OPTIMIZER_AND_PARAMS))
    norms = ARCH.num_hidden_layers * ARCH.norms_per_layer * H + H
    _close(z3.trainable, HALF * norms)  # the persistent parameters only
    assert z3.optimizer_state == 0 and z3.gradients == 0
    assert z3.host > (HALF + FP32 + FP32 + HALF + 2 * FP32) * P / gpus - MIB


def test_auto_settings_follow_hidden_size() -> None:
    auto = zero_settings(ARCH, ParallelSpec(gpus=2, strategy=Strategy.ZERO3))
    assert auto.reduce_bucket_size == H * H
    assert auto.prefetch_bucket_size == int(0.9 * H * H)
    assert auto.persistence_threshold == PERSISTENCE_FACTOR * H
    assert auto.overlap_comm  # DeepSpeed's default for stage 3
    assert not zero_settings(ARCH, ParallelSpec(gpus=2, strategy=Strategy.ZERO2)).overlap_comm
    given = zero_settings(
        ARCH,
        ParallelSpec(
            gpus=2,
            strategy=Strategy.ZERO3,
            reduce_bucket_size=1000,
            stage3_prefetch_bucket_size=2000,
            stage3_param_persistence_threshold=0,
            overlap_comm=False,
        ),
    )
    assert (given.reduce_bucket_size, given.prefetch_bucket_size) == (1000, 2000)
    assert given.persistence_threshold == 0 and not given.overlap_comm
    # a larger bucket is a larger buffer
    small = _layout(_spec("zero2", 2, parallel={"reduce_bucket_size": 1000}))
    big = _layout(_spec("zero2", 2, parallel={"reduce_bucket_size": 10**8}))
    assert big.comm_backward - small.comm_backward >= HALF * (10**8 - V * H) - MIB


def test_flat_buffer_padding_follows_the_world_size() -> None:
    align = ALIGNMENT * 8
    lay = _layout(_spec("zero2", 8))
    assert lay.trainable >= HALF * P
    assert lay.trainable - HALF * P <= 2 * HALF * align + 2 * 512  # two groups, two blocks


def test_zero3_gathering_follows_prefetch_bucket_max_live_and_reuse_distance() -> None:
    """At a module: its parameters plus the following ones prefetched while fewer than
    min(prefetch bucket, max live) elements are in flight; at the forward's end the trailing
    modules whose reuse lies within max_reuse_distance stay gathered."""
    modules = [(1000,), (10,), (2000,), (3000,), (4000,)]
    # threshold 10: the 10-element module is persistent, never gathered
    turn, peak = gathered_elements(modules, 10, prefetch=1, max_live=10**9)
    assert peak == 4000 + 3000  # the largest module and the next one prefetched
    turn, wide = gathered_elements(modules, 10, prefetch=10**6, max_live=10**9)
    # everything ahead prefetched as one coalesced set, counted twice (its flat tensor and
    # the parameters' copies)
    assert wide == 1000 + 2 * (2000 + 3000 + 4000)
    turn, capped = gathered_elements(modules, 10, prefetch=10**6, max_live=1)
    assert capped == peak
    assert turn == sum(m[0] for m in modules if m[0] > 10)  # a small model stays gathered
    big = [(MAX_REUSE_DISTANCE // 4,)] * 8
    turn, _ = gathered_elements(big, 0, prefetch=1, max_live=10**9)
    # modules with fewer than max_reuse_distance / 2 elements after them: the last two, and
    # the one before them prefetched
    assert turn == 3 * MAX_REUSE_DISTANCE // 4


def test_zero3_gathered_parameters_grow_with_the_prefetch_bucket() -> None:
    small = _layout(_spec("zero3", 4, parallel={"stage3_prefetch_bucket_size": 1}))
    assert small.comm_forward > small.gradients  # the gradient buffer and gathered parameters


def test_lora_under_zero2_gives_fp32_masters_to_the_adapters_only() -> None:
    lora = LoraSpec(r=8, target_modules=("q_proj", "v_proj"))
    gpus = 2
    lay = _layout(_spec("zero2", gpus, method=Method.LORA, lora=lora))
    q, v = (lin for lin in ARCH.linears if lin.name in ("q_proj", "v_proj"))
    adapters = ARCH.num_hidden_layers * sum(
        8 * lin.in_features + lin.out_features * 8 for lin in (q, v)
    )
    _close(lay.trainable, HALF * adapters)  # cast from PEFT's fp32 to bf16 by DeepSpeed
    _close(lay.optimizer_state, 3 * FP32 * adapters / gpus)
    _close(lay.frozen, HALF * P)  # the frozen base stays whole on every rank


def test_qlora_under_zero2_casts_the_fp32_parameters_back_to_bf16() -> None:
    """prepare_model_for_kbit_training makes the embedding, head and norms fp32; DeepSpeed's
    bf16 cast makes them bf16 again; the 4-bit weights stay."""
    spec = _spec("zero2", 1, method=Method.QLORA, quantization=QuantSpec())
    lay = _layout(spec)
    plain = _layout(_spec("ddp", 1, method=Method.QLORA, quantization=QuantSpec()))
    _close(plain.frozen - lay.frozen, (FP32 - HALF) * (2 * V * H + 9 * H))


def test_zero3_lora_shards_the_frozen_base() -> None:
    lora = LoraSpec(r=8, target_modules=("q_proj", "v_proj"))
    one = _layout(_spec("zero3", 1, method=Method.LORA, lora=lora))
    four = _layout(_spec("zero3", 4, method=Method.LORA, lora=lora))
    assert four.frozen < one.frozen / 3


def test_estimate_holds_master_weights_and_reports_host() -> None:
    gpus = 4
    est = estimate(ARCH, _spec("zero3", gpus, optim=Optim.ADAMW_TORCH_FUSED))
    assert est.allocated_bytes > (HALF + HALF + 3 * FP32) * P / gpus
    assert any("ZeRO-3" in note for note in est.assumptions)
    off = estimate(ARCH, _spec("zero3", gpus, offload=Offload.OPTIMIZER_AND_PARAMS))
    assert off.host_bytes > 0
    assert off.allocated_bytes < est.allocated_bytes


def test_zero2_accumulation_fills_a_second_partition_buffer() -> None:
    single = _layout(_spec("zero2", 4))
    accumulating = _layout(_spec("zero2", 4, gradient_accumulation_steps=4))
    assert accumulating.comm_backward - single.comm_backward == single.gradients
    # ZeRO-3 accumulates into its one gradient partition buffer
    z3 = _layout(_spec("zero3", 4))
    z3_acc = _layout(_spec("zero3", 4, gradient_accumulation_steps=4))
    assert z3_acc.gradients == z3.gradients
