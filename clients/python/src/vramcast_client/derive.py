"""The job spec of a running training job, read from the objects the job is made of.

From the model: its config.json (or catalog id), dtype and attention implementation; from
PEFT: method, LoRA options and quantization; from HF `TrainingArguments` or a Lightning
`Trainer`: micro-batch, optimizer, gradient accumulation and checkpointing, mixed precision
and the data-parallel layout. The sequence length comes from the caller, else from the
inputs the model was seen to take (`InputShapes`), else from the arguments' max length.

Everything is read by attribute, so nothing here imports torch, transformers, peft or
lightning. A job the API cannot describe (an adapter other than LoRA, an optimizer it does
not model) raises `UndescribableJobError`: uploading it under a wrong spec would corrupt
the calibration.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, get_args

from vramcast_client.models import (
    AttnImplName,
    Dpo,
    DTypeName,
    Grpo,
    Job,
    Kto,
    Lora,
    MethodName,
    ModelRef,
    OptimName,
    Orpo,
    Parallel,
    Quantization,
    QuantTypeName,
    StrategyName,
)

_DTYPES: dict[str, DTypeName] = {
    "torch.float32": "fp32",
    "torch.bfloat16": "bf16",
    "torch.float16": "fp16",
    "float32": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
}
_OPTIMS = frozenset(get_args(OptimName))
# TrainingArguments.optim names the API knows under another name, with the same state.
_OPTIM_ALIASES: dict[str, OptimName] = {
    "adamw_8bit": "adamw_bnb_8bit",
    "adamw_torch_xla": "adamw_torch",
    "adamw_torch_npu_fused": "adamw_torch_fused",
}
# Optimizer classes (torch, bitsandbytes, transformers) by name, for Lightning.
_OPTIM_CLASSES: dict[str, OptimName] = {
    "Adam": "adamw_torch",
    "AdamW": "adamw_torch",
    "AdamW8bit": "adamw_bnb_8bit",
    "Adam8bit": "adamw_bnb_8bit",
    "PagedAdamW8bit": "paged_adamw_8bit",
    "PagedAdamW32bit": "paged_adamw_32bit",
    "PagedAdamW": "paged_adamw_32bit",
    "Adafactor": "adafactor",
    "SGD": "sgd",
}
_ATTN_IMPLS = frozenset(get_args(AttnImplName))
_ZERO_STAGES: dict[int, StrategyName] = {1: "zero1", 2: "zero2", 3: "zero3"}


class UndescribableJobError(ValueError):
    """The job uses something the API's job spec cannot express; `reason` says what."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class InputShapes:
    """The largest (batch, sequence) a model was seen to take while training.

    A forward pre-hook reads only the shape of `input_ids` (or `inputs_embeds`): the peak a
    probe measured belongs to the longest batch that ran, padding included.
    """

    def __init__(self) -> None:
        self.max_seq_len: int | None = None
        self.max_batch_size: int | None = None
        self._handles: list[Any] = []

    def watch(self, module: Any) -> None:
        """Start recording the inputs of `module` (a torch.nn.Module)."""
        self._handles.append(module.register_forward_pre_hook(self._hook, with_kwargs=True))

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not getattr(module, "training", True):
            return
        tensor = kwargs.get("input_ids")
        if tensor is None:
            tensor = kwargs.get("inputs_embeds")
        if tensor is None and args:
            tensor = args[0]
        shape = getattr(tensor, "shape", None)
        if shape is None or len(shape) < 2:
            return
        batch, seq = int(shape[0]), int(shape[1])
        self.max_batch_size = max(self.max_batch_size or 0, batch)
        self.max_seq_len = max(self.max_seq_len or 0, seq)


def job_from_hf(
    model: Any,
    args: Any = None,
    *,
    seq_len: int | None = None,
    shapes: InputShapes | None = None,
    model_id: str | None = None,
) -> Job:
    """The job of an HF `Trainer` run: `model` as the Trainer holds it, `args` its
    TrainingArguments (or TRL's SFTConfig, which adds max_length; or TRL's DPOConfig or
    RewardConfig, whose batches are pairs: the model takes 2 x per_device_train_batch_size
    sequences; or TRL's KTOConfig, whose batches are unpaired examples; or TRL's ORPOConfig,
    pairs too; or TRL's GRPOConfig, whose batch counts completions of prompt +
    max_completion_length tokens)."""
    base = find_hf_model(model)
    dpo = _dpo(args)
    kto = _kto(args)
    orpo = _orpo(args)
    grpo = _grpo(args)
    reward = type(args).__name__ == "RewardConfig"  # by name: TRL need not be importable
    batch = _int(getattr(args, "per_device_train_batch_size", None))
    if batch is None and shapes is not None and shapes.max_batch_size:
        pairs = dpo is not None or orpo is not None or reward
        batch = shapes.max_batch_size // 2 if pairs else shapes.max_batch_size
    strategy, offload = _hf_parallel(args)
    job = _job(
        base,
        model_id=model_id,
        batch_size=batch,
        seq_len=_seq_len(seq_len, shapes, args),
        autocast=bool(getattr(args, "bf16", False) or getattr(args, "fp16", False)),
        optim=_hf_optim(getattr(args, "optim", None)) if args is not None else None,
        accumulation=_int(getattr(args, "gradient_accumulation_steps", None)),
        max_grad_norm=_float(getattr(args, "max_grad_norm", None)),
        checkpointing=bool(getattr(args, "gradient_checkpointing", False)),
        parallel=Parallel(
            gpus=_int(getattr(args, "world_size", None)) or world_size(),
            strategy=strategy,
            offload=offload,
        ),
    )
    if _padding_free(args):
        job = job.model_copy(update={"packing": True})
    if getattr(args, "torch_compile", False) is True:
        job = job.model_copy(update={"torch_compile": True})
    if getattr(args, "use_liger_kernel", False) is True:
        job = job.model_copy(update={"liger_kernel": True})
    if reward:
        return job.model_copy(update={"objective": "reward"})
    if kto is not None:
        return job.model_copy(update={"objective": "kto", "kto": kto})
    if grpo is not None:
        return job.model_copy(update={"objective": "grpo", "grpo": grpo})
    if orpo is not None:
        return job.model_copy(update={"objective": "orpo", "orpo": orpo})
    if dpo is None:
        return job
    return job.model_copy(update={"objective": "dpo", "dpo": dpo})


def _padding_free(args: Any) -> bool:
    """Whether `args`, TRL's SFTConfig (by its class name), runs padding-free: padding_free set,
    or packing under a best-fit-decreasing strategy (SFTTrainer.__init__ turns padding-free on
    for "bfd" and "bfd_split"; "wrapped" packs rows of max_length with a mask of their own)."""
    if type(args).__name__ != "SFTConfig":
        return False
    if getattr(args, "padding_free", False) is True:
        return True
    strategy = getattr(args, "packing_strategy", "bfd")
    return getattr(args, "packing", False) is True and strategy in ("bfd", "bfd_split")


def _dpo(args: Any) -> Dpo | None:
    """DPO's settings when `args` is TRL's DPOConfig (by its class name: TRL need not be
    importable here), else None."""
    if type(args).__name__ != "DPOConfig":
        return None
    precompute = getattr(args, "precompute_ref_log_probs", None)
    return Dpo(precompute_ref_log_probs=precompute if isinstance(precompute, bool) else None)


def _orpo(args: Any) -> Orpo | None:
    """ORPO's settings when `args` is TRL's ORPOConfig (by its class name), else None."""
    if type(args).__name__ != "ORPOConfig":
        return None
    disable = getattr(args, "disable_dropout", None)
    return Orpo(disable_dropout=disable if isinstance(disable, bool) else None)


def _kto(args: Any) -> Kto | None:
    """KTO's settings when `args` is TRL's KTOConfig (by its class name), else None."""
    if type(args).__name__ != "KTOConfig":
        return None
    precompute = getattr(args, "precompute_ref_log_probs", None)
    loss_type = getattr(args, "loss_type", None)
    return Kto(
        precompute_ref_log_probs=precompute if isinstance(precompute, bool) else None,
        loss_type=loss_type if loss_type in ("kto", "apo_zero_unpaired") else None,
    )


def _grpo(args: Any) -> Grpo | None:
    """GRPO's settings when `args` is TRL's GRPOConfig (by its class name), else None."""
    if type(args).__name__ != "GRPOConfig":
        return None
    return Grpo(
        num_generations=_int(getattr(args, "num_generations", None)),
        max_completion_length=_int(getattr(args, "max_completion_length", None)),
        beta=_float(getattr(args, "beta", None)),
        num_iterations=_int(getattr(args, "num_iterations", None)),
        use_vllm=bool(getattr(args, "use_vllm", False)),
    )


def job_from_lightning(
    trainer: Any,
    pl_module: Any,
    *,
    seq_len: int | None = None,
    shapes: InputShapes | None = None,
    model_id: str | None = None,
) -> Job:
    """The job of a Lightning `Trainer.fit`, whose LightningModule holds an HF model."""
    base = find_hf_model(pl_module)
    optimizers = list(getattr(trainer, "optimizers", None) or [])
    precision = str(getattr(trainer, "precision", ""))
    strategy, offload = _lightning_parallel(getattr(trainer, "strategy", None))
    return _job(
        base,
        model_id=model_id,
        batch_size=shapes.max_batch_size if shapes is not None else None,
        seq_len=_seq_len(seq_len, shapes, None),
        autocast=precision.endswith("-mixed"),
        optim=_optimizer_class(optimizers[0]) if optimizers else None,
        accumulation=_int(getattr(trainer, "accumulate_grad_batches", None)),
        # Lightning clips only when gradient_clip_val is set
        max_grad_norm=_float(getattr(trainer, "gradient_clip_val", None)) or 0.0,
        checkpointing=False,
        parallel=Parallel(
            gpus=_int(getattr(trainer, "world_size", None)) or world_size(),
            strategy=strategy,
            offload=offload,
        ),
    )


def find_hf_model(module: Any) -> Any:
    """The outermost module with an HF config (a PeftModel before the model it wraps)."""
    candidates = [module, *_submodules(module)]
    for candidate in candidates:
        if hasattr(candidate, "peft_config") and _has_config(candidate):
            return candidate
    for candidate in candidates:
        if _has_config(candidate):
            return candidate
    raise UndescribableJobError("no Hugging Face model (a module with a config) was found")


def world_size() -> int:
    return _int(os.environ.get("WORLD_SIZE")) or 1


def _job(
    model: Any,
    *,
    model_id: str | None,
    batch_size: int | None,
    seq_len: int | None,
    autocast: bool,
    optim: OptimName | None,
    accumulation: int | None,
    max_grad_norm: float | None,
    checkpointing: bool,
    parallel: Parallel,
) -> Job:
    if batch_size is None:
        raise UndescribableJobError("the micro-batch size is not known")
    if seq_len is None:
        raise UndescribableJobError(
            "the sequence length is not known: pass seq_len, or let the model take a batch"
        )
    config = model.config
    lora, quantized = _peft(model)
    quantization = _quantization(config) if quantized else None
    method: MethodName = "full" if lora is None else "qlora" if quantization else "lora"
    attn = getattr(config, "_attn_implementation", None)
    return Job(
        model=model_id if model_id else ModelRef(hf_config=hf_config(config)),
        method=method,
        batch_size=batch_size,
        seq_len=seq_len,
        lora=lora,
        quantization=quantization,
        dtype=_model_dtype(model),
        autocast=autocast,
        optim=optim,
        gradient_accumulation_steps=accumulation,
        max_grad_norm=max_grad_norm,
        gradient_checkpointing=checkpointing or _checkpointing(model),
        attn_implementation=attn if attn in _ATTN_IMPLS else None,
        parallel=parallel,
    )


def hf_config(config: Any) -> dict[str, Any]:
    """A config as its config.json would read (JSON values only)."""
    raw = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    parsed: dict[str, Any] = json.loads(json.dumps(raw, default=str))
    return parsed


def name_or_path(model: Any) -> str | None:
    """The Hub id the model was loaded from, when it looks like one ('org/name')."""
    config = getattr(find_hf_model(model), "config", None)
    value = getattr(config, "_name_or_path", None) or getattr(config, "name_or_path", None)
    if not isinstance(value, str) or value.count("/") != 1 or Path(value).exists():
        return None
    return value


def _has_config(module: Any) -> bool:
    return hasattr(getattr(module, "config", None), "model_type")


def _submodules(module: Any) -> Iterator[Any]:
    modules = getattr(module, "modules", None)
    if callable(modules):
        yield from modules()


def _peft(model: Any) -> tuple[Lora | None, bool]:
    """(LoRA options, whether the base is quantized) of a PEFT model; (None, False) without."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, Mapping) or not configs:
        return None, False
    active = getattr(model, "active_adapter", None)
    name = active if isinstance(active, str) and active in configs else next(iter(configs))
    config = configs[name]
    peft_type = str(getattr(config, "peft_type", ""))
    if not peft_type.upper().endswith("LORA"):
        raise UndescribableJobError(f"PEFT adapter type {peft_type} is not LoRA")
    targets = getattr(config, "target_modules", None)
    target_modules: Any = None
    if isinstance(targets, str):
        target_modules = targets if targets == "all-linear" else None
    elif targets:
        # get_peft_model expands "all-linear" into each adapted module's full path
        # (model.layers.0.self_attn.q_proj); a job names modules by their own name.
        target_modules = sorted({str(t).rsplit(".", 1)[-1] for t in targets})
    saved = getattr(config, "modules_to_save", None)
    # the names as PEFT keeps them; the model checks them against the schema's
    modules_to_save: Any = sorted(str(m) for m in saved) if saved else None
    lora = Lora(
        r=_int(getattr(config, "r", None)),
        lora_alpha=_int(getattr(config, "lora_alpha", None)),
        lora_dropout=float(getattr(config, "lora_dropout", 0.0) or 0.0),
        target_modules=target_modules,
        modules_to_save=modules_to_save,
        adapter_dtype=_adapter_dtype(model),
    )
    quantized = bool(
        getattr(model, "is_loaded_in_4bit", False)
        or getattr(model, "is_loaded_in_8bit", False)
        or getattr(getattr(model, "config", None), "quantization_config", None)
    )
    return lora, quantized


def _adapter_dtype(model: Any) -> DTypeName | None:
    named = getattr(model, "named_parameters", None)
    if not callable(named):
        return None
    for name, parameter in named():
        if "lora_" in name:
            return _dtype_name(parameter.dtype)
    return None


def _quantization(config: Any) -> Quantization | None:
    raw = getattr(config, "quantization_config", None)
    if raw is None:
        return None
    values: Mapping[str, Any] = raw.to_dict() if hasattr(raw, "to_dict") else raw
    method = values.get("quant_method")
    if method in ("gptq", "awq"):
        # transformers' GPTQConfig / AwqConfig: bits, group_size (and GPTQ's desc_act)
        return Quantization(
            type=method,
            bits=values.get("bits"),
            group_size=values.get("group_size"),
            desc_act=bool(values.get("desc_act", False)) if method == "gptq" else None,
        )
    if values.get("load_in_8bit"):
        kind: QuantTypeName = "int8"
    elif values.get("load_in_4bit"):
        kind = "fp4" if values.get("bnb_4bit_quant_type") == "fp4" else "nf4"
    else:
        raise UndescribableJobError(
            f"quantization {values.get('quant_method', '?')} is not bitsandbytes 4- or 8-bit, "
            "GPTQ or AWQ"
        )
    return Quantization(
        type=kind,
        double_quant=bool(values.get("bnb_4bit_use_double_quant", False)),
        compute_dtype=_dtype_name(values.get("bnb_4bit_compute_dtype")),
    )


def _model_dtype(model: Any) -> DTypeName | None:
    """The dtype the base is loaded in: that of its input embedding, never quantized."""
    embeddings = getattr(model, "get_input_embeddings", None)
    if callable(embeddings):
        weight = getattr(embeddings(), "weight", None)
        if weight is not None:
            return _dtype_name(weight.dtype)
    return _dtype_name(getattr(model, "dtype", None))


def _checkpointing(model: Any) -> bool:
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    # transformers 5 renamed is_gradient_checkpointing (reading the old name warns).
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if name in dir(type(base)):
            return bool(getattr(base, name))
    return False


def _dtype_name(value: Any) -> DTypeName | None:
    return _DTYPES.get(str(value)) if value is not None else None


def _hf_optim(value: Any) -> OptimName:
    name = str(getattr(value, "value", value))
    if name in _OPTIMS:
        return name  # type: ignore[return-value]
    if name in _OPTIM_ALIASES:
        return _OPTIM_ALIASES[name]
    raise UndescribableJobError(f"optimizer {name!r} is not one the estimator models")


def _optimizer_class(optimizer: Any) -> OptimName:
    inner = getattr(optimizer, "optimizer", optimizer)  # Lightning wraps some optimizers
    name = type(inner).__name__
    if name == "AdamW" and (getattr(inner, "defaults", None) or {}).get("fused"):
        return "adamw_torch_fused"
    if name in _OPTIM_CLASSES:
        return _OPTIM_CLASSES[name]
    raise UndescribableJobError(f"optimizer {name} is not one the estimator models")


def _hf_parallel(args: Any) -> tuple[StrategyName | None, Any]:
    if args is None:
        return None, None
    if getattr(args, "fsdp", None):
        offload = "offload" in str(args.fsdp)
        return "fsdp", "optimizer_and_params" if offload else None
    deepspeed = getattr(args, "deepspeed", None)
    if deepspeed:
        return _zero(deepspeed)
    return None, None


def _lightning_parallel(strategy: Any) -> tuple[StrategyName | None, Any]:
    name = type(strategy).__name__ if strategy is not None else ""
    if name.startswith("FSDP"):
        return "fsdp", None
    if name.startswith("DeepSpeed"):
        return _zero(getattr(strategy, "config", None) or {})
    return None, None


def _zero(config: Any) -> tuple[StrategyName | None, Any]:
    """Strategy and offload from a DeepSpeed config (a dict, or the path of its JSON)."""
    if isinstance(config, str | Path):
        try:
            config = json.loads(Path(config).read_text())
        except (OSError, ValueError) as error:
            raise UndescribableJobError(f"cannot read the DeepSpeed config: {error}") from None
    zero = config.get("zero_optimization", {}) if isinstance(config, Mapping) else {}
    stage = _int(zero.get("stage"))
    if stage is None or stage == 0:
        return None, None
    strategy = _ZERO_STAGES.get(stage)
    if strategy is None:
        raise UndescribableJobError(f"ZeRO stage {stage} is not one the estimator models")
    params = _offloaded(zero.get("offload_param"))
    optimizer = _offloaded(zero.get("offload_optimizer"))
    offload = "optimizer_and_params" if params else "optimizer" if optimizer else None
    return strategy, offload


def _offloaded(section: Any) -> bool:
    return isinstance(section, Mapping) and section.get("device") in ("cpu", "nvme")


def _seq_len(given: int | None, shapes: InputShapes | None, args: Any) -> int | None:
    if given is not None:
        return given
    if shapes is not None and shapes.max_seq_len:
        return shapes.max_seq_len
    for name in ("max_length", "max_seq_length"):
        value = _int(getattr(args, name, None))
        if value:
            return value
    return None


def _float(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if 0 <= number < float("inf") else None


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return None
