"""The resource request a fit-check answer makes for each batch scheduler: `vramcast fit
--format k8s | slurm | skypilot | dstack | json`.

Every format asks for GPUs whose total memory, as the driver reports it, holds the job's safe
bound (`device_bytes_upper`, the fit-check's `required_bytes`) plus what the driver keeps for
itself (a GPU's `memory_bytes` minus its `usable_bytes`): exactly the GPUs the service says
the job fits. Schedulers that select by name get the names of the GPUs that fit.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from service.core.units import GIB, MIB

# NVIDIA GPU Feature Discovery's node label: the total memory of the node's GPUs, MiB, as
# NVML reports it (github.com/NVIDIA/k8s-device-plugin, docs/gpu-feature-discovery).
K8S_GPU_MEMORY_LABEL = "nvidia.com/gpu.memory"
# The extended resource the NVIDIA device plugin advertises, one per GPU.
K8S_GPU_RESOURCE = "nvidia.com/gpu"
# A Slurm node has at most this many GPUs in the usual configurations (8-GPU HGX boards); a
# job spanning more asks for its total with --gpus instead of a per-node --gres.
SLURM_GPUS_PER_NODE = 8

# SkyPilot's accelerator names (`sky show-gpus -a`, docs.skypilot.co/en/stable/compute/
# gpus.html) where they differ from the catalog's: the 40 GB A100 is plain "A100", the 16 GB
# V100 plain "V100", the SXM H100 plain "H100", and RTX workstation cards drop "RTX".
_SKYPILOT_NAMES = {
    "A100-40GB": "A100",
    "A100-40GB-PCIe": "A100",
    "A100-80GB-PCIe": "A100-80GB",
    "H100-SXM": "H100",
    "V100-16GB": "V100",
    "RTXA6000": "A6000",
    "RTXA5000": "A5000",
}
# dstack names a GPU by its model, its memory is a separate filter: "A100-80GB" is A100.
_MEMORY_SUFFIX = re.compile(r"-\d+GB$")


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuChoice:
    """One GPU type of a fit-check answer."""

    name: str | None  # catalog name; None for a GPU given by memory that the catalog lacks
    memory_mib: int
    fits: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class ResourceRequest:
    """What a scheduler must give the job, from one fit-check answer."""

    model: str
    count: int  # GPUs the job spans
    required_bytes: int  # the safe bound, per GPU (the largest over the GPUs checked)
    driver_reserved_bytes: int  # memory the driver keeps, per GPU (the largest)
    gpus: tuple[GpuChoice, ...]

    @property
    def memory_bytes(self) -> int:
        """The least total memory a GPU must report for the job to fit it."""
        return self.required_bytes + self.driver_reserved_bytes

    @property
    def memory_mib(self) -> int:
        return -(-self.memory_bytes // MIB)

    @property
    def memory_gib(self) -> int:
        """The same, in whole GiB rounded up (the unit SkyPilot and dstack write as GB)."""
        return -(-self.memory_bytes // GIB)

    @property
    def fitting(self) -> tuple[str, ...]:
        """Catalog names of the GPUs that fit, in the order checked."""
        return tuple(g.name for g in self.gpus if g.fits and g.name is not None)

    def summary(self) -> str:
        return (
            f"{self.model}: {self.count} GPU(s), each with at least {self.memory_mib} MiB "
            f"({self.required_bytes / GIB:.2f} GiB safe bound + "
            f"{self.driver_reserved_bytes // MIB} MiB driver reserve)"
        )


def skypilot_name(name: str) -> str:
    return _SKYPILOT_NAMES.get(name, name)


def dstack_name(name: str) -> str:
    return _MEMORY_SUFFIX.sub("", skypilot_name(name))


def _unique(names: Sequence[str]) -> list[str]:
    return list(dict.fromkeys(names))


def _comment(request: ResourceRequest, mark: str = "#") -> list[str]:
    fits = ", ".join(request.fitting) or "none of the GPUs checked"
    return [f"{mark} vramcast: {request.summary()}", f"{mark} fits: {fits}"]


def format_json(request: ResourceRequest) -> str:
    """The request as JSON, for tools of one's own."""
    document = {
        "model": request.model,
        "count": request.count,
        "memory_mib": request.memory_mib,
        "memory_bytes": request.memory_bytes,
        "required_bytes": request.required_bytes,
        "driver_reserved_bytes": request.driver_reserved_bytes,
        "fits": list(request.fitting),
    }
    return json.dumps(document, indent=2)


def k8s_pod_spec(request: ResourceRequest) -> dict[str, object]:
    """Pod spec fields: the GPUs as a resource limit, and a node-affinity rule on GPU Feature
    Discovery's memory label (`Gt` is strict, hence one MiB less than the least)."""
    term = {
        "key": K8S_GPU_MEMORY_LABEL,
        "operator": "Gt",
        "values": [str(request.memory_mib - 1)],
    }
    return {
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchExpressions": [term]}]
                }
            }
        },
        "containers": [
            {"name": "train", "resources": {"limits": {K8S_GPU_RESOURCE: str(request.count)}}}
        ],
    }


def format_k8s(request: ResourceRequest) -> str:
    """A Pod spec's `affinity` and the container's GPU limit, as YAML to merge into a Pod, a
    Job's template, or a workload that Kueue or Volcano admits."""
    spec = k8s_pod_spec(request)
    lines = [*_comment(request), "# Pod spec fields (a Pod, or a Job's spec.template.spec):"]
    lines += _yaml(spec)
    return "\n".join(lines)


def format_slurm(request: ResourceRequest) -> str:
    """`#SBATCH` lines: the GPUs, and a constraint naming the GPU types that fit as node
    features (`A|B` is Slurm's OR)."""
    lines = _comment(request)
    if request.count <= SLURM_GPUS_PER_NODE:
        lines.append(f"#SBATCH --gres=gpu:{request.count}")
    else:
        lines.append(f"#SBATCH --gpus={request.count}")
    if request.fitting:
        lines.append(f"#SBATCH --constraint={'|'.join(request.fitting)}")
    return "\n".join(lines)


def format_skypilot(request: ResourceRequest) -> str:
    """A task's `resources`: the accelerators that fit, as a set SkyPilot picks the cheapest
    available of."""
    lines = _comment(request)
    names = _unique([skypilot_name(n) for n in request.fitting])
    lines += ["resources:", "  accelerators:"]
    if names:
        lines += [f"    {name}: {request.count}" for name in names]
    else:
        lines[-1] += " {}"
    return "\n".join(lines)


def format_dstack(request: ResourceRequest) -> str:
    """A run configuration's `resources.gpu`: the GPU models that fit, a memory range from
    the least that holds the job, and the count."""
    lines = _comment(request)
    names = _unique([dstack_name(n) for n in request.fitting])
    lines += ["resources:", "  gpu:"]
    if names:
        lines.append(f"    name: [{', '.join(names)}]")
    lines += [f"    memory: {request.memory_gib}GB..", f"    count: {request.count}"]
    return "\n".join(lines)


FORMATS: dict[str, Callable[[ResourceRequest], str]] = {
    "k8s": format_k8s,
    "slurm": format_slurm,
    "skypilot": format_skypilot,
    "dstack": format_dstack,
    "json": format_json,
}


def _yaml(value: object, indent: int = 0) -> list[str]:
    """Block YAML of plain dicts, lists, strings and ints (what the formats above build)."""
    pad = " " * indent
    lines: list[str] = []
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(item, dict | list) and item:
                lines.append(f"{pad}{key}:")
                lines += _yaml(item, indent + 2)
            else:
                lines.append(f"{pad}{key}: {_scalar(item)}")
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, dict | list) and item:
                first, *rest = _yaml(item, indent + 2)
                lines.append(f"{pad}- {first.lstrip()}")
                lines += rest
            else:
                lines.append(f"{pad}- {_scalar(item)}")
    return lines


# Strings YAML reads back as the same string when written plain: a letter first, no spaces or
# characters that start YAML syntax, and none of YAML 1.1's booleans and nulls.
_PLAIN = re.compile(r"[A-Za-z][A-Za-z0-9._/-]*")
_YAML_WORDS = {"y", "n", "yes", "no", "on", "off", "true", "false", "null"}


def _scalar(value: object) -> str:
    if isinstance(value, list):  # empty, or of scalars: flow style
        return "[" + ", ".join(_scalar(v) for v in value) + "]"
    if isinstance(value, bool | int):
        return json.dumps(value)
    text = str(value)
    if _PLAIN.fullmatch(text) and text.lower() not in _YAML_WORDS:
        return text
    return json.dumps(text)  # quoted: "31564" stays a string
