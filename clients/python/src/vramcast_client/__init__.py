"""Clients of the vramcast API: `VramcastClient` / `AsyncVramcastClient` for schedulers and
tools, and `Reporter` for training nodes.

Importing this package needs httpx and pydantic only; torch, transformers, peft and
lightning are used when a training process already has them. The framework callbacks live
in `vramcast_client.hf_callback` and `vramcast_client.lightning_callback`.
"""

from vramcast_client.client import AsyncVramcastClient, VramcastClient
from vramcast_client.errors import (
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
from vramcast_client.measure import CudaProbe, GpuPeaks, MemoryProbe
from vramcast_client.models import (
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
    PlacementRequest,
)
from vramcast_client.reporter import Delivery, Reporter, report_peaks
from vramcast_client.retry import RetryPolicy

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
    "PlacementRequest",
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
