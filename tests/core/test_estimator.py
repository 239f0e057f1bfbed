"""Estimator components against bytes computed by hand for a tiny Llama-style config."""

from __future__ import annotations

import pytest

from service.core.arch.hf_config import from_hf_config
from service.core.errors import InvalidSpecError
from service.core.estimator import (
    adapted_linears,
    estimate,
    layer_flow,
    layer_saved_bytes,
    litgpt_zero_pad_width,
)
from service.core.result import Component, Phase
from service.core.spec import (
    AttnImpl,
    Framework,
    LoraSpec,
    Method,
    Optim,
    QuantSpec,
    TrainingSpec,
    resolve,
)

TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 100,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
ARCH = from_hf_config(TINY)
LORA_QV = LoraSpec(r=4, target_modules=("q_proj", "v_proj"))


def _spec(**changes: object) -> TrainingSpec:
    base: dict[str, object] = {
        "method": Method.LORA,
        "lora": LORA_QV,
        "batch_size": 2,
        "seq_len": 8,
    }
    base.update(changes)
    return TrainingSpec(**base)  # type: ignore[arg-type]


def test_tiny_parameter_count() -> None:
    # embed 100*64, 2 layers of (q 64*64, k 64*32, v 64*32, o 64*64, gate/up/down 3*64*128,
    # 2 norms of 64), final norm 64, lm_head 100*64
    per_layer = 4096 + 2048 + 2048 + 4096 + 3 * 8192 + 2 * 64
    assert ARCH.total_params == 6400 + 2 * per_layer + 64 + 6400


def test_layer_activations_by_hand() -> None:
    rs = resolve(_spec())
    # b=2, s=8 -> 16 tokens; every tensor rounded up to 512 B.
    norm = 16 * 64 * 4 + 512  # fp32 copy of the input + rstd (64 B -> 512)
    lora_q = 16 * 64 * 4 + 512  # fp32 cast of the input + A output (256 B -> 512)
    lora_v = 16 * 64 * 4 + 512  # q and v each cast the shared input separately
    attention = 16 * 64 * 2 + 16 * 32 * 2 + 16 * 32 * 2 + 16 * 64 * 2 + 512  # q k v out lse
    mlp = 3 * 16 * 128 * 2  # gate output, up output, SiLU output
    expected = norm + lora_q + lora_v + attention + norm + mlp
    assert layer_saved_bytes(ARCH, rs, 2, 8) == expected == 37376
    # The first layer's input takes no gradient: its first norm saves nothing.
    assert layer_saved_bytes(ARCH, rs, 2, 8, input_needs_grad=False) == expected - norm


def test_peak_by_hand() -> None:
    est = estimate(ARCH, _spec())
    frozen = 2 * (8192 + 4096 + 4096 + 8192 + 3 * 16384 + 2 * 512) + 12800 + 512 + 12800
    adapters = 2 * (1024 + 1024 + 1024 + 512)
    # fused AdamW: exp_avg and exp_avg_sq in the adapters' fp32, and a device-side fp32 `step`
    # per tensor (8 adapter tensors, 512 B each)
    state = 2 * adapters + 8 * 512
    rope = 2 * 512  # cos and sin, (1, 8, 16) bf16 = 256 B each
    activations = 37376 + 32768 + (16 * 64 * 4 + 512) + rope  # two layers, final norm, RoPE
    inputs = 2 * 512  # input_ids and labels, int64, 128 B each
    loss_at_backward_start = 3 * 6656  # fp32 log-probs, NLL grad, LogSoftmax grad (6400->6656)
    # step 2: both cuBLAS handles (the Python thread's, the autograd engine's) hold a 32 MiB
    # workspace (Hopper's CUBLAS_WORKSPACE_CONFIG default, :4096:8)
    workspaces = 2 * 32 * 2**20
    assert est.components == {
        Component.FROZEN_WEIGHTS: frozen,
        Component.TRAINABLE_PARAMS: adapters,
        Component.INPUTS: inputs,
        Component.WORKSPACES: workspaces,
        Component.OPTIMIZER_STATE: state,
        Component.ACTIVATIONS: activations,
        Component.LOGITS_LOSS: loss_at_backward_start,
    }
    assert est.allocated_bytes == 297984 + workspaces == sum(est.components.values())
    assert (est.peak_step, est.peak_phase) == (2, Phase.BACKWARD_START)


def test_optimizer_state_is_lazy() -> None:
    est = estimate(ARCH, _spec())
    by_phase = {(p.step, p.phase): p for p in est.phases}
    assert Component.OPTIMIZER_STATE not in by_phase[(1, Phase.FORWARD_END)].components
    assert by_phase[(2, Phase.FORWARD_END)].components[Component.OPTIMIZER_STATE] > 0


def test_foreach_adamw_adds_one_state_copy_in_the_step() -> None:
    fused = estimate(ARCH, _spec(method=Method.FULL, lora=None))
    foreach = estimate(ARCH, _spec(method=Method.FULL, lora=None, optim=Optim.ADAMW_TORCH))
    step = {p.phase: p for p in foreach.phases if p.step == 1}[Phase.OPTIMIZER_STEP]
    trainable = fused.components[Component.TRAINABLE_PARAMS]
    assert step.components[Component.OPTIMIZER_TEMPORARIES] == trainable
    assert step.components[Component.OPTIMIZER_STATE] == 2 * trainable  # foreach: host steps


def test_qlora_weights_nf4_by_hand() -> None:
    est = estimate(ARCH, _spec(method=Method.QLORA, quantization=QuantSpec(prepare_kbit=False)))

    def nf4(n: int) -> int:  # packed + fp32 absmax per 64 + 16-entry fp32 code, each >= 512 B
        return max(512, -(-n // 2 // 512) * 512) + max(512, -(-(n // 64 * 4) // 512) * 512) + 512

    linears = [64 * 64, 64 * 32, 64 * 32, 64 * 64, 64 * 128, 64 * 128, 128 * 64]
    per_layer = sum(nf4(n) for n in linears) + 2 * 512  # bf16 norms stay
    assert est.components[Component.FROZEN_WEIGHTS] == 2 * per_layer + 12800 + 512 + 12800


def test_prepare_kbit_upcasts_unquantized_weights() -> None:
    plain = estimate(ARCH, _spec(method=Method.QLORA, quantization=QuantSpec(prepare_kbit=False)))
    prepared = estimate(ARCH, _spec(method=Method.QLORA, quantization=QuantSpec()))
    diff = (
        prepared.components[Component.FROZEN_WEIGHTS] - plain.components[Component.FROZEN_WEIGHTS]
    )
    assert diff == 2 * 12800  # embeddings and lm_head double; tiny norms stay one 512 B block


def test_eager_attention_warns_with_size() -> None:
    est = estimate(ARCH, _spec(attn_implementation=AttnImpl.EAGER))
    assert any("eager attention" in w for w in est.warnings)


def test_sequence_beyond_positions_warns() -> None:
    est = estimate(ARCH, _spec(seq_len=1024))
    assert any("max_position_embeddings" in w for w in est.warnings)


def test_litgpt_zero_pad_copies_the_adapted_part_of_qkv() -> None:
    # LitGPT's zero_pad index_copies the adapters' q/k/v output into the fused width when not
    # all of q, k and v are adapted; index_copy's backward keeps that source.
    qv = adapted_linears(ARCH, resolve(_spec(framework=Framework.LITGPT)))
    assert litgpt_zero_pad_width(ARCH, qv) == 64 + 32  # q_dim + kv_dim
    qkv = LoraSpec(r=4, target_modules=("q_proj", "k_proj", "v_proj"))
    every = adapted_linears(ARCH, resolve(_spec(framework=Framework.LITGPT, lora=qkv)))
    assert litgpt_zero_pad_width(ARCH, every) == 0
    neox = from_hf_config(
        {
            "model_type": "gpt_neox",
            "hidden_size": 64,
            "intermediate_size": 256,
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
            "vocab_size": 100,
            "max_position_embeddings": 512,
        }
    )
    fused = LoraSpec(r=4, target_modules=("query_key_value",))
    adapted = adapted_linears(neox, resolve(_spec(framework=Framework.LITGPT, lora=fused)))
    assert litgpt_zero_pad_width(neox, adapted) == 64 + 64  # query and value parts
    said = estimate(neox, _spec(framework=Framework.LITGPT, lora=fused)).assumptions
    assert any("query and value parts of the fused qkv" in a for a in said)
    # The copy is LitGPT's alone: the same layer under HF + PEFT keeps it not.
    for framework, width in ((Framework.LITGPT, 64 + 32), (Framework.HF, 0)):
        rs = resolve(_spec(framework=framework))
        assert layer_flow(ARCH, rs, adapted_linears(ARCH, rs)).zero_pad_width == width


def test_litgpt_qlora_warns_that_inputs_outlive_the_step() -> None:
    quant = QuantSpec(double_quant=True)
    est = estimate(ARCH, _spec(method=Method.QLORA, quantization=quant, framework=Framework.LITGPT))
    assert any("until the next forward pass" in w for w in est.warnings)
    assert not any(
        "until the next forward pass" in w
        for w in estimate(ARCH, _spec(method=Method.QLORA, quantization=quant)).warnings
    )


LORA_QV_DORA = LoraSpec(r=4, target_modules=("q_proj", "v_proj"), use_dora=True)


def test_dora_adds_a_magnitude_per_output_feature_of_each_adapted_linear() -> None:
    lora = estimate(ARCH, _spec())
    dora = estimate(ARCH, _spec(lora=LORA_QV_DORA))
    # q_proj (64 outputs) and v_proj (32) in each of the 2 layers
    assert dora.params.trainable - lora.params.trainable == 2 * (64 + 32)
    assert dora.allocated_bytes > lora.allocated_bytes


def test_dora_saves_the_base_and_adapter_results_of_each_adapted_linear() -> None:
    b, s = 2, 8
    lora = layer_saved_bytes(ARCH, resolve(_spec()), b, s)
    dora = layer_saved_bytes(ARCH, resolve(_spec(lora=LORA_QV_DORA)), b, s)

    def blk(nbytes: int) -> int:
        return -(-nbytes // 512) * 512

    # per adapted linear (fp32 adapters, bf16 model, 16 tokens): the bf16 base result, the
    # fp32 adapter result, and three fp32 vectors of its outputs (norm, scale, scale - 1)
    expected = sum(blk(16 * out * 2) + blk(16 * out * 4) + 3 * blk(out * 4) for out in (64, 32))
    assert dora - lora == expected


def test_rslora_changes_no_memory() -> None:
    plain = estimate(ARCH, _spec())
    rslora = estimate(
        ARCH, _spec(lora=LoraSpec(r=4, target_modules=("q_proj", "v_proj"), use_rslora=True))
    )
    assert (rslora.allocated_bytes, rslora.reserved_bytes) == (
        plain.allocated_bytes,
        plain.reserved_bytes,
    )


def test_dora_outside_peft_is_refused() -> None:
    with pytest.raises(InvalidSpecError) as caught:
        _spec(lora=LORA_QV_DORA, framework=Framework.LITGPT)
    assert caught.value.field == "lora.use_dora"


def test_dora_on_a_moes_expert_parameters_is_refused() -> None:
    from service.catalog.models import default_catalog

    arch = default_catalog().resolve("Qwen/Qwen3-30B-A3B").arch
    spec = _spec(lora=LoraSpec(r=8, target_modules="all-linear", use_dora=True), seq_len=128)
    with pytest.raises(InvalidSpecError) as caught:
        estimate(arch, spec)
    assert caught.value.field == "lora.use_dora"
    attention_only = LoraSpec(r=8, target_modules=("q_proj", "v_proj"), use_dora=True)
    assert estimate(arch, _spec(lora=attention_only, seq_len=128)).allocated_bytes > 0
