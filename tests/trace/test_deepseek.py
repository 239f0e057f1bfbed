"""DeepSeek-V2/V3's model states against the traced step of tiny models: the latent-q path
(q_a_proj, q_a_layernorm, q_b_proj), V3's fp32 correction bias, PEFT's expert adapters."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from service.core.arch.hf_config import from_hf_config
from service.core.estimator import deepseek_model_states
from service.core.result import Component
from service.core.spec import LoraSpec, Method, Optim, QuantSpec, TrainingSpec
from service.trace.runner import trace
from tests.core.test_deepseek import _tiny

pytestmark = pytest.mark.trace

CONFIGS = {
    "v2-q-latent": _tiny(q_lora_rank=24),
    "v3": _tiny("deepseek_v3", q_lora_rank=24, n_shared_experts=1, n_group=4, topk_group=2),
}
LORA = LoraSpec(r=4, lora_alpha=8, target_modules="all-linear")
SPECS = {
    "lora": TrainingSpec(method=Method.LORA, batch_size=1, seq_len=16, lora=LORA),
    "qlora": TrainingSpec(
        method=Method.QLORA,
        batch_size=1,
        seq_len=16,
        lora=LORA,
        quantization=QuantSpec(),
        gradient_checkpointing=True,
    ),
    "full": TrainingSpec(method=Method.FULL, batch_size=1, seq_len=16, optim=Optim.ADAMW_TORCH),
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("method", sorted(SPECS))
def test_model_states_match_a_tiny_trace(config: str, method: str) -> None:
    raw: dict[str, Any] = CONFIGS[config]
    spec = SPECS[method]
    result = trace(spec, raw, config)
    states = deepseek_model_states(from_hf_config(raw), spec)
    traced = result.peak.components
    assert states.frozen == traced[Component.FROZEN_WEIGHTS]
    assert states.trainable == traced[Component.TRAINABLE_PARAMS]
    assert (states.total_count, states.trainable_count) == (
        result.params_total,
        result.params_trainable,
    )
    held = result.steps[-1].snapshot.components  # the steady state's last phase
    assert states.optimizer_state == held[Component.OPTIMIZER_STATE]
