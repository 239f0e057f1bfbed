from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from service.catalog.models import (
    CatalogDataError,
    CatalogEntry,
    ModelCatalog,
    arch_from_config,
    default_catalog,
)
from service.core.arch.hf_config import from_hf_config
from service.core.errors import UnknownModelError

# Computed totals must match the published ones this closely: exact counts differ only by
# non-parameter buffers (Llama-2's rotary inv_freq), rounded ones by their rounding.
PARAM_TOLERANCE = 0.005

ENTRIES = default_catalog().entries()


def _relative_error(computed: int, published: int) -> float:
    return abs(computed - published) / published


@pytest.mark.parametrize("entry", ENTRIES, ids=[e.id for e in ENTRIES])
def test_computed_params_match_the_published_total(entry: CatalogEntry) -> None:
    computed = entry.arch.total_params
    error = _relative_error(computed, entry.published_params)
    print(f"\n{entry.id:<44} {computed:>16,} {entry.published_params:>16,} {100 * error:>8.4f} %")
    assert error <= PARAM_TOLERANCE


def test_rounded_published_totals_say_so() -> None:
    for entry in ENTRIES:
        if entry.published_params % 1_000_000 == 0:
            assert entry.published_params_source.startswith("ROUNDED"), entry.id


def test_every_entry_cites_its_config_on_the_hub() -> None:
    for entry in ENTRIES:
        assert entry.source == f"https://huggingface.co/{entry.id}/blob/main/config.json"


def test_catalog_covers_the_required_architectures() -> None:
    required = {
        "meta-llama/Llama-2-7b-hf",
        "meta-llama/Llama-2-13b-hf",
        "meta-llama/Llama-2-70b-hf",
        "meta-llama/Llama-3.1-8B",
        "meta-llama/Llama-3.1-70B",
        "meta-llama/Llama-3.2-1B",
        "meta-llama/Llama-3.2-3B",
        "meta-llama/Llama-3.3-70B-Instruct",
        "Qwen/Qwen-1_8B",
        "Qwen/Qwen-7B",
        "Qwen/Qwen-14B",
        "Qwen/Qwen-72B",
        "Qwen/Qwen2.5-0.5B",
        "Qwen/Qwen2.5-1.5B",
        "Qwen/Qwen2.5-3B",
        "Qwen/Qwen2.5-7B",
        "Qwen/Qwen2.5-14B",
        "Qwen/Qwen2.5-32B",
        "Qwen/Qwen2.5-72B",
        "Qwen/Qwen3-8B",
        "Qwen/Qwen1.5-MoE-A2.7B",
        "mistralai/Mistral-7B-v0.1",
        "mistralai/Mistral-7B-v0.3",
        "mistralai/Mixtral-8x7B-v0.1",
        "google/gemma-2-2b",
        "google/gemma-2-9b",
        "google/gemma-2-27b",
        "microsoft/Phi-3-mini-4k-instruct",
        "microsoft/phi-1_5",
        "stabilityai/stablelm-base-alpha-3b",
        "THUDM/glm-4-9b",
        "THUDM/glm-4-9b-hf",
        "01-ai/Yi-1.5-6B",
        "01-ai/Yi-1.5-9B",
        "01-ai/Yi-1.5-34B",
        "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
        "deepseek-ai/DeepSeek-R1-Distill-Llama-8B",
    }
    assert required <= {entry.id for entry in ENTRIES}


@pytest.mark.parametrize(
    "model_id",
    [  # the decoder-only models that rows of published_peaks_dev.csv use
        "Qwen/Qwen-1.8B",
        "Qwen/Qwen-7B",
        "Qwen/Qwen-14B",
        "Qwen/Qwen-72B",
        "meta-llama/Llama-2-7b-hf",
        "meta-llama/Llama-2-13b-hf",
        "meta-llama/Llama-3.1-8B",
        "meta-llama/Llama-3.2-3B",
        "meta-llama/Llama-3.3-70B-Instruct",
        "microsoft/phi-1_5",
        "stabilityai/stablelm-base-alpha-3b",
    ],
)
def test_models_of_the_reference_peaks_resolve(model_id: str) -> None:
    default_catalog().resolve(model_id)


# ---------------------------------------------------------------------------------------------
# counting, checked by hand

TINY_LLAMA: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 1000,
    "tie_word_embeddings": True,
}


def test_tiny_llama_with_tied_embeddings_counts_by_hand() -> None:
    head_dim = 64 // 4
    attention = 64 * 64 + 2 * (64 * 2 * head_dim) + 64 * 64  # q, k, v (2 KV heads), o
    mlp = 3 * 64 * 128  # gate, up, down
    norms = 2 * 64  # input and post-attention RMSNorm weights
    per_layer = attention + mlp + norms
    assert per_layer == 12_288 + 24_576 + 128
    expected = 1000 * 64 + 2 * per_layer + 64  # embedding (= LM head), layers, final norm
    assert expected == 138_048
    assert arch_from_config(TINY_LLAMA).total_params == expected


def test_untying_the_tiny_llama_adds_one_lm_head() -> None:
    untied = arch_from_config({**TINY_LLAMA, "tie_word_embeddings": False})
    assert untied.total_params == 138_048 + 1000 * 64


def test_arch_from_config_is_the_core_parser() -> None:
    entry = default_catalog().resolve("Qwen/Qwen2.5-7B")
    assert arch_from_config(entry.config) == from_hf_config(entry.config) == entry.arch


def test_entry_config_is_read_only() -> None:
    entry = default_catalog().resolve("Qwen/Qwen2.5-7B")
    with pytest.raises(TypeError):
        entry.config["hidden_size"] = 1  # type: ignore[index]


# ---------------------------------------------------------------------------------------------
# resolution


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("Qwen/Qwen2.5-7B", "Qwen/Qwen2.5-7B"),
        ("qwen/qwen2.5-7b", "Qwen/Qwen2.5-7B"),
        ("qwen2.5-7b", "Qwen/Qwen2.5-7B"),
        ("  Qwen2.5-7B  ", "Qwen/Qwen2.5-7B"),
        ("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-7B"),
        ("qwen2.5-7b-instruct", "Qwen/Qwen2.5-7B"),
        ("meta-llama/Llama-2-7b-chat-hf", "meta-llama/Llama-2-7b-hf"),
        ("Meta-Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B"),
        ("google/gemma-2-9b-it", "google/gemma-2-9b"),
        ("mistralai/Mistral-7B-Instruct-v0.3", "mistralai/Mistral-7B-v0.3"),
        ("Qwen/Qwen-1.8B", "Qwen/Qwen-1_8B"),
        ("meta-llama/Llama-3.3-70B-Instruct", "meta-llama/Llama-3.3-70B-Instruct"),
        ("microsoft/Phi-3-mini-4k-instruct", "microsoft/Phi-3-mini-4k-instruct"),
    ],
)
def test_resolve(query: str, expected: str) -> None:
    assert default_catalog().resolve(query).id == expected


def test_unknown_model_suggests_the_closest_ids() -> None:
    with pytest.raises(UnknownModelError) as caught:
        default_catalog().resolve("Qwen/Qwen2.5-8B")
    error = caught.value
    assert isinstance(error, LookupError)
    assert error.model_id == "Qwen/Qwen2.5-8B"
    assert len(error.suggestions) == 3
    assert "Qwen/Qwen2.5-7B" in error.suggestions
    assert "Qwen/Qwen2.5-7B" in str(error)


def test_an_organisation_is_not_dropped_from_a_qualified_id() -> None:
    with pytest.raises(UnknownModelError):
        default_catalog().resolve("someone/Qwen2.5-7B")


def _entry(model_id: str, aliases: tuple[str, ...] = ()) -> CatalogEntry:
    return CatalogEntry(
        id=model_id,
        aliases=aliases,
        config=TINY_LLAMA,
        arch=from_hf_config(TINY_LLAMA),
        source=f"https://huggingface.co/{model_id}/blob/main/config.json",
        published_params=138_048,
        published_params_source="counted by hand in this test",
    )


@pytest.mark.parametrize(
    "query",
    ["acme/tiny-7b-instruct", "ACME/Tiny-7B-Chat", "tiny-7b-it", "acme/tiny-7b_v2-hf"],
)
def test_fine_tuned_variants_fall_back_to_their_base(query: str) -> None:
    catalog = ModelCatalog([_entry("acme/tiny-7b"), _entry("acme/tiny-7b_v2-hf")])
    assert catalog.resolve(query).id in {"acme/tiny-7b", "acme/tiny-7b_v2-hf"}
    assert catalog.resolve("acme/tiny-7b_v2-chat-hf").id == "acme/tiny-7b_v2-hf"


def test_a_listed_variant_wins_over_its_base() -> None:
    catalog = ModelCatalog([_entry("acme/tiny-7b"), _entry("acme/tiny-7b-instruct")])
    assert catalog.resolve("acme/tiny-7b-instruct").id == "acme/tiny-7b-instruct"


def test_an_ambiguous_name_needs_its_organisation() -> None:
    catalog = ModelCatalog([_entry("acme/tiny"), _entry("other/tiny")])
    assert catalog.resolve("other/tiny").id == "other/tiny"
    with pytest.raises(UnknownModelError) as caught:
        catalog.resolve("tiny")
    assert set(caught.value.suggestions) == {"acme/tiny", "other/tiny"}


def test_an_alias_claimed_twice_is_refused() -> None:
    with pytest.raises(CatalogDataError, match="names both"):
        ModelCatalog([_entry("acme/a", ("acme/shared",)), _entry("acme/b", ("acme/shared",))])


# ---------------------------------------------------------------------------------------------
# loading


def _write(directory: Path, name: str, doc: object) -> None:
    (directory / name).write_text(json.dumps(doc), encoding="utf-8")


def _doc(model_id: str = "acme/tiny") -> dict[str, Any]:
    return {
        "id": model_id,
        "aliases": [],
        "source": f"https://huggingface.co/{model_id}/blob/main/config.json",
        "published_params": 138_048,
        "published_params_source": "by hand",
        "config": TINY_LLAMA,
    }


def test_loads_a_directory(tmp_path: Path) -> None:
    _write(tmp_path, "acme--tiny.json", _doc())
    (tmp_path / "README.txt").write_text("not an entry", encoding="utf-8")
    catalog = ModelCatalog.from_directory(tmp_path)
    assert [entry.id for entry in catalog.entries()] == ["acme/tiny"]
    assert catalog.resolve("tiny").arch.total_params == 138_048


@pytest.mark.parametrize(
    ("name", "doc", "message"),
    [
        ("acme--tiny.json", "{not json", "Expecting property name"),
        ("acme--tiny.json", [], "JSON object"),
        ("acme--tiny.json", {**_doc(), "published_params": "7B"}, "published_params"),
        ("acme--tiny.json", {**_doc(), "published_params": True}, "published_params"),
        ("acme--tiny.json", {**_doc(), "aliases": [1]}, "aliases"),
        ("acme--wrong.json", _doc(), "belongs in acme--tiny.json"),
        ("acme--tiny.json", {**_doc(), "config": {"model_type": "whisper"}}, "model_type"),
        ("tiny.json", _doc("tiny"), "'<org>/<name>'"),
    ],
)
def test_malformed_files_are_refused(tmp_path: Path, name: str, doc: object, message: str) -> None:
    if isinstance(doc, str):
        (tmp_path / name).write_text(doc, encoding="utf-8")
    else:
        _write(tmp_path, name, doc)
    with pytest.raises(CatalogDataError, match=message) as caught:
        ModelCatalog.from_directory(tmp_path)
    assert str(caught.value).startswith(f"{name}: ")
