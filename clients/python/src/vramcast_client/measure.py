"""Reading one rank's peak GPU memory: the probe the reporter asks, and the CUDA one.

A `MemoryProbe` is the reporter's only view of the GPU, so a test (or a node with another
accelerator stack) passes its own. `CudaProbe` reads the three levels of this process's
current device:

- allocated: `torch.cuda.max_memory_allocated()`
- reserved:  `torch.cuda.max_memory_reserved()`
- device:    NVML's memory of this process (nvidia-ml-py, the `node` extra), sampled in a
             background thread while training runs; at the end it is at least the reserved
             peak plus what the process holds outside the caching allocator then (CUDA context,
             NCCL, cuBLAS workspaces), since a sample can miss a short peak.

Peaks are the process's since it started (unless the training code reset them): a job that
needs more memory while loading than while training needs that much from its GPU too.
torch and pynvml are imported only when a probe is used.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any, Protocol

logger = logging.getLogger(__name__)

# How often the NVML sampler reads the process's device memory. NVML itself refreshes
# per-process usage about this often; sampling faster finds nothing new.
NVML_SAMPLE_INTERVAL_S = 0.1


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuPeaks:
    """One rank's GPU and its peaks, bytes; a level the probe cannot read is None."""

    gpu_name: str
    memory_total_bytes: int
    allocated_bytes: int | None
    reserved_bytes: int | None
    device_bytes: int | None
    driver: str | None = None  # the NVIDIA driver version, when NVML is available

    def __post_init__(self) -> None:
        if not self.gpu_name:
            raise ValueError("gpu_name must not be empty")
        if self.memory_total_bytes <= 0:
            raise ValueError("memory_total_bytes must be positive")


class MemoryProbe(Protocol):
    """What the reporter reads peaks from: started with training, read once at its end."""

    def start(self) -> None: ...

    def read(self) -> GpuPeaks | None:
        """The peaks so far; None when there is no GPU to read."""
        ...

    def stop(self) -> None: ...


class CudaProbe:
    """This process's CUDA device through torch, and its device-level memory through NVML."""

    def __init__(
        self,
        device: int | None = None,
        *,
        nvml: bool = True,
        sample_interval_s: float = NVML_SAMPLE_INTERVAL_S,
    ) -> None:
        self._device = device
        self._use_nvml = nvml
        self._interval_s = sample_interval_s
        self._nvml: _NvmlProcessMemory | None = None

    def start(self) -> None:
        torch = _torch_cuda()
        if torch is None or not self._use_nvml or self._nvml is not None:
            return
        self._nvml = _NvmlProcessMemory.open(torch, self._index(torch), self._interval_s)

    def read(self) -> GpuPeaks | None:
        torch = _torch_cuda()
        if torch is None:
            return None
        index = self._index(torch)
        properties = torch.cuda.get_device_properties(index)
        allocated = int(torch.cuda.max_memory_allocated(index))
        reserved = int(torch.cuda.max_memory_reserved(index))
        device: int | None = None
        driver: str | None = None
        if self._nvml is not None:
            driver = self._nvml.driver
            used_now = self._nvml.sample()
            if used_now is not None:
                outside_allocator = max(used_now - int(torch.cuda.memory_reserved(index)), 0)
                device = max(self._nvml.peak_bytes, reserved + outside_allocator)
        return GpuPeaks(
            gpu_name=str(properties.name),
            memory_total_bytes=int(properties.total_memory),
            allocated_bytes=allocated or None,
            reserved_bytes=reserved or None,
            device_bytes=device or None,
            driver=driver,
        )

    def stop(self) -> None:
        if self._nvml is not None:
            self._nvml.close()
            self._nvml = None

    def _index(self, torch: Any) -> int:
        return int(self._device if self._device is not None else torch.cuda.current_device())


def _torch_cuda() -> Any:
    """torch, when it is installed and sees a CUDA device; else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


class _NvmlProcessMemory:
    """Samples this process's memory on one device through NVML, keeping the largest."""

    def __init__(self, nvml: Any, handle: Any, interval_s: float) -> None:
        self._nvml = nvml
        self._handle = handle
        self._pid = os.getpid()
        self.peak_bytes = 0
        self.driver = _text(nvml.nvmlSystemGetDriverVersion())
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(interval_s,), name="vramcast-nvml", daemon=True
        )
        self._thread.start()

    @classmethod
    def open(cls, torch: Any, index: int, interval_s: float) -> _NvmlProcessMemory | None:
        try:
            import pynvml
        except ImportError:
            logger.info("nvidia-ml-py is not installed: the device level is not measured")
            return None
        try:
            pynvml.nvmlInit()
            return cls(pynvml, _nvml_handle(pynvml, torch, index), interval_s)
        except pynvml.NVMLError as error:
            logger.info("NVML is unavailable (%s): the device level is not measured", error)
            return None

    def sample(self) -> int | None:
        """This process's device memory now, bytes; None when NVML does not say."""
        try:
            processes = self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle)
        except self._nvml.NVMLError:
            return None
        for process in processes:
            used = getattr(process, "usedGpuMemory", None)
            if process.pid == self._pid and isinstance(used, int):
                self.peak_bytes = max(self.peak_bytes, used)
                return used
        return None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        with contextlib.suppress(self._nvml.NVMLError):
            self._nvml.nvmlShutdown()

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.sample()


def _nvml_handle(nvml: Any, torch: Any, index: int) -> Any:
    """The NVML handle of torch's device `index`, matched by UUID (CUDA_VISIBLE_DEVICES and
    CUDA_DEVICE_ORDER renumber devices; NVML's own indexes do not follow)."""
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    if uuid is not None:
        text = str(uuid)
        name = text if text.startswith("GPU-") else f"GPU-{text}"
        with contextlib.suppress(nvml.NVMLError):
            return nvml.nvmlDeviceGetHandleByUUID(name)
    return nvml.nvmlDeviceGetHandleByIndex(index)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is a CUDA out-of-memory error (without importing torch)."""
    torch = sys.modules.get("torch")
    oom_type = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    if isinstance(oom_type, type) and isinstance(error, oom_type):
        return True
    # Errors raised as a plain RuntimeError (older torch, some extensions) say so in words.
    return isinstance(error, RuntimeError) and "CUDA out of memory" in str(error)
