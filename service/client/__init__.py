"""Clients of the vramcast API: `VramcastClient` / `AsyncVramcastClient` for schedulers and
tools, and `Reporter` for training nodes.

Importing this package needs httpx and pydantic only; torch, transformers, peft and
lightning are used when a training process already has them. The framework callbacks live
in `service.client.hf_callback` and `service.client.lightning_callback`.
"""

from service.client.client import AsyncVramcastClient, VramcastClient
from service.client.errors import (
    AuthenticationError,
    InvalidRequestError,
    NotFoundError,
    Problem,
    ProblemError,
    RequestTooLargeError,
    ServerError,
    ServiceUnreachableError,
    UnexpectedResponseError,
    VramcastError,
)
from service.client.measure import CudaProbe, GpuPeaks, MemoryProbe
from service.client.models import (
    BatchEstimates,
    CalibrationReceipt,
    CalibrationUpload,
    Estimate,
    FitCheck,
    GpuList,
    GpuOffer,
    Job,
    Model,
    ModelList,
)
from service.client.reporter import Delivery, Reporter, report_peaks
from service.client.retry import RetryPolicy

__all__ = [
    "AsyncVramcastClient",
    "AuthenticationError",
    "BatchEstimates",
    "CalibrationReceipt",
    "CalibrationUpload",
    "CudaProbe",
    "Delivery",
    "Estimate",
    "FitCheck",
    "GpuList",
    "GpuOffer",
    "GpuPeaks",
    "InvalidRequestError",
    "Job",
    "MemoryProbe",
    "Model",
    "ModelList",
    "NotFoundError",
    "Problem",
    "ProblemError",
    "Reporter",
    "RequestTooLargeError",
    "RetryPolicy",
    "ServerError",
    "ServiceUnreachableError",
    "UnexpectedResponseError",
    "VramcastClient",
    "VramcastError",
    "report_peaks",
]
