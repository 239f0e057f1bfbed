"""Published measured peaks (tests/data/published_peaks.csv, copied with their sources from the
design data set) mapped onto training specs, for accuracy and calibration tests."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from service.core.spec import (
    ALL_LINEAR,
    LORA_METHODS,
    ZERO3_PARAM_PERSISTENCE_THRESHOLD,
    ZERO3_PREFETCH_BUCKET_SIZE,
    ZERO_REDUCE_BUCKET_SIZE,
    ZERO_STAGES,
    AttnImpl,
    Framework,
    LoraSpec,
    Method,
    Offload,
    Optim,
    ParallelSpec,
    QuantSpec,
    QuantType,
    Strategy,
    TrainingSpec,
)
from service.core.spec.delta import AdaLoraSpec, BoftSpec, LohaSpec, LokrSpec, OftSpec, VeraSpec
from service.core.spec.prompt import IA3Spec, LnTuningSpec, PrefixTuningSpec, PromptTuningSpec
from service.core.stack import preset
from service.core.units import DType

DATA = Path(__file__).parent / "data" / "published_peaks.csv"
# PEFT's methods besides LoRA, by the rows' method names (the spec's Method values)
PEFT_METHODS = (
    "ia3",
    "ln-tuning",
    "prompt-tuning",
    "prefix-tuning",
    "lora-fa",
    "vera",
    "loha",
    "lokr",
    "adalora",
    "oft",
    "boft",
)
# LitGPT's adapters; "(4-bit base)" rows quantize the base (finetune/adapter*.py --quantize)
ADAPTER_METHODS = ("llama-adapter", "llama-adapter-v2")
KBIT_SUFFIX = " (4-bit base)"
DECIMAL_GB = 10**9  # measured_peak_gb is decimal GB (design data README)
# PEFT's seq2seq examples on twitter_complaints (examples/conditional_generation/
# peft_lora_seq2seq_accelerate_ds_zero3_offload.py) pad each batch's tweets to its longest and
# the labels to the longest class label ("no complaint" and </s>: a few tokens); the rows give
# no length. Mapped: 128 source tokens (the max_length of PEFT's seq2seq notebooks, above any
# tweet's 280 characters) and 4 target tokens.
SEQ2SEQ_SOURCE_LEN = 128
SEQ2SEQ_TARGET_LEN = 4

# measure_kind -> the estimate level it is compared with; "unknown" figures come from
# nvidia-smi-like readings or script printouts of device memory, the most inclusive level.
LEVEL = {
    "max_memory_allocated": "allocated",
    "max_memory_reserved": "reserved",
    "nvidia-smi": "device",
    "unknown": "device",
}


@dataclass(frozen=True)
class Row:
    id: str
    source: str
    tier: str
    measure_kind: str
    level: str
    model: str
    spec: TrainingSpec
    measured_bytes: int
    framework: str
    gpu: str  # as the source names it ("A100-SXM4-40GB"); "" when it does not


def compute_capability(gpu: str) -> str | None:
    """The compute capability of a source's GPU name, when the catalog knows it."""
    from service.catalog.gpus import UnknownGpuError, default_gpu_catalog

    if not gpu:
        return None
    try:
        return default_gpu_catalog().resolve(gpu).compute_capability
    except UnknownGpuError:
        return None


@dataclass(frozen=True)
class Skipped:
    id: str
    reason: str


# The published rows' method column values the estimator answers (dora: LoRA with use_dora).
MODELLED_METHODS = (
    "lora",
    "qlora",
    "full",
    "dora",
    "lora-fa",
    "vera",
    "loha",
    "lokr",
    "adalora",
    "oft",
    "boft",
)


def _targets(raw: str, model_type: str) -> tuple[str, ...] | str | None:
    text = raw.lower()
    if not text or text.startswith("peft defaults"):
        return None
    if "all linear" in text or text.startswith("q,k,v,o,gate,up,down"):
        return ALL_LINEAR
    if text.startswith("query,value"):
        if model_type == "gpt_neox":
            return ("query_key_value",)
        return ("q_proj", "v_proj")
    head = text.split("+")[0].split("(")[0]
    return tuple(n.strip() for n in head.split(",") if n.strip())


def _option(raw: str, name: str) -> str:
    """An option the targets column spells out in parentheses: '... (name=value, ...)'."""
    return raw.split(f"{name}=")[1].split(",")[0].split(")")[0].strip()


def _modules_to_save(raw: str) -> tuple[str, ...]:
    if "modules_to_save" not in raw:
        return ()
    names = raw.split("modules_to_save", 1)[1].split("(")[0].strip(" :")
    mapping = {"wte": "embed_tokens", "lm_head": "lm_head"}
    return tuple(mapping.get(n.strip(), n.strip()) for n in names.split(",") if n.strip())


def _optim(raw: str, framework: str) -> Optim:
    text = raw.lower()
    if "paged" in text and "8" in text:
        return Optim.PAGED_ADAMW_8BIT
    if "paged" in text:
        return Optim.PAGED_ADAMW_32BIT
    if "sgd" in text:
        return Optim.SGD
    if "fused" in text:
        return Optim.ADAMW_TORCH_FUSED
    if "adafactor" in text:
        return Optim.ADAFACTOR
    if "adam8bit" in text or "adamw8bit" in text:
        return Optim.ADAMW_BNB_8BIT
    if "adamw_hf" in text:
        # transformers' own AdamW (optimization.py): fp32 states updated one parameter at a
        # time, like the fused kernel no state-sized temporaries (one parameter's at most)
        return Optim.ADAMW_TORCH_FUSED
    return Optim.ADAMW_TORCH


def _dtype(raw: str) -> tuple[DType, bool]:
    """The weights' dtype and whether autocast (HF Trainer's fp16/bf16 mixed precision) runs;
    rows that do not say fp32 keep the bf16 default."""
    text = raw.lower()
    dtype = DType.FP32 if text.startswith("fp32") else DType.BF16
    return dtype, "autocast" in text


def _parallel(row: dict[str, str]) -> ParallelSpec:
    gpus = int(row["num_gpus"] or 1)
    text = row["zero_or_fsdp"].lower()
    strategy = Strategy.DDP
    for key, value in (
        ("zero-3", Strategy.ZERO3),
        ("zero3", Strategy.ZERO3),
        ("zero-2", Strategy.ZERO2),
        ("zero2", Strategy.ZERO2),
        ("zero-1", Strategy.ZERO1),
        ("fsdp", Strategy.FSDP),
    ):
        if key in text:
            strategy = value
            break
    # "with CPU offload": PEFT's example DeepSpeed configs offload parameters and optimizer
    offload = "with cpu offload" in text
    buckets: dict[str, int] = {}
    if "accelerate" in row["framework"] and strategy in ZERO_STAGES:
        # PEFT's examples launch through an `accelerate config` file (README: ds_zero3_cpu.yaml:
        # zero_stage, offload devices, no bucket keys); accelerate's plugin builds a
        # zero_optimization section without them, so DeepSpeed's own defaults apply
        # (docs/parallel.md), not HF's hidden-size "auto".
        buckets = {
            "reduce_bucket_size": ZERO_REDUCE_BUCKET_SIZE,
            "stage3_prefetch_bucket_size": ZERO3_PREFETCH_BUCKET_SIZE,
            "stage3_param_persistence_threshold": ZERO3_PARAM_PERSISTENCE_THRESHOLD,
        }
    return ParallelSpec(
        gpus=gpus,
        strategy=strategy,
        offload=Offload.OPTIMIZER_AND_PARAMS if offload else Offload.NONE,
        **buckets,
    )


def _prompt_tuning(raw: str) -> PromptTuningSpec:
    """The virtual tokens the row's targets column names ("200 virtual tokens")."""
    return PromptTuningSpec(num_virtual_tokens=int(raw.split()[0]))


# AdaLoRA's schedule in PEFT's method-comparison run the rows cite (method_comparison/
# MetaMathQA/experiments/adalora/llama-3.2-3B-rank32/adapter_config.json); the rows give the
# ranks, alpha and targets.
ADALORA_SCHEDULE = {"tinit": 200, "tfinal": 500, "total_step": 5000}


def _adalora(row: dict[str, str]) -> AdaLoraSpec:
    """The row's "init_r=64,target_r=32" ranks, its alpha and targets."""
    ranks = dict(part.split("=") for part in row["lora_r"].split(","))
    return AdaLoraSpec(
        init_r=int(ranks["init_r"]),
        target_r=int(ranks["target_r"]),
        lora_alpha=int(row["lora_alpha"] or 8),
        target_modules=_targets(row["lora_targets"], ""),
        **ADALORA_SCHEDULE,
    )


def _prefix_tuning(raw: str) -> PrefixTuningSpec:
    """The virtual tokens and projection the row's targets column names ("200 virtual tokens,
    no projection")."""
    tokens, _, projection = raw.partition(",")
    return PrefixTuningSpec(
        num_virtual_tokens=int(tokens.split()[0]),
        prefix_projection="no projection" not in projection and "projection" in projection,
    )


def _checkpointing(raw: dict[str, str]) -> bool:
    """As published; where not, the framework's default: LLaMA-Factory checkpoints unless
    disable_gradient_checkpointing is set (src/llamafactory/hparams/model_args.py, default
    False), HF Trainer does not (TrainingArguments.gradient_checkpointing, default False)."""
    value = raw["grad_checkpointing"]
    if value.startswith("unknown"):
        return "LLaMA-Factory" in raw["framework"]
    return value.startswith("yes")


# The library stack of a source's runs where it is not the traced one: transformers' single-GPU
# training page (docs v4.18-v4.28) was measured once, when it was written (its nvidia-smi output
# is dated 2022-01-11), on a torch that loaded CUDA's kernels eagerly (its 1343 MB context): the
# `hf-4.16` preset (service/core/stack.py says why those versions).
STACKS = {"hf-trainer (transformers ~4.16-4.27)": "hf-4.16"}


def load() -> tuple[list[Row], list[Skipped]]:
    """Rows mapped to specs, and the rows that cannot be (with why)."""
    from service.catalog.models import default_catalog
    from service.core.errors import EstimatorError
    from service.core.estimator import peak_levels

    catalog = default_catalog()
    rows: list[Row] = []
    skipped: list[Skipped] = []
    with DATA.open(newline="") as fh:
        for raw in csv.DictReader(fh):
            rid = raw["id"]
            method_text = raw["method"].strip()
            kbit_adapter = method_text.endswith(KBIT_SUFFIX)
            method_text = method_text.removesuffix(KBIT_SUFFIX)
            if method_text not in (
                "lora",
                "qlora",
                "full",
                "dora",
                *PEFT_METHODS,
                *ADAPTER_METHODS,
            ):
                skipped.append(Skipped(rid, f"method {method_text!r} is not modelled"))
                continue
            if raw["is_estimate"] == "yes" and not raw["batch_size"]:
                skipped.append(Skipped(rid, "a rule-of-thumb estimate: no model, batch or length"))
                continue
            model = raw["model"].split(" (")[0].strip()
            try:
                entry = catalog.resolve(model)
            except EstimatorError:
                skipped.append(Skipped(rid, f"model {model!r} not in the catalog"))
                continue
            seq_text = raw["seq_len"].lstrip("<=")
            target_length = None
            if entry.arch.encoder_decoder and not seq_text:
                seq_text, target_length = str(SEQ2SEQ_SOURCE_LEN), SEQ2SEQ_TARGET_LEN
            if not seq_text.isdigit() or not raw["batch_size"].isdigit():
                skipped.append(Skipped(rid, "batch or sequence length not published"))
                continue
            framework = Framework.LITGPT if raw["framework"] == "litgpt" else Framework.HF
            # DoRA is PEFT's LoRA with use_dora=True.
            dora = method_text == "dora"
            method = Method.LORA if dora else Method(method_text)
            lora = None
            vera = None
            loha = None
            lokr = None
            adalora = None
            oft = None
            boft = None
            if method is Method.VERA:
                vera = VeraSpec(
                    r=int(raw["lora_r"] or 256),
                    target_modules=_targets(raw["lora_targets"], entry.arch.model_type),
                )
            elif method is Method.LOHA:
                loha = LohaSpec(
                    r=int(raw["lora_r"] or 8),
                    alpha=int(raw["lora_alpha"] or 8),
                    target_modules=_targets(raw["lora_targets"], entry.arch.model_type),
                )
            elif method is Method.LOKR:
                factor = raw["lora_targets"].split("decompose_factor=")[1].split(")")[0]
                lokr = LokrSpec(
                    r=int(raw["lora_r"] or 8),
                    alpha=int(raw["lora_alpha"] or 8),
                    decompose_factor=int(factor) if factor.strip("-").isdigit() else -1,
                    target_modules=_targets(raw["lora_targets"], entry.arch.model_type),
                )
            elif method is Method.ADALORA:
                adalora = _adalora(raw)
            elif method is Method.OFT:
                oft = OftSpec(
                    r=int(raw["lora_r"]),
                    oft_block_size=0,
                    target_modules=_targets(raw["lora_targets"], entry.arch.model_type),
                )
            elif method is Method.BOFT:
                boft = BoftSpec(
                    boft_block_size=int(_option(raw["lora_targets"], "boft_block_size")),
                    boft_n_butterfly_factor=int(_option(raw["lora_targets"], "n_butterfly_factor")),
                    target_modules=_targets(raw["lora_targets"], entry.arch.model_type),
                )
            elif method in LORA_METHODS:
                lora = LoraSpec(
                    r=int(raw["lora_r"] or 8),
                    lora_alpha=int(raw["lora_alpha"] or 16),
                    target_modules=_targets(raw["lora_targets"], entry.arch.model_type),
                    modules_to_save=_modules_to_save(raw["lora_targets"]),
                    use_dora=dora,
                )
            quant = None
            gptq = "gptq" in raw["base_dtype"].lower()
            if gptq:
                # a GPTQ checkpoint ("int4 GPTQ ..., compute fp16"): 4 bits, GPTQConfig's
                # default group of 128, computed in fp16
                quant = QuantSpec(type=QuantType.GPTQ, bits=4)
            elif method is Method.QLORA or kbit_adapter:
                quant = QuantSpec(
                    double_quant="double" in raw["base_dtype"],
                    prepare_kbit=framework is Framework.HF,
                )
            attn = raw["attn_impl"].lower()
            dtype, autocast = _dtype(raw["base_dtype"])
            if gptq:
                dtype = DType.FP16
            try:
                spec = TrainingSpec(
                    method=method,
                    batch_size=int(raw["batch_size"]),
                    seq_len=int(seq_text),
                    lora=lora,
                    vera=vera,
                    loha=loha,
                    lokr=lokr,
                    adalora=adalora,
                    oft=oft,
                    boft=boft,
                    quantization=quant,
                    # PEFT's defaults, as the rows' target columns spell them out
                    ia3=IA3Spec() if method is Method.IA3 else None,
                    ln_tuning=LnTuningSpec() if method is Method.LN_TUNING else None,
                    prompt_tuning=_prompt_tuning(raw["lora_targets"])
                    if method is Method.PROMPT_TUNING
                    else None,
                    prefix_tuning=_prefix_tuning(raw["lora_targets"])
                    if method is Method.PREFIX_TUNING
                    else None,
                    dtype=dtype,
                    autocast=autocast,
                    optim=_optim(raw["optimizer"], raw["framework"]),
                    gradient_checkpointing=_checkpointing(raw),
                    gradient_accumulation_steps=int(raw["grad_accum"] or 1),
                    attn_implementation=AttnImpl.EAGER
                    if "eager" in attn
                    else AttnImpl.FLASH_ATTENTION_2
                    if "flash" in attn
                    else AttnImpl.SDPA,
                    framework=framework,
                    parallel=_parallel(raw),
                    stack=preset(STACKS.get(raw["framework"], "hf-5.24")),
                    target_length=target_length,
                )
                if entry.arch.encoder_decoder:
                    peak_levels(entry.arch, spec)  # refused while its step is not modelled
            except EstimatorError as exc:
                skipped.append(Skipped(rid, str(exc)))
                continue
            rows.append(
                Row(
                    id=rid,
                    source=raw["source_url"],
                    tier=raw["tier"],
                    measure_kind=raw["measure_kind"],
                    level=LEVEL[raw["measure_kind"]],
                    model=entry.id,
                    spec=spec,
                    measured_bytes=round(float(raw["measured_peak_gb"]) * DECIMAL_GB),
                    framework=raw["framework"],
                    gpu=raw["gpu"].strip(),
                )
            )
    return rows, skipped
