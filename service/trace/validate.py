"""`vramcast trace --validate`: the fake trace against real CPU runs of the same tiny models.

For each case the same two training steps run twice with the CPU-runnable kernels: once on fake
tensors, once on real CPU tensors. The check is that both give the same peak, breakdown, phase
snapshots and sequence of allocations and frees. The real run is also profiled, so the tracker's
running total (unrounded) can be set against the CPU allocator's own counter; every byte of
difference at the allocator's peak is attributed to allocations no dispatched op made.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.core.spec import LoraSpec, Method, QuantSpec, TrainingSpec
from service.core.units import DType
from service.trace.reference import reference_name

VALIDATION_PATH = Path(__file__).with_name("VALIDATION.md")

_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}

# One tiny config per architecture family of the reference matrix.
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny-qwen2": {**_COMMON, "model_type": "qwen2", "tie_word_embeddings": True},
    "tiny-llama": {**_COMMON, "model_type": "llama"},
    # A 16-token window at 32 tokens: a mask is built, so attention takes the masked path.
    "tiny-mistral": {**_COMMON, "model_type": "mistral", "sliding_window": 16},
    "tiny-gemma2": {
        **_COMMON,
        "model_type": "gemma2",
        "head_dim": 16,
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": 16,
        "tie_word_embeddings": True,
    },
    "tiny-phi3": {**_COMMON, "model_type": "phi3", "num_key_value_heads": 4, "pad_token_id": 0},
    "tiny-qwen2-moe": {
        **_COMMON,
        "model_type": "qwen2_moe",
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
    },
    # BERT sequence classification, eager attention: the CPU flash op takes no dropout, and
    # eager runs the attention-probability dropout as its own op.
    "tiny-bert": {
        "model_type": "bert",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 256,
        "max_position_embeddings": 512,
        "hidden_act": "gelu",
        "pad_token_id": 0,
    },
}
# Tiny models whose validation runs eager attention.
_EAGER = ("tiny-gemma2", "tiny-bert")

BATCH, SEQ = 2, 32
NO_OP = "(no op)"
_LORA = LoraSpec(r=8, lora_alpha=16, target_modules="all-linear")


def _case(model: str, method: Method, **fields: Any) -> tuple[str, TrainingSpec]:
    """A validation case: the tiny model and a spec at BATCH x SEQ."""
    return model, TrainingSpec(method=method, batch_size=BATCH, seq_len=SEQ, **fields)


def validation_cases() -> list[tuple[str, TrainingSpec]]:
    """Every architecture with LoRA with and without checkpointing and full FT; LoRA dropout;
    QLoRA."""
    from service.core.spec import AttnImpl

    cases: list[tuple[str, TrainingSpec]] = []
    for model in TINY_CONFIGS:
        attention = {"attn_implementation": AttnImpl.EAGER} if model in _EAGER else {}
        for ckpt in (False, True):
            cases.append(
                _case(model, Method.LORA, lora=_LORA, gradient_checkpointing=ckpt, **attention)
            )
        cases.append(_case(model, Method.FULL, gradient_checkpointing=True, **attention))
    dropout = LoraSpec(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.1)
    cases.append(_case("tiny-llama", Method.LORA, lora=dropout))
    qlora = {"lora": _LORA, "quantization": QuantSpec(double_quant=True)}
    for model in ("tiny-qwen2", "tiny-llama"):
        cases.append(_case(model, Method.QLORA, gradient_checkpointing=True, **qlora))
    # HF Trainer's mixed precision under the emulated CUDA autocast policy: bf16 (LoRA with and
    # without checkpointing, QLoRA), and fp16 with its GradScaler.
    for model in ("tiny-qwen2", "tiny-llama"):
        for ckpt in (False, True):
            cases.append(
                _case(model, Method.LORA, lora=_LORA, gradient_checkpointing=ckpt, autocast=True)
            )
    cases.append(
        _case("tiny-qwen2", Method.QLORA, gradient_checkpointing=True, autocast=True, **qlora)
    )
    cases.append(_case("tiny-llama", Method.LORA, lora=_LORA, dtype=DType.FP16, autocast=True))
    return cases


@dataclass(frozen=True, slots=True, kw_only=True)
class AllocatorCheck:
    """The tracker's unrounded peak against the CPU allocator's counter during the same run.

    `boundary_peak` is the allocator's level right after each dispatched op returns (when the
    tracker counts the op's outputs), less tensors that no op allocated; it must equal the
    tracker's peak. The allocator's own peak can sit higher, inside an op, by that op's scratch.
    """

    tracker_peak: int
    allocator_peak: int
    boundary_peak: int
    outside_ops: int  # bytes live at the allocator's peak that no dispatched op allocated
    peak_op: str  # the dispatched op running at the allocator's peak

    @property
    def explained(self) -> bool:
        return self.boundary_peak == self.tracker_peak

    @property
    def inside_op(self) -> int:
        """Bytes at the allocator's peak held inside the running op (its scratch, its outputs
        not yet returned), beyond the tracker's peak."""
        return self.allocator_peak - self.outside_ops - self.tracker_peak


@dataclass(frozen=True, slots=True, kw_only=True)
class CaseReport:
    model: str
    name: str
    fake_peak: int
    real_peak: int
    same_breakdown: bool
    same_phases: bool
    events: int
    same_events: bool
    allocator: AllocatorCheck

    @property
    def passed(self) -> bool:
        return (
            self.fake_peak == self.real_peak
            and self.same_breakdown
            and self.same_phases
            and self.same_events
            and self.allocator.explained
        )


def check_case(model: str, spec: TrainingSpec, config: Mapping[str, Any]) -> CaseReport:
    from service.trace.runner import trace

    fake = trace(spec, config, model, cpu_kernels=True, record_events=True)
    real = trace(spec, config, model, real=True, cpu_kernels=True, record_events=True)
    return CaseReport(
        model=model,
        name=reference_name(model, spec),
        fake_peak=fake.peak.allocated_bytes,
        real_peak=real.peak.allocated_bytes,
        same_breakdown=fake.peak == real.peak,
        same_phases=fake.phases == real.phases,
        events=len(fake.events),
        same_events=fake.events == real.events,
        allocator=check_allocator(spec, config, model),
    )


def check_allocator(spec: TrainingSpec, config: Mapping[str, Any], model: str) -> AllocatorCheck:
    """Profile a real run (tracker counting requested bytes) and read the allocator's counter."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    from service.trace.runner import trace

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = trace(spec, config, model, real=True, cpu_kernels=True, allocation_unit=1)
    allocations: list[Any] = []
    pending = list(prof.profiler.kineto_results.experimental_event_tree())
    while pending:
        node = pending.pop()
        if node.tag == _EventType.Allocation:
            allocations.append(node)
        pending.extend(node.children)
    allocations.sort(key=lambda n: n.start_time_ns)
    base = allocations[0].extra_fields.total_allocated - allocations[0].extra_fields.alloc_size

    # The level when a dispatched op returns is the level after its last allocator event (ops
    # that allocate nothing cannot raise it); op-end timestamps are not used, since they can
    # land on either side of the frees that follow the op.
    after_op: dict[tuple[int, int, str], int] = {}
    live: dict[int, Any] = {}
    outside = 0
    allocator_peak, peak_outside, peak_node = -1, 0, allocations[0]
    for node in allocations:
        fields = node.extra_fields
        owner = _dispatched_ancestor(node)
        if fields.alloc_size > 0:
            live[fields.ptr] = node
            outside += fields.alloc_size if owner is None else 0
        else:
            born = live.pop(fields.ptr, None)
            if born is not None and _outside_ops(born):
                outside -= born.extra_fields.alloc_size
        level = fields.total_allocated - base
        if owner is not None:
            after_op[(owner.start_time_ns, owner.end_time_ns, owner.name)] = level - outside
        if level > allocator_peak:
            allocator_peak, peak_outside, peak_node = level, outside, node
    boundary_peak = max(after_op.values(), default=0)
    return AllocatorCheck(
        tracker_peak=result.peak.allocated_bytes,
        allocator_peak=allocator_peak,
        boundary_peak=boundary_peak,
        outside_ops=peak_outside,
        peak_op=_name(_dispatched_ancestor(peak_node)),
    )


def _dispatched(node: Any) -> bool:
    """An op the tracker's dispatch mode ran (the profiler nests it under the mode's frame)."""
    parent = node.parent
    return parent is not None and parent.name == "PythonDispatchMode"


def _outside_ops(node: Any) -> bool:
    """Allocated by no dispatched op: C++ or Python code between ops (RNG state, scalars)."""
    return _dispatched_ancestor(node) is None


def _dispatched_ancestor(node: Any) -> Any:
    parent = node.parent
    while parent is not None and not _dispatched(parent):
        parent = parent.parent
    return parent


def _name(node: Any) -> str:
    return NO_OP if node is None else str(node.name)


def format_report(reports: list[CaseReport]) -> str:
    lines = [
        "# Reference tracer: validation",
        "",
        "`vramcast trace --validate` runs each case twice",
        "with the CPU-runnable kernels (CPU flash attention, bitsandbytes' own 4-bit matmul): on",
        "fake tensors and on real CPU tensors, two steps each, and compares everything the tracker",
        "records. The real run is then profiled (`torch.profiler`, `profile_memory=True`) with the",
        "tracker counting requested bytes (no 512-B rounding), and the tracker's peak is set",
        "against the CPU allocator's own running total (`total_allocated` of its allocation",
        "events). Tiny models: hidden 64, 2 layers, 4 heads, vocabulary 256; batch 2, 32 tokens.",
        "",
        "| case | peak (fake = real, B) | breakdown | phases | events (alloc/free) "
        "| tracker peak, unrounded (B) | allocator at op boundaries (B) "
        "| allocator peak: + inside op, + outside ops (B) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in reports:
        a = r.allocator
        same = "=" if r.fake_peak == r.real_peak else f"≠ {r.real_peak:,}"
        lines.append(
            f"| {r.name} | {r.fake_peak:,} {same} | {_yes(r.same_breakdown)} "
            f"| {_yes(r.same_phases)} | {r.events:,} {_yes(r.same_events)} "
            f"| {a.tracker_peak:,} | {a.boundary_peak:,} {_equal(a.explained)} "
            f"| +{a.inside_op:,} in {a.peak_op}, +{a.outside_ops:,} |"
        )
    passed = sum(r.passed for r in reports)
    lines += [
        "",
        f"{passed} of {len(reports)} cases pass both checks. Fake and real runs are identical:",
        "the peak, the breakdown at the peak, every phase snapshot, and the whole sequence of",
        "allocations and frees. And right after each dispatched op returns (when the tracker",
        "counts its outputs) the CPU allocator's running total, less the tensors that no",
        "dispatched op allocated, peaks at exactly the tracker's unrounded peak. The allocator's",
        "own peak sits higher by the last column: what the running op holds inside itself at",
        "that instant (its scratch; its outputs before they are returned), and tensors made",
        "outside any op (0-dim tensors wrapping Python scalars; the RNG state that",
        "checkpointing saves, 5,056 B), which live in host memory on a GPU run.",
        "",
        "## Known limits of the fake trace",
        "",
        "- **Allocated and reserved levels.** Reserved is the tracer's allocations and frees",
        "  replayed through the allocator model (default `PYTORCH_CUDA_ALLOC_CONF` unless the",
        "  spec sets one), from a model whose weights were allocated in their final form. Device",
        "  memory (CUDA context, NCCL, paged optimizer state) is not traced: it comes from",
        "  measured rows.",
        "- **GPU kernels are chosen, not run.** The references use the ops a GPU runs (CUDA flash",
        "  / mem-efficient SDPA, SDPA's math composite as CUDA runs it, bitsandbytes' dequantize",
        "  + F.linear for 4-bit matmuls); their outputs come from the meta kernels of PyTorch and",
        "  bitsandbytes, which this validation cannot execute on a CPU. SDPA `auto` follows what",
        "  an H200 with torch 2.11 chose (`torch._fused_sdp_choice`, recorded in",
        "  `tests/data/gpu/h200_environment.json`): flash for fp16/bf16 without a mask and",
        "  head_dim <= 256, math for fp32 with grouped key/value heads and no mask, else",
        "  mem-efficient; cuDNN attention is counted as flash (the same saved tensors).",
        "  bitsandbytes' fused 4-bit GEMM is assumed at <= 512 rows for large weights and <= 1536",
        "  rows otherwise (its SM-count branches for small weights are not modelled).",
        "- **Kernel scratch.** The cuBLAS workspace of each handle (32 MiB on compute capability",
        "  9.0: the forward thread's and the autograd thread's) and cuBLASLt's 1 MiB are",
        "  allocated at the first GEMM of each, as on the GPU; the math kernel's softmax backward",
        "  scratch is allocated. Other scratch a CUDA kernel allocates and frees inside itself",
        "  (flash-attention backward's fp32 dq accumulator and softmax_d, mem-efficient",
        "  backward's workspace) is not seen; none of it is live at a LoRA/QLoRA peak (the loss",
        "  gradient), but a backward-phase peak on a GPU can sit higher by that op's scratch.",
        "- **Host tensors stay on the host.** Flash/efficient philox seed and offset, the step",
        "  counters and scalars of foreach/for-loop optimizers, checkpointing's RNG state and",
        "  wrapped Python scalars are not counted (they are CPU tensors on a GPU run).",
        "- **Mixed precision is CUDA's policy, emulated.** With `autocast` the step runs as HF",
        "  Trainer runs it under bf16/fp16 mixed precision, through CPU autocast made to act as",
        "  CUDA's (`service/trace/autocast.py`): the ops CUDA registers autocast kernels for,",
        "  with their policies, read from the pinned torch (a test checks the list against its",
        "  registrations); every other op uncast; lower-precision casts of fp32 weights cached",
        "  for the autocast region; CUDA's autocast queries answered. fp16 adds the GradScaler",
        "  (scaled loss, unscale, inf checks); gradients are clipped to `max_grad_norm` as the",
        "  Trainer clips them.",
        "- **Not traced** (refused with a reason): multi-GPU strategies, paged optimizers,",
        "  Adafactor, LitGPT/torchtune presets, chunked losses, and fused ones except Liger's.",
        "  `flash_attention_2` is traced as SDPA's flash op (the same saved tensors). Gradient",
        "  accumulation runs its micro-batches as the Trainer does, the gradients added in place.",
        "- **Liger Kernel (`use_liger_kernel`) runs as stand-ins of its Triton Functions**",
        "  (`service/trace/liger.py`): each allocates and saves what liger-kernel 0.8.2's does,",
        "  its register arithmetic outside the device count; tests/trace/test_liger.py checks",
        "  their values against the unpatched transformers modules on real tensors.",
        "- **LLM.int8 bases take CUDA's kernels, without outlier columns.** bitsandbytes' int8",
        "  matmul dispatches to MatMul8bitLt as for a CUDA tensor, and its quantization and",
        "  integer matmul run as their CUDA kernels allocate (the fp16 input copy, the threshold",
        "  mask, the int32 product). Which input columns exceed the outlier threshold depends on",
        "  the values: the trace has none; on a GPU each such column keeps one more input column",
        "  per layer for backward (a few per layer in the LLM.int8 paper).",
        "- **Unpacked, unpadded batches.** No attention mask is passed and transformers'",
        "  packed-sequence check is answered as a real run of unpacked rows answers it (its few",
        "  512-B transients are not counted); with padding a GPU run builds a mask and takes the",
        "  mem-efficient kernel.",
        "- **Checkpointing is non-reentrant** (`use_reentrant=False`); HF's default without",
        "  `gradient_checkpointing_kwargs` is reentrant.",
        "- **Versions.** torch 2.13.0, transformers 5.24.0, peft 0.21.2, bitsandbytes 0.50.2;",
        "  each reference records the versions it ran with, and other versions can differ.",
    ]
    return "\n".join(lines) + "\n"


def _equal(flag: bool) -> str:
    return "=" if flag else "≠"


def _yes(flag: bool) -> str:
    return "same" if flag else "DIFFERS"


def _check_named_case(model: str, spec: TrainingSpec) -> CaseReport:
    return check_case(model, spec, TINY_CONFIGS[model])


def check_all_cases() -> Iterator[CaseReport]:
    """Check every case of `validation_cases()`, each in a fresh process, in order.

    A real run leaves process-wide caches behind (bitsandbytes' 4-bit code tables,
    `backends/utils.py` `_code_4bit_cache`); a later case would reach them without allocating,
    so the tracker would count a storage the allocator never saw in that run.
    """
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=context, max_tasks_per_child=1) as pool:
        futures = [pool.submit(_check_named_case, m, s) for m, s in validation_cases()]
        for future in futures:
            yield future.result()


def report_line(report: CaseReport) -> str:
    """One case's outcome on one line."""
    return (
        f"{'ok ' if report.passed else 'BAD'} {report.name}: {report.fake_peak:,} B, "
        f"allocator at op boundaries {report.allocator.boundary_peak:,} B "
        f"(tracker {report.allocator.tracker_peak:,} B)"
    )
