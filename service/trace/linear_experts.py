"""A MoE block laid out as transformers 4 builds it, swapped into the installed model.

transformers 5 keeps a block's routed experts as 3-D parameters run by grouped GEMMs; transformers
4 (checked against 4.48.0) builds one MLP of nn.Linear modules per expert and loops over them in
Python (models/mixtral/modeling_mixtral.py MixtralSparseMoeBlock and MixtralBlockSparseTop2MLP,
models/qwen2_moe/modeling_qwen2_moe.py Qwen2MoeSparseMoeBlock and Qwen2MoeMLP). That layout is
what bitsandbytes quantizes expert by expert and LoRA adapts linear by linear. `install` puts a
block of that layout, written here from those forwards' operations, in place of every MoE block
of a model built by the installed transformers, before quantization and PEFT, so that the
installed bitsandbytes and PEFT act on real nn.Linear experts.

The forward, in 4.48's order: the router's logits (an nn.Linear `gate`), their fp32 softmax,
top-k (renormalised for Mixtral, and for Qwen2-MoE/Qwen3-MoE when `norm_topk_prob`), the weights
cast back to the hidden dtype, a zero output, the one-hot expert mask permuted to (experts, k,
tokens); then per expert `torch.where` of its mask, the tokens gathered, the expert's MLP, the
product with its routing weights and `index_add_` into the output; Qwen2-MoE then adds its shared
expert scaled by the sigmoid of `shared_expert_gate`.

On fake tensors `torch.where` has no data to count: each expert is given an even share of the
batch's tokens x k routed rows (the first `tokens * k % experts` experts one row more), the one
int64 (rows, 2) tensor CUDA's nonzero returns, unbound into the two index columns.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

# The module names of each expert's linears and the block's router, as transformers 4 names them
# (MixtralBlockSparseTop2MLP: w1 gate, w3 up, w2 down; Qwen2MoeMLP: gate_proj, up_proj,
# down_proj), by model type.
EXPERT_LINEAR_NAMES: dict[str, tuple[str, str, str]] = {
    "mixtral": ("w1", "w3", "w2"),
    "qwen2_moe": ("gate_proj", "up_proj", "down_proj"),
    "qwen3_moe": ("gate_proj", "up_proj", "down_proj"),
}

# The order each expert's __init__ registers them (MixtralBlockSparseTop2MLP: w1, w2, w3;
# Qwen2MoeMLP: gate_proj, up_proj, down_proj).
REGISTRATION_ORDER = ("w1", "w2", "w3", "gate_proj", "up_proj", "down_proj")


class ExpertMlp(nn.Module):
    """One expert: act(gate(x)) * up(x) -> down, three bias-free nn.Linear."""

    def __init__(self, names: tuple[str, str, str], hidden: int, width: int, act: Any) -> None:
        super().__init__()
        self._names = names
        shapes = dict(zip(names, ((hidden, width), (hidden, width), (width, hidden)), strict=True))
        # registered in transformers 4's order (Mixtral's w1, w2, w3), the order bitsandbytes,
        # PEFT and the optimizer then meet them in
        for name in sorted(names, key=REGISTRATION_ORDER.index):
            self.add_module(name, nn.Linear(*shapes[name], bias=False))
        self.act_fn = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, name) for name in self._names)
        return down(self.act_fn(gate(x)) * up(x))  # type: ignore[no-any-return]


class LoopedMoeBlock(nn.Module):
    """A sparse MoE block run expert by expert (see the module docstring)."""

    def __init__(
        self,
        config: Any,
        names: tuple[str, str, str],
        *,
        renormalise: bool,
        shared_expert: nn.Module | None = None,
        shared_expert_gate: nn.Module | None = None,
    ) -> None:
        from transformers.activations import ACT2FN

        super().__init__()
        hidden = config.hidden_size
        experts = getattr(config, "num_local_experts", None) or config.num_experts
        width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        self.num_experts = experts
        self.top_k = config.num_experts_per_tok
        self.renormalise = renormalise
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(
            ExpertMlp(names, hidden, width, ACT2FN[config.hidden_act]) for _ in range(experts)
        )
        if shared_expert is not None:
            self.shared_expert = shared_expert
            self.shared_expert_gate = shared_expert_gate

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden)
        router_logits = self.gate(hidden_states)
        routing_weights = nn.functional.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected = torch.topk(routing_weights, self.top_k, dim=-1)
        if self.renormalise:
            routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        out = torch.zeros(
            (batch * seq, hidden), dtype=hidden_states.dtype, device=hidden_states.device
        )
        mask = nn.functional.one_hot(selected, num_classes=self.num_experts).permute(2, 1, 0)
        for index, expert in enumerate(self.experts):
            slot, token = _where(mask[index], index, self.num_experts, batch * seq * self.top_k)
            state = hidden_states[None, token].reshape(-1, hidden)
            routed = expert(state) * routing_weights[token, slot, None]
            out.index_add_(0, token, routed.to(hidden_states.dtype))
        if hasattr(self, "shared_expert"):
            shared = self.shared_expert(hidden_states)
            shared = nn.functional.sigmoid(self.shared_expert_gate(hidden_states)) * shared
            out = out + shared
        return out.reshape(batch, seq, hidden)


def _where(
    mask: torch.Tensor, expert: int, experts: int, rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.where(mask) (nonzero(as_tuple=True)); on fake tensors, the expert's even share of
    the routed rows."""
    if not isinstance(mask, FakeTensor):
        return torch.where(mask)  # type: ignore[no-any-return]
    share = rows // experts + (1 if expert < rows % experts else 0)
    found = torch.empty((share, mask.dim()), dtype=torch.long, device=mask.device)
    slot, token = found.unbind(1)
    return slot, token


def is_moe_block(module: nn.Module) -> bool:
    """A routed MoE block of the installed transformers (MixtralSparseMoeBlock, ...)."""
    return type(module).__name__.endswith("SparseMoeBlock")


def install(model: nn.Module, dtype: torch.dtype) -> int:
    """Put a `LoopedMoeBlock` in place of every MoE block of `model` (on meta, in `dtype`);
    returns how many. Qwen2-MoE keeps its own shared expert and gate, already nn.Linear."""
    config = model.config
    model_type = config.model_type
    if model_type not in EXPERT_LINEAR_NAMES:
        raise ValueError(f"no transformers 4 expert layout for model_type {model_type!r}")
    names = EXPERT_LINEAR_NAMES[model_type]
    # Mixtral always renormalises the top-k weights; Qwen2-MoE and Qwen3-MoE when told
    renormalise = model_type == "mixtral" or bool(getattr(config, "norm_topk_prob", False))
    swapped = 0
    for layer in model.get_decoder().layers:
        block = layer.mlp
        if not is_moe_block(block):
            continue
        with torch.device("meta"):
            looped = LoopedMoeBlock(
                config,
                names,
                renormalise=renormalise,
                shared_expert=getattr(block, "shared_expert", None),
                shared_expert_gate=getattr(block, "shared_expert_gate", None),
            ).to(dtype)
        looped.train(block.training)
        layer.mlp = looped
        swapped += 1
    return swapped
