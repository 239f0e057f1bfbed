"""`VramcastClient` and `AsyncVramcastClient`: the REST API over httpx, with typed results.

    with VramcastClient("http://vramcast:8000") as client:
        fit = client.fit_check({"model": "Qwen/Qwen2.5-7B", "batch_size": 4, "seq_len": 2048},
                               gpus=["A100-80GB", {"memory_mib": 46068}])
        if not fit.fits_all: ...

Every method raises a `VramcastError` (see `vramcast_client.errors`); failures a later
attempt can fix are retried first, as `RetryPolicy` says. The two clients share everything
but the sending loop.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Generic, Self, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, ValidationError

from vramcast_client.errors import (
    Problem,
    ServiceUnreachableError,
    UnexpectedResponseError,
    problem_error,
)
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
from vramcast_client.retry import RetryPolicy, retry_after_s, retryable_status

URL_ENV = "VRAMCAST_URL"
API_KEY_ENV = "VRAMCAST_API_KEY"
DEFAULT_URL = "http://127.0.0.1:8000"
# A fit-check answers in milliseconds; a service slower than this is treated as down.
DEFAULT_TIMEOUT_S = 10.0
IDEMPOTENCY_HEADER = "Idempotency-Key"
REPLAYED_HEADER = "Idempotent-Replayed"

JobLike = Job | Mapping[str, Any]
GpuLike = str | GpuOffer | Mapping[str, Any]
PlacementLike = PlacementRequest | Mapping[str, Any]
UploadLike = CalibrationUpload | Mapping[str, Any]
ResultT = TypeVar("ResultT", bound=BaseModel)


def _json(value: BaseModel | Mapping[str, Any] | str) -> Any:
    if isinstance(value, Job | GpuOffer | CalibrationUpload):
        return value.to_json()
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", exclude_none=True)
    if isinstance(value, str):
        return value
    return dict(value)


@dataclass(frozen=True, slots=True)
class _Call(Generic[ResultT]):
    """One API operation: what to send, and what a 2xx answer parses into."""

    method: str
    path: str
    result: type[ResultT]
    body: Any = None
    headers: Mapping[str, str] = field(default_factory=dict)


class _ClientBase:
    def __init__(
        self,
        base_url: str | None,
        *,
        api_key: str | None,
        timeout: float | httpx.Timeout,
        retry: RetryPolicy,
        headers: Mapping[str, str] | None,
    ) -> None:
        self.base_url = (base_url or os.environ.get(URL_ENV) or DEFAULT_URL).rstrip("/")
        self.api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
        self.timeout = timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout)
        self.retry = retry
        self._headers = {"Accept": "application/json", **(headers or {})}
        if self.api_key:
            self._headers["Authorization"] = f"Bearer {self.api_key}"

    # What each operation sends --------------------------------------------------------

    @staticmethod
    def _estimate(job: JobLike) -> _Call[Estimate]:
        return _Call("POST", "/v1/estimates", Estimate, _json(job))

    @staticmethod
    def _batch(jobs: Sequence[JobLike]) -> _Call[BatchEstimates]:
        body = {"jobs": [_json(job) for job in jobs]}
        return _Call("POST", "/v1/estimates:batch", BatchEstimates, body)

    @staticmethod
    def _fit_check(
        job: JobLike, gpus: Sequence[GpuLike], placement: PlacementLike | None = None
    ) -> _Call[FitCheck]:
        body = {"job": _json(job), "gpus": [_json(gpu) for gpu in gpus]}
        if placement is not None:
            body["placement"] = _json(placement)
        return _Call("POST", "/v1/fit-checks", FitCheck, body)

    @staticmethod
    def _models() -> _Call[ModelList]:
        return _Call("GET", "/v1/models", ModelList)

    @staticmethod
    def _model(model_id: str) -> _Call[Model]:
        return _Call("GET", f"/v1/models/{quote(model_id, safe='/')}", Model)

    @staticmethod
    def _gpus() -> _Call[GpuList]:
        return _Call("GET", "/v1/gpus", GpuList)

    def _upload(self, upload: UploadLike, idempotency_key: str) -> _Call[CalibrationReceipt]:
        if not idempotency_key:
            raise ValueError("an upload needs an Idempotency-Key, so a retry is not stored twice")
        headers = {IDEMPOTENCY_HEADER: idempotency_key}
        return _Call("POST", "/v1/calibrations", CalibrationReceipt, _json(upload), headers)

    # What an answer means ---------------------------------------------------------------

    def _request(self, http: httpx.Client | httpx.AsyncClient, call: _Call[Any]) -> httpx.Request:
        return http.build_request(
            call.method,
            call.path,
            json=call.body,
            headers=dict(call.headers) if call.headers else None,
        )

    def _parse(self, call: _Call[ResultT], response: httpx.Response, attempts: int) -> ResultT:
        url = str(response.request.url)
        if response.is_success:
            try:
                result = call.result.model_validate_json(response.content)
            except ValidationError as error:
                raise UnexpectedResponseError(
                    f"not a {call.result.__name__}: {error.errors()[0]['msg']}",
                    method=call.method,
                    url=url,
                    status=response.status_code,
                ) from error
            if isinstance(result, CalibrationReceipt):
                replayed = response.headers.get(REPLAYED_HEADER, "").lower() == "true"
                return result.model_copy(update={"replayed": replayed})
            return result
        problem = Problem.from_body(response.status_code, response.content, response.reason_phrase)
        raise problem_error(
            problem,
            method=call.method,
            url=url,
            attempts=attempts,
            retry_after_s=retry_after_s(response),
        )

    def _unreachable(
        self, call: _Call[Any], error: httpx.TransportError, attempts: int
    ) -> ServiceUnreachableError:
        message = str(error) or type(error).__name__
        return ServiceUnreachableError(
            message, method=call.method, url=self.base_url + call.path, attempts=attempts
        )


class VramcastClient(_ClientBase):
    """The API, blocking. Use as a context manager, or call `close()`.

    base_url and api_key default to $VRAMCAST_URL and $VRAMCAST_API_KEY; `transport` replaces
    the network (httpx.MockTransport in tests).
    """

    def __init__(
        self,
        base_url: str | None = None,
        *,
        api_key: str | None = None,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT_S,
        retry: RetryPolicy | None = None,
        headers: Mapping[str, str] | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        super().__init__(
            base_url,
            api_key=api_key,
            timeout=timeout,
            retry=retry or RetryPolicy(),
            headers=headers,
        )
        self._http = httpx.Client(
            base_url=self.base_url, timeout=self.timeout, headers=self._headers, transport=transport
        )

    def estimate(self, job: JobLike) -> Estimate:
        """POST /v1/estimates: the job's peak, its breakdown and the safe bound."""
        return self._send(self._estimate(job))

    def estimate_batch(self, jobs: Sequence[JobLike]) -> BatchEstimates:
        """POST /v1/estimates:batch: one result per job, in order; each fails on its own."""
        return self._send(self._batch(jobs))

    def fit_check(
        self, job: JobLike, gpus: Sequence[GpuLike], placement: PlacementLike | None = None
    ) -> FitCheck:
        """POST /v1/fit-checks: per GPU type, whether it fits, how far it can grow, and fixes;
        with `placement`, also the fewest GPUs per GPU type and strategy."""
        return self._send(self._fit_check(job, gpus, placement))

    def models(self) -> ModelList:
        return self._send(self._models())

    def model(self, model_id: str) -> Model:
        """GET /v1/models/{id}; raises NotFoundError (with suggestions) for an unknown id."""
        return self._send(self._model(model_id))

    def gpus(self) -> GpuList:
        return self._send(self._gpus())

    def upload_calibration(self, upload: UploadLike, *, idempotency_key: str) -> CalibrationReceipt:
        """POST /v1/calibrations (needs an `upload` key); a repeated key replays the answer."""
        return self._send(self._upload(upload, idempotency_key))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _send(self, call: _Call[ResultT]) -> ResultT:
        attempt = 0
        while True:
            attempt += 1
            last = attempt >= self.retry.attempts
            try:
                response = self._http.send(self._request(self._http, call))
            except httpx.TransportError as error:
                if last:
                    raise self._unreachable(call, error, attempt) from error
                time.sleep(self.retry.delay_s(attempt))
                continue
            if last or not retryable_status(response.status_code):
                return self._parse(call, response, attempt)
            time.sleep(self.retry.delay_s(attempt, retry_after_s(response)))


class AsyncVramcastClient(_ClientBase):
    """The API for asyncio code; the same methods as `VramcastClient`, awaited."""

    def __init__(
        self,
        base_url: str | None = None,
        *,
        api_key: str | None = None,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT_S,
        retry: RetryPolicy | None = None,
        headers: Mapping[str, str] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__(
            base_url,
            api_key=api_key,
            timeout=timeout,
            retry=retry or RetryPolicy(),
            headers=headers,
        )
        self._http = httpx.AsyncClient(
            base_url=self.base_url, timeout=self.timeout, headers=self._headers, transport=transport
        )

    async def estimate(self, job: JobLike) -> Estimate:
        return await self._send(self._estimate(job))

    async def estimate_batch(self, jobs: Sequence[JobLike]) -> BatchEstimates:
        return await self._send(self._batch(jobs))

    async def fit_check(
        self, job: JobLike, gpus: Sequence[GpuLike], placement: PlacementLike | None = None
    ) -> FitCheck:
        return await self._send(self._fit_check(job, gpus, placement))

    async def models(self) -> ModelList:
        return await self._send(self._models())

    async def model(self, model_id: str) -> Model:
        return await self._send(self._model(model_id))

    async def gpus(self) -> GpuList:
        return await self._send(self._gpus())

    async def upload_calibration(
        self, upload: UploadLike, *, idempotency_key: str
    ) -> CalibrationReceipt:
        return await self._send(self._upload(upload, idempotency_key))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def _send(self, call: _Call[ResultT]) -> ResultT:
        attempt = 0
        while True:
            attempt += 1
            last = attempt >= self.retry.attempts
            try:
                response = await self._http.send(self._request(self._http, call))
            except httpx.TransportError as error:
                if last:
                    raise self._unreachable(call, error, attempt) from error
                await asyncio.sleep(self.retry.delay_s(attempt))
                continue
            if last or not retryable_status(response.status_code):
                return self._parse(call, response, attempt)
            await asyncio.sleep(self.retry.delay_s(attempt, retry_after_s(response)))
