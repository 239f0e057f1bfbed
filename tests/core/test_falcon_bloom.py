"""Falcon and BLOOM read from their config.json: module layout, parameter counts, errors."""

from __future__ import annotations

import pytest

from service.catalog.models import default_catalog
from service.core.arch import LinearKind, MlpKind, NormKind
from service.core.arch.hf_config import from_hf_config
from service.core.errors import InvalidConfigError, InvalidSpecError
from service.core.estimator import estimate
from service.core.spec import ALL_LINEAR, AttnImpl, LoraSpec, Method, SdpaKernel, TrainingSpec
from service.core.units import DType

FALCON_7B = {
    "model_type": "falcon",
    "hidden_size": 4544,
    "num_attention_heads": 71,
    "num_hidden_layers": 32,
    "multi_query": True,
    "parallel_attn": True,
    "new_decoder_architecture": False,
    "bias": False,
    "alibi": False,
    "vocab_size": 65024,
}
# Falcon-40B's layout (new_decoder_architecture: grouped key/value heads, ln_attn and ln_mlp).
FALCON_NEW = {
    "model_type": "falcon",
    "hidden_size": 8192,
    "num_attention_heads": 128,
    "num_kv_heads": 8,
    "num_hidden_layers": 60,
    "new_decoder_architecture": True,
    "parallel_attn": True,
    "bias": False,
    "alibi": False,
    "vocab_size": 65024,
}
BLOOM = {"model_type": "bloom", "n_embed": 1024, "n_head": 16, "n_layer": 24, "vocab_size": 250880}


def test_falcon_7b_is_multi_query_with_one_parallel_layernorm() -> None:
    arch = from_hf_config(FALCON_7B)
    qkv, dense, up, down = arch.linears
    assert (qkv.name, qkv.kind, qkv.out_features) == (
        "query_key_value",
        LinearKind.ATTN_QKV,
        (71 + 2) * 64,
    )
    assert (dense.name, up.name, down.name) == ("dense", "dense_h_to_4h", "dense_4h_to_h")
    assert up.out_features == down.in_features == 4 * 4544
    assert not any(lin.bias for lin in arch.linears)
    assert arch.num_key_value_heads == 1 and arch.head_dim == 64
    assert arch.norm is NormKind.LAYER and arch.norms_per_layer == 1
    assert arch.parallel_residual and arch.mlp is MlpKind.PLAIN
    assert arch.tie_word_embeddings and not arch.alibi and not arch.embedding_norm


def test_falcon_new_decoder_architecture_has_grouped_heads_and_two_norms() -> None:
    arch = from_hf_config(FALCON_NEW)
    assert arch.num_key_value_heads == 8
    assert arch.linears[0].out_features == (128 + 2 * 8) * 64
    assert arch.norms_per_layer == 2
    one = from_hf_config({**FALCON_NEW, "num_ln_in_parallel_attn": 1})
    assert one.norms_per_layer == 1


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"alibi": True}, "alibi"),
        ({"parallel_attn": False}, "parallel_attn"),
        ({"num_kv_heads": 3, "new_decoder_architecture": True}, "num_kv_heads"),
        ({"hidden_size": 4545}, "hidden_size"),
    ],
)
def test_falcon_layouts_not_modelled_are_refused(change: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidConfigError) as raised:
        from_hf_config({**FALCON_7B, **change})
    assert raised.value.field == field


def test_bloom_has_biased_linears_an_embedding_norm_and_alibi() -> None:
    arch = from_hf_config(BLOOM)
    assert arch.hidden_size == 1024  # from n_embed
    assert [lin.name for lin in arch.linears] == [
        "query_key_value",
        "dense",
        "dense_h_to_4h",
        "dense_4h_to_h",
    ]
    assert all(lin.bias for lin in arch.linears)
    assert arch.linears[0].out_features == 3 * 1024
    assert arch.alibi and arch.embedding_norm and not arch.parallel_residual
    assert arch.norms_per_layer == 2 and arch.tie_word_embeddings
    # bloom-560m's model card: 559,214,592 parameters, word_embeddings_layernorm included
    assert arch.total_params == 559_214_592


def test_bloom_post_layernorm_residual_is_refused() -> None:
    with pytest.raises(InvalidConfigError) as raised:
        from_hf_config({**BLOOM, "apply_residual_connection_post_layernorm": True})
    assert raised.value.field == "apply_residual_connection_post_layernorm"


@pytest.mark.parametrize(
    ("model_id", "total"),
    [
        ("tiiuae/falcon-7b", 6_921_720_704),
        ("bigscience/bloom-560m", 559_214_592),
        ("bigscience/bloomz-7b1", 7_069_016_064),
    ],
)
def test_catalog_entries_resolve(model_id: str, total: int) -> None:
    assert default_catalog().resolve(model_id).arch.total_params == total


def _lora_spec(**changes: object) -> TrainingSpec:
    fields: dict[str, object] = {
        "method": Method.LORA,
        "batch_size": 1,
        "seq_len": 512,
        "lora": LoraSpec(r=16, lora_alpha=32, target_modules=ALL_LINEAR),
    }
    return TrainingSpec(**{**fields, **changes})  # type: ignore[arg-type]


def test_bloom_runs_its_own_attention_whatever_is_requested() -> None:
    """transformers 5.24 refuses SDPA for BLOOM and from_pretrained falls back to eager."""
    arch = default_catalog().resolve("bigscience/bloom-560m").arch
    eager = estimate(arch, _lora_spec(attn_implementation=AttnImpl.EAGER))
    sdpa = estimate(arch, _lora_spec())
    assert sdpa.allocated_bytes == eager.allocated_bytes
    assert sdpa.reserved_bytes == eager.reserved_bytes
    assert any("BLOOM runs its own attention" in a for a in sdpa.assumptions)


def test_falcon_7b_attention_is_sdpa_math_whether_asked_or_picked() -> None:
    arch = default_catalog().resolve("tiiuae/falcon-7b").arch
    picked = estimate(arch, _lora_spec())
    asked = estimate(arch, _lora_spec(sdpa_kernel=SdpaKernel.MATH))
    assert picked.allocated_bytes == asked.allocated_bytes


@pytest.mark.parametrize("kernel", [SdpaKernel.FLASH, SdpaKernel.EFFICIENT])
def test_falcon_7b_refuses_kernels_that_cannot_broadcast_its_key_value_head(
    kernel: SdpaKernel,
) -> None:
    arch = default_catalog().resolve("tiiuae/falcon-7b").arch
    with pytest.raises(InvalidSpecError) as raised:
        estimate(arch, _lora_spec(sdpa_kernel=kernel))
    assert raised.value.field == "sdpa_kernel"


def test_falcon_qlora_quantizes_nothing_in_transformers_5() -> None:
    """FalconLinear subclasses nn.Linear, which transformers' 4-bit swap skips; kbit
    preparation then casts every weight to fp32 (reference trace falcon-7b__qlora__*)."""
    arch = default_catalog().resolve("tiiuae/falcon-7b").arch
    qlora = estimate(arch, _lora_spec(method=Method.QLORA, gradient_checkpointing=True))
    fp32_lora = estimate(arch, _lora_spec(dtype=DType.FP32, gradient_checkpointing=True))
    assert qlora.allocated_bytes == fp32_lora.allocated_bytes
    assert any("quantizes no layer" in w for w in qlora.warnings)
    bloom = default_catalog().resolve("bigscience/bloom-560m").arch
    quantized = estimate(bloom, _lora_spec(method=Method.QLORA))
    assert not any("quantizes no layer" in w for w in quantized.warnings)
