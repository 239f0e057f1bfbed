"""LoRA on an LLM.int8 base: what its linears keep, and what checkpointing cannot drop."""

from __future__ import annotations

from service.catalog.models import default_catalog
from service.core.estimator import estimate
from service.core.spec import ALL_LINEAR, LoraSpec, Method, QuantSpec, QuantType, TrainingSpec
from service.core.units import FP32_BYTES

LLAMA_1B = default_catalog().resolve("meta-llama/Llama-3.2-1B").arch


def _spec(quant: QuantType, ckpt: bool, prepare_kbit: bool = True) -> TrainingSpec:
    return TrainingSpec(
        method=Method.QLORA,
        batch_size=2,
        seq_len=512,
        gradient_checkpointing=ckpt,
        lora=LoraSpec(r=16, lora_alpha=32, target_modules=ALL_LINEAR),
        quantization=QuantSpec(type=quant, prepare_kbit=prepare_kbit),
    )


def _activations(quant: QuantType, ckpt: bool) -> int:
    return estimate(LLAMA_1B, _spec(quant, ckpt)).components["activations"]


def test_int8_linears_keep_their_four_distinct_inputs_past_checkpointing() -> None:
    """MatMul8bitLt holds its input on the autograd node, out of checkpointing's reach;
    bitsandbytes 0.50's 4-bit matmul keeps none. k-bit preparation runs the stream in fp32:
    each layer keeps the attention's and the MLP's normed inputs, the attention output and
    the MLP product, each once however many linears read it."""
    tokens = 2 * 512
    arch = LLAMA_1B
    widths = (arch.hidden_size, arch.q_dim, arch.hidden_size, arch.intermediate_size)
    kept = sum(tokens * width * FP32_BYTES for width in widths)
    difference = _activations(QuantType.INT8, True) - _activations(QuantType.NF4, True)
    assert difference == arch.num_hidden_layers * kept
    # without checkpointing the int8 inputs are saved tensors like any other
    assert _activations(QuantType.INT8, False) > _activations(QuantType.INT8, True)


def test_an_int8_answer_states_its_outlier_assumption_and_no_4bit_caveat() -> None:
    answer = estimate(LLAMA_1B, _spec(QuantType.INT8, ckpt=False, prepare_kbit=False))
    assert any("outlier threshold" in a for a in answer.assumptions)
    assert not any("modelled as for 4-bit" in w for w in answer.warnings)
