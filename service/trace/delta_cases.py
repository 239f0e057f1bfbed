"""Reference cases of the PEFT methods beside LoRA that change what a step holds: LoRA-FA
(lora_A frozen, PEFT's LoraFAOptimizer), VeRA (shared frozen projections, trained
vectors), LoHa and LoKr (a full-size delta weight each forward: a Hadamard product, a Kronecker
product), AdaLoRA (SVD-shaped triplets, the orthogonality penalty, the RankAllocator's
buffers), on Qwen2.5-0.5B and Llama-3.2-1B."""

from __future__ import annotations

from service.core.spec import ALL_LINEAR, AttnImpl, LoraSpec, Method, TrainingSpec
from service.core.spec.delta import AdaLoraSpec, BoftSpec, LohaSpec, LokrSpec, OftSpec, VeraSpec

QWEN_05B = "Qwen/Qwen2.5-0.5B"
LLAMA_1B = "meta-llama/Llama-3.2-1B"
GEMMA_2B = "google/gemma-2-2b"
QUERY_VALUE = ("q_proj", "v_proj")
# AdaLoRA's schedule in PEFT's method-comparison runs (method_comparison/MetaMathQA/
# experiments/adalora/llama-3.2-3B-rank32/adapter_config.json): both traced steps in its warm-up.
ADALORA_SCHEDULE = {"tinit": 200, "tfinal": 500, "total_step": 5000}


def _job(method: Method, b: int, s: int, *, ckpt: bool = False, **options: object) -> TrainingSpec:
    return TrainingSpec(
        method=method,
        batch_size=b,
        seq_len=s,
        gradient_checkpointing=ckpt,
        **options,  # type: ignore[arg-type]
    )


def peft_delta_cases() -> list[tuple[str, TrainingSpec]]:
    """(model id, spec) of each method's references."""
    lora_fa = Method.LORA_FA
    all_linear = LoraSpec(r=16, lora_alpha=32, target_modules=ALL_LINEAR)
    query_value = LoraSpec(r=16, lora_alpha=32, target_modules=QUERY_VALUE)
    return [
        (QWEN_05B, _job(lora_fa, 2, 512, lora=all_linear)),
        (
            QWEN_05B,
            _job(
                lora_fa,
                2,
                512,
                ckpt=True,
                lora=LoraSpec(r=16, lora_alpha=32, target_modules=ALL_LINEAR, lora_dropout=0.1),
            ),
        ),
        (LLAMA_1B, _job(lora_fa, 2, 512, lora=query_value)),
        (QWEN_05B, _job(Method.VERA, 2, 512)),
        (QWEN_05B, _job(Method.VERA, 1, 512, ckpt=True, vera=VeraSpec(target_modules=ALL_LINEAR))),
        (LLAMA_1B, _job(Method.VERA, 2, 512)),
        (QWEN_05B, _job(Method.LOHA, 2, 512, loha=LohaSpec(r=16, target_modules=ALL_LINEAR))),
        (QWEN_05B, _job(Method.LOHA, 2, 512, ckpt=True)),
        (LLAMA_1B, _job(Method.LOHA, 2, 512, loha=LohaSpec(r=16, target_modules=QUERY_VALUE))),
        (LLAMA_1B, _job(Method.LOKR, 2, 512, lokr=LokrSpec(r=16, target_modules=QUERY_VALUE))),
        (
            QWEN_05B,
            _job(
                Method.LOKR,
                2,
                512,
                lokr=LokrSpec(r=32, decompose_factor=4, target_modules=ALL_LINEAR),
            ),
        ),
        (
            QWEN_05B,
            _job(Method.LOKR, 1, 256, ckpt=True, lokr=LokrSpec(r=4, decompose_both=True)),
        ),
        (
            QWEN_05B,
            _job(
                Method.ADALORA,
                2,
                512,
                adalora=AdaLoraSpec(init_r=16, target_modules=ALL_LINEAR, **ADALORA_SCHEDULE),
            ),
        ),
        (
            QWEN_05B,
            _job(Method.ADALORA, 1, 512, ckpt=True, adalora=AdaLoraSpec(tinit=2, total_step=100)),
        ),
        (
            LLAMA_1B,
            _job(
                Method.ADALORA,
                2,
                512,
                adalora=AdaLoraSpec(init_r=64, target_r=32, **ADALORA_SCHEDULE),
            ),
        ),
        (QWEN_05B, _job(Method.OFT, 2, 512, oft=OftSpec(r=16, oft_block_size=0))),
        (QWEN_05B, _job(Method.OFT, 1, 512, ckpt=True, oft=OftSpec(target_modules=ALL_LINEAR))),
        (LLAMA_1B, _job(Method.OFT, 2, 512, oft=OftSpec(r=32, oft_block_size=0))),
        (QWEN_05B, _job(Method.BOFT, 2, 512, boft=BoftSpec())),
        (QWEN_05B, _job(Method.BOFT, 1, 512, ckpt=True, boft=BoftSpec(boft_n_butterfly_factor=2))),
        (LLAMA_1B, _job(Method.BOFT, 2, 256, boft=BoftSpec(boft_block_size=8))),
        (LLAMA_1B, _job(Method.BOFT, 1, 512, ckpt=True, boft=BoftSpec(boft_n_butterfly_factor=3))),
        (
            GEMMA_2B,
            _job(
                Method.BOFT,
                1,
                256,
                attn_implementation=AttnImpl.EAGER,
                boft=BoftSpec(boft_n_butterfly_factor=2),
            ),
        ),
        (
            GEMMA_2B,
            _job(
                Method.BOFT,
                1,
                512,
                ckpt=True,
                attn_implementation=AttnImpl.EAGER,
                boft=BoftSpec(boft_block_size=8),
            ),
        ),
    ]
