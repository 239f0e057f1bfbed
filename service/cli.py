"""The `vramcast` command line: estimate, fit, serve, keys, db, trace.

Bad input exits with status 2 and a one-line reason naming the option; never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from service.core.allocator import parse_alloc_conf
from service.core.architecture import ModelArch, from_hf_config
from service.core.errors import EstimatorError, InvalidConfigError, InvalidSpecError
from service.core.estimator import estimate
from service.core.result import PHASE_WORDS, Estimate, estimate_to_dict
from service.core.spec import (
    ALL_LINEAR,
    AttnImpl,
    Framework,
    LoraSpec,
    LossImpl,
    Method,
    Offload,
    Optim,
    ParallelSpec,
    QuantSpec,
    QuantType,
    SdpaKernel,
    Strategy,
    TrainingSpec,
)
from service.core.units import GIB, DType

EXIT_OK = 0
EXIT_NO_FIT = 1
EXIT_USAGE = 2

# Spec field (dotted, as errors name it) -> the option that sets it.
_OPTION_FOR_FIELD = {
    "batch_size": "--batch-size",
    "seq_len": "--seq-len",
    "gradient_accumulation_steps": "--gradient-accumulation-steps",
    "max_grad_norm": "--max-grad-norm",
    "lora": "--r/--target-modules",
    "lora.r": "--r",
    "lora.lora_dropout": "--lora-dropout",
    "lora.target_modules": "--target-modules",
    "quantization": "--quant",
    "parallel.gpus": "--gpus",
    "parallel.offload": "--offload",
}


class CliError(Exception):
    """A one-line reason to print before exiting with status 2."""


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
    quant = parser.add_argument_group("QLoRA (bitsandbytes)")
    quant.add_argument("--quant", choices=_choices(QuantType))
    quant.add_argument("--double-quant", action="store_true")
    quant.add_argument("--compute-dtype", choices=_choices(DType))
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
        "--attn-implementation", choices=_choices(AttnImpl), default=AttnImpl.SDPA.value
    )
    train.add_argument("--sdpa-kernel", choices=_choices(SdpaKernel), default="auto")
    train.add_argument("--loss", choices=_choices(LossImpl))
    train.add_argument("--framework", choices=_choices(Framework), default=Framework.HF.value)
    par = parser.add_argument_group("parallelism")
    par.add_argument("--gpus", type=int, default=1)
    par.add_argument("--strategy", choices=_choices(Strategy), default=Strategy.DDP.value)
    par.add_argument("--offload", choices=_choices(Offload), default=Offload.NONE.value)
    parser.add_argument(
        "--alloc-conf",
        default="",
        help="PYTORCH_CUDA_ALLOC_CONF, e.g. expandable_segments:True (default: PyTorch's)",
    )


def _names(raw: str | None) -> tuple[str, ...] | str | None:
    if raw is None:
        return None
    if raw.strip() == ALL_LINEAR:
        return ALL_LINEAR
    names = tuple(n.strip() for n in raw.split(",") if n.strip())
    return names


def spec_from_args(args: argparse.Namespace) -> TrainingSpec:
    """Build a TrainingSpec from parsed options; raises CliError naming the option."""
    try:
        method = Method(args.method)
        lora: LoraSpec | None = None
        lora_given = any(
            getattr(args, n) is not None
            for n in ("r", "lora_alpha", "lora_dropout", "target_modules", "adapter_dtype")
        ) or bool(args.modules_to_save)
        if method is not Method.FULL:
            defaults = LoraSpec()
            saved = _names(args.modules_to_save)
            lora = LoraSpec(
                r=args.r if args.r is not None else defaults.r,
                lora_alpha=args.lora_alpha if args.lora_alpha is not None else defaults.lora_alpha,
                lora_dropout=args.lora_dropout,
                target_modules=_names(args.target_modules),
                modules_to_save=saved if isinstance(saved, tuple) else (),
                adapter_dtype=DType(args.adapter_dtype) if args.adapter_dtype else None,
            )
        elif lora_given:
            raise CliError("--r/--target-modules: LoRA options need --method lora or qlora")
        quant: QuantSpec | None = None
        if method is Method.QLORA:
            quant = QuantSpec(
                type=QuantType(args.quant or QuantType.NF4.value),
                double_quant=args.double_quant,
                compute_dtype=DType(args.compute_dtype) if args.compute_dtype else None,
                prepare_kbit=not args.no_prepare_kbit,
            )
        elif args.quant or args.double_quant or args.compute_dtype:
            raise CliError("--quant: quantization options need --method qlora")
        return TrainingSpec(
            method=method,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            lora=lora,
            quantization=quant,
            dtype=DType(args.dtype),
            autocast=args.autocast,
            optim=Optim(args.optim),
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            max_grad_norm=args.max_grad_norm,
            gradient_checkpointing=args.gradient_checkpointing,
            attn_implementation=AttnImpl(args.attn_implementation),
            sdpa_kernel=SdpaKernel(args.sdpa_kernel),
            loss=LossImpl(args.loss) if args.loss else None,
            framework=Framework(args.framework),
            parallel=ParallelSpec(
                gpus=args.gpus, strategy=Strategy(args.strategy), offload=Offload(args.offload)
            ),
            allocator=parse_alloc_conf(getattr(args, "alloc_conf", "") or ""),
        )
    except InvalidSpecError as exc:
        if exc.field.startswith("allocator"):
            raise CliError(f"--alloc-conf: {exc}") from None
        option = _OPTION_FOR_FIELD.get(exc.field, "--" + exc.field.split(".")[-1].replace("_", "-"))
        raise CliError(f"{option}: {exc.reason}") from None


def load_model(args: argparse.Namespace) -> tuple[str, Mapping[str, Any], ModelArch]:
    """(model id, config.json mapping, architecture) from `model` or `--config`."""
    if args.config is not None:
        if args.model:
            raise CliError("give a model id or --config, not both")
        try:
            raw = json.loads(args.config.read_text())
        except OSError as exc:
            raise CliError(f"--config: cannot read {args.config}: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise CliError(f"--config: not valid JSON ({exc.msg}, line {exc.lineno})") from None
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


def format_estimate(model_id: str, est: Estimate) -> str:
    """A readable breakdown: component, GiB, share of the allocated peak, the peak phase."""
    lines = [
        f"{model_id}: peak {est.allocated_bytes / GIB:.2f} GiB allocated, "
        f"step {est.peak_step}, {PHASE_WORDS[est.peak_phase]}",
        "",
    ]
    lines.append(f"  {'component':<24}{'GiB':>10}{'share':>9}")
    for comp, nbytes in sorted(est.components.items(), key=lambda kv: -kv[1]):
        share = nbytes / est.allocated_bytes if est.allocated_bytes else 0.0
        lines.append(f"  {comp.value:<24}{nbytes / GIB:>10.2f}{share:>9.1%}")
    lines.append("")
    lines.append(f"  {'allocated':<24}{est.allocated_bytes / GIB:>10.2f}")
    lines.append(f"  {'reserved':<24}{est.reserved_bytes / GIB:>10.2f}")
    lines.append(f"  {'device':<24}{est.device_bytes / GIB:>10.2f}")
    lines.append(f"  {'device, safe bound':<24}{est.device_bytes_upper / GIB:>10.2f}")
    lines.append("")
    lines.append(f"  parameters: {est.params.total:,} total, {est.params.trainable:,} trainable")
    for note in est.warnings:
        lines.append(f"  warning: {note}")
    for note in est.assumptions:
        lines.append(f"  assumes: {note}")
    return "\n".join(lines)


def _cmd_estimate(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    model_id, _raw, arch = load_model(args)
    capability = None
    if getattr(args, "gpu", None):
        from service.catalog.gpus import UnknownGpuError, default_gpu_catalog

        try:
            capability = default_gpu_catalog().resolve(args.gpu).compute_capability
        except UnknownGpuError as exc:
            raise CliError(f"--gpu: {exc}") from None
    try:
        est = estimate(arch, spec, compute_capability=capability)
    except InvalidSpecError as exc:
        option = _OPTION_FOR_FIELD.get(exc.field, "--" + exc.field.split(".")[-1].replace("_", "-"))
        raise CliError(f"{option}: {exc.reason}") from None
    if args.json:
        print(json.dumps({"model": model_id, **estimate_to_dict(est)}, indent=2))
    else:
        print(format_estimate(model_id, est))
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vramcast", description="Peak GPU memory of fine-tuning jobs."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    est = sub.add_parser("estimate", help="estimate a job's peak memory")
    add_spec_options(est)
    est.add_argument("--json", action="store_true", help="print the estimate as JSON")
    est.add_argument(
        "--gpu", help="the GPU it runs on (catalog or nvidia-smi name): its device-level row"
    )
    est.set_defaults(handler=_cmd_estimate)
    # Subcommands live beside their component; none imports a heavy dependency until it runs.
    from service.api.cli import register as register_api
    from service.api.cli import stored_job_estimator
    from service.store.cli import register as register_store
    from service.trace.cli import register as register_trace
    from service.trace.probe_cli import register as register_probe

    register_api(sub)
    register_store(sub, job_estimator=stored_job_estimator)
    register_trace(sub)
    register_probe(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.handler(args)
    except CliError as exc:
        print(f"vramcast {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        # The reader went away (`vramcast estimate ... | head`): not an error of ours.
        sys.stderr.close()
        return EXIT_OK
    return code


if __name__ == "__main__":
    sys.exit(main())
