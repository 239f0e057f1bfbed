"""The reference matrix's families beyond the first (T5, DoRA, PEFT's other tuners, Falcon and
BLOOM, LLM.int8 bases), with the model ids and spec helpers `reference.matrix()` shares."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from service.core.spec import (
    ALL_LINEAR,
    LORA_METHODS,
    AttnImpl,
    DpoSpec,
    Framework,
    LoraSpec,
    LossImpl,
    Method,
    Objective,
    Optim,
    QuantSpec,
    QuantType,
    TrainingSpec,
)
from service.core.spec.grpo import GrpoSpec
from service.core.spec.kto import KtoLossType, KtoSpec
from service.core.spec.orpo import OrpoSpec
from service.core.spec.prompt import IA3Spec, LnTuningSpec, PrefixTuningSpec, PromptTuningSpec
from service.core.spec.vision import VisionInputs
from service.core.units import DType

QWEN_7B = "Qwen/Qwen2.5-7B"
QWEN_05B = "Qwen/Qwen2.5-0.5B"
LLAMA_8B = "meta-llama/Llama-3.1-8B"
MISTRAL_7B = "mistralai/Mistral-7B-v0.1"
GEMMA_2B = "google/gemma-2-2b"
PHI_3 = "microsoft/Phi-3-mini-4k-instruct"
QWEN_MOE = "Qwen/Qwen1.5-MoE-A2.7B"
BERT_BASE = "google-bert/bert-base-uncased"
BERT_LARGE = "google-bert/bert-large-uncased"
DEEPSEEK_V2_LITE = "deepseek-ai/DeepSeek-V2-Lite"
DEEPSEEK_V3 = "deepseek-ai/DeepSeek-V3"
PHI_2 = "microsoft/phi-2"
GEMMA_3 = "google/gemma-3-1b-pt"
QWEN3_MOE = "Qwen/Qwen3-30B-A3B"
MIXTRAL = "mistralai/Mixtral-8x7B-v0.1"
T5_SMALL = "google/t5-v1_1-small"
T0_3B = "bigscience/T0_3B"
MT0_XXL = "bigscience/mt0-xxl"
QWEN2_VL_2B = "Qwen/Qwen2-VL-2B-Instruct"
QWEN25_VL_7B = "Qwen/Qwen2.5-VL-7B-Instruct"
LLAMA_32_VISION = "meta-llama/Llama-3.2-11B-Vision"

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
# DeepSeek-V2-Lite's attention linears (multi-head latent attention, q_lora_rank unset)
MLA_PROJECTIONS = ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


def lora_spec(
    r: int = 16,
    targets: tuple[str, ...] | str | None = ALL_LINEAR,
    adapter_dtype: DType | None = None,
    **kwargs: Any,
) -> LoraSpec:
    return LoraSpec(
        r=r, lora_alpha=2 * r, target_modules=targets, adapter_dtype=adapter_dtype, **kwargs
    )


def qlora_spec(double_quant: bool = True, prepare_kbit: bool = True, **kwargs: Any) -> QuantSpec:
    return QuantSpec(
        type=kwargs.pop("type", QuantType.NF4),
        double_quant=double_quant,
        prepare_kbit=prepare_kbit,
        **kwargs,
    )


def case_spec(method: Method, b: int, s: int, *, ckpt: bool = False, **kwargs: Any) -> TrainingSpec:
    if method in LORA_METHODS and "lora" not in kwargs:
        kwargs["lora"] = lora_spec()
    if method is Method.QLORA and "quantization" not in kwargs:
        kwargs["quantization"] = qlora_spec()
    return TrainingSpec(
        method=method, batch_size=b, seq_len=s, gradient_checkpointing=ckpt, **kwargs
    )


LLAMA_1B = "meta-llama/Llama-3.2-1B"


def t5_cases() -> list[tuple[str, TrainingSpec]]:
    """Encoder-decoders (T5 v1.1, eager attention with the relative position bias, dropout
    0.1 everywhere): full and LoRA (PEFT's default q and v, r 8, dropout 0.1, as PEFT's
    seq2seq examples) in fp32 with torch AdamW, and bf16; T0-3B as the published runs."""
    lora, full = Method.LORA, Method.FULL
    fp32, eager = DType.FP32, AttnImpl.EAGER
    adamw = Optim.ADAMW_TORCH
    peft_lora = lora_spec(r=8, targets=None, lora_dropout=0.1)
    all_linear = lora_spec(r=16, lora_dropout=0.1)
    # PEFT's seq2seq LoRA in fp32 with eager attention, as T0-3B's published runs
    eager_peft_fp32 = case_spec(
        lora,
        8,
        128,
        target_length=4,
        dtype=fp32,
        attn_implementation=eager,
        optim=adamw,
        lora=peft_lora,
    )
    # SDPA (transformers' default): the mem-efficient kernel with the bias as its mask
    sdpa = [
        (T5_SMALL, case_spec(full, 4, 128, target_length=32, dtype=fp32, optim=adamw)),
        (T5_SMALL, case_spec(full, 4, 128, target_length=32)),
        (T5_SMALL, case_spec(lora, 4, 128, target_length=32, lora=lora_spec(r=8, targets=None))),
        (T0_3B, case_spec(lora, 8, 128, target_length=4, dtype=fp32, optim=adamw, lora=peft_lora)),
        # mT5 (MT5ForConditionalGeneration, a 250k vocabulary): mt0-xxl as PEFT's README ran it
        (
            MT0_XXL,
            case_spec(lora, 8, 128, target_length=4, dtype=fp32, optim=adamw, lora=peft_lora),
        ),
    ]
    return [
        *sdpa,
        (
            T5_SMALL,
            case_spec(lora, 4, 64, target_length=16, attn_implementation=eager, lora=all_linear),
        ),
        (
            T5_SMALL,
            case_spec(full, 2, 256, target_length=64, dtype=fp32, attn_implementation=eager),
        ),
        (T5_SMALL, case_spec(full, 4, 64, target_length=256)),  # a target longer than the source
        (T5_SMALL, case_spec(full, 4, 128, target_length=32, gradient_accumulation_steps=2)),
        (
            T5_SMALL,
            case_spec(
                lora,
                4,
                128,
                target_length=32,
                dtype=fp32,
                attn_implementation=eager,
                optim=adamw,
                lora=lora_spec(r=16),
            ),
        ),
        (
            T5_SMALL,
            case_spec(
                full, 4, 128, target_length=32, dtype=fp32, attn_implementation=eager, optim=adamw
            ),
        ),
        (T5_SMALL, eager_peft_fp32),
        (T5_SMALL, case_spec(full, 4, 128, target_length=32, attn_implementation=eager)),
        (
            T5_SMALL,
            case_spec(
                lora,
                4,
                128,
                target_length=32,
                attn_implementation=eager,
                lora=lora_spec(r=8, targets=None),
            ),
        ),
        (T0_3B, eager_peft_fp32),
        (
            T0_3B,
            case_spec(
                full, 8, 128, target_length=4, dtype=fp32, attn_implementation=eager, optim=adamw
            ),
        ),
    ]


def dpo_cases() -> list[tuple[str, TrainingSpec]]:
    """TRL's DPOTrainer (objective 'dpo'): full, LoRA and QLoRA on three families, the
    reference forward on or precomputed, the whole sequence or a completion scored."""
    lora, qlora, full = Method.LORA, Method.QLORA, Method.FULL
    eager = AttnImpl.EAGER
    dpo = {"objective": Objective.DPO}

    def settings(**kwargs: Any) -> dict[str, Any]:
        return {**dpo, "dpo": DpoSpec(**kwargs)}

    return [
        (QWEN_05B, case_spec(lora, 1, 512, **dpo)),
        (QWEN_05B, case_spec(full, 1, 512, **dpo)),
        (QWEN_05B, case_spec(full, 2, 1024, ckpt=True, **settings(precompute_ref_log_probs=True))),
        (QWEN_05B, case_spec(lora, 4, 1024, **settings(max_completion_length=512))),
        # DPOConfig.disable_dropout (default True) turns LoRA's dropout off
        (
            QWEN_05B,
            case_spec(
                lora, 2, 512, gradient_accumulation_steps=2, lora=lora_spec(lora_dropout=0.1), **dpo
            ),
        ),
        (LLAMA_1B, case_spec(qlora, 2, 512, ckpt=True, **dpo)),
        (LLAMA_1B, case_spec(lora, 2, 1024, ckpt=True, **settings(max_completion_length=256))),
        (LLAMA_1B, case_spec(full, 1, 512, ckpt=True, **dpo)),
        # fp32 attention after kbit preparation: SDPA's math kernel in the reference forward
        (LLAMA_1B, case_spec(qlora, 2, 1024, **dpo)),
        # Gemma-2 runs eager attention (transformers 5.24 gives it no SDPA path)
        (GEMMA_2B, case_spec(lora, 1, 512, ckpt=True, attn_implementation=eager, **dpo)),
        (
            GEMMA_2B,
            case_spec(
                qlora,
                2,
                512,
                ckpt=True,
                attn_implementation=eager,
                **settings(precompute_ref_log_probs=True),
            ),
        ),
        (PHI_3, case_spec(lora, 1, 1024, ckpt=True, **dpo)),
        # an LM head apart from the embedding: its fp32 gradient accumulator and its cast
        (PHI_3, case_spec(full, 1, 512, ckpt=True, **dpo)),
    ]


def reward_cases() -> list[tuple[str, TrainingSpec]]:
    """TRL's RewardTrainer (objective 'reward'): a one-label sequence classifier over the
    [chosen; rejected] batch, full, LoRA and QLoRA on two families."""
    lora, qlora, full = Method.LORA, Method.QLORA, Method.FULL
    reward = {"objective": Objective.REWARD}
    return [
        (QWEN_05B, case_spec(lora, 2, 512, **reward)),
        (QWEN_05B, case_spec(full, 2, 1024, ckpt=True, **reward)),
        (LLAMA_1B, case_spec(lora, 4, 1024, ckpt=True, **reward)),
        (LLAMA_1B, case_spec(full, 1, 512, **reward)),
        (LLAMA_1B, case_spec(qlora, 2, 1024, ckpt=True, **reward)),
        (QWEN_05B, case_spec(qlora, 2, 512, **reward)),
        # RewardConfig.disable_dropout (default True) turns LoRA's dropout off
        (
            LLAMA_1B,
            case_spec(
                lora,
                2,
                512,
                gradient_accumulation_steps=2,
                lora=lora_spec(lora_dropout=0.1),
                **reward,
            ),
        ),
    ]


def mixed_precision_objective_cases() -> list[tuple[str, TrainingSpec]]:
    """DPO, KTO and reward modelling under TRL's default mixed precision (its configs set
    bf16=True unless fp16 is asked for: trl/trainer/base_config.py): accelerate's autocast
    around each model's forward, full, LoRA and QLoRA on four families."""
    lora, qlora, full = Method.LORA, Method.QLORA, Method.FULL
    eager = AttnImpl.EAGER
    dpo = {"objective": Objective.DPO, "autocast": True}
    reward = {"objective": Objective.REWARD, "autocast": True}
    kto = {"objective": Objective.KTO, "autocast": True}
    no_kl = {**kto, "kto": KtoSpec(loss_type=KtoLossType.APO_ZERO_UNPAIRED)}
    return [
        (QWEN_05B, case_spec(lora, 1, 512, ckpt=True, **dpo)),
        (QWEN_05B, case_spec(full, 1, 512, **dpo)),
        (QWEN_05B, case_spec(qlora, 2, 512, **dpo)),
        (LLAMA_1B, case_spec(qlora, 2, 1024, ckpt=True, **dpo)),
        (LLAMA_1B, case_spec(lora, 2, 512, **dpo)),
        (
            LLAMA_1B,
            case_spec(full, 1, 512, ckpt=True, **dpo, dpo=DpoSpec(max_completion_length=256)),
        ),
        (GEMMA_2B, case_spec(lora, 1, 512, ckpt=True, attn_implementation=eager, **dpo)),
        (PHI_3, case_spec(qlora, 1, 1024, ckpt=True, **dpo)),
        (QWEN_05B, case_spec(lora, 2, 512, **reward)),
        (QWEN_05B, case_spec(qlora, 2, 512, ckpt=True, **reward)),
        (LLAMA_1B, case_spec(full, 1, 512, **reward)),
        (LLAMA_1B, case_spec(qlora, 2, 1024, **reward)),
        (QWEN_05B, case_spec(lora, 2, 512, **kto)),
        (QWEN_05B, case_spec(full, 2, 512, ckpt=True, **kto)),
        (QWEN_05B, case_spec(qlora, 2, 1024, ckpt=True, **no_kl)),
        (LLAMA_1B, case_spec(qlora, 2, 512, ckpt=True, **kto)),
        (LLAMA_1B, case_spec(lora, 2, 1024, ckpt=True, **kto)),
        (LLAMA_1B, case_spec(full, 2, 512, **kto)),
        (LLAMA_1B, case_spec(qlora, 2, 1024, **kto)),
        (GEMMA_2B, case_spec(lora, 2, 512, ckpt=True, attn_implementation=eager, **kto)),
        (PHI_3, case_spec(lora, 2, 512, ckpt=True, **kto)),
    ]


def kto_cases() -> list[tuple[str, TrainingSpec]]:
    """TRL's KTOTrainer (objective 'kto'): full, LoRA and QLoRA on four families, with the KL
    batch (loss 'kto') or without it ('apo_zero_unpaired'), the reference forward on or
    precomputed, with and without checkpointing."""
    lora, qlora, full = Method.LORA, Method.QLORA, Method.FULL
    eager = AttnImpl.EAGER
    kto = {"objective": Objective.KTO}

    def settings(**kwargs: Any) -> dict[str, Any]:
        return {**kto, "kto": KtoSpec(**kwargs)}

    no_kl = settings(loss_type=KtoLossType.APO_ZERO_UNPAIRED)
    return [
        (QWEN_05B, case_spec(lora, 2, 512, **kto)),
        (QWEN_05B, case_spec(full, 2, 512, **kto)),
        (QWEN_05B, case_spec(lora, 2, 1024, ckpt=True, **no_kl)),
        (QWEN_05B, case_spec(full, 2, 1024, ckpt=True, **settings(precompute_ref_log_probs=True))),
        # KTOConfig.disable_dropout (default True) turns LoRA's dropout off
        (
            QWEN_05B,
            case_spec(
                lora, 2, 512, gradient_accumulation_steps=2, lora=lora_spec(lora_dropout=0.1), **kto
            ),
        ),
        (LLAMA_1B, case_spec(qlora, 2, 512, ckpt=True, **kto)),
        (LLAMA_1B, case_spec(lora, 2, 1024, ckpt=True, **kto)),
        (LLAMA_1B, case_spec(full, 2, 512, ckpt=True, **kto)),
        # fp32 attention after kbit preparation: SDPA's math kernel in the no-grad forwards
        (LLAMA_1B, case_spec(qlora, 2, 1024, **kto)),
        (LLAMA_1B, case_spec(qlora, 2, 512, **settings(precompute_ref_log_probs=True))),
        # Gemma-2 runs eager attention (transformers 5.24 gives it no SDPA path)
        (GEMMA_2B, case_spec(lora, 2, 512, ckpt=True, attn_implementation=eager, **kto)),
        (GEMMA_2B, case_spec(qlora, 2, 512, ckpt=True, attn_implementation=eager, **no_kl)),
        (PHI_3, case_spec(lora, 2, 512, ckpt=True, **kto)),
        # an LM head apart from the embedding: its fp32 gradient accumulator and its cast
        (PHI_3, case_spec(full, 2, 512, ckpt=True, **kto)),
        # longer and wider: the reference forwards' transients beside every saved activation
        (QWEN_05B, case_spec(lora, 4, 1024, **kto)),
        (LLAMA_1B, case_spec(full, 2, 1024, **kto)),
    ]


def orpo_cases() -> list[tuple[str, TrainingSpec]]:
    """TRL's ORPOTrainer (objective 'orpo'): full, LoRA and QLoRA on four families, with and
    without checkpointing, with and without TRL's default bf16 mixed precision."""
    lora, qlora, full = Method.LORA, Method.QLORA, Method.FULL
    eager = AttnImpl.EAGER
    orpo: dict[str, Any] = {"objective": Objective.ORPO}
    mixed: dict[str, Any] = {**orpo, "autocast": True}
    dropout = lora_spec(lora_dropout=0.1)
    return [
        (QWEN_05B, case_spec(lora, 2, 512, **orpo)),
        (QWEN_05B, case_spec(full, 2, 512, **orpo)),
        (QWEN_05B, case_spec(full, 2, 1024, ckpt=True, **orpo)),
        (QWEN_05B, case_spec(qlora, 2, 512, **orpo)),
        (QWEN_05B, case_spec(lora, 2, 512, ckpt=True, **mixed)),
        (QWEN_05B, case_spec(full, 1, 512, **mixed)),
        # an fp32 model under autocast: the LM head's half weight copy beside the logits
        (QWEN_05B, case_spec(lora, 1, 512, dtype=DType.FP32, **mixed)),
        # ORPOConfig.disable_dropout (default True) turns LoRA's dropout off; False keeps it
        (QWEN_05B, case_spec(lora, 2, 512, gradient_accumulation_steps=2, lora=dropout, **orpo)),
        (
            QWEN_05B,
            case_spec(lora, 2, 512, lora=dropout, orpo=OrpoSpec(disable_dropout=False), **orpo),
        ),
        (LLAMA_1B, case_spec(qlora, 2, 512, ckpt=True, **orpo)),
        (LLAMA_1B, case_spec(lora, 2, 1024, ckpt=True, **orpo)),
        (LLAMA_1B, case_spec(full, 1, 512, ckpt=True, **orpo)),
        (LLAMA_1B, case_spec(lora, 2, 512, **mixed)),
        (LLAMA_1B, case_spec(full, 1, 512, ckpt=True, **mixed)),
        # Gemma-2 runs eager attention (transformers 5.24 gives it no SDPA path)
        (GEMMA_2B, case_spec(lora, 1, 512, ckpt=True, attn_implementation=eager, **orpo)),
        (GEMMA_2B, case_spec(qlora, 1, 512, ckpt=True, attn_implementation=eager, **orpo)),
        (PHI_3, case_spec(lora, 1, 512, ckpt=True, **orpo)),
        # an LM head apart from the embedding: its weight's gradient beside the logits'
        (PHI_3, case_spec(full, 1, 512, ckpt=True, **orpo)),
    ]


def dora_cases() -> list[tuple[str, TrainingSpec]]:
    """DoRA (PEFT use_dora): LoRA and QLoRA, with and without checkpointing, autocast and
    dropout, on Qwen2.5-0.5B, and Llama-3.2-1B for a second family."""
    lora, qlora = Method.LORA, Method.QLORA
    dora = lora_spec(use_dora=True)
    return [
        (QWEN_05B, case_spec(lora, 2, 512, lora=dora)),
        (QWEN_05B, case_spec(lora, 2, 512, ckpt=True, lora=dora)),
        (QWEN_05B, case_spec(qlora, 2, 512, ckpt=True, lora=dora)),
        (QWEN_05B, case_spec(lora, 2, 512, ckpt=True, lora=dora, autocast=True)),
        # With dropout PEFT runs the base linear again on the dropped-out input.
        (QWEN_05B, case_spec(lora, 2, 512, lora=lora_spec(use_dora=True, lora_dropout=0.1))),
        (LLAMA_1B, case_spec(lora, 1, 1024, ckpt=True, lora=dora)),
    ]


def tuner_cases() -> list[tuple[str, TrainingSpec]]:
    """PEFT's (IA)^3 and LN tuning with their defaults, with and without checkpointing, on
    Qwen2.5-0.5B and Llama-3.2-1B (whose defaults differ: q_proj or k_proj scaled, one norm
    or every norm trained), and with targets named; prompt tuning likewise; prefix tuning
    without checkpointing (PEFT refuses it there), with and without its projection MLP."""
    ia3, ln, prompt = Method.IA3, Method.LN_TUNING, Method.PROMPT_TUNING
    virtual_200 = PromptTuningSpec(num_virtual_tokens=200)
    prefix = Method.PREFIX_TUNING
    projected = PrefixTuningSpec(num_virtual_tokens=30, prefix_projection=True)
    every_norm = LnTuningSpec(
        target_modules=("input_layernorm", "post_attention_layernorm", "norm")
    )
    named_ia3 = IA3Spec(
        target_modules=("q_proj", "k_proj", "v_proj", "up_proj", "down_proj"),
        feedforward_modules=("up_proj", "down_proj"),
    )
    return [
        (QWEN_05B, case_spec(ia3, 2, 512)),
        (QWEN_05B, case_spec(ia3, 2, 512, ckpt=True)),
        (QWEN_05B, case_spec(ia3, 2, 512, ia3=named_ia3)),
        (QWEN_05B, case_spec(ln, 2, 512)),
        (QWEN_05B, case_spec(ln, 1, 1024, ckpt=True)),
        (QWEN_05B, case_spec(ln, 2, 512, ln_tuning=every_norm)),
        (LLAMA_1B, case_spec(ia3, 1, 1024)),
        (LLAMA_1B, case_spec(ia3, 2, 256, ckpt=True)),
        (LLAMA_1B, case_spec(ln, 1, 1024)),
        (LLAMA_1B, case_spec(ln, 2, 512, ckpt=True)),
        # prompt tuning: 20 virtual tokens, and the 200 of PEFT's method comparison
        (
            QWEN_05B,
            case_spec(prompt, 2, 512, prompt_tuning=PromptTuningSpec(num_virtual_tokens=20)),
        ),
        (QWEN_05B, case_spec(prompt, 2, 512, ckpt=True, prompt_tuning=virtual_200)),
        (LLAMA_1B, case_spec(prompt, 1, 1024, prompt_tuning=virtual_200)),
        (LLAMA_1B, case_spec(prompt, 2, 256, ckpt=True, prompt_tuning=virtual_200)),
        # prefix tuning (PEFT refuses it with checkpointing): 20 and 200 virtual tokens, the
        # latter PEFT's method comparison's, and the MLP projection
        (
            QWEN_05B,
            case_spec(prefix, 2, 512, prefix_tuning=PrefixTuningSpec(num_virtual_tokens=20)),
        ),
        (QWEN_05B, case_spec(prefix, 2, 512, prefix_tuning=projected)),
        (
            LLAMA_1B,
            case_spec(prefix, 1, 1024, prefix_tuning=PrefixTuningSpec(num_virtual_tokens=200)),
        ),
        (LLAMA_1B, case_spec(prefix, 2, 256, prefix_tuning=projected)),
    ]


FALCON_7B = "tiiuae/falcon-7b"
BLOOM_560M = "bigscience/bloom-560m"
BLOOMZ_7B1 = "bigscience/bloomz-7b1"


def falcon_bloom_cases() -> list[tuple[str, TrainingSpec]]:
    """Falcon-7B (multi-query attention through SDPA's math kernel, one LayerNorm feeding
    attention and MLP in parallel) and BLOOM (ALiBi, its own baddbmm attention, which
    transformers 5.24 runs as eager only; an embedding LayerNorm)."""
    lora, full = Method.LORA, Method.FULL
    eager = AttnImpl.EAGER
    return [
        (FALCON_7B, case_spec(lora, 1, 512)),
        (FALCON_7B, case_spec(lora, 1, 1024, ckpt=True)),
        (FALCON_7B, case_spec(lora, 2, 512, ckpt=True, lora=lora_spec(r=8, targets=None))),
        (FALCON_7B, case_spec(full, 1, 512, ckpt=True)),
        (FALCON_7B, case_spec(lora, 1, 512, attn_implementation=eager)),
        (FALCON_7B, case_spec(lora, 2, 512)),
        (FALCON_7B, case_spec(lora, 2, 512, attn_implementation=eager)),
        (FALCON_7B, case_spec(lora, 1, 2048, ckpt=True, attn_implementation=eager)),
        (FALCON_7B, case_spec(lora, 1, 1024, ckpt=True, autocast=True)),
        (FALCON_7B, case_spec(Method.QLORA, 1, 1024, ckpt=True)),
        (BLOOM_560M, case_spec(lora, 2, 512, attn_implementation=eager)),
        (BLOOM_560M, case_spec(lora, 4, 1024, ckpt=True, attn_implementation=eager)),
        (
            BLOOM_560M,
            case_spec(lora, 4, 512, attn_implementation=eager, lora=lora_spec(r=8, targets=None)),
        ),
        (BLOOM_560M, case_spec(full, 1, 1024, ckpt=True, attn_implementation=eager)),
        (BLOOM_560M, case_spec(lora, 1, 2048, attn_implementation=eager)),
        (BLOOM_560M, case_spec(lora, 2, 2048, ckpt=True, attn_implementation=eager)),
        (BLOOM_560M, case_spec(lora, 2, 512, attn_implementation=eager, autocast=True)),
        (BLOOM_560M, case_spec(Method.QLORA, 2, 512, attn_implementation=eager)),
        # PEFT's README row for bigscience/bloomz-7b1: LoRA r8 on query_key_value, fp32, b8 s64.
        (
            BLOOMZ_7B1,
            case_spec(
                lora,
                8,
                64,
                attn_implementation=eager,
                dtype=DType.FP32,
                lora=lora_spec(r=8, targets=None),
            ),
        ),
    ]


def int8_cases() -> list[tuple[str, TrainingSpec]]:
    """LoRA on an LLM.int8 base (bitsandbytes Linear8bitLt): with and without PEFT's k-bit
    preparation and checkpointing, every linear adapted, on three families."""
    qlora = Method.QLORA
    int8 = qlora_spec(double_quant=False, type=QuantType.INT8)
    raw = qlora_spec(double_quant=False, prepare_kbit=False, type=QuantType.INT8)
    return [
        (QWEN_7B, case_spec(qlora, 4, 2048, ckpt=True, quantization=int8)),
        (QWEN_7B, case_spec(qlora, 1, 1024, quantization=int8)),
        (QWEN_05B, case_spec(qlora, 2, 512, quantization=int8)),
        (QWEN_05B, case_spec(qlora, 1, 128, ckpt=True, quantization=int8)),
        (QWEN_05B, case_spec(qlora, 2, 512, ckpt=True, quantization=raw)),
        (LLAMA_1B, case_spec(qlora, 2, 512, quantization=int8, lora=lora_spec(r=8, targets=None))),
        (LLAMA_1B, case_spec(qlora, 1, 1024, ckpt=True, quantization=int8)),
        (LLAMA_1B, case_spec(qlora, 2, 512, quantization=raw)),
        (MISTRAL_7B, case_spec(qlora, 1, 2048, ckpt=True, quantization=int8)),
    ]


def grpo_cases() -> list[tuple[str, TrainingSpec]]:
    """TRL's GRPOTrainer (objective 'grpo', beta 0.0, model.generate): full, LoRA and QLoRA on
    four families, eight completions of one prompt per step (GRPOConfig.num_generations 8),
    with and without checkpointing; short completions (the tracer runs every decode step of
    model.generate on fake tensors, a fraction of a second each)."""
    lora, qlora, full = Method.LORA, Method.QLORA, Method.FULL
    eager = AttnImpl.EAGER

    def grpo(prompt: int, completion: int, generations: int = 8) -> dict[str, Any]:
        settings = GrpoSpec(
            num_generations=generations,
            max_prompt_length=prompt,
            max_completion_length=completion,
        )
        return {"objective": Objective.GRPO, "grpo": settings}

    return [
        (QWEN_05B, case_spec(lora, 8, 512, **grpo(480, 32))),
        (QWEN_05B, case_spec(full, 8, 512, ckpt=True, **grpo(448, 64))),
        (QWEN_05B, case_spec(lora, 4, 1024, gradient_accumulation_steps=2, **grpo(992, 32))),
        (LLAMA_1B, case_spec(lora, 8, 512, ckpt=True, **grpo(480, 32))),
        (LLAMA_1B, case_spec(qlora, 8, 512, ckpt=True, **grpo(448, 64))),
        (LLAMA_1B, case_spec(full, 4, 512, ckpt=True, **grpo(480, 32, generations=4))),
        (GEMMA_2B, case_spec(lora, 8, 512, ckpt=True, attn_implementation=eager, **grpo(480, 32))),
        (PHI_3, case_spec(qlora, 8, 512, ckpt=True, **grpo(480, 32))),
        # one completion per micro-batch, sixteen accumulated: generate's prefill on all
        # sixteen rows is the peak
        (
            QWEN_05B,
            case_spec(lora, 1, 512, ckpt=True, gradient_accumulation_steps=16, **grpo(480, 32)),
        ),
    ]


def train_feature_cases() -> list[tuple[str, TrainingSpec]]:
    """torchtune's optimizer in backward (full fine-tuning, no clipping, as its recipe needs)
    and its activation offloading (with checkpointing, as its recipes need), on two families;
    transformers' loss on the logits (the tracer runs no chunked loss)."""
    lora, full = Method.LORA, Method.FULL
    tune: dict[str, Any] = {"framework": Framework.TORCHTUNE, "loss": LossImpl.HF}
    in_bwd: dict[str, Any] = {**tune, "optimizer_in_backward": True, "max_grad_norm": 0.0}
    offload: dict[str, Any] = {**tune, "activation_offloading": True}
    return [
        (QWEN_05B, case_spec(full, 1, 2048, **in_bwd)),
        (QWEN_05B, case_spec(full, 2, 1024, ckpt=True, **in_bwd)),
        (LLAMA_1B, case_spec(full, 1, 1024, **in_bwd)),
        # a short sequence: the LM head's backward (its weight's gradient) is the peak
        (LLAMA_1B, case_spec(full, 1, 256, **in_bwd)),
        (QWEN_05B, case_spec(lora, 2, 1024, ckpt=True, **offload)),
        (QWEN_05B, case_spec(full, 1, 2048, ckpt=True, **offload)),
        (LLAMA_1B, case_spec(lora, 1, 2048, ckpt=True, **offload)),
        (LLAMA_1B, case_spec(full, 1, 1024, ckpt=True, **{**offload, **in_bwd})),
    ]


# The language model's linears by name: none of them names a module of Qwen2-VL's vision
# tower (qkv, proj, fc1, fc2, the merger's mlp.0 and mlp.2), so PEFT adapts the LM alone.
LANGUAGE_MODEL_LINEARS = (*ATTENTION_PROJECTIONS, "gate_proj", "up_proj", "down_proj")


def vision_cases() -> list[tuple[str, TrainingSpec]]:
    """Qwen2-VL-2B and Qwen2.5-VL-7B with images (pixel_values and image_grid_thw through
    the real vision tower, M-RoPE positions, the features scattered into the embeddings):
    LoRA and QLoRA on the language model's linears, the tower frozen; one or two images per
    sample at modest resolutions (448 x 448 pixels: 256 tokens; 672 x 672: 576)."""
    lora, qlora = Method.LORA, Method.QLORA
    targets = lora_spec(targets=LANGUAGE_MODEL_LINEARS)
    attention = lora_spec(targets=ATTENTION_PROJECTIONS)
    one = VisionInputs(images_per_sample=1, image_height=448, image_width=448)
    two = VisionInputs(images_per_sample=2, image_height=448, image_width=448)
    large = VisionInputs(images_per_sample=2, image_height=672, image_width=672)
    return [
        (QWEN2_VL_2B, case_spec(lora, 2, 1024, ckpt=True, lora=targets, vision=one)),
        (QWEN2_VL_2B, case_spec(lora, 2, 1024, lora=targets, vision=one)),
        (QWEN2_VL_2B, case_spec(qlora, 2, 1024, ckpt=True, lora=targets, vision=two)),
        (QWEN2_VL_2B, case_spec(lora, 1, 2048, ckpt=True, lora=targets, vision=large)),
        # Qwen2.5-VL's tower has gate_proj/up_proj/down_proj of its own: attention targets
        # keep it frozen; windowed attention in all blocks but four
        (QWEN25_VL_7B, case_spec(lora, 1, 2048, ckpt=True, lora=attention, vision=two)),
        (QWEN25_VL_7B, case_spec(lora, 1, 1536, lora=attention, vision=large)),
        *mllama_cases(),
    ]


# Llama-3.2-Vision's tower has q/k/v/o_proj of its own (and fc1/fc2): only the language
# model's MLP linears are its alone.
MLLAMA_LANGUAGE_MODEL_LINEARS = ("gate_proj", "up_proj", "down_proj")


def mllama_cases() -> list[tuple[str, TrainingSpec]]:
    """Llama-3.2-11B-Vision: pixel_values through the real tiled tower (every image padded to
    four tiles), the projected features as the keys and values of the eight cross-attention
    layers; LoRA on the language model's MLP linears, with and without checkpointing; an
    image of 1120 x 1120 pixels (2 x 2 tiles), one of 448 x 448 (one tile), two of 560 x 1120
    (1 x 2 tiles)."""
    lora = Method.LORA
    mlp = lora_spec(targets=MLLAMA_LANGUAGE_MODEL_LINEARS)
    large = VisionInputs(images_per_sample=1, image_height=1120, image_width=1120)
    small = VisionInputs(images_per_sample=1, image_height=448, image_width=448)
    wide = VisionInputs(images_per_sample=2, image_height=560, image_width=1120)
    return [
        (LLAMA_32_VISION, case_spec(lora, 1, 1024, ckpt=True, lora=mlp, vision=large)),
        (LLAMA_32_VISION, case_spec(lora, 1, 1024, lora=mlp, vision=large)),
        (LLAMA_32_VISION, case_spec(lora, 2, 512, ckpt=True, lora=mlp, vision=small)),
        # two images a sample (1 x 2 tiles each): twice the keys of every cross-attention layer
        (LLAMA_32_VISION, case_spec(lora, 1, 2048, lora=mlp, vision=wide)),
        (
            LLAMA_32_VISION,
            case_spec(lora, 2, 512, lora=mlp, vision=replace(small, images_per_sample=2)),
        ),
    ]


def packing_cases() -> list[tuple[str, TrainingSpec]]:
    """TRL's padding-free packing (one row of batch x seq tokens, position_ids restarting at
    each sequence): SDPA's block-diagonal mask (its mem-efficient kernel, the key/value heads
    repeated), flash_attention_2's varlen run, and eager's mask, on two families, full, LoRA and
    QLoRA, with and without checkpointing."""
    lora, qlora, full = Method.LORA, Method.QLORA, Method.FULL
    flash, eager = AttnImpl.FLASH_ATTENTION_2, AttnImpl.EAGER
    return [
        (QWEN_05B, case_spec(full, 2, 256, packing=True)),
        (QWEN_05B, case_spec(lora, 4, 512, ckpt=True, packing=True)),
        (QWEN_05B, case_spec(lora, 2, 256, packing=True, attn_implementation=eager)),
        (LLAMA_1B, case_spec(lora, 2, 1024, packing=True, attn_implementation=flash)),
        (LLAMA_1B, case_spec(qlora, 4, 512, ckpt=True, packing=True)),
        (LLAMA_1B, case_spec(lora, 8, 256, packing=True)),
    ]


def liger_cases() -> list[tuple[str, TrainingSpec]]:
    """HF Trainer's use_liger_kernel (liger-kernel 0.8.2's patches: RoPE, RMSNorm, SwiGLU for
    llama and qwen2, Gemma-2's RMSNorm mode and GEGLU, fused linear cross-entropy): LoRA, QLoRA
    and full fine-tuning, with and without checkpointing."""
    lora, qlora, full = Method.LORA, Method.QLORA, Method.FULL
    return [
        (LLAMA_1B, case_spec(lora, 2, 1024, liger_kernel=True)),
        (LLAMA_1B, case_spec(lora, 4, 1024, ckpt=True, liger_kernel=True)),
        (LLAMA_1B, case_spec(full, 1, 1024, liger_kernel=True)),
        (LLAMA_1B, case_spec(qlora, 2, 1024, ckpt=True, liger_kernel=True)),
        (QWEN_05B, case_spec(lora, 2, 1024, liger_kernel=True)),
        (QWEN_05B, case_spec(full, 2, 512, ckpt=True, liger_kernel=True)),
        (QWEN_05B, case_spec(full, 1, 1024, liger_kernel=True)),
        (GEMMA_2B, case_spec(lora, 1, 1024, attn_implementation=AttnImpl.EAGER, liger_kernel=True)),
        (
            GEMMA_2B,
            case_spec(
                lora, 2, 512, ckpt=True, attn_implementation=AttnImpl.EAGER, liger_kernel=True
            ),
        ),
    ]
