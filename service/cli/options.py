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

from service.cli.job_flags import add_job_flags, field_options, given_fields
from service.core.allocator import alloc_conf_values
from service.core.arch import ModelArch
from service.core.arch.hf_config import from_hf_config
from service.core.codec import spec_from_dict, spec_to_dict
from service.core.errors import EstimatorError, InvalidConfigError, InvalidSpecError
from service.core.parallel_config import parallel_from_deepspeed, parallel_from_fsdp
from service.core.spec import (
    ADAPTER_METHODS,
    LORA_METHODS,
    METHOD_OPTIONS,
    Method,
    QuantType,
    TrainingSpec,
)
from service.core.spec.delta import AdaLoraSpec


class CliError(Exception):
    """A one-line reason to print before exiting with status 2."""


def option_error(exc: InvalidSpecError) -> CliError:
    """The error naming the option that sets the spec field `exc` names, and the field."""
    if exc.field.startswith("allocator"):
        return CliError(f"--alloc-conf: {exc}")
    if exc.field.startswith("stack"):
        return CliError(f"--stack ({exc.field}): {exc.reason}")
    fallback = "--" + exc.field.split(".")[-1].replace("_", "-")
    option = field_options().get(exc.field, fallback)
    return CliError(f"{option} ({exc.field}): {exc.reason}")


def add_spec_options(parser: argparse.ArgumentParser, *, require_job: bool = True) -> None:
    """The job-spec options shared by `estimate`, `fit`, `trace` and `probe` (the job schema's
    fields, service/cli/job_flags.py, and the model and files beside them); with `require_job`
    False, batch size and sequence length may be left out (`trace --matrix`)."""
    parser.add_argument("model", nargs="?", help="catalog id, e.g. Qwen/Qwen2.5-7B-Instruct")
    parser.add_argument("--config", type=Path, help="a model config.json instead of a catalog id")
    groups = add_job_flags(parser, require_job=require_job)
    groups["training"].add_argument(
        "--stack",
        help="the library versions it runs on: a preset (hf-5.24, the traced one, hf-4.48 or "
        "hf-4.16) or transformers=X[,peft=Y,bitsandbytes=Z,torch=W]",
    )
    par = groups["parallelism"]
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


def _given(values: Mapping[str, Any]) -> dict[str, Any]:
    """The options set, so the spec's defaults fill the rest."""
    return {key: value for key, value in values.items() if value is not None}


# The LoRA flags each method takes as its own settings (its PEFT config's fields of those
# names, or, for OFT, BOFT and AdaLoRA, the rank given as their block count or initial rank);
# any other LoRA flag given is refused for a method other than LoRA's.
_SHARED_LORA_FLAGS = {
    **{method: ("target_modules",) for method in METHOD_OPTIONS},
    **{method: ("r", "target_modules") for method in (Method.VERA, Method.LOHA, Method.LOKR)},
    **{
        method: ("r", "lora_alpha", "target_modules")
        for method in (Method.ADALORA, Method.OFT, Method.BOFT)
    },
}


def spec_from_args(args: argparse.Namespace) -> TrainingSpec:
    """Build a TrainingSpec from parsed options; raises CliError naming the option."""
    data = given_fields(args)
    method = Method(data["method"])
    lora = data.pop("lora", {})
    if method not in LORA_METHODS and set(lora) - set(_SHARED_LORA_FLAGS.get(method, ())):
        raise CliError("--r/--target-modules: LoRA options need --method lora or qlora")
    _prompt_settings(data, method, lora.get("target_modules"))
    _adapter_settings(data, method, lora)
    _quantization_settings(data, method)
    _objective_settings(data)
    stack = _stack_value(getattr(args, "stack", None))
    if stack is not None:
        data["stack"] = stack
    _apply_parallel_configs(args, data)
    try:
        data["allocator"] = alloc_conf_values(getattr(args, "alloc_conf", "") or "")
        return spec_from_dict(data)
    except InvalidSpecError as exc:
        raise option_error(exc) from None


def _prompt_settings(data: dict[str, Any], method: Method, targets: Any) -> None:
    """Prompt and prefix tuning's settings, or the targets of PEFT's other methods' options."""
    prefix = data.pop("prefix_tuning", {})
    virtual = prefix.get("num_virtual_tokens")
    if virtual is not None and method not in (Method.PROMPT_TUNING, Method.PREFIX_TUNING):
        raise CliError("--num-virtual-tokens: needs --method prompt-tuning or prefix-tuning")
    if set(prefix) - {"num_virtual_tokens"} and method is not Method.PREFIX_TUNING:
        raise CliError("--prefix-projection/--encoder-hidden-size: need --method prefix-tuning")
    peft_method = METHOD_OPTIONS.get(method)
    if method is Method.PREFIX_TUNING and prefix:
        data["prefix_tuning"] = prefix
    elif virtual is not None:
        data["prompt_tuning"] = {"num_virtual_tokens": virtual}
    elif peft_method is not None and targets is not None:
        data[peft_method] = {"target_modules": targets}


def _adapter_settings(data: dict[str, Any], method: Method, lora: dict[str, Any]) -> None:
    """The LoRA flags as the method's own settings: LoRA's, or the rank and targets of the
    PEFT methods that take them."""
    r, targets = lora.get("r"), lora.get("target_modules")
    if method in (Method.VERA, Method.LOHA, Method.LOKR):
        data[method.value] = _given({"r": r, "target_modules": targets})
    if method is Method.OFT:
        # --r is OFT's block count, given instead of its block size
        blocks = None if r is None else {"r": r, "oft_block_size": 0}
        data["oft"] = _given({**(blocks or {}), "target_modules": targets})
    if method is Method.BOFT:
        # --r is BOFT's block count, given instead of its block size
        blocks = None if r is None else {"boft_block_num": r, "boft_block_size": 0}
        data["boft"] = _given({**(blocks or {}), "target_modules": targets})
    if method is Method.ADALORA:
        # --r is AdaLoRA's initial rank; its target (a masking budget, no memory) is kept at
        # most that
        target_r = None if r is None else min(r, AdaLoraSpec().target_r)
        data["adalora"] = _given(
            {
                "init_r": r,
                "target_r": target_r,
                "lora_alpha": lora.get("lora_alpha"),
                "target_modules": targets,
            }
        )
    if method in LORA_METHODS:
        data["lora"] = {**lora, "modules_to_save": lora.get("modules_to_save", [])}


def _quantization_settings(data: dict[str, Any], method: Method) -> None:
    """The base's quantization: QLoRA's always, LitGPT's adapters' when a flag asks."""
    quant = data.pop("quantization", {})
    prepare = quant.pop("prepare_kbit", True)
    if quant and method is not Method.QLORA and method not in ADAPTER_METHODS:
        raise CliError(
            "--quant: quantization options need --method qlora, llama-adapter or llama-adapter-v2"
        )
    if method is Method.QLORA or (method in ADAPTER_METHODS and quant):
        # PEFT's kbit preparation is QLoRA's; LitGPT's adapters never run it
        prepare = prepare and method is Method.QLORA
        data["quantization"] = {"type": QuantType.NF4.value, **quant, "prepare_kbit": prepare}


def _objective_settings(data: dict[str, Any]) -> None:
    """The flags DPO, KTO and GRPO share, sent to the objective's settings: KTO's reference
    log-probs, GRPO's completion length; the rest stay DPO's."""
    objective = data.get("objective")
    dpo, kto, grpo = (data.pop(name, {}) for name in ("dpo", "kto", "grpo"))
    if objective == "kto" or kto:
        precompute = dpo.pop("precompute_ref_log_probs", None)
        data["kto"] = {**_given({"precompute_ref_log_probs": precompute}), **kto}
    if objective == "grpo":
        completion = dpo.pop("max_completion_length", None)
        data["grpo"] = {**grpo, **_given({"max_completion_length": completion})}
    if dpo:
        data["dpo"] = dpo


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
