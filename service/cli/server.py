"""`vramcast serve` (the API under uvicorn) and `vramcast fit` (ask a running service).

`vramcast fit` is made for batch schedulers (a Slurm cli_filter or job_submit script, a job
script's first line): it exits

    0  the job fits (every GPU given, or any with --any),
    1  it does not fit,
    2  it could not decide: the service is unreachable or answered an error, or the input is bad.

`--format k8s | slurm | skypilot | dstack | json` prints the resource request each scheduler
takes instead: GPUs with the memory that holds the job's safe bound plus the driver's reserve,
and the GPU types that fit. Without --gpu, every GPU of the catalog is checked (and the exit
status is that of --any).

`--strategies zero3,fsdp`, `--max-gpus` or `--gpus-per-node` also print, per GPU type and
strategy, the fewest GPUs that hold the job (1 up to a node, then whole nodes; the micro-batch
and sequence stay per GPU), marking the cheapest (prices from `--price NAME=PRICE`) and the
fewest. The exit status stays that of the job as given.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import uvicorn
from pydantic import ValidationError

from service.api.settings import Settings
from service.calibration import EstimateFn
from service.cli.options import CliError, add_spec_options, job_fields, read_config, spec_from_args
from service.cli.problems import problem_text
from service.cli.schedulers import FORMATS, GpuChoice, ResourceRequest
from service.core.placement import MAX_PLACEMENT_GPUS
from service.core.spec import Strategy, TrainingSpec
from service.core.units import GIB
from vramcast_client.client import DEFAULT_TIMEOUT_S, DEFAULT_URL, URL_ENV, VramcastClient
from vramcast_client.errors import (
    ProblemError,
    ServiceUnreachableError,
    UnexpectedResponseError,
    VramcastError,
)
from vramcast_client.models import FitCheck, GpuFit, Placements
from vramcast_client.retry import NO_RETRY

EXIT_FITS = 0
EXIT_DOES_NOT_FIT = 1
EXIT_UNDECIDED = 2


def stored_job_estimator() -> EstimateFn:
    """The estimator of jobs as calibration uploads store them (`vramcast db rederive`)."""
    from service.api.uploads import job_estimator
    from service.catalog.models import default_catalog

    return job_estimator(default_catalog())


def register(subparsers: Any) -> None:
    """Add `serve` and `fit` to the `vramcast` command line."""
    serve = subparsers.add_parser("serve", help="run the REST API (uvicorn)")
    serve.add_argument("--host", help="address to listen on (default: VRAMCAST_HOST, 127.0.0.1)")
    serve.add_argument("--port", type=int, help="TCP port (default: VRAMCAST_PORT, 8000)")
    serve.add_argument("--workers", type=int, default=1, help="uvicorn worker processes")
    serve.set_defaults(handler=_cmd_serve)

    fit = subparsers.add_parser(
        "fit",
        help="ask a running service whether a job fits (exit 0 fits, 1 does not, 2 undecided)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_spec_options(fit)
    where = fit.add_argument_group("GPUs and service")
    where.add_argument(
        "--gpu",
        action="append",
        default=[],
        help="GPU by catalog name or nvidia-smi name (repeatable)",
    )
    where.add_argument(
        "--gpu-memory-mib",
        type=int,
        action="append",
        default=[],
        help="GPU by the total memory the node reports, MiB (repeatable)",
    )
    where.add_argument("--count", type=int, help="GPUs the job spans (default: --gpus)")
    where.add_argument(
        "--price",
        action="append",
        default=[],
        metavar="GPU=PRICE",
        help="price of one GPU per hour, by the name or MiB given in --gpu (repeatable)",
    )
    where.add_argument("--any", action="store_true", help="exit 0 if any GPU given fits")
    where.add_argument(
        "--url",
        default=os.environ.get(URL_ENV, DEFAULT_URL),
        help=f"default: ${URL_ENV} or {DEFAULT_URL}",
    )
    where.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds")
    where.add_argument("--json", action="store_true", help="print the service's answer as JSON")
    where.add_argument(
        "--format",
        choices=sorted(FORMATS),
        help="print the resource request of this scheduler (json: as plain JSON)",
    )
    placing = fit.add_argument_group("placement (fewest GPUs per GPU type and strategy)")
    placing.add_argument(
        "--strategies",
        help=f"comma-separated, of {', '.join(s.value for s in Strategy)} (default: --strategy)",
    )
    placing.add_argument(
        "--max-gpus", type=int, help=f"most GPUs of one type, 1-{MAX_PLACEMENT_GPUS} (default 64)"
    )
    placing.add_argument(
        "--gpus-per-node", type=int, help="GPUs per node (default: the job's, else 8)"
    )
    fit.set_defaults(handler=_cmd_fit)


def _cmd_serve(args: argparse.Namespace) -> int:
    try:
        settings = Settings()
    except ValidationError as exc:
        raise CliError(f"settings from the environment are invalid: {exc}") from None
    uvicorn.run(
        "service.api.app:create_app",
        factory=True,
        host=args.host or settings.host,
        port=args.port or settings.port,
        workers=args.workers,
        access_log=False,  # the app logs each request as one JSON line (service/api/access.py)
    )
    return 0


def _cmd_fit(args: argparse.Namespace) -> int:
    # A scheduler hook must not hold a submission for long: a service slower than --timeout
    # is treated as down (exit 2) and nothing is retried. The check sends no API key.
    with VramcastClient(args.url, api_key="", timeout=args.timeout, retry=NO_RETRY) as client:
        return run_fit(args, client)


def run_fit(args: argparse.Namespace, client: VramcastClient) -> int:
    """POST the job to /v1/fit-checks and print the answer; returns the exit status."""
    try:
        job, gpus = fit_request(args, spec_from_args(args))
        placement = placement_request(args)
    except CliError as exc:
        return _undecided(f"error: {exc}")
    whole_catalog = args.format is not None and not (args.gpu or args.gpu_memory_mib)
    try:
        answer = client.fit_check(job, gpus, placement)
    except ServiceUnreachableError as exc:
        return _undecided(f"service unreachable at {args.url}: {exc}")
    except ProblemError as exc:
        return _undecided(problem_text(exc.problem))
    except UnexpectedResponseError:
        return _undecided("the service's answer is not a fit-check")
    except VramcastError as exc:
        return _undecided(str(exc))
    if args.format is not None:
        request = resource_request(args.model or str(args.config), answer)
        print(FORMATS[args.format](request))
        if not request.fitting:
            print("vramcast fit: the job fits none of the GPUs checked", file=sys.stderr)
    elif args.json:
        print(json.dumps(answer.model_dump(mode="json", exclude_unset=True), indent=2))
    else:
        for result in answer.results:
            print(format_result(result))
        if answer.placement is not None:
            print(format_placements(answer.placement))
    decided = answer.fits_any if args.any or whole_catalog else answer.fits_all
    return EXIT_FITS if decided else EXIT_DOES_NOT_FIT


def resource_request(model: str, answer: FitCheck) -> ResourceRequest:
    """What a scheduler must give the job: per GPU, the largest safe bound and driver reserve
    of the GPUs checked (they differ only by the device level's row for a GPU's generation)."""
    results = answer.results
    return ResourceRequest(
        model=model,
        count=max(r.count for r in results),
        required_bytes=max(r.required_bytes for r in results),
        driver_reserved_bytes=max(r.gpu.memory_bytes - r.usable_bytes for r in results),
        gpus=tuple(
            GpuChoice(name=r.gpu.name, memory_mib=r.gpu.memory_mib, fits=r.fits) for r in results
        ),
    )


def fit_request(
    args: argparse.Namespace, spec: TrainingSpec
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The /v1/fit-checks job and GPUs for the parsed options."""
    config = read_config(args)
    if config is not None:
        model: Any = {"hf_config": config}
    elif args.model:
        model = args.model
    else:
        raise CliError("model: give a catalog id or --config config.json")
    if args.json and args.format is not None:
        raise CliError("--json: give --json or --format, not both")
    names = list(args.gpu)
    if not names and not args.gpu_memory_mib:
        if args.format is None:
            raise CliError("--gpu: name at least one GPU (or --gpu-memory-mib)")
        from service.catalog.gpus import default_gpu_catalog

        names = [gpu.name for gpu in default_gpu_catalog().gpus()]
    extra: dict[str, Any] = {} if args.count is None else {"count": args.count}
    prices = _prices(args.price, [*names, *map(str, args.gpu_memory_mib)])
    gpus = [{"name": name, **extra, **prices.get(name, {})} for name in names]
    gpus += [
        {"memory_mib": mib, **extra, **prices.get(str(mib), {})} for mib in args.gpu_memory_mib
    ]
    return {"model": model, **job_fields(spec)}, gpus


def _prices(given: list[str], gpus: list[str]) -> dict[str, dict[str, float]]:
    """--price NAME=PRICE options as each GPU's price_per_hour, by the name given in --gpu."""
    prices: dict[str, dict[str, float]] = {}
    for entry in given:
        name, sep, value = entry.rpartition("=")
        if not sep or not name:
            raise CliError(f"--price: {entry!r} is not GPU=PRICE")
        if name not in gpus:
            raise CliError(f"--price: {name!r} is not a GPU given with --gpu or --gpu-memory-mib")
        try:
            price = float(value)
        except ValueError:
            raise CliError(f"--price: {value!r} is not a number") from None
        prices[name] = {"price_per_hour": price}
    return prices


def placement_request(args: argparse.Namespace) -> dict[str, Any] | None:
    """The fit-check's `placement`, when --strategies, --max-gpus or --gpus-per-node asks."""
    if args.strategies is None and args.max_gpus is None and args.gpus_per_node is None:
        return None
    if args.format is not None:
        raise CliError("--strategies, --max-gpus and --gpus-per-node are not printed by --format")
    placement: dict[str, Any] = {}
    if args.strategies is not None:
        names = [name.strip() for name in args.strategies.split(",") if name.strip()]
        known = {s.value for s in Strategy}
        unknown = [name for name in names if name not in known]
        if not names or unknown:
            raise CliError(
                f"--strategies: {', '.join(map(repr, unknown)) or 'none given'}; "
                f"choose from {', '.join(sorted(known))}"
            )
        placement["strategies"] = names
    if args.max_gpus is not None:
        if not 1 <= args.max_gpus <= MAX_PLACEMENT_GPUS:
            raise CliError(f"--max-gpus: must be in [1, {MAX_PLACEMENT_GPUS}]")
        placement["max_gpus"] = args.max_gpus
    if args.gpus_per_node is not None:
        if args.gpus_per_node < 1:
            raise CliError("--gpus-per-node: must be at least 1")
        placement["gpus_per_node"] = args.gpus_per_node
    return placement


def format_placements(answer: Placements) -> str:
    """The fewest GPUs per GPU type and strategy, one line each, cheapest and fewest marked."""
    lines = [
        f"fewest GPUs (up to {answer.max_gpus}, {answer.gpus_per_node} per node, "
        "micro-batch and sequence per GPU):"
    ]
    width = max(len(p.gpu) for p in answer.placements)
    cheapest = None if answer.cheapest is None else answer.cheapest.index
    fewest = None if answer.fewest is None else answer.fewest.index
    for index, p in enumerate(answer.placements):
        head = f"  {p.gpu:<{width}}  {p.strategy:<5}  "
        if p.count is None or p.required_bytes is None:
            lines.append(head + (p.reason or p.outcome))
            continue
        nodes = "node" if p.nodes == 1 else "nodes"
        text = (
            f"{p.count:>4} GPUs ({p.nodes} {nodes}), "
            f"{p.required_bytes / GIB:.1f} of {p.usable_bytes / GIB:.1f} GiB per GPU"
        )
        if p.cost_per_hour is not None:
            text += f", {p.cost_per_hour:.2f}/h"
        marks = [name for name, at in (("cheapest", cheapest), ("fewest", fewest)) if at == index]
        if marks:
            text += f"  <- {', '.join(marks)}"
        lines.append(head + text)
    return "\n".join(lines)


def format_result(result: GpuFit) -> str:
    gpu = result.gpu
    name = gpu.name or f"{gpu.memory_mib} MiB GPU"
    need = result.required_bytes / GIB
    usable = result.usable_bytes / GIB
    head = (
        f"{name}: {'fits' if result.fits else 'does not fit'} "
        f"(needs {need:.1f} GiB of {usable:.1f} GiB usable; "
        f"max batch {result.max_batch_size}, max seq {result.max_seq_len})"
    )
    fixes = [s for s in result.suggestions if s.fits][:3]
    lines = [head]
    lines += [f"  try: {s.description} ({s.required_bytes / GIB:.1f} GiB)" for s in fixes]
    return "\n".join(lines)


def _undecided(message: str) -> int:
    print(f"vramcast fit: {message}", file=sys.stderr)
    return EXIT_UNDECIDED
