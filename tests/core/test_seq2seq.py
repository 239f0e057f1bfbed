"""Encoder-decoder models (T5 v1.1, mT5): the parsed layout and its parameter count, the
target length in the spec, the step's estimate (tests/core/test_references.py holds it to the
traces) and what it refuses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from service.catalog.models import default_catalog
from service.core.arch import MlpKind, ModelArch
from service.core.arch.hf_config import from_hf_config
from service.core.codec import spec_from_dict, spec_to_dict
from service.core.errors import InvalidConfigError, InvalidSpecError
from service.core.estimator import estimate, peak_levels
from service.core.result import Component, Phase
from service.core.spec import (
    ZERO3_PARAM_PERSISTENCE_THRESHOLD,
    ZERO3_PREFETCH_BUCKET_SIZE,
    ZERO_REDUCE_BUCKET_SIZE,
    AttnImpl,
    LoraSpec,
    Method,
    Offload,
    Optim,
    ParallelSpec,
    QuantSpec,
    SdpaKernel,
    Strategy,
    TrainingSpec,
)
from service.core.units import DType

TRACES = Path(__file__).resolve().parents[1] / "data" / "traces"


def _arch(name: str) -> ModelArch:
    return default_catalog().resolve(name).arch


def _t5_count(h: int, inner: int, ff: int, enc: int, dec: int, vocab: int, heads: int) -> int:
    """T5ForConditionalGeneration's parameters with a gated feed-forward and an untied
    lm_head, tensor by tensor (models/t5/modeling_t5.py)."""
    attention = 4 * h * inner
    ffn = 3 * h * ff  # wi_0, wi_1, wo
    encoder = enc * (attention + ffn + 2 * h)  # two T5LayerNorms per block
    decoder = dec * (2 * attention + ffn + 3 * h)  # self- and cross-attention
    bias_tables = 2 * 32 * heads  # relative_attention_bias in each stack's first block
    return 2 * vocab * h + encoder + decoder + bias_tables + 2 * h  # final norms


@pytest.mark.parametrize(
    ("name", "h", "heads", "ff", "layers", "vocab"),
    [
        ("bigscience/T0_3B", 2048, 32, 5120, 24, 32128),
        ("bigscience/mt0-xxl", 4096, 64, 10240, 24, 250112),
        ("google/t5-v1_1-small", 512, 6, 1024, 8, 32128),
    ],
)
def test_the_layout_counts_every_tensor(
    name: str, h: int, heads: int, ff: int, layers: int, vocab: int
) -> None:
    arch = _arch(name)
    assert arch.encoder_decoder and not arch.encoder
    assert arch.decoder_layers == arch.num_hidden_layers == layers
    assert arch.mlp is MlpKind.GATED and arch.hidden_act == "gelu_new"
    assert not arch.tie_word_embeddings
    assert arch.total_params == _t5_count(h, heads * 64, ff, layers, layers, vocab, heads)
    assert [lin.name.split(".")[-1] for lin in arch.decoder_linears] == [
        *("q", "k", "v", "o", "q", "k", "v", "o"),
        *("wi_0", "wi_1", "wo"),
    ]


def _config(**overrides: Any) -> dict[str, Any]:
    path = Path(__file__).resolve().parents[2] / "service/catalog/models/google--t5-v1_1-small.json"
    return {**json.loads(path.read_text())["config"], **overrides}


def test_the_original_t5_layout_is_relu_and_tied_by_default() -> None:
    raw = _config(feed_forward_proj="relu", num_decoder_layers=3)
    del raw["tie_word_embeddings"]
    arch = from_hf_config(raw)
    assert arch.mlp is MlpKind.PLAIN and arch.hidden_act == "relu"
    assert arch.tie_word_embeddings and arch.decoder_layers == 3
    assert [lin.name for lin in arch.linears][-2:] == ["DenseReluDense.wi", "DenseReluDense.wo"]


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"feed_forward_proj": "gated-gelu-x"}, "feed_forward_proj"),
        ({"feed_forward_proj": "double-gelu"}, "feed_forward_proj"),
        ({"dropout_rate": 1.5}, "dropout_rate"),
        ({"num_heads": 0}, "num_heads"),
        ({"d_model": None}, "d_model"),
    ],
)
def test_invalid_t5_configs_name_the_field(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidConfigError) as caught:
        from_hf_config(_config(**overrides))
    assert caught.value.field == field


def test_target_length_is_written_when_set_and_read_back() -> None:
    spec = TrainingSpec(batch_size=8, seq_len=128, target_length=4)
    assert spec_to_dict(spec)["target_length"] == 4
    assert "target_length" not in spec_to_dict(TrainingSpec(batch_size=8, seq_len=128))
    assert spec_from_dict(spec_to_dict(spec)) == spec
    with pytest.raises(InvalidSpecError, match="target_length"):
        spec_from_dict({"batch_size": 2, "seq_len": 16, "target_length": 0})
    with pytest.raises(InvalidSpecError, match="target_length"):
        TrainingSpec(batch_size=2, seq_len=16, target_length=0)


def test_target_length_on_a_decoder_only_model_is_refused() -> None:
    decoder = _arch("Qwen/Qwen2.5-0.5B")
    spec = TrainingSpec(batch_size=1, seq_len=64, target_length=8)
    for run in (estimate, peak_levels):
        with pytest.raises(InvalidSpecError) as caught:
            run(decoder, spec)
        assert caught.value.field == "target_length"


def _job(**overrides: Any) -> TrainingSpec:
    """PEFT's seq2seq example: fp32, batch 8, torch AdamW, LoRA r8 on q and v, dropout 0.1."""
    values: dict[str, Any] = {
        "method": Method.LORA,
        "batch_size": 8,
        "seq_len": 128,
        "target_length": 4,
        "dtype": DType.FP32,
        "optim": Optim.ADAMW_TORCH,
        "attn_implementation": AttnImpl.EAGER,
        "lora": LoraSpec(r=8, lora_alpha=32, lora_dropout=0.1, target_modules=None),
    }
    return TrainingSpec(**{**values, **overrides})


def test_t0_3b_lora_holds_its_weights_and_peaks_at_the_loss_backward() -> None:
    arch = _arch("bigscience/T0_3B")
    est = estimate(arch, _job())
    tied = arch.total_params - arch.vocab_size * arch.hidden_size
    assert est.params.total == tied  # transformers 5 ties the lm_head to the shared table
    # q and v of 24 encoder self-attentions and 24 decoder self- and cross-attentions
    assert est.params.trainable == 72 * 2 * 8 * (2048 + 2048)
    assert est.components[Component.FROZEN_WEIGHTS] == tied * 4
    assert est.peak_phase is Phase.BACKWARD_START
    longer = estimate(arch, _job(target_length=64))
    assert longer.allocated_bytes > est.allocated_bytes
    levels = peak_levels(arch, _job())
    assert levels.allocated_bytes == est.allocated_bytes
    assert est.allocated_bytes <= levels.device_bytes < levels.device_bytes_upper


def test_full_fine_tuning_peaks_in_the_optimizer_step_with_foreach_adamw() -> None:
    est = estimate(_arch("bigscience/T0_3B"), _job(method=Method.FULL, lora=None))
    assert est.peak_phase is Phase.OPTIMIZER_STEP
    trainable = est.components[Component.TRAINABLE_PARAMS]
    assert est.components[Component.OPTIMIZER_STATE] == 2 * trainable
    assert est.components[Component.OPTIMIZER_TEMPORARIES] == trainable


def test_sdpa_saves_no_score_matrices() -> None:
    arch = _arch("bigscience/T0_3B")
    eager = estimate(arch, _job(seq_len=512))
    sdpa = estimate(arch, _job(seq_len=512, attn_implementation=AttnImpl.SDPA))
    # eager keeps the softmax, its dropout's output and mask per head and query: 9 bytes per
    # score in fp32, over 24 encoder blocks at 512 tokens far above SDPA's outputs
    scores = 8 * 32 * 512 * 512 * 9 * 24
    saved = eager.components[Component.ACTIVATIONS] - sdpa.components[Component.ACTIVATIONS]
    assert saved > scores // 2


def test_accumulated_micro_batches_hold_every_gradient() -> None:
    arch = _arch("bigscience/T0_3B")
    one = estimate(arch, _job())
    two = estimate(arch, _job(gradient_accumulation_steps=2))
    adapters = one.components[Component.TRAINABLE_PARAMS]
    assert two.allocated_bytes == one.allocated_bytes + adapters
    assert two.components[Component.GRADIENTS] == adapters


def test_a_feed_forward_other_than_gated_gelu_is_refused() -> None:
    relu = from_hf_config(_config(feed_forward_proj="relu"))
    with pytest.raises(InvalidConfigError, match="gated-gelu") as caught:
        estimate(relu, _job())
    assert caught.value.field == "feed_forward_proj"


def test_the_target_defaults_to_the_source_length() -> None:
    arch = _arch("google/t5-v1_1-small")
    same = estimate(arch, _job(target_length=128)).allocated_bytes
    assert estimate(arch, _job(target_length=None)).allocated_bytes == same


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"attn_implementation": AttnImpl.FLASH_ATTENTION_2}, "attn_implementation"),
        ({"attn_implementation": AttnImpl.SDPA, "sdpa_kernel": SdpaKernel.MATH}, "sdpa_kernel"),
        ({"gradient_checkpointing": True}, "gradient_checkpointing"),
        ({"method": Method.QLORA, "quantization": QuantSpec()}, "method"),
        ({"autocast": True, "dtype": DType.BF16}, "autocast"),
        ({"dtype": DType.FP16}, "dtype"),
        ({"optim": Optim.SGD}, "optim"),
        ({"parallel": ParallelSpec(gpus=2)}, "parallel.strategy"),
        ({"parallel": ParallelSpec(gpus=2, strategy=Strategy.FSDP)}, "parallel.strategy"),
        ({"parallel": ParallelSpec(strategy=Strategy.ZERO2)}, "parallel.strategy"),
        (
            {
                "method": Method.FULL,
                "lora": None,
                "parallel": ParallelSpec(strategy=Strategy.ZERO3),
            },
            "parallel.strategy",
        ),
        ({"num_labels": 3}, "num_labels"),
        ({"lora": LoraSpec(r=8, target_modules=("q_proj",))}, "lora.target_modules"),
    ],
)
def test_what_is_not_modelled_is_refused_by_field(overrides: dict[str, Any], field: str) -> None:
    for run in (estimate, peak_levels):
        with pytest.raises(InvalidSpecError) as caught:
            run(_arch("bigscience/mt0-xxl"), _job(**overrides))
        assert caught.value.field == field


def test_t5_references_are_traced_with_their_target_length() -> None:
    paths = [*TRACES.glob("t[05]*.json"), *TRACES.glob("mt0*.json")]
    references = [json.loads(p.read_text()) for p in sorted(paths)]
    names = {ref["model_id"] for ref in references}
    assert {"google/t5-v1_1-small", "bigscience/T0_3B", "bigscience/mt0-xxl"} <= names
    for ref in references:
        assert ref["spec"]["target_length"] != ref["spec"]["seq_len"]
        assert f"__t{ref['spec']['target_length']}" in ref["name"]


def test_the_safe_bound_covers_the_traced_reserved_level_it_does_not_model() -> None:
    """The reserved level is reported at the allocated one; the safe bound must still lie
    above what each traced step reserved, plus what the device adds outside the allocator."""
    paths = [*TRACES.glob("t[05]*.json"), *TRACES.glob("mt0*.json")]
    assert len(paths) >= 10
    for path in sorted(paths):
        ref = json.loads(path.read_text())
        answer = estimate(_arch(ref["model_id"]), spec_from_dict(ref["spec"]))
        assert answer.reserved_bytes == answer.allocated_bytes
        outside = answer.device_bytes - answer.reserved_bytes
        assert answer.device_bytes_upper >= ref["reserved"]["bytes"] + outside, ref["name"]


# PEFT's example ZeRO-3 offload run (README: accelerate's DeepSpeed plugin, no bucket keys):
# DeepSpeed's own defaults.
ZERO3_OFFLOAD = ParallelSpec(
    strategy=Strategy.ZERO3,
    offload=Offload.OPTIMIZER_AND_PARAMS,
    reduce_bucket_size=ZERO_REDUCE_BUCKET_SIZE,
    stage3_prefetch_bucket_size=ZERO3_PREFETCH_BUCKET_SIZE,
    stage3_param_persistence_threshold=ZERO3_PARAM_PERSISTENCE_THRESHOLD,
)


def test_zero3_offload_keeps_the_parameters_on_the_host_and_the_activations_on_the_gpu() -> None:
    arch = _arch("bigscience/T0_3B")
    one = estimate(arch, _job())
    zero = estimate(arch, _job(parallel=ZERO3_OFFLOAD))
    # the same saved tensors: ZeRO-3 moves parameters, not activations (fp32: no cast)
    assert zero.components[Component.ACTIVATIONS] == one.components[Component.ACTIVATIONS]
    # on the GPU only the parameters under the persistence threshold: norms, the relative
    # bias tables and the adapters, a few MB
    kept = zero.components[Component.FROZEN_WEIGHTS] + zero.components[Component.TRAINABLE_PARAMS]
    assert kept < 64 * 2**20
    assert one.components[Component.FROZEN_WEIGHTS] > 10 * 2**30
    # every parameter's fp32 shard (one GPU: the whole model) is pinned on the host
    assert zero.host_bytes >= arch.total_params * 4 - arch.vocab_size * arch.hidden_size * 4
    # the 5e8-element fp32 reduce bucket lives on the GPU for the whole run
    assert zero.components[Component.COMMUNICATION] > ZERO_REDUCE_BUCKET_SIZE * 4
    assert zero.allocated_bytes < one.allocated_bytes
    assert any("ZeRO-3" in note for note in zero.assumptions)
    assert peak_levels(arch, _job(parallel=ZERO3_OFFLOAD)).allocated_bytes == zero.allocated_bytes


def test_zero3_shards_over_gpus_and_casts_the_adapters_to_the_half_dtype() -> None:
    arch = _arch("bigscience/mt0-xxl")
    two = ParallelSpec(gpus=2, strategy=Strategy.ZERO3)
    four = ParallelSpec(gpus=4, strategy=Strategy.ZERO3)
    at_two = estimate(arch, _job(parallel=two))
    at_four = estimate(arch, _job(parallel=four))
    # without offload each GPU keeps 1/N of every parameter
    frozen_two = at_two.components[Component.FROZEN_WEIGHTS]
    frozen_four = at_four.components[Component.FROZEN_WEIGHTS]
    assert frozen_four < frozen_two < arch.total_params * 4
    assert frozen_two == pytest.approx(2 * frozen_four, rel=0.01)
    # bf16 with DeepSpeed: the fp32 adapters PEFT makes become bf16, so LoRA's dropout copies
    # and lora_A outputs are half as large as the one-GPU step's fp32 ones
    bf16 = estimate(arch, _job(dtype=DType.BF16, parallel=two))
    alone = estimate(arch, _job(dtype=DType.BF16))
    assert bf16.components[Component.ACTIVATIONS] < alone.components[Component.ACTIVATIONS]
