"""Prometheus metrics: requests and latency per route, estimates per model.

Each app owns its registry, so apps built side by side (tests, several workers' factories)
never share or collide on collectors.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Latency buckets, seconds: an estimate answers in about a millisecond, a fit-check over
# dozens of GPUs or a 1000-job batch in up to a few seconds.
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# Label for requests that matched no route: raw paths would grow the label set without bound.
UNMATCHED_ROUTE = "unmatched"
# Label for estimates of a model given as a config.json rather than a catalog id.
CUSTOM_MODEL = "hf_config"


class Metrics:
    """The app's collectors."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "vramcast_http_requests",
            "HTTP requests answered, by method, route template and status.",
            ("method", "route", "status"),
            registry=self.registry,
        )
        self.latency = Histogram(
            "vramcast_http_request_duration_seconds",
            "Time from the request's arrival to the end of its response, by route template.",
            ("method", "route"),
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.estimates = Counter(
            "vramcast_estimates",
            "Job estimates computed (single, batch entries and fit-check jobs), by model.",
            ("model",),
            registry=self.registry,
        )
        self._estimates_by_model: dict[str, Counter] = {}
        self.cold_work_refusals = Counter(
            "vramcast_cold_work_refusals",
            "Requests refused cold work (a job's step run, an allocator replay), by reason: busy "
            "(no slot freed in time), anonymous_share (the keyless callers' slots stayed "
            "taken), budget (the request's time for cold work ran out).",
            ("reason",),
            registry=self.registry,
        )
        self.cold_work_admissions = Counter(
            "vramcast_cold_work_admissions",
            "Requests given a slot for cold work, by caller (keyed: a live API key).",
            ("caller",),
            registry=self.registry,
        )
        self.cold_work_slots_held = Gauge(
            "vramcast_cold_work_slots_held",
            "Slots for cold work held now.",
            registry=self.registry,
        )

    def count_estimate(self, model: str) -> None:
        # The labelled child once per model: `labels()` takes a lock and builds its key on
        # every call, and every estimate counts.
        child = self._estimates_by_model.get(model)
        if child is None:
            child = self._estimates_by_model[model] = self.estimates.labels(model=model)
        child.inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class MetricsMiddleware:
    """Counts and times every HTTP request under its route template (pure ASGI)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_with_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_with_status)
        finally:
            route = getattr(scope.get("route"), "path", None) or UNMATCHED_ROUTE
            method = scope["method"]
            self.metrics.latency.labels(method=method, route=route).observe(
                time.perf_counter() - start
            )
            self.metrics.requests.labels(method=method, route=route, status=str(status)).inc()
