"""DeepSeek-V2/V3 configs: multi-head latent attention, dense first layers, DeepSeekMoE."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from service.catalog.models import default_catalog
from service.core.arch import LinearKind
from service.core.arch.hf_config import from_hf_config
from service.core.errors import InvalidConfigError, InvalidSpecError
from service.core.estimator import (
    deepseek_layer_trainable,
    deepseek_lora_targets,
    deepseek_model_states,
    deepseek_weights,
    estimate,
)
from service.core.result import Component
from service.core.spec import (
    AttnImpl,
    LoraSpec,
    LossImpl,
    Method,
    Optim,
    QuantSpec,
    SdpaKernel,
    TrainingSpec,
    resolve,
)
from service.core.spec.parallel import ParallelSpec
from service.core.units import DType
from service.trace.reference import spec_from_json
from tests.core.test_references import TRACES

V2_LITE = default_catalog().resolve("deepseek-ai/DeepSeek-V2-Lite")
V3 = default_catalog().resolve("deepseek-ai/DeepSeek-V3")
REFERENCES = sorted(TRACES.glob("deepseek-v2-lite__*.json"))


def _tiny(model_type: str = "deepseek_v2", **overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "model_type": model_type,
        "hidden_size": 64,
        "intermediate_size": 96,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": 256,
        "kv_lora_rank": 32,
        "q_lora_rank": None,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 12,
        "first_k_dense_replace": 1,
        "n_routed_experts": 8,
        "n_shared_experts": 2,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
    }
    return config | overrides


def test_every_traced_parameter_is_counted() -> None:
    """The full fine-tuning trace trains every parameter transformers builds."""
    ref = json.loads((TRACES / "deepseek-v2-lite__full__b1-s1024__ckpt.json").read_text())
    assert ref["params"]["total"] == ref["params"]["trainable"] == V2_LITE.arch.total_params


def test_v2_lite_layout() -> None:
    arch = V2_LITE.arch
    names = [lin.name for lin in arch.linears]
    assert names[:4] == ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    assert (arch.head_dim, arch.v_head_dim, arch.kv_lora_rank) == (192, 128, 512)
    assert (arch.num_experts, arch.num_experts_per_tok, arch.dense_layers) == (64, 6, 1)
    assert arch.shared_expert_intermediate_size == 2 * 1408
    dense = {lin.name: lin.out_features for lin in arch.dense_linears}
    assert dense["gate_proj"] == arch.intermediate_size == 10944
    assert arch.is_mla and arch.is_moe


def test_v3_projects_q_through_its_latent() -> None:
    arch = V3.arch
    q = [lin for lin in arch.linears if lin.kind is LinearKind.ATTN_QKV]
    assert [lin.name for lin in q] == ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"]
    assert q[1].in_features == 1536 and q[1].out_features == 128 * 192
    assert arch.dense_layers == 3 and arch.shared_expert_intermediate_size == 2048


def test_tiny_counts_match_transformers() -> None:
    """The parameter counts of the models transformers builds from the same configs."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    configs = [
        _tiny(),
        _tiny(q_lora_rank=24, attention_bias=True),
        _tiny("deepseek_v3", n_shared_experts=1, n_group=4, topk_group=2),
        _tiny(first_k_dense_replace=3),
    ]
    for config in configs:
        values = dict(config)
        hf = transformers.AutoConfig.for_model(values.pop("model_type"), **values)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(hf)
        built = sum(p.numel() for p in model.parameters())
        assert from_hf_config(config).total_params == built, config


def test_all_dense_layers_make_no_moe() -> None:
    arch = from_hf_config(_tiny(first_k_dense_replace=3))
    assert not arch.is_moe and arch.dense_layers == 0
    assert [lin.name for lin in arch.linears][-3:] == ["gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"first_k_dense_replace": 4}, "first_k_dense_replace"),
        ({"topk_method": "noaux_tc"}, "topk_method"),
        ({"topk_method": "group_limited_greedy", "n_group": 3}, "n_group"),
        ({"kv_lora_rank": 0}, "kv_lora_rank"),
        ({"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ],
)
def test_configs_transformers_cannot_run_are_refused(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidConfigError) as caught:
        from_hf_config(_tiny(**overrides))
    assert caught.value.field == field


def test_v3_needs_groups_dividing_its_experts() -> None:
    with pytest.raises(InvalidConfigError) as caught:
        from_hf_config(_tiny("deepseek_v3", n_group=3))
    assert caught.value.field == "n_group"


@pytest.mark.parametrize("path", REFERENCES, ids=[p.stem for p in REFERENCES])
def test_weights_match_the_traces_to_the_byte(path: Any) -> None:
    """Frozen weights (4-bit linears, the fp32 router, fp32 experts after kbit preparation,
    rotary buffers), trainable parameters (PEFT's adapters on the experts and the router),
    and fused AdamW's state, as the traced step holds them at its peak."""
    ref = json.loads(path.read_text())
    states = deepseek_model_states(V2_LITE.arch, spec_from_json(ref["spec"]))
    traced = ref["peak"]["components"]
    assert states.frozen == traced["frozen_weights"]
    assert states.trainable == traced["trainable_params"]
    assert states.optimizer_state == traced["optimizer_state"]
    assert (states.total_count, states.trainable_count) == (
        ref["params"]["total"],
        ref["params"]["trainable"],
    )


def _lora(targets: Any) -> LoraSpec:
    return LoraSpec(r=16, lora_alpha=32, target_modules=targets)


def test_peft_moves_mlp_targets_to_the_experts() -> None:
    arch = V2_LITE.arch
    all_linear = deepseek_lora_targets(arch, _lora("all-linear"))
    assert all_linear.modules == {"q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"}
    assert all_linear.router and all_linear.gate_up and all_linear.down
    mlp = deepseek_lora_targets(arch, _lora(("gate_proj", "up_proj", "down_proj")))
    assert not mlp.modules and not mlp.router and mlp.gate_up and mlp.down
    attention = deepseek_lora_targets(arch, _lora(("q_proj", "o_proj")))
    assert attention.modules == {"q_proj", "o_proj"} and not attention.gate_up


@pytest.mark.parametrize("targets", [("q_proj", "gate_proj"), ("k_proj",), None])
def test_targets_peft_refuses_are_refused(targets: Any) -> None:
    with pytest.raises(InvalidSpecError) as caught:
        deepseek_lora_targets(V2_LITE.arch, _lora(targets))
    assert caught.value.field == "lora.target_modules"


def _v2_job(**changes: Any) -> TrainingSpec:
    spec = TrainingSpec(
        method=Method.LORA,
        batch_size=1,
        seq_len=1024,
        lora=_lora("all-linear"),
        gradient_checkpointing=True,
    )
    return replace(spec, **changes)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"autocast": True}, "autocast"),
        ({"dtype": DType.FP32}, "dtype"),
        ({"gradient_accumulation_steps": 4}, "gradient_accumulation_steps"),
        ({"attn_implementation": AttnImpl.EAGER}, "attn_implementation"),
        ({"sdpa_kernel": SdpaKernel.FLASH}, "sdpa_kernel"),
        ({"sdpa_kernel": SdpaKernel.MATH}, "sdpa_kernel"),
        ({"loss": LossImpl.FUSED}, "loss"),
        ({"optim": Optim.ADAMW_BNB_8BIT}, "optim"),
        (
            {"lora": LoraSpec(r=16, target_modules="all-linear", lora_dropout=0.05)},
            "lora.lora_dropout",
        ),
        ({"lora": LoraSpec(r=16, target_modules="all-linear", use_dora=True)}, "lora.use_dora"),
        (
            {"lora": LoraSpec(r=16, target_modules="all-linear", adapter_dtype=DType.BF16)},
            "lora.adapter_dtype",
        ),
        (
            {"method": Method.QLORA, "quantization": QuantSpec(prepare_kbit=False)},
            "quantization.prepare_kbit",
        ),
        ({"parallel": ParallelSpec(gpus=2)}, "parallel.gpus"),
    ],
)
def test_settings_no_trace_checked_are_refused(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidSpecError) as caught:
        estimate(V2_LITE.arch, _v2_job(**changes))
    assert caught.value.field == field
    assert "DeepSeek" in str(caught.value)


def test_v3_refuses_what_v2_refuses() -> None:
    with pytest.raises(InvalidSpecError) as caught:
        estimate(V3.arch, _v2_job(autocast=True))
    assert caught.value.field == "autocast"


def test_v2_step_scales_with_the_tokens() -> None:
    """The saved tensors grow with the tokens, the expert stacks' merged copies do not."""
    one = estimate(V2_LITE.arch, _v2_job(gradient_checkpointing=False))
    two = estimate(V2_LITE.arch, _v2_job(gradient_checkpointing=False, batch_size=2))
    acts_one = one.components[Component.ACTIVATIONS]
    acts_two = two.components[Component.ACTIVATIONS]
    assert acts_one < acts_two < 2 * acts_one


@pytest.mark.parametrize("method", [Method.LORA, Method.FULL])
def test_layer_trainable_bytes_add_up_to_the_model(method: Method) -> None:
    """One MoE layer's and one dense layer's trainable bytes (the gradients a layer's backward
    has made) times their counts, with the embedding, final norm and head, are the model's."""
    arch = V2_LITE.arch
    spec = _v2_job(method=method, lora=_lora("all-linear") if method is Method.LORA else None)
    rs = resolve(spec)
    moe, dense = deepseek_layer_trainable(arch, rs)
    params = deepseek_weights(arch, rs)
    layers = (arch.num_hidden_layers - arch.dense_layers) * moe + arch.dense_layers * dense
    outside = params.embed_trainable + params.head_trainable
    assert layers + outside == params.trainable
    assert moe > dense > 0
