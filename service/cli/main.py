"""The `vramcast` command line: estimate, fit, serve, keys, db, trace, probe.

Bad input exits with status 2 and a one-line reason naming the option; never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from service.cli.options import CliError, add_spec_options, load_model, option_error, spec_from_args
from service.core.errors import InvalidConfigError, InvalidSpecError
from service.core.estimator import estimate
from service.core.result import PHASE_WORDS, Component, Estimate, estimate_to_dict
from service.core.spec import Objective
from service.core.units import GIB

EXIT_OK = 0
EXIT_USAGE = 2


def format_estimate(model_id: str, est: Estimate, objective: Objective = Objective.SFT) -> str:
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
    if objective in (Objective.DPO, Objective.KTO, Objective.ORPO, Objective.GRPO):
        # the phases tell where a preference objective's cost sits (DPO's and KTO's reference
        # forward, ORPO's logits' gradients at the start of backward, GRPO's generation)
        lines.append("  phases (GiB allocated, step 2):")
        for ph in est.phases:
            if ph.step == 2:
                lines.append(f"    {ph.phase.value:<22}{ph.allocated_bytes / GIB:>10.2f}")
                kv = ph.components.get(Component.GENERATION_KV_CACHE, 0)
                if kv:
                    lines.append(
                        f"      {Component.GENERATION_KV_CACHE.value:<20}{kv / GIB:>10.2f}"
                    )
        lines.append("")
    lines.append(f"  parameters: {est.params.total:,} total, {est.params.trainable:,} trainable")
    if est.host_bytes:
        lines.append(f"  host memory per GPU for what is offloaded: {est.host_bytes / GIB:.2f} GiB")
    if est.host_pinned_bytes:
        pinned = est.host_pinned_bytes / GIB
        lines.append(f"  pinned host memory per GPU for offloaded activations: {pinned:.2f} GiB")
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
        raise option_error(exc) from None
    except InvalidConfigError as exc:
        raise CliError(f"{model_id}: {exc}") from None
    if args.json:
        print(json.dumps({"model": model_id, **estimate_to_dict(est)}, indent=2))
    else:
        print(format_estimate(model_id, est, spec.objective))
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
    # No subcommand imports a heavy dependency (torch, the HF stack) until it runs.
    from service.cli import probe, server, store, trace

    server.register(sub)
    store.register(sub, job_estimator=server.stored_job_estimator)
    trace.register(sub)
    probe.register(sub)
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
