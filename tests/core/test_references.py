"""The estimator against the committed reference traces: the allocated peak of the real HF/PEFT
step, traced storage by storage (see service/trace), on one GPU (tests/data/traces) and as rank
0 of DDP, FSDP1 and FSDP2 jobs on a fake process group (tests/data/traces_parallel)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from service.catalog.models import default_catalog
from service.core.device import REFERENCE_COMPUTE_CAPABILITY
from service.core.estimator import estimate
from service.core.result import Component, Estimate
from service.core.units import MIB

TRACES = Path(__file__).resolve().parents[1] / "data" / "traces"
PARALLEL_TRACES = TRACES.with_name("traces_parallel")
# Each set and the fewest references it holds (a set that lost its files fails).
REFERENCE_SETS = {"one-gpu": (TRACES, 140), "multi-gpu": (PARALLEL_TRACES, 60)}
PEAK_TOLERANCE = 0.01  # each reference's allocated peak
RESERVED_TOLERANCE = 0.02  # each reference's reserved peak (the allocator model's replay)
GRPO_GAP = "GRPO: the replayed KV cache growth takes more segments than the trace's (over)"
# Reserved peaks not yet within the tolerance, each with the bound it holds and why; a gap
# that grows fails, one that closes fails too.
RESERVED_KNOWN_GAPS: dict[str, tuple[float, str]] = {
    # Prompt tuning runs 1024 + 200 positions: the estimate interpolates the reserved gap
    # between the replays at 1024 and 2048 (reserved.reserved_gap), and the trace's step 2
    # takes a new logits-sized segment there; the replay at 1224 itself is within 0.03 %.
    "llama-3_2-1b__prompt-tuning__200-virtual__b1-s1024": (
        0.04,
        "prompt tuning's lengthened sequence: the reserved gap interpolated between powers of two",
    ),
    # DPO under autocast with checkpointing: the allocator replay (service/core/schedule) runs
    # the recomputed layers with the fused head's half-precision tiles and casts, but not yet
    # with every autocast copy the traced recomputation makes in the policy's backward.
    "llama-3_2-1b__qlora__dpo__r16-all-linear__nf4-dq__b2-s1024__ckpt__autocast": (
        0.03,
        "DPO under autocast with checkpointing: the replay's recomputed layers (over)",
    ),
    "phi-3-mini-4k-instruct__qlora__dpo__r16-all-linear__nf4-dq__b1-s1024__ckpt__autocast": (
        0.025,
        "DPO under autocast with checkpointing: the replay's recomputed layers (over)",
    ),
    "qwen2_5-0_5b__lora__dpo__r16-all-linear__b1-s512__ckpt__autocast": (
        0.035,
        "DPO under autocast with checkpointing: the replay's recomputed layers (under)",
    ),
    # GRPO: the allocator replay runs model.generate's prefill and its KV cache grown by
    # torch.cat a token at a time before each step (service/core/schedule/generation.py).
    # Where every head has its own key and value (Phi-3-mini: a 45 MiB tensor per layer at
    # 480 prompt tokens) the replayed growth outruns each segment's rounding and takes new
    # segments for all of them: 9.2 GB reserved during the generation where the trace's holds
    # 7.0 GB (its tensors 6.4 GB); which freed blocks the traced growth reuses is not found.
    "llama-3_2-1b__qlora__grpo__g8-p448__r16-all-linear__nf4-dq__b8-s512__ckpt": (0.025, GRPO_GAP),
    "phi-3-mini-4k-instruct__qlora__grpo__g8-p480__r16-all-linear__nf4-dq__b8-s512__ckpt": (
        0.33,
        GRPO_GAP,
    ),
    # a 16-row generation batch for one-completion micro-batches: the replay's gap at the
    # generation is 0.1 GB short of the trace's (the safe bound above it by 12 MiB)
    "qwen2_5-0_5b__lora__grpo__g8-p480__r16-all-linear__b1-s512__ckpt__ga16": (
        0.03,
        "GRPO: the generation's reserved gap beside a one-row step (under)",
    ),
    # KTO under autocast: the replay's allocated peak falls 108 MB short of the trace's with
    # checkpointing on Llama-3.2-1B QLoRA (the estimate's allocated level is exact, so the
    # recomputed layers' autocast copies are missing from the replay, as for DPO); on
    # Qwen2.5-0.5B QLoRA the replay's peak matches and its gap is 75 MB short; without
    # checkpointing, Llama-3.2-1B full's replay reserves 1.5 GB more in its second step than
    # in its first, where the trace's adds 0.5 GB. The safe bound holds on all three.
    "llama-3_2-1b__qlora__kto__r16-all-linear__nf4-dq__b2-s512__ckpt__autocast": (
        0.05,
        "KTO under autocast with checkpointing: the replay's recomputed layers (under)",
    ),
    "qwen2_5-0_5b__qlora__kto__apo-zero-unpaired__r16-all-linear__nf4-dq__b2-s1024__ckpt"
    "__autocast": (
        0.055,
        "KTO under autocast with checkpointing: the replay's segments (under)",
    ),
    "llama-3_2-1b__full__kto__b2-s512__autocast": (
        0.055,
        "KTO under autocast, full fine-tuning: the replay's second step (over)",
    ),
    # BOFT with three butterfly factors and checkpointing: the replay lays out each linear's
    # fp32 permutation buffer (3 x 2048 x 2048) but runs none of BOFT's own forward events (the
    # rotation's in x in products, service/core/estimator/oft.py _boft_saves); the allocated
    # level is exact.
    "llama-3_2-1b__boft__r0-default__block4__butterfly3__b1-s512__ckpt": (
        0.035,
        "BOFT's per-linear rotation products are not in the allocator replay (over)",
    ),
    # torchtune's activation offloading is estimated phase by phase; the allocator replay
    # keeps every checkpoint on the GPU, as without it (an over-estimate).
    "llama-3_2-1b__full__b1-s1024__ckpt__loss-hf__clip0__torchtune__optim-in-bwd__offload-acts": (
        0.03,
        "activation offloading: the replay keeps the offloaded checkpoints (over)",
    ),
    # Llama-3.2-Vision: the allocator replay runs the language model's step alone; the
    # tower's graph (checkpointing), the cross-attention layers' image keys and values and the
    # processor's inputs are added to the allocated level but not replayed, so their segments'
    # rounding is missing (under: 1.4-2.0 % on the other three references).
    **{
        f"llama-3_2-11b-vision__lora__r16-gate_proj+up_proj+down_proj__{shape}": (
            0.025,
            "Llama-3.2-Vision: the tower's and cross-attention layers' tensors are not "
            "replayed (under)",
        )
        for shape in ("b1-s2048__img2-560x1120", "b2-s512__img2-448x448")
    },
    # transformers 4's looped MoE experts (stack hf-4.48): the replay lays out every expert's
    # weights and adapters one by one, as the trace's, but runs the block's forward and
    # backward as transformers 5's grouped one, not expert by expert.
    **{
        name: (bound, "transformers 4's looped experts: the replay runs the grouped block (under)")
        for name, bound in (
            ("qwen1_5-moe-a2_7b__lora__r16-all-linear__b1-s512__ckpt__transformers4_48_0", 0.03),
            (
                "qwen1_5-moe-a2_7b__qlora__r16-all-linear__nf4-dq__b1-s512__ckpt"
                "__transformers4_48_0",
                0.07,
            ),
        )
    },
    # Encoder-decoders (T5): the step is estimated phase by phase, not replayed op by op, so
    # their reserved level is reported at the allocated one (an under-estimate).
    **{
        path.stem: (0.13, "T5's reserved level is not modelled: reported at the allocated level")
        for path in TRACES.glob("t[05]*.json")
    },
}
MEDIAN_TOLERANCE = 0.003  # median over all references
COMPONENT_TOLERANCE = 0.02  # each component, or within COMPONENT_SLACK_BYTES
COMPONENT_SLACK_BYTES = 16 * MIB

# References the estimator does not yet meet the tolerances on, each with the bound it holds
# and why; docs/accuracy.md lists them. A gap that grows fails; one that closes
# fails too, so this list only shrinks.
KNOWN_GAPS: dict[str, tuple[float, str]] = {}


def _references(directory: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))]


def _estimate(ref: dict[str, Any]) -> Estimate:
    from service.trace.reference import spec_from_json

    arch = default_catalog().resolve(ref["model_id"]).arch
    spec = spec_from_json(ref["spec"])
    return estimate(arch, spec, compute_capability=REFERENCE_COMPUTE_CAPABILITY)


@pytest.fixture(scope="module", params=sorted(REFERENCE_SETS))
def compared(request: pytest.FixtureRequest) -> list[tuple[dict[str, Any], Estimate]]:
    directory, fewest = REFERENCE_SETS[request.param]
    refs = _references(directory)
    assert len(refs) >= fewest, f"the committed references in {directory} are missing"
    return [(ref, _estimate(ref)) for ref in refs]


def test_peaks_match_the_traces(
    compared: list[tuple[dict[str, Any], Estimate]], capsys: pytest.CaptureFixture[str]
) -> None:
    errors = []
    beyond = []
    lines = [f"{'reference':<66}{'traced GiB':>11}{'estimate':>10}{'error':>9}  peak"]
    for ref, est in compared:
        traced = ref["peak"]["allocated_bytes"]
        err = est.allocated_bytes / traced - 1
        errors.append(abs(err))
        bound = KNOWN_GAPS.get(ref["name"], (PEAK_TOLERANCE, ""))[0]
        if abs(err) > bound:
            beyond.append(f"{ref['name']}: {err:+.3%} (bound {bound:.0%})")
        if ref["name"] in KNOWN_GAPS and abs(err) <= PEAK_TOLERANCE:
            beyond.append(
                f"{ref['name']}: now within {PEAK_TOLERANCE:.0%}; drop it from KNOWN_GAPS"
            )
        where = f"{ref['peak']['phase']}/{ref['peak']['step']}"
        lines.append(
            f"{ref['name'][:65]:<66}{traced / 2**30:>11.2f}{est.allocated_bytes / 2**30:>10.2f}"
            f"{err:>+9.3%}  {where}"
        )
    lines.append(f"median |error| {statistics.median(errors):.4%}, max {max(errors):.4%}")
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    assert not beyond, "\n".join(beyond)
    assert statistics.median(errors) <= MEDIAN_TOLERANCE


def test_reserved_matches_the_traces(
    compared: list[tuple[dict[str, Any], Estimate]], capsys: pytest.CaptureFixture[str]
) -> None:
    """The tracer replays every allocation of the traced step through the allocator model;
    the estimator replays the step's schedule it synthesises from the shapes."""
    errors = []
    beyond = []
    lines = [f"{'reference':<66}{'traced GiB':>11}{'estimate':>10}{'error':>9}"]
    for ref, est in compared:
        traced = ref["reserved"]["bytes"]
        assert traced >= ref["peak"]["allocated_bytes"]
        err = est.reserved_bytes / traced - 1
        errors.append(abs(err))
        bound = RESERVED_KNOWN_GAPS.get(ref["name"], (RESERVED_TOLERANCE, ""))[0]
        # A multi-GPU trace replays one stream; on a GPU the collectives allocate on streams
        # of their own, in pools the default stream cannot reuse, so its reserved level is not
        # the GPU's: printed, not held to the bound.
        if ref["spec"]["parallel"]["gpus"] == 1 and abs(err) > bound:
            beyond.append(f"{ref['name']}: reserved {err:+.3%} (bound {bound:.0%})")
        if ref["name"] in RESERVED_KNOWN_GAPS and abs(err) <= RESERVED_TOLERANCE:
            beyond.append(f"{ref['name']}: now within; drop it from RESERVED_KNOWN_GAPS")
        lines.append(
            f"{ref['name'][:65]:<66}{traced / 2**30:>11.2f}{est.reserved_bytes / 2**30:>10.2f}"
            f"{err:>+9.3%}"
        )
    lines.append(f"reserved: median |error| {statistics.median(errors):.4%}, max {max(errors):.4%}")
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    assert not beyond, "\n".join(beyond)


# Peaks within the tolerance whose breakdown is not the trace's: the estimate's peak moment
# holds the same total made up differently, each with why.
COMPONENT_KNOWN_GAPS: dict[str, str] = {
    "qwen2_5-0_5b__lora__grpo__g8-p480__r16-all-linear__b8-s512": (
        "GRPO LoRA without checkpointing: the trace peaks inside the top layer's MLP forward, "
        "before the fused head; the estimate's forward end holds the head's tiles (17 MB of "
        "logits_loss) and is 0.75 % under"
    ),
    "gemma-2-2b__lora__grpo__g8-p480__r16-all-linear__b8-s512__ckpt__eager": (
        "Gemma-2 LoRA GRPO, eager attention on 8 rows: the estimate's moment inside the "
        "layers' backward holds 19 MB more backward temporaries than the trace's (0.3 %)"
    ),
    "llama-3_2-1b__lora__dpo__r16-all-linear__b2-s512__ckpt__autocast__ddp-4gpu": (
        "DPO LoRA under autocast with checkpointing: the estimate's moment inside the layers' "
        "backward holds 16 MiB more activations than the trace's (0.5 % of the peak)"
    ),
    "phi-3-mini-4k-instruct__qlora__dpo__r16-all-linear__nf4-dq__b1-s1024__ckpt__autocast": (
        "Phi-3 QLoRA DPO under autocast: the trace peaks inside the recomputed top layer's "
        "fused gate_up, the estimate at its down_proj backward, 0.2 % above the trace"
    ),
    "gemma-2-2b__qlora__dpo__precomputed-ref__r16-all-linear__nf4-dq__b2-s512__ckpt__eager": (
        "Gemma-2 QLoRA, eager attention on 4 rows: the recomputed top layer's moment holds "
        "18 MiB more than the trace's (0.4 % of the peak)"
    ),
    "phi-3-mini-4k-instruct__full__b1-s512__ckpt__fsdp-2gpu-full-shard": (
        "FSDP1, untied LM head: the trace peaks as a layer above the bottom flattens its "
        "gradients (fewer sharded, more in flight); the estimate takes that at the bottom layer"
    ),
    **{
        name: (
            "transformers 4's looped experts, LoRA with checkpointing: the trace peaks inside "
            "the bottom layer's recomputation, at the MoE block's last saving op, where the "
            "forward's locals are still alive beside the layer's saved tensors (the routed "
            "output being summed, the last expert's gathered rows, Qwen2-MoE's shared product, "
            "hidden-sized residual sums: 16.7 MiB for Qwen1.5-MoE at s512, 39 MiB for Mixtral "
            "at s1024); the estimate holds the saved tensors alone (they match the trace "
            "without checkpointing within 0.1 %), the same total within 0.05 %"
        )
        for name in (
            "qwen1_5-moe-a2_7b__lora__r16-all-linear__b1-s512__ckpt__transformers4_48_0",
            "mixtral-8x7b-v0_1__lora__r16-all-linear__b1-s1024__ckpt__transformers4_48_0",
        )
    },
    **{
        name: (
            "transformers 4's looped experts, QLoRA with checkpointing: the trace peaks at the "
            "bottom layer's first 4-bit down projection backward in the MoE block (Qwen2-MoE's "
            "shared expert, Mixtral's last expert: its dequantized weight beside the "
            "gradients), the estimate as that block's backward begins, the same total within "
            "0.05 %"
        )
        for name in (
            "qwen1_5-moe-a2_7b__qlora__r16-all-linear__nf4-dq__b1-s512__ckpt__transformers4_48_0",
            "mixtral-8x7b-v0_1__qlora__r16-all-linear__nf4-dq__b1-s1024__ckpt__transformers4_48_0",
        )
    },
    "phi-3-mini-4k-instruct__full__b1-s512__ckpt__fsdp2-2gpu": (
        "FSDP2, untied LM head: the trace peaks inside a layer's backward with its unsharded "
        "gradients in flight (reduce-scatter input), the estimate at the bottom layer"
    ),
}


def test_components_match_the_traces(compared: list[tuple[dict[str, Any], Estimate]]) -> None:
    misses = []
    for ref, est in compared:
        if ref["name"] in KNOWN_GAPS or ref["name"] in COMPONENT_KNOWN_GAPS:
            continue
        for name, traced in ref["peak"]["components"].items():
            ours = est.components.get(Component(name), 0)
            diff = abs(ours - traced)
            if diff > max(COMPONENT_SLACK_BYTES, COMPONENT_TOLERANCE * traced):
                misses.append(f"{ref['name']}: {name} traced {traced} estimated {ours}")
    assert not misses, "\n".join(misses)


def test_pinned_host_memory_matches_the_traces() -> None:
    """Offloaded activations' pinned host memory, exactly as traced (the power-of-two blocks of
    the pinned caching allocator); none where nothing is offloaded."""
    refs = [r for r in _references(TRACES) if r["spec"].get("activation_offloading")]
    assert len(refs) >= 4, "the activation offloading references are missing"
    for ref in refs:
        assert _estimate(ref).host_pinned_bytes == ref["host_pinned_bytes"], ref["name"]


def test_peak_phase_matches_the_traces(compared: list[tuple[dict[str, Any], Estimate]]) -> None:
    misses = [
        f"{ref['name']}: traced {ref['peak']['phase']}/{ref['peak']['step']}, "
        f"estimated {est.peak_phase.value}/{est.peak_step}"
        for ref, est in compared
        if (ref["peak"]["phase"], ref["peak"]["step"]) != (est.peak_phase.value, est.peak_step)
        # within 1 % of each other the two phases are a tie the trace may resolve either way
        and abs(est.allocated_bytes / ref["peak"]["allocated_bytes"] - 1) > PEAK_TOLERANCE
        and ref["name"] not in KNOWN_GAPS
    ]
    assert not misses, "\n".join(misses)


# Each objective's references with at least this many of them committed (`-k dpo`, `-k grpo`,
# `-k kto`, `-k orpo`, `-k reward`).
OBJECTIVE_REFERENCES = {"dpo": 21, "grpo": 9, "kto": 24, "orpo": 18, "reward": 11}


@pytest.mark.parametrize("objective", sorted(OBJECTIVE_REFERENCES))
def test_objective_references_match(objective: str, capsys: pytest.CaptureFixture[str]) -> None:
    """One objective's references alone: allocated within PEAK_TOLERANCE, reserved within
    RESERVED_TOLERANCE (or its known gap's bound), the peak's phase the trace's; printed per
    reference."""
    refs = [r for r in _references(TRACES) if r["spec"].get("objective") == objective]
    assert len(refs) >= OBJECTIVE_REFERENCES[objective], f"the {objective} references are missing"
    lines = [f"{'reference':<66}{'traced GiB':>11}{'error':>9}{'reserved':>10}  peak"]
    beyond = []
    for ref in refs:
        est = _estimate(ref)
        err = est.allocated_bytes / ref["peak"]["allocated_bytes"] - 1
        reserved = est.reserved_bytes / ref["reserved"]["bytes"] - 1
        traced_phase = (ref["peak"]["phase"], ref["peak"]["step"])
        reserved_bound = RESERVED_KNOWN_GAPS.get(ref["name"], (RESERVED_TOLERANCE, ""))[0]
        if abs(err) > PEAK_TOLERANCE or abs(reserved) > reserved_bound:
            beyond.append(f"{ref['name']}: {err:+.3%} allocated, {reserved:+.3%} reserved")
        if traced_phase != (est.peak_phase.value, est.peak_step):
            beyond.append(f"{ref['name']}: peak {traced_phase}, estimated {est.peak_phase}")
        lines.append(
            f"{ref['name'][:65]:<66}{ref['peak']['allocated_bytes'] / 2**30:>11.2f}"
            f"{err:>+9.3%}{reserved:>+10.3%}  {traced_phase[0]}/{traced_phase[1]}"
        )
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    assert not beyond, "\n".join(beyond)
