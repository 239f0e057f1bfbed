"""What a step's schedule is built from: the kernels, the optimizer's updater, the shapes."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from service.core.arch import ModelArch
from service.core.libs.optimizers import Updater

HALF_BYTES = 2  # autocast's bf16 / fp16

Event = tuple[int, int]


class Kernel(StrEnum):
    """The attention computation a layer runs (after SDPA's own backend choice)."""

    FLASH = "flash"  # flash / cuDNN: q, k, v, output and an fp32 log-sum-exp saved
    EFFICIENT = "efficient"  # mem-efficient: key/value repeated to the query heads
    MATH = "math"  # SDPA's math composite: fp32 scores materialised
    EAGER = "eager"  # transformers' eager attention: scores, fp32 softmax, cast


@dataclass(frozen=True, slots=True, kw_only=True)
class LinearShape:
    """One linear call of a decoder layer."""

    name: str
    d_in: int
    d_out: int
    adapted: bool  # carries a LoRA adapter
    trainable: bool  # its weight trains (full fine-tuning)
    weight_bytes: int  # a trainable weight's gradient bytes
    quantized: bool = False  # a bitsandbytes 4-bit weight
    int8: bool = False  # a bitsandbytes LLM.int8 weight (Linear8bitLt)
    bias: bool = False
    # (IA)^3: a trainable vector scales the output, or (a feedforward module) the input
    scales_output: bool = False
    scales_input: bool = False
    # LoKr's w1 and w2 (peft/tuners/lokr/layer.py): the bytes of each as its forward builds
    # it (0: a whole parameter), and of the gradients its backward makes (the parameter's,
    # or the rank-r pair's two).
    lokr_factors: tuple[int, ...] = ()
    lokr_grads: tuple[tuple[int, ...], ...] = ()
    # OFT's rotation of the input (peft/tuners/oft/layer.py): its block count and block size
    # (0, 0: none)
    oft_blocks: tuple[int, int] = (0, 0)

    @property
    def bnb(self) -> bool:
        """A bitsandbytes layer, which PEFT wraps in its bnb LoRA layers (peft/tuners/lora/
        bnb.py): the adapter's output cast to the base result's dtype, no input cast under
        autocast."""
        return self.quantized or self.int8


@dataclass(frozen=True, slots=True, kw_only=True)
class StepShape:
    """Everything the schedule depends on; sizes per token unless named otherwise."""

    tokens: int  # b * s
    batch: int
    seq: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    qkv: tuple[LinearShape, ...]  # q, k, v (or one fused projection)
    out_proj: LinearShape
    mlp_in: tuple[LinearShape, ...]  # gate, up (or one fused gate_up, or fc1)
    mlp_out: LinearShape
    gated: bool
    intermediate: int  # the MLP's (a MoE's shared expert's; 0 without one)
    experts: int = 0  # routed experts of a MoE block (0: a dense MLP)
    top_k: int = 0
    expert_intermediate: int = 0
    shared_gate: LinearShape | None = None  # a MoE's shared-expert gate (h -> 1)
    experts_trainable: bool = False
    expert_gate_up_bytes: int = 0
    expert_down_bytes: int = 0
    residual: int  # bytes per element of the residual stream
    compute: int  # the 4-bit linears' compute dtype bytes
    half_is_fp16: bool = False  # two-byte activations are fp16 (an fp16 model), not bf16
    adapter: int  # bytes per element of the LoRA adapters (0 without LoRA)
    rank: int
    dropout: bool
    double_quant: bool
    kernel: Kernel
    window_mask: bool  # an explicit (b, 1, s, s) mask is built for the model's forward
    masks: int  # how many (one per kind of layer: Gemma-2 has global and sliding ones)
    mask_bytes: int  # per element: 1 for SDPA's boolean mask, the attention dtype's for eager
    rope_pass_cat: bool  # RoPE concatenates the rotated and pass-through dimensions
    softcap: bool  # Gemma-2's attention-logit softcapping (eager)
    final_softcap: bool  # Gemma-2's final-logit softcapping
    gemma_norm: bool  # Gemma's RMSNorm: (1 + weight) applied in fp32, then the cast
    sandwich_norms: bool  # Gemma-2's norms after the attention and the MLP too
    embed_scale: bool  # Gemma scales the embedding output by sqrt(hidden_size)
    checkpointing: bool
    input_grad: bool  # the first layer's input needs a gradient
    norm_trainable: bool
    loss_upcast: bool  # HF's loss: logits.float() (no copy when they are fp32 already)
    loss_materialised: bool  # the loss builds b*s*V logits (not chunked or fused)
    head_bytes: int  # bytes per element of the logits
    head_trainable: bool
    embed_trainable: bool
    tied: bool  # the LM head is the embedding
    updater: Updater
    trainable: tuple[int, ...]  # trainable tensors' bytes, in parameter order
    states: tuple[int, ...]  # optimizer state tensors' bytes, in creation order
    largest_trainable: int  # elements of the largest trainable tensor (Adafactor)
    workspace: int  # one cuBLAS handle's workspace
    lt_workspace: int  # the cuBLASLt workspace (addmm with a bias), 0 when no linear has one
    # HF Trainer's mixed precision: matmuls and SDPA in half precision (autocast), the LM
    # head's half copy of a weight that is not half (0: none), and clipping's norms.
    autocast: bool = False
    head_weight_copy: int = 0
    clip: bool = False
    # torchtune's optimizer in backward: each gradient stepped and freed as it lands, a tied
    # head's waiting for the embedding's; the states made at the first gradient of step 1
    in_backward: bool = False
    param_bytes: int = 2  # bytes per element of the model's (trainable) weights
    accumulation: int = 1  # micro-batches per optimizer step
    # BLOOM: ALiBi instead of RoPE and its own baddbmm attention (modeling_bloom.py)
    alibi: bool = False
    # Falcon's eager attention: softmax in the model's dtype, the probabilities returned
    half_softmax: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3, Gemma-3)
    # HF Trainer's use_liger_kernel: Liger's RMSNorm, RoPE, SwiGLU and fused linear
    # cross-entropy Functions (service/core/liger.py)
    liger: bool = False
    liger_norm_in_place: bool = True  # LigerRMSNorm's in_place (False for Gemma-2)
    composite_gelu: bool = False  # transformers' NewGELUActivation, op by op (Phi)
    dora: bool = False  # PEFT's DoRA variant on the adapted linears (peft/tuners/lora/dora.py)
    # zero_grad(set_to_none=False), torch's default before 2.0: the gradients stay allocated
    # (zeroed in place) after the optimizer step, and the next step adds into them
    grads_kept: bool = False
    # softmax's and log_softmax's backward nodes keep their input too (torch before 1.11)
    softmax_saves_input: bool = False
    # LN tuning's trained norm copies, by the schedule's names ("norm1", "norm2", "final")
    trained_norms: frozenset[str] = frozenset()
    # prompt tuning's virtual tokens per sequence (counted in `seq`; 0: none)
    virtual_tokens: int = 0
    # prefix tuning's virtual tokens in front of every layer's keys and values (not in `seq`;
    # 0: none), the prefix's width per token (every layer's key and value) and the projection
    # MLP's hidden width (0: no projection)
    prefix_tokens: int = 0
    prefix_width: int = 0
    prefix_encoder: int = 0
    frozen_a: bool = False  # LoRA-FA: lora_A frozen (peft/optimizers/lorafa.py)
    vera: bool = False  # VeRA on the adapted linears (peft/tuners/vera/layer.py)
    loha: bool = False  # LoHa on the adapted linears (peft/tuners/loha/layer.py)
    lokr: bool = False  # LoKr on the adapted linears (peft/tuners/lokr/layer.py)
    # DPO (TRL's DPOTrainer): positions its fused LM head scores (0: not DPO), and whether
    # the step runs the reference model's forward (not with precomputed log-probs)
    dpo_scored: int = 0
    dpo_reference: bool = False
    # KTO (TRL's KTOTrainer) on DPO's fused-head step: the KL batch through the policy under
    # no_grad before its forward and through the reference before the completions; the
    # policy's head returns no is_top1 (dpo_top1 False)
    kto_kl: bool = False
    dpo_top1: bool = True
    dpo_mean_logits: bool = True  # GRPO's policy head: log-probs and entropy alone
    # GRPO's generation before each optimizer step (schedule/generation.py): its rows, prompt
    # tokens, generated tokens (0: none) and the KV cache's bytes per element
    generation_rows: int = 0
    generation_prompt: int = 0
    generation_tokens: int = 0
    generation_kv_bytes: int = 0
    # ORPO (TRL's ORPOTrainer): bytes per logit of its whole logits (0: not ORPO), kept for
    # its log-prob kernel, with the chosen half's NLL beside them
    orpo_logits: int = 0
    adalora: bool = False  # AdaLoRA on the adapted linears (peft/tuners/adalora/layer.py)
    oft: bool = False  # OFT on the adapted linears (peft/tuners/oft/layer.py)
    # AdaLoRA's penalised parameters' bytes, every lora_A and lora_B in named_parameters order,
    # and the RankAllocator's, every lora_A, lora_B and lora_E
    penalty: tuple[int, ...] = ()
    ranked: tuple[int, ...] = ()
    # A reward model (TRL's RewardTrainer): a one-output score head instead of the LM head
    score_head: bool = False

    @property
    def peft_method(self) -> str:
        """The PEFT method on the adapted linears: the first of `PEFT_FLAGS` set, else LoRA."""
        return next((name for name in PEFT_FLAGS if getattr(self, name)), "lora")


# The PEFT methods a StepShape flags, in the order they are read (OFT before the rest).
PEFT_FLAGS = ("oft", "loha", "lokr", "adalora", "vera", "dora")


def model_sizes(arch: ModelArch, batch: int, seq: int) -> dict[str, Any]:
    """A StepShape's sizes of the micro-batch and the model: tokens, layers, widths, heads
    and vocabulary."""
    return dict(
        tokens=batch * seq,
        batch=batch,
        seq=seq,
        layers=arch.num_hidden_layers,
        hidden=arch.hidden_size,
        heads=arch.num_attention_heads,
        kv_heads=arch.num_key_value_heads,
        head_dim=arch.head_dim,
        vocab=arch.vocab_size,
    )
