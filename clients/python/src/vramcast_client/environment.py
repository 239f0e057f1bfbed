"""The software a peak was measured with, read from installed packages without importing them.

Only torch's CUDA version needs torch itself, and it is read only when the training process
has already imported torch.
"""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, version

from vramcast_client.models import Environment


def package_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def cuda_version() -> str | None:
    """The CUDA version torch was built with; None for a CPU build or without torch."""
    torch = sys.modules.get("torch")
    cuda = getattr(getattr(torch, "version", None), "cuda", None)
    return cuda if isinstance(cuda, str) else None


def collect_environment(*, driver: str | None, world_size: int) -> Environment:
    return Environment(
        torch=package_version("torch"),
        cuda=cuda_version(),
        driver=driver,
        transformers=package_version("transformers"),
        peft=package_version("peft"),
        bitsandbytes=package_version("bitsandbytes"),
        world_size=world_size,
    )
