"""Reading the device: torch's allocator counters and NVML's used memory."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any, Protocol

# NVML's used memory is polled this often (seconds) for the device peak.
POLL_S = 0.002


# -- reading the device ---------------------------------------------------------------------


class DeviceReadings(Protocol):
    """What a measurement reads: the caching allocator's counters and the GPU's used memory.

    `device` is where the model and batches are made. `CudaReadings` reads a CUDA GPU through
    torch.cuda and NVML; a test passes readings of its own, with `device` "cpu", so the steps
    run for real on CPU tensors while the readings come from the test.
    """

    device: str

    def used(self) -> int:
        """The GPU's used memory now (NVML, every process on it), bytes."""
        ...

    def used_peak(self) -> int:
        """The highest used memory seen since `start`, bytes."""
        ...

    def start(self) -> None:
        """Start watching the used memory, then make this process's CUDA context."""
        ...

    def stop(self) -> None: ...

    def synchronize(self) -> None: ...

    def reset_peaks(self) -> None:
        """`torch.cuda.reset_peak_memory_stats()`."""
        ...

    def allocated(self) -> int: ...

    def max_allocated(self) -> int: ...

    def reserved(self) -> int: ...

    def max_reserved(self) -> int: ...

    def stats(self) -> Mapping[str, Any]:
        """`torch.cuda.memory_stats()`."""
        ...

    def versions(self) -> dict[str, Any]:
        """The software and the GPU: as `versions()` (gpu, gpu_total, driver, cuda, ...)."""
        ...


class NvmlPoller:
    """The highest NVML used memory of GPU `index` (NVML's numbering), polled in a thread."""

    def __init__(self, index: int = 0, period_s: float = POLL_S) -> None:
        import pynvml

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        self._period_s = period_s
        self.peak = self.used()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def used(self) -> int:
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.used())
            time.sleep(self._period_s)

    def __enter__(self) -> NvmlPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.peak = max(self.peak, self.used())


class CudaReadings:
    """A CUDA GPU: torch.cuda's allocator counters, and NVML's used memory of the whole GPU.

    Making one touches neither CUDA nor the GPU's memory: `used()` before `start()` is what
    the GPU held before this process's CUDA context.
    """

    def __init__(self, device: str = "cuda", period_s: float = POLL_S) -> None:
        import torch

        self._torch = torch
        target = torch.device(device)
        index = target.index if target.index is not None else 0
        self.device = str(torch.device("cuda", index))
        self._poller = NvmlPoller(_nvml_index(torch, index), period_s)

    def used(self) -> int:
        return self._poller.used()

    def used_peak(self) -> int:
        return self._poller.peak

    def start(self) -> None:
        self._poller.__enter__()
        torch = self._torch
        torch.cuda.init()
        torch.cuda.set_device(self.device)
        torch.empty(1, device=self.device)
        torch.cuda.synchronize()
        time.sleep(0.05)  # NVML's reading catches up with the new context

    def stop(self) -> None:
        self._poller.__exit__()

    def synchronize(self) -> None:
        self._torch.cuda.synchronize()

    def reset_peaks(self) -> None:
        self._torch.cuda.reset_peak_memory_stats()

    def allocated(self) -> int:
        return int(self._torch.cuda.memory_allocated())

    def max_allocated(self) -> int:
        return int(self._torch.cuda.max_memory_allocated())

    def reserved(self) -> int:
        return int(self._torch.cuda.memory_reserved())

    def max_reserved(self) -> int:
        return int(self._torch.cuda.max_memory_reserved())

    def stats(self) -> Mapping[str, Any]:
        stats: Mapping[str, Any] = self._torch.cuda.memory_stats()
        return stats

    def versions(self) -> dict[str, Any]:
        return versions(self._torch.device(self.device).index or 0)


def _nvml_index(torch: Any, index: int) -> int:
    """NVML's number of CUDA device `index` (CUDA_VISIBLE_DEVICES renumbers), without
    initialising CUDA."""
    try:
        return int(torch.cuda._get_nvml_device_index(torch.device("cuda", index)))
    except Exception:  # a private helper; NVML's order is the usual fallback
        return index


def open_cuda_readings(device: str = "cuda") -> CudaReadings | None:
    """Readings of the local CUDA GPU; None when torch sees none. Needs nvidia-ml-py."""
    import torch

    if not torch.cuda.is_available():
        return None
    return CudaReadings(device)


def software_versions() -> dict[str, Any]:
    """The versions of the packages a run depends on (None: not installed)."""
    import importlib.metadata as md

    found: dict[str, Any] = {}
    for package in ("torch", "transformers", "peft", "bitsandbytes", "accelerate"):
        try:
            found[package] = md.version(package)
        except md.PackageNotFoundError:
            found[package] = None
    return found


def versions(index: int = 0) -> dict[str, Any]:
    """The software, CUDA, the driver, and CUDA device `index`'s name and total memory."""
    import torch

    found = software_versions()
    found["cuda"] = torch.version.cuda
    found["gpu"] = torch.cuda.get_device_name(index)
    found["gpu_total"] = int(torch.cuda.get_device_properties(index).total_memory)
    found["driver"] = _driver()
    return found


def _driver() -> str | None:
    try:
        import pynvml

        value = pynvml.nvmlSystemGetDriverVersion()
        return value.decode() if isinstance(value, bytes) else str(value)
    except Exception:  # the driver version is a nicety
        return None


def nvml_used(index: int = 0) -> int:
    import pynvml

    pynvml.nvmlInit()
    return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).used)
