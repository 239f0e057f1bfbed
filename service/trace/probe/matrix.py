"""Measuring the matrix of cases, each in a fresh process, and the environment's facts."""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from service.trace.probe.cases import MATRIX, ProbeCase
from service.trace.probe.readings import CudaReadings, nvml_used, versions
from service.trace.probe.record import measure

# -- the matrix -----------------------------------------------------------------------------


def _model_config(model_id: str) -> Mapping[str, Any]:
    from service.catalog.models import default_catalog

    return default_catalog().resolve(model_id).config


def _run_case(
    case: ProbeCase, out: str, base_used: int, trace_dir: Path | None, device: str
) -> None:
    record = measure(
        case,
        _model_config(case.model_id),
        base_used=base_used,
        trace_dir=trace_dir,
        readings=CudaReadings(device),
    )
    with open(out, "a") as f:
        f.write(json.dumps(record) + "\n")
    gib = 1 << 30
    levels = " ".join(
        f"{key} {record[key] / gib:7.2f}"
        for key in ("max_allocated", "max_reserved", "end_used")
        if isinstance(record.get(key), int)
    )
    print(f"{case.name:36s} {levels} {record.get('error', '')[:300]}", flush=True)


def _in_child(target: Any, *args: Any, timeout: float) -> bool:
    """Run `target(*args)` in a fresh process (its own CUDA context); False on timeout. Forked
    while CUDA is untouched here (the imports are inherited), else spawned."""
    import multiprocessing

    import torch

    method = "spawn" if torch.cuda.is_initialized() else "fork"
    process = multiprocessing.get_context(method).Process(target=target, args=args)
    process.start()
    process.join(timeout)
    if process.is_alive():
        process.kill()
        process.join()
        return False
    return True


def run_matrix(args: argparse.Namespace) -> int:
    """Each case of MATRIX in a fresh process, within `--budget-s` seconds."""
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # nothing touches CUDA before the fork
    t_start = time.time()
    # Imported once here and inherited by every forked child.
    import peft  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    trace_dir = Path(args.allocator_trace) if args.allocator_trace else None
    print(f"imports {time.time() - t_start:.1f} s", flush=True)
    if args.environment:
        _in_child(_environment_child, args.environment, timeout=60)
    for case in MATRIX:
        if args.only and not any(part in case.name for part in args.only.split(",")):
            continue
        left = args.budget_s - (time.time() - t_start)
        if left < args.min_left_s:
            print(f"{case.name}: skipped, budget spent", flush=True)
            continue
        finished = _in_child(
            _run_case,
            case,
            args.out,
            nvml_used(),
            trace_dir,
            args.device,
            timeout=min(args.per_case_s, left),
        )
        if not finished:
            with open(args.out, "a") as f:
                f.write(json.dumps({"name": case.name, "error": "timeout"}) + "\n")
            print(f"{case.name}: timeout", flush=True)
    print(f"total {time.time() - t_start:.1f} s", flush=True)
    return 0


def _environment_child(out: str) -> None:
    with open(out, "w") as f:
        json.dump(environment_facts(), f, indent=1)


def environment_facts() -> dict[str, Any]:
    """What lies outside the shapes on this GPU: the CUDA context, the cuBLAS and cuBLASLt
    workspaces the first matmuls take from the caching allocator, and the SDPA backend PyTorch
    selects for each dtype, mask, GQA and head size."""
    import torch
    import torch.nn.functional as F

    base = nvml_used()
    facts: dict[str, Any] = {"versions": None, "base_used": base}
    torch.cuda.init()
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    facts["context_used"] = nvml_used() - base
    facts["alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    facts["cublas_workspace_config"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG", "")
    workspaces = []
    for dtype, op in (
        (torch.bfloat16, "mm"),
        (torch.bfloat16, "linear_bias"),
        (torch.float32, "mm"),
        (torch.bfloat16, "mm_backward"),
        (torch.float16, "mm"),
        (torch.float32, "linear_bias"),
    ):
        a = torch.randn(2048, 2048, device="cuda", dtype=dtype, requires_grad=op == "mm_backward")
        b = torch.randn(2048, 2048, device="cuda", dtype=dtype)
        bias = torch.randn(2048, device="cuda", dtype=dtype)
        torch.cuda.synchronize()
        before, used_before = torch.cuda.memory_allocated(), nvml_used()
        if op == "mm":
            c = a @ b
        elif op == "linear_bias":
            c = F.linear(a, b, bias)
        else:
            c = a @ b
            c.sum().backward()
        torch.cuda.synchronize()
        kept = torch.cuda.memory_allocated() - before
        workspaces.append(
            {
                "dtype": str(dtype),
                "op": op,
                "allocated_delta": int(kept),
                "output_bytes": int(c.numel() * c.element_size()),
                "used_delta": nvml_used() - used_before,
            }
        )
        del a, b, c, bias
    facts["matmul_workspaces"] = workspaces
    facts["after_matmuls"] = {
        "allocated": int(torch.cuda.memory_allocated()),
        "reserved": int(torch.cuda.memory_reserved()),
        "used": nvml_used() - base,
    }
    facts["sdpa_choices"] = _sdpa_choices(torch)
    facts["versions"] = versions()
    return facts


def _sdpa_choices(torch: Any) -> list[dict[str, Any]]:
    """torch._fused_sdp_choice for training-shaped inputs: 0 math, 1 flash, 2 efficient, ..."""
    choices = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for head_dim in (64, 80, 96, 128, 256):
            for heads, kv_heads in ((8, 8), (8, 2)):
                for mask in ("none", "bool", "additive"):
                    for causal in (True, False):
                        if mask != "none" and causal:
                            continue
                        q = torch.empty(
                            2, heads, 256, head_dim, device="cuda", dtype=dtype, requires_grad=True
                        )
                        k = torch.empty(
                            2,
                            kv_heads,
                            256,
                            head_dim,
                            device="cuda",
                            dtype=dtype,
                            requires_grad=True,
                        )
                        v = torch.empty_like(k, requires_grad=True)
                        attn_mask = None
                        if mask == "bool":
                            attn_mask = torch.ones(2, 1, 256, 256, device="cuda", dtype=torch.bool)
                        elif mask == "additive":
                            attn_mask = torch.zeros(2, 1, 256, 256, device="cuda", dtype=dtype)
                        gqa = heads != kv_heads
                        try:
                            choice = int(
                                torch._fused_sdp_choice(
                                    q, k, v, attn_mask, 0.0, causal, scale=None, enable_gqa=gqa
                                )
                            )
                        except Exception as error:  # the failure is the fact
                            choice = f"{type(error).__name__}: {error}"[:200]
                        choices.append(
                            {
                                "dtype": str(dtype),
                                "head_dim": head_dim,
                                "heads": heads,
                                "kv_heads": kv_heads,
                                "mask": mask,
                                "is_causal": causal,
                                "enable_gqa": gqa,
                                "choice": choice,
                            }
                        )
    return choices


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service.trace.probe")
    parser.add_argument("--matrix", action="store_true", help="measure every case of MATRIX")
    parser.add_argument("--only", default="", help="comma-separated substrings of case names")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--environment", default="", help="also write environment facts here")
    parser.add_argument("--out", default="gpu_peaks.jsonl")
    parser.add_argument("--allocator-trace", default="")
    parser.add_argument("--budget-s", type=float, default=480.0)
    parser.add_argument("--per-case-s", type=float, default=150.0)
    parser.add_argument("--min-left-s", type=float, default=25.0)
    args = parser.parse_args(argv)
    if args.matrix:
        return run_matrix(args)
    parser.error("--matrix is required")
    return 2
