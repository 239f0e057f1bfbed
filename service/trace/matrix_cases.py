"""The reference matrix's own cases (service/trace/reference.py `matrix()`), one table per
concept: each a list of (model id, spec), in the order the matrix lists them."""

from __future__ import annotations

from service.core.spec import AttnImpl, LossImpl, Method, Optim, QuantType, SdpaKernel, TrainingSpec
from service.core.stack import PINNED_STACK, preset
from service.core.units import DType
from service.trace.families import (
    ATTENTION_PROJECTIONS,
    BERT_BASE,
    BERT_LARGE,
    DEEPSEEK_V2_LITE,
    DEEPSEEK_V3,
    GEMMA_2B,
    GEMMA_3,
    LLAMA_8B,
    MISTRAL_7B,
    MIXTRAL,
    MLA_PROJECTIONS,
    PHI_2,
    PHI_3,
    QWEN3_MOE,
    QWEN_05B,
    QWEN_7B,
    QWEN_MOE,
    case_spec,
    lora_spec,
    qlora_spec,
)

Cases = list[tuple[str, TrainingSpec]]


def _on(model_id: str, *specs: TrainingSpec) -> Cases:
    """The cases of one model."""
    return [(model_id, s) for s in specs]


def qwen_7b_cases() -> Cases:
    """Qwen2.5-7B: the memory model's reference cases and the axes around them."""
    lora, qlora, full = Method.LORA, Method.QLORA, Method.FULL
    bf16 = DType.BF16
    cases: Cases = []
    cases += _on(
        QWEN_7B,
        case_spec(lora, 1, 512, ckpt=True),
        case_spec(lora, 4, 2048, ckpt=True),
        case_spec(lora, 4, 2048),
        case_spec(lora, 4, 2048, lora=lora_spec(adapter_dtype=bf16)),
        case_spec(lora, 4, 2048, ckpt=True, lora=lora_spec(adapter_dtype=bf16)),
        case_spec(qlora, 4, 2048, ckpt=True),
        case_spec(qlora, 4, 2048),
        case_spec(qlora, 4, 2048, ckpt=True, quantization=qlora_spec(prepare_kbit=False)),
        case_spec(qlora, 4, 2048, ckpt=True, quantization=qlora_spec(double_quant=False)),
        case_spec(qlora, 4, 2048, ckpt=True, quantization=qlora_spec(type=QuantType.FP4)),
        case_spec(qlora, 1, 512, ckpt=True),
        case_spec(lora, 1, 2048, ckpt=True),
        case_spec(lora, 1, 2048),
        case_spec(lora, 1, 8192, ckpt=True),
        case_spec(qlora, 1, 8192, ckpt=True),
        case_spec(lora, 1, 2048, attn_implementation=AttnImpl.EAGER),
        case_spec(lora, 1, 2048, sdpa_kernel=SdpaKernel.EFFICIENT),
        case_spec(lora, 1, 2048, sdpa_kernel=SdpaKernel.MATH),
        case_spec(lora, 1, 2048, attn_implementation=AttnImpl.FLASH_ATTENTION_2),
        case_spec(lora, 4, 2048, ckpt=True, optim=Optim.ADAMW_TORCH),
        case_spec(lora, 4, 2048, ckpt=True, optim=Optim.ADAMW_BNB_8BIT),
        case_spec(lora, 4, 2048, ckpt=True, lora=lora_spec(r=8, targets=None)),
        case_spec(lora, 4, 2048, ckpt=True, lora=lora_spec(r=64)),
        case_spec(lora, 4, 2048, ckpt=True, lora=lora_spec(targets=ATTENTION_PROJECTIONS)),
        case_spec(lora, 4, 2048, ckpt=True, lora=lora_spec(modules_to_save=("lm_head",))),
        case_spec(
            lora, 1, 2048, ckpt=True, lora=lora_spec(modules_to_save=("embed_tokens", "lm_head"))
        ),
        case_spec(lora, 4, 2048, ckpt=True, lora=lora_spec(lora_dropout=0.05)),
        case_spec(lora, 4, 2048, ckpt=True, loss=LossImpl.PLAIN),
        case_spec(full, 1, 2048, ckpt=True),
        case_spec(full, 1, 2048, ckpt=True, optim=Optim.ADAMW_TORCH),
        case_spec(full, 1, 2048, ckpt=True, optim=Optim.ADAMW_BNB_8BIT),
        case_spec(full, 1, 512),
    )
    return cases


def seven_b_family_cases() -> Cases:
    """Llama-3.1-8B, Mistral-7B, Gemma-2-2B and Phi-3-mini: their layouts' LoRA, QLoRA and full
    steps."""
    lora, qlora, full = Method.LORA, Method.QLORA, Method.FULL
    bf16 = DType.BF16
    cases: Cases = []
    # Llama-3.1-8B (128k vocabulary).
    cases += _on(
        LLAMA_8B,
        case_spec(lora, 4, 2048, ckpt=True),
        case_spec(lora, 4, 2048),
        case_spec(lora, 4, 2048, ckpt=True, lora=lora_spec(adapter_dtype=bf16)),
        case_spec(qlora, 4, 2048, ckpt=True),
        case_spec(qlora, 1, 2048),
        case_spec(lora, 1, 8192, ckpt=True),
        case_spec(lora, 2, 4096, ckpt=True, optim=Optim.ADAMW_BNB_8BIT),
        case_spec(lora, 1, 2048, ckpt=True, lora=lora_spec(r=8, targets=None)),
        case_spec(full, 1, 2048, ckpt=True),
        case_spec(lora, 1, 1024, attn_implementation=AttnImpl.EAGER),
    )
    # Mistral-7B-v0.1: 4096-token sliding window (a mask, hence the mem-efficient kernel, past it).
    cases += _on(
        MISTRAL_7B,
        case_spec(lora, 4, 2048, ckpt=True),
        case_spec(lora, 1, 2048),
        case_spec(qlora, 4, 2048, ckpt=True),
        case_spec(qlora, 2, 2048, quantization=qlora_spec(prepare_kbit=False)),
        case_spec(lora, 1, 8192, ckpt=True),
        case_spec(lora, 2, 1024, ckpt=True, lora=lora_spec(r=8, targets=None, adapter_dtype=bf16)),
        case_spec(full, 1, 1024, ckpt=True),
    )
    # Gemma-2-2B: logit soft-capping, so eager attention (SDPA cannot soft-cap); 256k vocabulary.
    eager = AttnImpl.EAGER
    cases += _on(
        GEMMA_2B,
        case_spec(lora, 1, 2048, ckpt=True, attn_implementation=eager),
        case_spec(lora, 1, 2048, attn_implementation=eager),
        case_spec(lora, 4, 1024, ckpt=True, attn_implementation=eager),
        case_spec(qlora, 1, 2048, ckpt=True, attn_implementation=eager),
        case_spec(
            qlora, 2, 1024, attn_implementation=eager, quantization=qlora_spec(double_quant=False)
        ),
        case_spec(full, 1, 1024, ckpt=True, attn_implementation=eager),
        case_spec(full, 1, 1024, ckpt=True, attn_implementation=eager, optim=Optim.ADAMW_TORCH),
        case_spec(
            lora, 2, 1024, ckpt=True, attn_implementation=eager, lora=lora_spec(adapter_dtype=bf16)
        ),
    )
    # Phi-3-mini: fused qkv_proj and gate_up_proj; a 2047-token sliding window.
    cases += _on(
        PHI_3,
        case_spec(lora, 4, 2048, ckpt=True),
        case_spec(lora, 1, 1024),
        case_spec(lora, 2, 1024, ckpt=True, lora=lora_spec(targets=("qkv_proj", "o_proj"))),
        case_spec(qlora, 4, 2048, ckpt=True),
        case_spec(qlora, 1, 1024, quantization=qlora_spec(prepare_kbit=False)),
        case_spec(full, 1, 1024, ckpt=True),
        case_spec(lora, 1, 1024, ckpt=True, sdpa_kernel=SdpaKernel.EFFICIENT),
        case_spec(lora, 1, 4096, ckpt=True),
        # Without checkpointing, the memory-efficient kernel (fp32 after kbit preparation;
        # past the window, its mask) keeps the value, a view of the fused qkv output, whole.
        case_spec(qlora, 1, 1024),
        case_spec(qlora, 2, 2048),
        case_spec(lora, 1, 1024, sdpa_kernel=SdpaKernel.EFFICIENT),
    )
    return cases


def moe_cases() -> Cases:
    """Qwen1.5-MoE, DeepSeek-V2-Lite and DeepSeek-V3: routed and shared experts, latent
    attention."""
    lora, qlora, full = Method.LORA, Method.QLORA, Method.FULL
    bf16 = DType.BF16
    cases: Cases = []
    # Qwen1.5-MoE-A2.7B: 60 routed experts (grouped_mm) plus a shared expert per layer.
    cases += _on(
        QWEN_MOE,
        case_spec(lora, 1, 2048, ckpt=True),
        case_spec(lora, 1, 1024),
        case_spec(lora, 2, 2048, ckpt=True, lora=lora_spec(targets=ATTENTION_PROJECTIONS)),
        case_spec(lora, 1, 2048, ckpt=True, lora=lora_spec(adapter_dtype=bf16)),
        case_spec(full, 1, 1024, ckpt=True),
        # QLoRA: bitsandbytes quantizes the attention and shared-expert linears only; kbit
        # preparation casts the 3-D experts to fp32, which then run the grouped GEMM in fp32.
        case_spec(qlora, 1, 1024, ckpt=True),
        case_spec(qlora, 1, 1024),
        case_spec(qlora, 1, 1024, ckpt=True, quantization=qlora_spec(prepare_kbit=False)),
        case_spec(qlora, 1, 1024, ckpt=True, autocast=True),
    )
    # DeepSeek-V2-Lite: multi-head latent attention; a dense first layer, then 64 routed experts
    # (top-6, grouped_mm) and two shared experts per layer.
    cases += _on(
        DEEPSEEK_V2_LITE,
        case_spec(lora, 1, 1024, ckpt=True),
        case_spec(lora, 1, 1024),
        case_spec(qlora, 1, 1024, ckpt=True),
        case_spec(full, 1, 1024, ckpt=True),
        # without checkpointing: QLoRA (fp32 experts after kbit preparation) and full
        case_spec(qlora, 1, 1024),
        # LoRA on the attention's projections alone: no adapter on the experts or the router
        case_spec(lora, 2, 1024, ckpt=True, lora=lora_spec(targets=MLA_PROJECTIONS)),
    )
    # DeepSeek-V3 (671B on fake tensors): q through its latent, a sigmoid router with group-limited
    # top-k, 256 routed experts (top-8) and one shared expert, three dense first layers.
    cases += _on(
        DEEPSEEK_V3,
        case_spec(lora, 1, 1024, ckpt=True),
        case_spec(lora, 1, 512),
        case_spec(qlora, 1, 1024, ckpt=True),
        case_spec(full, 1, 512, ckpt=True),
    )
    return cases


def qwen_05b_cases() -> Cases:
    """Qwen2.5-0.5B: cheap cases over every axis."""
    lora, qlora, full = Method.LORA, Method.QLORA, Method.FULL
    bf16 = DType.BF16
    cases: Cases = []
    # Qwen2.5-0.5B: cheap cases over every axis (the re-trace tests use a few of these).
    cases += _on(
        QWEN_05B,
        case_spec(full, 1, 2048),
        case_spec(full, 1, 512, ckpt=True),
        case_spec(full, 4, 512, optim=Optim.ADAMW_TORCH),
        case_spec(full, 4, 512, optim=Optim.ADAMW_BNB_8BIT),
        case_spec(full, 4, 512, optim=Optim.SGD),
        case_spec(full, 1, 512, dtype=DType.FP32),
        case_spec(lora, 1, 128),
        case_spec(lora, 1, 128, ckpt=True),
        case_spec(lora, 2, 512, lora=lora_spec(adapter_dtype=bf16)),
        case_spec(lora, 2, 512, ckpt=True, lora=lora_spec(r=8, targets=None)),
        case_spec(lora, 2, 512, ckpt=True, lora=lora_spec(modules_to_save=("embed_tokens",))),
        case_spec(lora, 2, 512, lora=lora_spec(lora_dropout=0.1)),
        case_spec(lora, 2, 512, attn_implementation=AttnImpl.EAGER),
        case_spec(lora, 2, 512, sdpa_kernel=SdpaKernel.EFFICIENT),
        case_spec(lora, 2, 512, sdpa_kernel=SdpaKernel.MATH),
        case_spec(lora, 2, 512, loss=LossImpl.PLAIN),
        case_spec(lora, 8, 2048, ckpt=True),
        case_spec(lora, 1, 8192, ckpt=True),
        case_spec(qlora, 1, 128),
        case_spec(qlora, 2, 512, ckpt=True),
        case_spec(qlora, 2, 512, quantization=qlora_spec(prepare_kbit=False, double_quant=False)),
        case_spec(qlora, 2, 512, ckpt=True, optim=Optim.ADAMW_BNB_8BIT),
    )
    return cases


def mixed_precision_cases() -> Cases:
    """HF Trainer with mixed precision on every family, and Qwen2.5-0.5B's accumulation and
    clipping."""
    lora, qlora, full = Method.LORA, Method.QLORA, Method.FULL
    bf16 = DType.BF16
    eager = AttnImpl.EAGER
    cases: Cases = []
    # HF Trainer with mixed precision (autocast, service/trace/autocast.py) on every family.
    mixed = {"autocast": True}
    cases += _on(
        QWEN_7B,
        case_spec(lora, 4, 2048, ckpt=True, **mixed),
        case_spec(lora, 4, 2048, **mixed),
        case_spec(lora, 4, 2048, ckpt=True, lora=lora_spec(adapter_dtype=bf16), **mixed),
        case_spec(lora, 4, 2048, ckpt=True, lora=lora_spec(lora_dropout=0.05), **mixed),
        case_spec(qlora, 4, 2048, ckpt=True, **mixed),
        case_spec(qlora, 1, 2048, **mixed),
        case_spec(qlora, 4, 2048, ckpt=True, quantization=qlora_spec(prepare_kbit=False), **mixed),
        case_spec(lora, 1, 2048, attn_implementation=AttnImpl.EAGER, **mixed),
        case_spec(full, 1, 2048, ckpt=True, **mixed),
    )
    cases += _on(
        LLAMA_8B,
        case_spec(lora, 4, 2048, ckpt=True, **mixed),
        case_spec(lora, 1, 2048, **mixed),
        case_spec(qlora, 4, 2048, ckpt=True, **mixed),
    )
    cases += _on(
        MISTRAL_7B,
        case_spec(lora, 1, 8192, ckpt=True, **mixed),
        case_spec(qlora, 2, 2048, ckpt=True, **mixed),
    )
    cases += _on(
        GEMMA_2B,
        case_spec(lora, 1, 2048, ckpt=True, attn_implementation=eager, **mixed),
        case_spec(qlora, 1, 2048, ckpt=True, attn_implementation=eager, **mixed),
    )
    cases += _on(
        PHI_3,
        case_spec(lora, 4, 2048, ckpt=True, **mixed),
        case_spec(qlora, 4, 2048, ckpt=True, **mixed),
    )
    cases += _on(QWEN_MOE, case_spec(lora, 1, 2048, ckpt=True, **mixed))
    cases += _on(
        QWEN_05B,
        case_spec(lora, 1, 128, ckpt=True, **mixed),
        case_spec(lora, 2, 512, **mixed),
        case_spec(qlora, 2, 512, ckpt=True, **mixed),
        case_spec(lora, 2, 512, ckpt=True, dtype=DType.FP16, **mixed),
        case_spec(full, 1, 512, ckpt=True, dtype=DType.FP32, **mixed),
        case_spec(lora, 2, 512, ckpt=True, max_grad_norm=0.0),
        # HF Trainer's gradient accumulation: micro-batches add into .grad before the step.
        case_spec(lora, 2, 512, ckpt=True, gradient_accumulation_steps=2, **mixed),
        case_spec(full, 1, 512, ckpt=True, gradient_accumulation_steps=2),
    )
    return cases


def small_family_cases() -> Cases:
    """Phi-2, Gemma-3-1B and Qwen3-30B-A3B."""
    lora, qlora, full = Method.LORA, Method.QLORA, Method.FULL
    mixed = {"autocast": True}
    cases: Cases = []
    # Phi-2: LayerNorm, parallel attention and MLP, partial RoPE, biases everywhere, the
    # published residual dropout (0.1) active in training.
    cases += _on(
        PHI_2,
        case_spec(lora, 2, 1024, ckpt=True),
        case_spec(lora, 1, 1024),
        case_spec(
            lora, 2, 512, ckpt=True, lora=lora_spec(targets=("q_proj", "k_proj", "v_proj", "dense"))
        ),
        case_spec(qlora, 2, 1024, ckpt=True),
        case_spec(full, 1, 512, ckpt=True),
        case_spec(lora, 2, 1024, ckpt=True, **mixed),
    )
    # Gemma-3-1B: five sliding-window (512) layers to one global, qk-norm, sandwich norms,
    # one key/value head, a 262k vocabulary; below the window no layer builds a mask.
    cases += _on(
        GEMMA_3,
        case_spec(lora, 2, 1024, ckpt=True),
        case_spec(lora, 1, 256),
        case_spec(qlora, 2, 1024, ckpt=True),
        case_spec(full, 1, 1024, ckpt=True),
        case_spec(lora, 2, 1024, ckpt=True, **mixed),
    )
    # Qwen3-30B-A3B: 128 routed experts, top-8 with renormalised weights, no shared expert.
    # (kbit preparation casts the 3-D expert weights to fp32; CUDA's grouped GEMM runs them.)
    cases += _on(
        QWEN3_MOE,
        case_spec(lora, 1, 1024, ckpt=True),
        case_spec(lora, 1, 512),
        case_spec(lora, 2, 512, ckpt=True, lora=lora_spec(targets=ATTENTION_PROJECTIONS)),
        case_spec(qlora, 1, 1024, ckpt=True, quantization=qlora_spec(prepare_kbit=False)),
        case_spec(qlora, 1, 1024, ckpt=True),
        case_spec(full, 1, 512, ckpt=True),
    )
    return cases


def transformers4_moe_cases() -> Cases:
    """transformers 4's MoE layout, expert by expert."""
    lora, qlora = Method.LORA, Method.QLORA
    cases: Cases = []
    # transformers 4's MoE layout (stack 'hf-4.48'): the router and every expert's linears
    # nn.Linear modules run expert by expert (service/trace/linear_experts.py), which
    # bitsandbytes quantizes and "all-linear" adapts one by one.
    v4 = preset("hf-4.48")
    cases += _on(
        QWEN_MOE,
        case_spec(lora, 1, 512, ckpt=True, stack=v4),
        case_spec(qlora, 1, 512, ckpt=True, stack=v4),
        case_spec(lora, 1, 512, stack=v4),
    )
    cases += _on(
        MIXTRAL,
        case_spec(qlora, 1, 1024, ckpt=True, stack=v4),
        case_spec(lora, 1, 1024, ckpt=True, stack=v4),
    )
    return cases


def lora_grid_cases(previous: Cases) -> Cases:
    """Every family's LoRA step the cases before do not already cover."""
    lora = Method.LORA
    cases: Cases = []
    # Every family's LoRA step with checkpointing on and off, SDPA (the kernel PyTorch picks)
    # and eager attention, mixed precision on and off: the combinations the cases above do
    # not already cover, at one sequence of 1024 tokens.
    covered = {
        (m, s.gradient_checkpointing, s.attn_implementation, s.autocast)
        for m, s in previous
        if s.method is lora and s.stack == PINNED_STACK
    }
    families = (QWEN_7B, LLAMA_8B, MISTRAL_7B, GEMMA_2B, PHI_3, QWEN_MOE, QWEN_05B)
    for model_id in (*families, PHI_2, GEMMA_3, QWEN3_MOE):
        # transformers 5.24 runs Gemma-2 with eager attention only (it refuses SDPA)
        attentions = (AttnImpl.EAGER,) if model_id == GEMMA_2B else (AttnImpl.SDPA, AttnImpl.EAGER)
        for ckpt in (True, False):
            for attention in attentions:
                for mixed_precision in (False, True):
                    if (model_id, ckpt, attention, mixed_precision) in covered:
                        continue
                    cases += _on(
                        model_id,
                        case_spec(
                            lora,
                            1,
                            1024,
                            ckpt=ckpt,
                            attn_implementation=attention,
                            autocast=mixed_precision,
                        ),
                    )
    return cases


def mlp_only_cases() -> Cases:
    """LoRA on the MLP's linears alone."""
    lora, qlora = Method.LORA, Method.QLORA
    eager = AttnImpl.EAGER
    cases: Cases = []
    # LoRA on the MLP's linears alone: the first layer's norm, attention and output projection
    # (frozen, on the frozen embedding's output) record nothing, and a frozen 4-bit o_proj
    # keeps no input (SDPA's math kernel on fp32 after kbit preparation); Gemma-2's
    # post-feedforward norm and Phi-2's residual dropout on the MLP's output still record.
    mlp = ("gate_proj", "up_proj", "down_proj")
    cases += _on(
        LLAMA_8B,
        case_spec(qlora, 1, 1024, lora=lora_spec(targets=mlp)),
        case_spec(qlora, 1, 1024, ckpt=True, lora=lora_spec(targets=mlp)),
        case_spec(lora, 1, 1024, lora=lora_spec(targets=mlp)),
    )
    cases += _on(
        QWEN_05B,
        case_spec(qlora, 2, 512, lora=lora_spec(targets=mlp)),
        # PEFT's default q and v: the frozen 4-bit o_proj keeps no input either
        case_spec(qlora, 2, 512, lora=lora_spec(r=8, targets=None)),
    )
    cases += _on(
        PHI_3, case_spec(qlora, 1, 1024, lora=lora_spec(targets=("gate_up_proj", "down_proj")))
    )
    cases += _on(
        GEMMA_2B, case_spec(lora, 1, 512, attn_implementation=eager, lora=lora_spec(targets=mlp))
    )
    cases += _on(PHI_2, case_spec(lora, 1, 512, lora=lora_spec(targets=("fc1", "fc2"))))
    return cases


def bert_cases() -> Cases:
    """BERT sequence classification."""
    lora, full = Method.LORA, Method.FULL
    eager = AttnImpl.EAGER
    mixed = {"autocast": True}
    cases: Cases = []
    # BERT sequence classification (2 labels): post-LN encoder layers, bidirectional attention,
    # dropout on the hidden states and the attention probabilities, pooler and classifier.
    fp32 = DType.FP32
    cases += _on(
        BERT_BASE,
        case_spec(full, 4, 512, dtype=fp32, attn_implementation=eager),
        case_spec(full, 4, 512, dtype=fp32, **mixed),
        case_spec(full, 4, 512, ckpt=True, dtype=fp32),
        case_spec(lora, 4, 512, lora=lora_spec(r=8, targets=None)),
    )
    cases += _on(
        BERT_BASE,
        case_spec(lora, 4, 512, ckpt=True, lora=lora_spec(r=8, targets=None)),
        case_spec(lora, 2, 256, attn_implementation=eager, lora=lora_spec(r=8, lora_dropout=0.1)),
        case_spec(full, 2, 256, gradient_accumulation_steps=2),
    )
    cases += _on(
        BERT_LARGE,
        case_spec(full, 1, 512, dtype=fp32),
        case_spec(full, 4, 512, dtype=fp32, attn_implementation=eager, **mixed),
    )
    return cases
