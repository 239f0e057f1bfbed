"""The transformers 4 MoE block the tracer swaps in (service/trace/linear_experts.py): its
forward routes each token as transformers 4's does, PEFT adapts its nn.Linear experts and
router as on transformers 4, and fake tensors get the even split."""

from __future__ import annotations

import warnings
from typing import Any

import pytest

torch = pytest.importorskip("torch")

HIDDEN, WIDTH, EXPERTS, TOP_K, TOKENS = 16, 24, 4, 2, 10


def _config(model_type: str, **extra: Any) -> Any:
    from transformers import AutoConfig

    values: dict[str, Any] = {
        "hidden_size": HIDDEN,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "intermediate_size": WIDTH,
        "num_experts_per_tok": TOP_K,
        "vocab_size": 64,
    }
    if model_type == "mixtral":
        values["num_local_experts"] = EXPERTS
    else:
        values |= {
            "num_experts": EXPERTS,
            "moe_intermediate_size": WIDTH,
            "shared_expert_intermediate_size": 2 * WIDTH,
        }
    return AutoConfig.for_model(model_type, **values, **extra)


def _dense_reference(block: Any, x: Any, renormalise: bool) -> Any:
    """Every expert on every token, weighted by the token's top-k routing weights (zero for
    the experts it is not routed to): what the per-expert loop must add up to."""
    probs = torch.softmax(block.gate(x).float(), dim=1)
    weights, chosen = torch.topk(probs, TOP_K, dim=-1)
    if renormalise:
        weights = weights / weights.sum(-1, keepdim=True)
    dense = torch.zeros(x.shape[0], EXPERTS)
    dense.scatter_(1, chosen, weights)
    out = sum(dense[:, i, None] * expert(x) for i, expert in enumerate(block.experts))
    if hasattr(block, "shared_expert"):
        out = out + torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    return out


@pytest.mark.parametrize(
    ("model_type", "renormalise"), [("mixtral", True), ("qwen2_moe", False), ("qwen2_moe", True)]
)
def test_the_loop_adds_up_each_tokens_routed_experts(model_type: str, renormalise: bool) -> None:
    from transformers import AutoModelForCausalLM

    from service.trace.linear_experts import EXPERT_LINEAR_NAMES, LoopedMoeBlock, install

    torch.manual_seed(0)
    config = _config(model_type, norm_topk_prob=renormalise)
    model = AutoModelForCausalLM.from_config(config)
    assert install(model, torch.float32) == 1
    block = model.model.layers[0].mlp
    assert isinstance(block, LoopedMoeBlock)
    block.to_empty(device="cpu")
    for param in block.parameters():
        torch.nn.init.normal_(param, std=0.2)
    x = torch.randn(1, TOKENS, HIDDEN)
    got = block(x).reshape(TOKENS, HIDDEN)
    want = _dense_reference(block, x.reshape(TOKENS, HIDDEN), renormalise)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # each expert's linears as transformers 4 names and registers them
    names = [name for name, _ in block.experts[0].named_children() if name != "act_fn"]
    assert set(names) == set(EXPERT_LINEAR_NAMES[model_type])
    if model_type == "mixtral":
        assert names == ["w1", "w2", "w3"]


def test_all_linear_adapts_every_expert_and_the_router_as_on_transformers_4() -> None:
    """PEFT 0.21 on transformers 5 rewrites a Mixtral's w1/w2/w3 and gate targets into the 3-D
    experts' parameters (which the stand-in does not have); with that rewrite off, as PEFT 0.14
    runs on transformers 4, "all-linear" puts a LoRA on every expert's linears and the router."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from service.trace.linear_experts import install
    from service.trace.model import _v4_targets

    def adapted(v4: bool) -> set[str]:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(_config("mixtral"))
        install(model, torch.float32)
        config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
        with _v4_targets(v4), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the libraries' deprecation notices
            peft_model = get_peft_model(model, config)
        return {
            name.removeprefix("base_model.model.")
            for name, module in peft_model.named_modules()
            if hasattr(module, "lora_A") and module.lora_A
        }

    layer = "model.layers.0.mlp"
    experts = {f"{layer}.experts.{i}.{w}" for i in range(EXPERTS) for w in ("w1", "w2", "w3")}
    found = adapted(True)
    assert experts | {f"{layer}.gate"} <= found
    assert "lm_head" not in found
    assert not experts & adapted(False)


def test_fake_tensors_get_an_even_split_of_the_routed_rows() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from service.trace.linear_experts import _where

    rows = TOKENS * TOP_K
    with FakeTensorMode():
        mask = torch.zeros(TOP_K, TOKENS, dtype=torch.long)
        shares = [_where(mask, e, EXPERTS, rows)[1].shape[0] for e in range(EXPERTS)]
        slot, token = _where(mask, 0, EXPERTS, rows)
        assert slot._base is not None and token._base is slot._base
        # the two index columns are views of one (rows, 2) int64 tensor, as CUDA's nonzero
        assert slot.untyped_storage().nbytes() == shares[0] * 2 * 8
    assert sum(shares) == rows
    assert max(shares) - min(shares) <= 1
