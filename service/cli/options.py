"""The job-spec options `estimate`, `fit`, `trace` and `probe` share, and what they build: the
spec (through the core's spec codec, so the command line refuses what the API refuses, for the
same reason), and the model from a catalog id or `--config`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from enum import Enum
from pathlib import Path
from typing import Any

from service.cli.grpo_options import GRPO_OPTIONS, add_grpo_options, grpo_settings
from service.core.allocator import alloc_conf_values
from service.core.architecture import ModelArch
from service.core.codec import spec_from_dict, spec_to_dict
from service.core.errors import EstimatorError, InvalidConfigError, InvalidSpecError
from service.core.hf_config import from_hf_config
from service.core.parallel_config import parallel_from_deepspeed, parallel_from_fsdp
from service.core.spec import (
    ADAPTER_METHODS,
    ALL_LINEAR,
    LORA_METHODS,
    METHOD_OPTIONS,
    AttnImpl,
    Framework,
    FsdpSharding,
    LossImpl,
    Method,
    Offload,
    Optim,
    QuantType,
    SdpaKernel,
    Strategy,
    TrainingSpec,
)
from service.core.spec_delta import AdaLoraSpec
from service.core.units import DType

# Spec field (dotted, as errors name it) -> the option that sets it.
_OPTION_FOR_FIELD = {
    "batch_size": "--batch-size",
    "seq_len": "--seq-len",
    "target_length": "--target-length",
    "gradient_accumulation_steps": "--gradient-accumulation-steps",
    "max_grad_norm": "--max-grad-norm",
    "lora": "--r/--target-modules",
    "lora.r": "--r",
    "lora.lora_dropout": "--lora-dropout",
    "lora.target_modules": "--target-modules",
    "quantization": "--quant",
    "quantization.type": "--quant",
    "parallel.gpus": "--gpus",
    "parallel.offload": "--offload",
    "dpo": "--precompute-ref-log-probs/--max-completion-length",
    "dpo.max_completion_length": "--max-completion-length",
    "kto": "--precompute-ref-log-probs/--kto-loss-type",
    **GRPO_OPTIONS,
    "orpo": "--objective orpo/--keep-dropout",
    "vision": "--images-per-sample/--image-height/--image-width/--image-tokens",
}


# The image options, by their spec field (service/core/spec_vision.py VisionInputs).
_VISION_OPTIONS = (
    "images_per_sample",
    "image_height",
    "image_width",
    "image_tokens",
    "min_pixels",
    "max_pixels",
)


class CliError(Exception):
    """A one-line reason to print before exiting with status 2."""


def option_error(exc: InvalidSpecError) -> CliError:
    """The error naming the option that sets the spec field `exc` names, and the field."""
    if exc.field.startswith("allocator"):
        return CliError(f"--alloc-conf: {exc}")
    if exc.field.startswith("stack"):
        return CliError(f"--stack ({exc.field}): {exc.reason}")
    option = _OPTION_FOR_FIELD.get(exc.field, "--" + exc.field.split(".")[-1].replace("_", "-"))
    return CliError(f"{option} ({exc.field}): {exc.reason}")


def _choices(enum: type[Any]) -> list[str]:
    return [e.value for e in enum]


def add_spec_options(parser: argparse.ArgumentParser, *, require_job: bool = True) -> None:
    """The job-spec options shared by `estimate`, `fit` and `trace`; with `require_job`
    False, batch size and sequence length may be left out (`trace --matrix`)."""
    parser.add_argument("model", nargs="?", help="catalog id, e.g. Qwen/Qwen2.5-7B-Instruct")
    parser.add_argument("--config", type=Path, help="a model config.json instead of a catalog id")
    parser.add_argument("--method", choices=_choices(Method), default=Method.LORA.value)
    parser.add_argument(
        "-b", "--batch-size", type=int, required=require_job, help="micro-batch per GPU"
    )
    parser.add_argument(
        "-s", "--seq-len", type=int, required=require_job, help="tokens per sequence"
    )
    lora = parser.add_argument_group("LoRA (PEFT LoraConfig)")
    lora.add_argument("--r", type=int, help="LoRA rank (PEFT default 8)")
    lora.add_argument("--lora-alpha", type=int)
    lora.add_argument("--lora-dropout", type=float)
    lora.add_argument("--target-modules", help=f"comma-separated module names, or {ALL_LINEAR}")
    lora.add_argument("--modules-to-save", help="comma-separated, e.g. embed_tokens,lm_head")
    lora.add_argument("--adapter-dtype", choices=_choices(DType))
    lora.add_argument(
        "--use-dora", action="store_true", default=None, help="DoRA (PEFT use_dora=True)"
    )
    lora.add_argument(
        "--use-rslora",
        action="store_true",
        default=None,
        help="rsLoRA scaling (PEFT use_rslora=True; no memory change)",
    )
    prompt = parser.add_argument_group(
        "prompt and prefix tuning (PEFT PromptTuningConfig, PrefixTuningConfig)"
    )
    prompt.add_argument(
        "--num-virtual-tokens",
        type=int,
        help="virtual tokens prepended (prompt-tuning), or in front of every layer's keys "
        "and values (prefix-tuning)",
    )
    prompt.add_argument(
        "--prefix-projection",
        action="store_true",
        default=None,
        help="prefix tuning's two-layer MLP (PEFT prefix_projection=True)",
    )
    prompt.add_argument(
        "--encoder-hidden-size", type=int, help="the prefix projection's width (prefix-tuning)"
    )
    images = parser.add_argument_group(
        "images (a vision-language model: Qwen2-VL, Qwen2.5-VL, Llama-3.2-Vision)"
    )
    images.add_argument("--images-per-sample", type=int, help="images in each sample")
    images.add_argument("--image-height", type=int, help="the images' height in pixels")
    images.add_argument("--image-width", type=int, help="the images' width in pixels")
    images.add_argument(
        "--image-tokens",
        type=int,
        help="instead of the size: tokens per image (seq_len counts them; not Llama-3.2-Vision)",
    )
    images.add_argument("--min-pixels", type=int, help="Qwen2-VL's processor min_pixels")
    images.add_argument("--max-pixels", type=int, help="Qwen2-VL's processor max_pixels")
    quant = parser.add_argument_group("QLoRA (bitsandbytes, GPTQ, AWQ, HQQ, torchao)")
    quant.add_argument("--quant", choices=_choices(QuantType))
    quant.add_argument("--double-quant", action="store_true")
    quant.add_argument("--compute-dtype", choices=_choices(DType))
    quant.add_argument(
        "--bits", type=int, help="GPTQ/AWQ bits, HQQ nbits (default 4; gptq, awq, hqq only)"
    )
    quant.add_argument(
        "--group-size",
        type=int,
        help="GPTQ/AWQ/HQQ group size (default 128, HQQ 64; -1: one group per row)",
    )
    quant.add_argument("--desc-act", action="store_true", help="GPTQ act-order (desc_act)")
    quant.add_argument(
        "--no-prepare-kbit", action="store_true", help="skip prepare_model_for_kbit_training"
    )
    train = parser.add_argument_group("training")
    train.add_argument("--dtype", choices=_choices(DType), default=DType.BF16.value)
    train.add_argument("--autocast", action="store_true", help="bf16/fp16 mixed precision")
    train.add_argument("--optim", choices=_choices(Optim), default=Optim.ADAMW_TORCH_FUSED.value)
    train.add_argument("--gradient-accumulation-steps", type=int, default=1)
    train.add_argument(
        "--max-grad-norm",
        type=float,
        default=1.0,
        help="gradient clipping as HF Trainer's max_grad_norm (default 1.0; 0: none)",
    )
    train.add_argument("--gradient-checkpointing", action="store_true")
    train.add_argument(
        "--optimizer-in-backward",
        action="store_true",
        help="torchtune's optimizer_in_bwd: each parameter stepped as its gradient lands",
    )
    train.add_argument(
        "--activation-offloading",
        action="store_true",
        help="torchtune's enable_activation_offloading: saved activations to pinned host memory",
    )
    train.add_argument(
        "--torch-compile",
        action="store_true",
        help="TrainingArguments.torch_compile (not traced: the eager step is estimated)",
    )
    train.add_argument(
        "--liger-kernel",
        action="store_true",
        help="TrainingArguments.use_liger_kernel: Liger's RoPE, RMSNorm, SwiGLU/GEGLU and fused "
        "linear cross-entropy (llama, mistral, qwen2, gemma2)",
    )
    train.add_argument(
        "--packing",
        action="store_true",
        help="TRL's padding-free packing: the micro-batch's sequences as one row of "
        "batch x seq tokens",
    )
    train.add_argument(
        "--attn-implementation", choices=_choices(AttnImpl), default=AttnImpl.SDPA.value
    )
    train.add_argument("--sdpa-kernel", choices=_choices(SdpaKernel), default="auto")
    train.add_argument("--loss", choices=_choices(LossImpl))
    train.add_argument(
        "--num-labels",
        type=int,
        help="classes of an encoder's (BERT) sequence-classification head (default: the "
        "model's, 2)",
    )
    train.add_argument(
        "--target-length",
        type=int,
        help="an encoder-decoder's (T5) decoder tokens, the labels' length; --seq-len is then "
        "the source's (default: as long as --seq-len)",
    )
    train.add_argument(
        "--objective",
        help="the training objective as TRL names its trainers: sft (default), dpo, reward "
        "(a one-label reward model, RewardTrainer), kto (KTOTrainer), orpo (ORPOTrainer) or "
        "grpo (GRPOTrainer)",
    )
    train.add_argument(
        "--precompute-ref-log-probs",
        action="store_true",
        default=None,
        help="dpo, kto: precompute_ref_log_probs of DPOConfig or KTOConfig (no reference "
        "forward, no reference copy)",
    )
    train.add_argument(
        "--kto-loss-type",
        choices=("kto", "apo_zero_unpaired"),
        help="kto: KTOConfig.loss_type (default kto, with the KL batch; apo_zero_unpaired "
        "runs none)",
    )
    train.add_argument(
        "--keep-dropout",
        action="store_true",
        default=None,
        help="orpo: ORPOConfig.disable_dropout=False (LoRA's dropout kept; TRL's default sets "
        "every dropout's p to 0)",
    )
    train.add_argument(
        "--max-completion-length",
        type=int,
        help="dpo, grpo: completion tokens of each sequence, scored by TRL's fused LM head "
        "(dpo default: the whole sequence; grpo: GRPOConfig's 512, generated)",
    )
    add_grpo_options(train)
    train.add_argument("--framework", choices=_choices(Framework), default=Framework.HF.value)
    train.add_argument(
        "--stack",
        help="the library versions it runs on: a preset (hf-5.24, the traced one, hf-4.48 or "
        "hf-4.16) "
        "or transformers=X[,peft=Y,bitsandbytes=Z,torch=W]",
    )
    par = parser.add_argument_group("parallelism")
    par.add_argument("--gpus", type=int, default=1)
    par.add_argument("--strategy", choices=_choices(Strategy), help="default ddp")
    par.add_argument("--offload", choices=_choices(Offload), help="default none")
    par.add_argument(
        "--deepspeed",
        metavar="FILE",
        help="a DeepSpeed config JSON, as HF Trainer's --deepspeed takes it: its "
        "zero_optimization section sets the strategy, offload and ZeRO settings",
    )
    par.add_argument(
        "--fsdp-config",
        metavar="FILE",
        help="an FSDP config JSON: HF Trainer's fsdp_config, or accelerate's fsdp_ keys",
    )
    par.add_argument(
        "--sharding-strategy",
        choices=_choices(FsdpSharding),
        help="FSDP1's sharding strategy (default FULL_SHARD)",
    )
    par.add_argument(
        "--no-reshard-after-forward",
        dest="reshard_after_forward",
        action="store_false",
        default=None,
        help="FSDP2: keep each layer's gathered parameters from its forward to its backward",
    )
    par.add_argument("--bucket-cap-mb", type=int, help="DDP's bucket cap in MB (default 25)")
    par.add_argument(
        "--gradient-as-bucket-view",
        action="store_true",
        default=None,
        help="DDP: gradients are views into the buckets",
    )
    parser.add_argument(
        "--alloc-conf",
        default="",
        help="PYTORCH_CUDA_ALLOC_CONF, e.g. expandable_segments:True (default: PyTorch's)",
    )


def _stack_value(raw: str | None) -> str | dict[str, str] | None:
    """--stack: a preset's name, or library=version pairs separated by commas."""
    if raw is None or "=" not in raw:
        return raw
    versions: dict[str, str] = {}
    for item in raw.split(","):
        name, sep, version = item.partition("=")
        if not sep:
            raise CliError(f"--stack: {item!r} is not library=version")
        versions[name.strip()] = version.strip()
    return versions


def _names(raw: str | None) -> list[str] | str | None:
    if raw is None:
        return None
    if raw.strip() == ALL_LINEAR:
        return ALL_LINEAR
    return [n.strip() for n in raw.split(",") if n.strip()]


def _given(values: Mapping[str, Any]) -> dict[str, Any]:
    """The options set, so the spec's defaults fill the rest."""
    return {key: value for key, value in values.items() if value is not None}


# LoRA's options that no other PEFT method takes (`--target-modules` is every method's)
_LORA_ONLY_OPTIONS = ("r", "lora_alpha", "lora_dropout", "adapter_dtype", "use_dora", "use_rslora")


def spec_from_args(args: argparse.Namespace) -> TrainingSpec:
    """Build a TrainingSpec from parsed options; raises CliError naming the option."""
    method = Method(args.method)
    lora_given = any(
        getattr(args, n) is not None
        for n in (
            "r",
            "lora_alpha",
            "lora_dropout",
            "target_modules",
            "adapter_dtype",
            "use_dora",
            "use_rslora",
        )
    ) or bool(args.modules_to_save)
    peft_method = METHOD_OPTIONS.get(method)
    if peft_method is not None:
        # --target-modules names the modules of PEFT's other methods too
        lora_given = bool(args.modules_to_save) or any(
            getattr(args, n) is not None for n in _LORA_ONLY_OPTIONS
        )
    elif method in (Method.VERA, Method.LOHA, Method.LOKR):
        # VeRA, LoHa and LoKr take the rank and the targets (their PEFT configs' r, target_modules)
        lora_given = any(
            getattr(args, n) is not None
            for n in ("lora_alpha", "lora_dropout", "adapter_dtype", "use_dora", "use_rslora")
        ) or bool(args.modules_to_save)
    elif method in (Method.ADALORA, Method.OFT, Method.BOFT):
        # AdaLoRA takes the rank (its init_r), alpha and the targets; OFT the rank (its block
        # count) and the targets
        lora_given = any(
            getattr(args, n) is not None
            for n in ("lora_dropout", "adapter_dtype", "use_dora", "use_rslora")
        ) or bool(args.modules_to_save)
    if method not in LORA_METHODS and lora_given:
        raise CliError("--r/--target-modules: LoRA options need --method lora or qlora")
    quant_given = bool(
        args.quant
        or args.double_quant
        or args.compute_dtype
        or args.bits is not None
        or args.group_size is not None
        or args.desc_act
    )
    if method is not Method.QLORA and method not in ADAPTER_METHODS and quant_given:
        raise CliError(
            "--quant: quantization options need --method qlora, llama-adapter or llama-adapter-v2"
        )
    data = _given(
        {
            "method": method.value,
            "batch_size": args.batch_size,
            "seq_len": args.seq_len,
            "dtype": args.dtype,
            "autocast": args.autocast,
            "optim": args.optim,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "max_grad_norm": args.max_grad_norm,
            "gradient_checkpointing": args.gradient_checkpointing,
            "optimizer_in_backward": args.optimizer_in_backward or None,
            "activation_offloading": args.activation_offloading or None,
            "packing": args.packing,
            "torch_compile": args.torch_compile,
            "liger_kernel": args.liger_kernel,
            "attn_implementation": args.attn_implementation,
            "sdpa_kernel": args.sdpa_kernel,
            "loss": args.loss,
            "framework": args.framework,
            "num_labels": getattr(args, "num_labels", None),
            "target_length": getattr(args, "target_length", None),
            "stack": _stack_value(getattr(args, "stack", None)),
            "parallel": _given(
                {
                    "gpus": args.gpus,
                    "strategy": args.strategy,
                    "offload": args.offload,
                    "sharding_strategy": args.sharding_strategy,
                    "reshard_after_forward": args.reshard_after_forward,
                    "bucket_cap_mb": args.bucket_cap_mb,
                    "gradient_as_bucket_view": args.gradient_as_bucket_view,
                }
            ),
        }
    )
    virtual = getattr(args, "num_virtual_tokens", None)
    projection = getattr(args, "prefix_projection", None)
    width = getattr(args, "encoder_hidden_size", None)
    if virtual is not None and method not in (Method.PROMPT_TUNING, Method.PREFIX_TUNING):
        raise CliError("--num-virtual-tokens: needs --method prompt-tuning or prefix-tuning")
    if (projection is not None or width is not None) and method is not Method.PREFIX_TUNING:
        raise CliError("--prefix-projection/--encoder-hidden-size: need --method prefix-tuning")
    if method is Method.PREFIX_TUNING and (virtual, projection, width) != (None, None, None):
        data["prefix_tuning"] = _given(
            {
                "num_virtual_tokens": virtual,
                "prefix_projection": projection,
                "encoder_hidden_size": width,
            }
        )
    elif virtual is not None:
        data["prompt_tuning"] = {"num_virtual_tokens": virtual}
    elif peft_method is not None and args.target_modules is not None:
        data[peft_method] = {"target_modules": _names(args.target_modules)}
    if method in (Method.VERA, Method.LOHA, Method.LOKR):
        data[method.value] = _given({"r": args.r, "target_modules": _names(args.target_modules)})
    if method is Method.OFT:
        # --r is OFT's block count, given instead of its block size
        blocks = None if args.r is None else {"r": args.r, "oft_block_size": 0}
        data["oft"] = _given({**(blocks or {}), "target_modules": _names(args.target_modules)})
    if method is Method.BOFT:
        # --r is BOFT's block count, given instead of its block size
        blocks = None if args.r is None else {"boft_block_num": args.r, "boft_block_size": 0}
        data["boft"] = _given({**(blocks or {}), "target_modules": _names(args.target_modules)})
    if method is Method.ADALORA:
        # --r is AdaLoRA's initial rank; its target (a masking budget, no memory) is kept at
        # most that
        target_r = None if args.r is None else min(args.r, AdaLoraSpec().target_r)
        data["adalora"] = _given(
            {
                "init_r": args.r,
                "target_r": target_r,
                "lora_alpha": args.lora_alpha,
                "target_modules": _names(args.target_modules),
            }
        )
    if method in LORA_METHODS:
        saved = _names(args.modules_to_save)
        data["lora"] = _given(
            {
                "r": args.r,
                "lora_alpha": args.lora_alpha,
                "lora_dropout": args.lora_dropout,
                "target_modules": _names(args.target_modules),
                "modules_to_save": saved if isinstance(saved, list) else [],
                "adapter_dtype": args.adapter_dtype,
                "use_dora": args.use_dora,
                "use_rslora": args.use_rslora,
            }
        )
    if method is Method.QLORA or (method in ADAPTER_METHODS and quant_given):
        data["quantization"] = _given(
            {
                "type": args.quant or QuantType.NF4.value,
                "double_quant": args.double_quant,
                "compute_dtype": args.compute_dtype,
                # PEFT's kbit preparation is QLoRA's; LitGPT's adapters never run it
                "prepare_kbit": not args.no_prepare_kbit and method is Method.QLORA,
                "bits": args.bits,
                "group_size": args.group_size,
                "desc_act": args.desc_act,
            }
        )
    objective = getattr(args, "objective", None)
    if objective is not None:
        data["objective"] = objective
    precompute = getattr(args, "precompute_ref_log_probs", None)
    kto = objective == "kto" or getattr(args, "kto_loss_type", None) is not None
    settings = _given(
        {
            "precompute_ref_log_probs": precompute,
            "max_completion_length": getattr(args, "max_completion_length", None),
        }
    )
    if kto:
        # KTOConfig's settings; DPO's completion length stays DPO's
        data["kto"] = _given(
            {"precompute_ref_log_probs": precompute, "loss_type": args.kto_loss_type}
        )
        settings.pop("precompute_ref_log_probs", None)
    if objective == "grpo":
        data["grpo"] = grpo_settings(args)
        settings.pop("max_completion_length", None)
    if settings:
        data["dpo"] = settings
    if getattr(args, "keep_dropout", None):
        data["orpo"] = {"disable_dropout": False}  # ORPOConfig's, for objective 'orpo'
    vision = _given({name: getattr(args, name, None) for name in _VISION_OPTIONS})
    if vision:
        data["vision"] = vision
    _apply_parallel_configs(args, data)
    try:
        data["allocator"] = alloc_conf_values(getattr(args, "alloc_conf", "") or "")
        return spec_from_dict(data)
    except InvalidSpecError as exc:
        raise option_error(exc) from None


def _apply_parallel_configs(args: argparse.Namespace, data: dict[str, Any]) -> None:
    """Fill the parallel settings (and checkpointing) that --deepspeed or --fsdp-config set
    and no option gave."""
    deepspeed = getattr(args, "deepspeed", None)
    fsdp = getattr(args, "fsdp_config", None)
    if deepspeed and fsdp:
        raise CliError("--deepspeed and --fsdp-config: give one of them")
    option, path = ("--deepspeed", deepspeed) if deepspeed else ("--fsdp-config", fsdp)
    if not path:
        return
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise CliError(f"{option}: cannot read {path}: {exc}") from None
    job: dict[str, Any] = {}
    try:
        if deepspeed:
            fields = parallel_from_deepspeed(config)
        else:
            fields, job = parallel_from_fsdp(config)
    except InvalidSpecError as exc:
        raise CliError(f"{option}: {exc.field}: {exc.reason}") from None
    parallel = data.setdefault("parallel", {})
    for name, value in fields.items():
        parallel.setdefault(name, value.value if isinstance(value, Enum) else value)
    if job.get("gradient_checkpointing") and not args.gradient_checkpointing:
        data["gradient_checkpointing"] = True


def job_fields(spec: TrainingSpec) -> dict[str, Any]:
    """A spec as the API's job fields (the codec's names), options left unset left out."""
    fields: dict[str, Any] = _without_nulls(spec_to_dict(spec))
    return fields


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    return value


def read_config(args: argparse.Namespace) -> Mapping[str, Any] | None:
    """The `--config` file's JSON, None without --config; refuses a model id beside it."""
    if args.config is None:
        return None
    if args.model:
        raise CliError("give a model id or --config, not both")
    try:
        raw: Mapping[str, Any] = json.loads(Path(args.config).read_text())
    except OSError as exc:
        raise CliError(f"--config: cannot read {args.config}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise CliError(f"--config: not valid JSON ({exc.msg}, line {exc.lineno})") from None
    return raw


def load_model(args: argparse.Namespace) -> tuple[str, Mapping[str, Any], ModelArch]:
    """(model id, config.json mapping, architecture) from `model` or `--config`."""
    raw = read_config(args)
    if raw is not None:
        try:
            return str(args.config), raw, from_hf_config(raw)
        except InvalidConfigError as exc:
            raise CliError(f"--config: {exc}") from None
    if not args.model:
        raise CliError("model: give a catalog id or --config config.json")
    from service.catalog.models import default_catalog

    try:
        entry = default_catalog().resolve(args.model)
    except EstimatorError as exc:
        raise CliError(f"model: {exc}") from None
    return entry.id, entry.config, entry.arch
