"""`vramcast trace`: trace one job, regenerate the committed references, or validate the tracer.

Imports of torch and the HF stack happen only when a trace runs, so registering the subcommand
costs `vramcast estimate` nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from service.cli.options import CliError, add_spec_options, load_model, spec_from_args
from service.cli.progress import Progress
from service.core.spec import TrainingSpec
from service.core.units import GIB

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


def add_trace_arguments(parser: argparse.ArgumentParser) -> None:
    """The options only `trace` has."""
    group = parser.add_argument_group("trace")
    group.add_argument("--json", action="store_true", help="print the trace as reference JSON")
    group.add_argument(
        "--matrix",
        action="store_true",
        help="regenerate every committed reference (tests/data/traces/ and, for several "
        "GPUs, tests/data/traces_parallel/)",
    )
    group.add_argument("--only", help="with --matrix: only the references whose name has this")
    group.add_argument(
        "--out", type=Path, help="write the JSON here (default for --matrix: tests/data/traces)"
    )
    group.add_argument(
        "--validate",
        action="store_true",
        help="compare fake and real CPU runs of tiny models; writes service/trace/VALIDATION.md",
    )


def register(sub: Any) -> None:
    """Add `trace` to the `vramcast` subcommands."""
    parser = sub.add_parser(
        "trace",
        help="trace the real HF/PEFT training step on fake tensors (allocated level, exact)",
    )
    add_spec_options(parser, require_job=False)  # --matrix and --validate need no job
    add_trace_arguments(parser)
    parser.set_defaults(handler=_command)


def _command(args: argparse.Namespace) -> int:
    if args.matrix or args.validate:
        return run_trace_command(args, None, None, "")
    if args.batch_size is None or args.seq_len is None:
        raise CliError("-b/--batch-size and -s/--seq-len are required")
    spec = spec_from_args(args)
    model_id, config, _arch = load_model(args)
    return run_trace_command(args, spec, config, model_id)


def run_trace_command(
    args: argparse.Namespace,
    spec: TrainingSpec | None,
    config: Mapping[str, Any] | None,
    model_id: str,
) -> int:
    """Run what the parsed `trace` options ask for; returns the exit status."""
    if args.matrix:
        return run_matrix(args.out, only=args.only)
    if args.validate:
        return run_validation()
    if spec is None or config is None:
        print("vramcast trace: error: a job spec and a model are required", file=sys.stderr)
        return EXIT_USAGE
    from service.trace.reference import reference_name, result_to_json, write_reference
    from service.trace.runner import trace
    from service.trace.traceable import NotTraceableError

    try:
        result = trace(spec, config, model_id)
    except (NotTraceableError, NotImplementedError) as exc:
        print(f"vramcast trace: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    document = result_to_json(reference_name(model_id, spec), result)
    if args.out is not None:
        write_reference(document, args.out)
    print(json.dumps(document, indent=1) if args.json else format_trace(document))
    return EXIT_OK


def run_matrix(out: Path | None, *, only: str | None = None) -> int:
    """Trace every case of the reference matrix and write its JSON; prints one line per case."""
    from service.catalog.models import default_catalog
    from service.trace.reference import (
        PARALLEL_REFERENCE_DIR,
        REFERENCE_DIR,
        matrix,
        parallel_matrix,
        result_to_json,
        write_reference,
    )
    from service.trace.runner import trace

    catalog = default_catalog()
    # One GPU's references and rank 0 of multi-GPU jobs, each set in its own directory.
    sets = ((REFERENCE_DIR, matrix()), (PARALLEL_REFERENCE_DIR, parallel_matrix()))
    cases = [
        (out or directory, case)
        for directory, every in sets
        for case in every
        if only is None or only in case.name
    ]
    names = {c.name for _, c in cases}
    if len(names) != len(cases):
        print("vramcast trace: error: two matrix cases share a name", file=sys.stderr)
        return EXIT_FAILED
    started = time.perf_counter()
    failed = []
    with Progress(len(cases), "tracing", unit="case") as progress:
        for index, (directory, case) in enumerate(cases, 1):
            progress.now(case.name)
            entry = catalog.resolve(case.model_id)
            began = time.perf_counter()
            try:
                result = trace(case.spec, entry.config, entry.id)
            except Exception as exc:  # report every failing case, then fail the run
                failed.append(case.name)
                progress.echo(f"[{index}/{len(cases)}] FAILED {case.name}: {exc!r}")
                progress.step()
                continue
            path = write_reference(result_to_json(case.name, result), directory)
            progress.echo(
                f"[{index}/{len(cases)}] {result.peak.allocated_bytes / GIB:8.2f} GiB "
                f"{time.perf_counter() - began:5.1f}s  {path.name}"
            )
            progress.step()
    if failed:
        print(f"{len(failed)} of {len(cases)} cases failed", file=sys.stderr)
        return EXIT_FAILED
    if only is None:
        for directory in {directory for directory, _ in cases}:
            for stale in sorted(directory.glob("*.json")):
                if stale.stem not in names:
                    stale.unlink()
                    print(f"removed stale {stale.name}")
    print(f"{len(cases)} references in {time.perf_counter() - started:.0f}s")
    return EXIT_OK


def format_trace(document: Mapping[str, Any]) -> str:
    """The peak, its breakdown, and each phase of each step, in GiB."""
    peak = document["peak"]
    lines = [
        f"{document['model_id']}: peak {peak['allocated_bytes'] / GIB:.3f} GiB allocated "
        f"({peak['allocated_bytes']:,} B), step {peak['step']}, {peak['phase']}, at {peak['op']}",
        "",
        f"  {'component':<24}{'GiB':>10}",
    ]
    for name, nbytes in sorted(peak["components"].items(), key=lambda kv: -kv[1]):
        if nbytes:
            lines.append(f"  {name:<24}{nbytes / GIB:>10.3f}")
    lines += ["", f"  {'step':<6}{'phase':<18}{'GiB':>10}  op"]
    for entry in document["phases"]:
        lines.append(
            f"  {entry['step']:<6}{entry['phase']:<18}"
            f"{entry['allocated_bytes'] / GIB:>10.3f}  {entry['op']}"
        )
    params = document["params"]
    lines += ["", f"  parameters: {params['total']:,} total, {params['trainable']:,} trainable"]
    lines += [f"  assumes: {note}" for note in document["assumptions"]]
    return "\n".join(lines)


def run_validation() -> int:
    """Check the fake step against the real one case by case and write the report."""
    from service.trace.validate import (
        VALIDATION_PATH,
        check_all_cases,
        format_report,
        report_line,
        validation_cases,
    )

    reports = []
    with Progress(len(validation_cases()), "validating", unit="case") as progress:
        for report in check_all_cases():
            reports.append(report)
            progress.echo(report_line(report))
            progress.step()
    VALIDATION_PATH.write_text(format_report(reports))
    print(f"wrote {VALIDATION_PATH}")
    return 0 if all(r.passed for r in reports) else 1
