"""The reporter's upload path end to end into the store, with the GPU given by a fake probe:
uploads, the disk spool when the service is down, refusals, OOM, and no GPU at all."""

from __future__ import annotations

import json
import logging
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.client.conftest import (
    A100_80GB,
    GIB,
    SMALL_JOB,
    FakeProbe,
    FlakyFactory,
    Service,
    free_port,
)
from vramcast_client import Delivery, Job, Reporter, RetryPolicy, report_peaks
from vramcast_client.measure import GpuPeaks, is_out_of_memory
from vramcast_client.reporter import default_run_id, idempotency_key

FAST = RetryPolicy(attempts=2, backoff_s=0.01, max_backoff_s=0.05)


def reporter(url: str, key: str, spool: Path, **options: Any) -> Reporter:
    options.setdefault("probe", FakeProbe())
    options.setdefault("run_id", f"run-{uuid.uuid4().hex[:8]}-rank0")
    return Reporter(url, api_key=key, spool_dir=spool, node_id="gpu-node-17", retry=FAST, **options)


def test_uploads_the_measured_peaks_and_environment(service: Service, tmp_path: Path) -> None:
    probe = FakeProbe()
    node = reporter(service.url, service.upload_key, tmp_path, probe=probe)
    node.start()
    assert node.finish(SMALL_JOB) is Delivery.UPLOADED
    assert node.finish(SMALL_JOB) is Delivery.SKIPPED  # once per run
    node.close()

    (row,) = service.store.uploads(node.run_id)
    assert row.idempotency_key == node.idempotency_key
    assert row.model == SMALL_JOB["model"] and row.outcome == "completed"
    assert (row.job["batch_size"], row.job["seq_len"]) == (2, 512)
    assert row.gpu_name == "A100-80GB"  # the catalog's name for the driver's
    assert row.gpu_memory_total_bytes == A100_80GB.memory_total_bytes
    assert (row.measured_allocated_bytes, row.measured_reserved_bytes) == (3 * GIB, 4 * GIB)
    assert row.measured_device_bytes == 5 * GIB
    assert row.node_id == "gpu-node-17"
    assert row.environment["driver"] == "550.54.15"
    assert row.environment["world_size"] == 1
    assert row.environment["torch"].startswith("2.")
    assert {"transformers", "peft", "bitsandbytes"} <= row.environment.keys()
    assert (probe.started, probe.stopped) == (1, 1)
    assert not list(tmp_path.glob("*.json"))


def test_service_down_keeps_the_upload_until_the_next_start(
    service: Service, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    down = f"http://127.0.0.1:{free_port()}"
    first = reporter(down, service.upload_key, tmp_path)
    first.start()
    with caplog.at_level(logging.WARNING, logger="vramcast.reporter"):
        assert first.finish(SMALL_JOB) is Delivery.SPOOLED
    first.close()
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1
    (kept,) = tmp_path.glob("*.json")
    assert json.loads(kept.read_text())["idempotency_key"] == first.idempotency_key

    # The next run starts with the service back: the kept upload is sent first.
    second = reporter(service.url, service.upload_key, tmp_path)
    second.start()
    assert second.finish(SMALL_JOB) is Delivery.UPLOADED
    second.close()
    (kept_row,) = service.store.uploads(first.run_id)
    assert kept_row.idempotency_key == first.idempotency_key
    assert len(service.store.uploads(second.run_id)) == 1
    assert not list(tmp_path.glob("*.json"))


def test_sending_a_kept_upload_twice_stores_it_once(service: Service, tmp_path: Path) -> None:
    node = reporter(service.url, service.upload_key, tmp_path)
    # The same upload kept by two processes (ranks sharing a node, or a retried send).
    body = node.upload_for(Job.model_validate(SMALL_JOB), A100_80GB, "completed").to_json()
    node.spool.put(node.idempotency_key, body)
    other = Reporter(
        service.url, api_key=service.upload_key, spool_dir=tmp_path / "other", retry=FAST
    )
    other.spool.put(node.idempotency_key, body)
    assert node.send_pending() == 1 and other.send_pending() == 1
    node.close()
    other.close()
    assert len(service.store.uploads(node.run_id)) == 1


def test_a_refused_upload_is_set_aside_not_retried(service: Service, tmp_path: Path) -> None:
    impossible = GpuPeaks(  # more allocated than reserved: the service refuses it (422)
        gpu_name="NVIDIA A100-SXM4-80GB",
        memory_total_bytes=85_899_345_920,
        allocated_bytes=5 * GIB,
        reserved_bytes=4 * GIB,
        device_bytes=None,
    )
    node = reporter(service.url, service.upload_key, tmp_path, probe=FakeProbe(impossible))
    assert node.finish(SMALL_JOB) is Delivery.REJECTED
    node.close()
    assert not list(tmp_path.glob("*.json")) and not service.store.uploads(node.run_id)


def test_a_failing_service_keeps_the_upload(
    service: Service, flaky: FlakyFactory, tmp_path: Path
) -> None:
    server = flaky([503, 503, 503], retry_after="0")  # e.g. its database is down
    node = reporter(server.url, service.upload_key, tmp_path)
    assert node.finish(SMALL_JOB) is Delivery.SPOOLED
    assert len(server.requests) == FAST.attempts
    assert len(list(tmp_path.glob("*.json"))) == 1


def test_a_wrong_key_keeps_the_upload(service: Service, tmp_path: Path) -> None:
    node = reporter(service.url, "vck_00000000_wrong", tmp_path)
    assert node.finish(SMALL_JOB) is Delivery.SPOOLED
    node.close()
    assert len(list(tmp_path.glob("*.json"))) == 1


def test_oom_is_reported_as_a_lower_bound_and_re_raised(service: Service, tmp_path: Path) -> None:
    import torch

    node = reporter(service.url, service.upload_key, tmp_path)
    with pytest.raises(torch.OutOfMemoryError), node.track(SMALL_JOB):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
    node.close()
    assert node.last_delivery is Delivery.UPLOADED
    (row,) = service.store.uploads(node.run_id)
    assert row.outcome == "oom"


def test_other_errors_are_re_raised_and_not_reported(service: Service, tmp_path: Path) -> None:
    node = reporter(service.url, service.upload_key, tmp_path)
    with pytest.raises(KeyError), node.track(SMALL_JOB):
        raise KeyError("a bug in the training script")
    node.close()
    assert node.last_delivery is None and not service.store.uploads(node.run_id)


def test_without_a_gpu_nothing_is_sent(tmp_path: Path) -> None:
    down = f"http://127.0.0.1:{free_port()}"
    delivery = report_peaks(
        SMALL_JOB, url=down, api_key="k", probe=FakeProbe(None), spool_dir=tmp_path
    )
    assert delivery is Delivery.SKIPPED and not list(tmp_path.glob("*.json"))


def test_report_peaks_function(service: Service, tmp_path: Path) -> None:
    run_id = f"fn-{uuid.uuid4().hex[:8]}-rank3"
    delivery = report_peaks(
        SMALL_JOB,
        outcome="oom",
        url=service.url,
        api_key=service.upload_key,
        probe=FakeProbe(),
        spool_dir=tmp_path,
        run_id=run_id,
    )
    assert delivery is Delivery.UPLOADED
    assert [row.outcome for row in service.store.uploads(run_id)] == ["oom"]


def test_a_broken_probe_never_raises(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    class BrokenProbe(FakeProbe):
        def start(self) -> None:
            raise RuntimeError("NVML exploded")

        def read(self) -> GpuPeaks | None:
            raise RuntimeError("NVML exploded again")

    node = reporter("http://127.0.0.1:1", "k", tmp_path, probe=BrokenProbe())
    node.start()
    assert node.finish(SMALL_JOB) is Delivery.SKIPPED
    node.close()
    assert "NVML exploded" in caplog.text


def test_run_ids_and_idempotency_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("VRAMCAST_RUN_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "4711")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    monkeypatch.setenv("RANK", "3")
    assert default_run_id() == "slurm-4711-restart1-rank3"
    monkeypatch.setenv("VRAMCAST_RUN_ID", "job-9")
    assert default_run_id() == "job-9-rank3"
    key = idempotency_key("gpu-node-17", "job-9-rank3")
    assert key == idempotency_key("gpu-node-17", "job-9-rank3")
    assert key != idempotency_key("gpu-node-17", "job-9-rank2")


def test_out_of_memory_recognised() -> None:
    import torch

    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert is_out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert not is_out_of_memory(RuntimeError("expected scalar type Float"))
