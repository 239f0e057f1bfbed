"""Encoder-decoder models (T5 v1.1, mT5): the parsed layout and its parameter count, the
target length in the spec, and the refusal of their step while it is not modelled."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from service.catalog.models import default_catalog
from service.core.architecture import MlpKind, ModelArch
from service.core.codec import spec_from_dict, spec_to_dict
from service.core.errors import InvalidConfigError, InvalidSpecError
from service.core.estimator import estimate, peak_levels
from service.core.hf_config import from_hf_config
from service.core.spec import TrainingSpec

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


@pytest.mark.parametrize("name", ["bigscience/T0_3B", "bigscience/mt0-xxl"])
def test_the_step_is_refused_until_it_is_modelled(name: str) -> None:
    spec = TrainingSpec(batch_size=8, seq_len=128, target_length=4)
    for run in (estimate, peak_levels):
        with pytest.raises(InvalidConfigError, match="not modelled yet") as caught:
            run(_arch(name), spec)
        assert caught.value.field == "model_type"


def test_t5_references_are_traced_with_their_target_length() -> None:
    references = [json.loads(p.read_text()) for p in sorted(TRACES.glob("t[05]*.json"))]
    names = {ref["model_id"] for ref in references}
    assert {"google/t5-v1_1-small", "bigscience/T0_3B"} <= names
    for ref in references:
        assert ref["spec"]["target_length"] < ref["spec"]["seq_len"]
        assert f"__t{ref['spec']['target_length']}" in ref["name"]
