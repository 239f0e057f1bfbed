"""`vramcast probe` on CPU: the two steps run for real on CPU tensors of a tiny model while the
device readings a GPU would give come from `FakeGpu`; the command's table, JSON, refusals, no
GPU, no torch, and `--upload` into a real service on loopback."""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from service.api.schemas import JobSpec
from service.cli import probe as probe_cli
from service.cli.main import build_parser, main
from service.cli.options import spec_from_args
from service.core.arch.hf_config import from_hf_config
from service.core.estimator import estimate
from service.core.result import Estimate
from service.core.spec import LoraSpec, Method, TrainingSpec
from service.store.keys import KeyScope
from service.trace import probe
from service.trace.probe import ProbeCase, build_on_device, training_arguments
from service.trace.validate import TINY_CONFIGS
from tests.client.conftest import Service, ServiceProcess, Store
from vramcast_client.reporter import Reporter

pytestmark = pytest.mark.trace

GIB = 1024**3
TINY = TINY_CONFIGS["tiny-llama"]
H200 = {"gpu": "NVIDIA H200", "gpu_total": 150_754_820_096, "driver": "570.124.06", "cuda": "12.8"}
LORA_QV = ["--r", "8", "--lora-alpha", "16", "--target-modules", "q_proj,v_proj"]


class FakeGpu:
    """What a GPU's torch.cuda counters and NVML would read, given; `device` is the CPU, so the
    model and the steps are real CPU tensors.

    NVML's used memory is `base` before the CUDA context, `base + context` until the steps
    start, then `base + end_used`; each `reset_peaks` (one per loop step, one for a Trainer
    run) moves on to the next (max allocated, max reserved) of `steps`.
    """

    device = "cpu"

    def __init__(
        self,
        *,
        steps: Sequence[tuple[int, int]],
        end_used: int,
        device_peak: int | None = None,
        context: int = GIB // 2,
        base: int = GIB,
    ) -> None:
        self.steps = list(steps)
        self.end_used = end_used
        self.device_peak = device_peak if device_peak is not None else end_used
        self.context = context
        self.base = base
        self.started = False
        self.stopped = False
        self.resets = 0

    def used(self) -> int:
        if not self.started:
            return self.base
        return self.base + (self.end_used if self.resets else self.context)

    def used_peak(self) -> int:
        return self.base + self.device_peak

    def start(self) -> None:
        self.started = True

    def stop(self) -> None:
        self.stopped = True

    def synchronize(self) -> None:
        pass

    def reset_peaks(self) -> None:
        self.resets += 1

    def _step(self) -> tuple[int, int]:
        return self.steps[min(max(self.resets, 1), len(self.steps)) - 1]

    def allocated(self) -> int:
        return self._step()[0] // 2

    def max_allocated(self) -> int:
        return self._step()[0]

    def reserved(self) -> int:
        return self._step()[1]

    def max_reserved(self) -> int:
        return self._step()[1]

    def stats(self) -> Mapping[str, Any]:
        return {"num_alloc_retries": 0, "segment.all.current": 3}

    def versions(self) -> dict[str, Any]:
        return {**probe.software_versions(), **H200}


def job_argv(config: Path, *options: str) -> list[str]:
    return ["probe", "--config", str(config), "-b", "2", "-s", "32", *options]


def estimate_of(argv: list[str]) -> Estimate:
    return estimate(from_hf_config(TINY), spec_from_args(build_parser().parse_args(argv)))


def fake_gpu_for(est: Estimate, *, device_peak: int | None = None) -> FakeGpu:
    """Readings that make the estimate 25 % high when allocated, exact when reserved, and 5 %
    low when device (the end of step 2)."""
    allocated = round(est.allocated_bytes / 1.25)
    end_used = round(est.device_bytes / 0.95)
    return FakeGpu(
        steps=[(allocated - 4096, est.reserved_bytes - 2**21), (allocated, est.reserved_bytes)],
        end_used=end_used,
        device_peak=device_peak,
    )


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    return path


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[list[FakeGpu]]:
    """Install a FakeGpu as the command's device; the test appends the one to use."""
    given: list[FakeGpu] = []

    def open_readings(device: str) -> FakeGpu:
        assert device == "cuda"
        return given[0]

    monkeypatch.setattr(probe_cli, "open_readings", open_readings)
    monkeypatch.setenv("VRAMCAST_SPOOL_DIR", str(tmp_path / "spool"))  # not ~/.cache
    yield given


def test_the_table_sets_each_level_against_the_estimate(
    config: Path, gpu: list[FakeGpu], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = job_argv(config, *LORA_QV, "--gradient-checkpointing")
    est = estimate_of(argv)
    gpu.append(fake_gpu_for(est))
    assert main(argv) == 0
    out = capsys.readouterr().out
    head, _, rest = out.partition("\n\n")
    assert head.startswith(f"{config}: 2 training steps (loop) on NVIDIA H200, 140.4 GiB")
    assert "driver 570.124.06, CUDA 12.8, torch 2.13" in head
    rows = {line[:24].strip(): line[24:].split() for line in rest.splitlines()[1:5]}
    # GiB: the device level alone holds the CUDA context and kernel libraries (~0.75 GiB)
    assert est.device_bytes_upper >= 1024**3
    gib = 1024**3
    assert rows["allocated"] == [
        f"{est.allocated_bytes / gib:.2f}",
        f"{round(est.allocated_bytes / 1.25) / gib:.2f}",
        "+25.0%",
    ]
    assert rows["reserved"][2] == "+0.0%"
    assert rows["device"][2] == "-5.0%"
    assert rows["device, safe bound"] == [
        f"{est.device_bytes_upper / gib:.2f}",
        f"{round(est.device_bytes / 0.95) / gib:.2f}",
        "held",
    ]
    assert "GiB; error = estimate / measured - 1" in out
    assert gpu[0].started and gpu[0].stopped and gpu[0].resets == 2  # two loop steps


def test_a_device_peak_above_the_safe_bound_is_called_out(
    config: Path, gpu: list[FakeGpu], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = job_argv(config, *LORA_QV)
    est = estimate_of(argv)
    gpu.append(fake_gpu_for(est, device_peak=est.device_bytes_upper + 2**20))
    assert main(argv) == 0
    bound = next(line for line in capsys.readouterr().out.splitlines() if "safe bound" in line)
    assert bound.split()[-1] == "EXCEEDED"


def test_json_gives_every_byte(
    config: Path, gpu: list[FakeGpu], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = job_argv(config, "--method", "full", "--json")
    est = estimate_of(argv)
    gpu.append(fake_gpu_for(est))
    assert main(argv) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["estimate"] == {
        "allocated_bytes": est.allocated_bytes,
        "reserved_bytes": est.reserved_bytes,
        "device_bytes": est.device_bytes,
        "device_bytes_upper": est.device_bytes_upper,
    }
    fake = gpu[0]
    assert document["measured"] == {
        "allocated_bytes": fake.steps[1][0],
        "reserved_bytes": fake.steps[1][1],
        "device_bytes": fake.end_used,
        "device_peak_bytes": fake.device_peak,
        "context_bytes": fake.context,
    }
    assert document["error"]["allocated"] == pytest.approx(0.25, abs=1e-4)
    assert document["error"]["reserved"] == 0.0
    assert document["error"]["device"] == pytest.approx(-0.05, abs=1e-4)
    assert document["safe_bound_held"] is True
    assert document["gpu"]["name"] == "NVIDIA H200" and document["runner"] == "loop"
    run = document["run"]
    assert [s["step"] for s in run["steps"]] == [1, 2]
    # The steps ran: every parameter trains, and each step took time.
    assert run["params_trainable"] == run["params_total"] > 0
    assert all(s["seconds"] > 0 for s in run["steps"])


def test_autocast_runs_hf_trainer(
    config: Path, gpu: list[FakeGpu], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = job_argv(config, *LORA_QV, "--autocast", "--json")
    gpu.append(fake_gpu_for(estimate_of(argv)))
    assert main(argv) == 0
    document = json.loads(capsys.readouterr().out)  # Trainer printed nothing of its own
    assert document["runner"] == "trainer"
    assert [s["step"] for s in document["run"]["steps"]] == ["1-2"]
    assert gpu[0].resets == 1


@pytest.mark.parametrize(
    ("options", "words"),
    [
        (["--runner", "loop", "--autocast"], "the loop runner has no autocast"),
        (["--gpus", "2"], "one GPU"),
        (["--loss", "fused"], "loss fused"),
        (["--method", "qlora", "--quant", "int8"], "int8"),
    ],
)
def test_jobs_the_probe_cannot_run_exit_2(
    config: Path,
    gpu: list[FakeGpu],
    capsys: pytest.CaptureFixture[str],
    options: list[str],
    words: str,
) -> None:
    assert main(job_argv(config, *options)) == 2
    err = capsys.readouterr().err
    assert err.startswith("vramcast probe: error: ") and words in err
    assert not gpu  # refused before any device was asked for


def test_without_a_gpu_it_says_so_and_exits_2(
    config: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(probe_cli, "open_readings", lambda device: None)
    assert main(job_argv(config)) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "vramcast probe: error: no CUDA GPU is visible (torch.cuda.is_available() is False); "
        "the probe measures on a GPU\n"
    )


def test_on_this_machine_without_a_gpu_too(
    config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(job_argv(config)) == 2
    assert "no CUDA GPU is visible" in capsys.readouterr().err


def test_without_torch_it_names_the_extra(
    config: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    assert main(job_argv(config)) == 2
    err = capsys.readouterr().err
    assert err.startswith("vramcast probe: error: the probe needs the [trace] extra (torch is")
    assert err.count("\n") == 1


def test_a_failed_run_exits_1_and_uploads_nothing(
    config: Path, gpu: list[FakeGpu], capsys: pytest.CaptureFixture[str]
) -> None:
    class OutOfMemory(FakeGpu):
        def reset_peaks(self) -> None:
            super().reset_peaks()
            if self.resets == 2:
                raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    argv = job_argv(config, *LORA_QV, "--upload", "--url", "http://127.0.0.1:9")
    fake = fake_gpu_for(estimate_of(argv))
    gpu.append(OutOfMemory(steps=fake.steps, end_used=fake.end_used))
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "vramcast probe: the run ran out of GPU memory: RuntimeError: CUDA out of memory. "
        "Tried to allocate 2.00 GiB; nothing uploaded\n"
    )
    assert gpu[0].stopped


# -- --upload into a real service -----------------------------------------------------------


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """The service on loopback on a fresh migrated store (tests/client/conftest.py's)."""
    store = Store(tmp_path_factory.mktemp("probe-store"))
    process = ServiceProcess(store)
    try:
        yield Service(process.url, store, store.issue_key(KeyScope.UPLOAD), process)
    finally:
        process.stop()
        store.close()


@pytest.fixture
def node(service: Service, monkeypatch: pytest.MonkeyPatch) -> str:
    """The reporter's environment (key, node, run); the run id the upload will carry."""
    run = f"probe-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("VRAMCAST_API_KEY", service.upload_key)
    monkeypatch.setenv("VRAMCAST_NODE_ID", "probe-node-3")
    monkeypatch.setenv("VRAMCAST_RUN_ID", run)
    return f"{run}-rank0"


def reporter_job(spec: TrainingSpec, tmp_path: Path) -> dict[str, Any]:
    """The job the training-node reporter derives from the same model and arguments, as the
    service stores it."""
    built = build_on_device(spec, TINY, "cpu")
    arguments = training_arguments(spec, "cpu", str(tmp_path))
    reporter = Reporter("http://127.0.0.1:9", seq_len=spec.seq_len, spool_dir=tmp_path)
    job = reporter.hf_job(built.model, arguments)().to_json()
    stored: dict[str, Any] = JobSpec.model_validate(job).model_dump(mode="json", exclude_unset=True)
    return stored


def test_upload_stores_the_peaks_under_the_job_a_node_reports(
    config: Path,
    gpu: list[FakeGpu],
    service: Service,
    node: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = job_argv(config, *LORA_QV, "--gradient-checkpointing", "--upload", "--url", service.url)
    est = estimate_of(argv)
    gpu.append(fake_gpu_for(est))
    assert main([*argv, "--json"]) == 0
    document = json.loads(capsys.readouterr().out)

    (row,) = service.store.uploads(node)
    fake = gpu[0]
    assert (row.measured_allocated_bytes, row.measured_reserved_bytes) == fake.steps[1]
    assert row.measured_device_bytes == fake.end_used
    assert row.gpu_name == "H200" and row.gpu_memory_total_bytes == H200["gpu_total"]
    assert row.node_id == "probe-node-3" and row.outcome == "completed"
    assert row.environment["driver"] == "570.124.06"
    spec = TrainingSpec(
        method=Method.LORA,
        batch_size=2,
        seq_len=32,
        lora=LoraSpec(r=8, lora_alpha=16, target_modules=("q_proj", "v_proj")),
        gradient_checkpointing=True,
    )
    assert row.job == reporter_job(spec, tmp_path)
    assert row.job["model"]["hf_config"]["model_type"] == "llama"
    # The service estimates the stored job as the probe's estimate did.
    ratios = {r["level"]: r["measured_over_estimated"] for r in document["upload"]["ratios"]}
    assert ratios["allocated"] == pytest.approx(1 / 1.25, abs=1e-4)
    assert document["upload"]["id"] == row.id and document["upload"]["run_id"] == node


def test_upload_text_says_what_was_stored(
    config: Path,
    gpu: list[FakeGpu],
    service: Service,
    node: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = job_argv(config, *LORA_QV, "--upload", "--url", service.url)
    gpu.append(fake_gpu_for(estimate_of(argv)))
    assert main(argv) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    (row,) = service.store.uploads(node)
    assert last.startswith(
        f"uploaded: calibration upload {row.id}, node probe-node-3, run {node}; "
        "measured / the service's estimate: allocated 0.800"
    )


def test_a_job_a_node_would_report_differently_is_not_uploaded(
    config: Path,
    gpu: list[FakeGpu],
    service: Service,
    node: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A node cannot tell which SDPA kernel ran: its upload would be estimated with `auto`.
    argv = job_argv(config, *LORA_QV, "--sdpa-kernel", "math", "--upload", "--url", service.url)
    gpu.append(fake_gpu_for(estimate_of(argv)))
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert "device, safe bound" in captured.out  # the measurement is still shown
    assert captured.err.startswith("vramcast probe: not uploaded: the job a training node ")
    assert captured.err.endswith(": sdpa_kernel: 'auto' reported, 'math' probed\n")
    assert service.store.uploads(node) == []


def test_an_unreachable_service_exits_1(
    config: Path, gpu: list[FakeGpu], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = job_argv(config, *LORA_QV, "--upload", "--url", "http://127.0.0.1:9")
    gpu.append(fake_gpu_for(estimate_of(argv)))
    assert main(argv) == 1
    assert "not uploaded: the service did not store it" in capsys.readouterr().err


# -- the matrix's building blocks ----------------------------------------------------------


def test_measure_records_a_case_and_keeps_a_failure_as_data() -> None:
    spec = TrainingSpec(method=Method.FULL, batch_size=2, seq_len=16)
    case = ProbeCase(name="tiny-full", model_id="tiny", spec=spec)
    readings = FakeGpu(steps=[(3 * GIB, 4 * GIB)], end_used=5 * GIB)
    record = probe.measure(case, TINY, base_used=GIB, readings=readings)
    assert "error" not in record
    assert (record["max_allocated"], record["max_reserved"]) == (3 * GIB, 4 * GIB)
    assert (record["end_used"], record["context_used"]) == (5 * GIB, GIB // 2)
    assert record["versions"]["gpu"] == "NVIDIA H200"

    unknown = {**TINY, "model_type": "no-such-model"}
    readings = FakeGpu(steps=[(1, 1)], end_used=1)
    record = probe.measure(case, unknown, base_used=0, readings=readings)
    assert record["error"].startswith("ValueError") and "trace" in record


def test_the_matrix_cases_are_named_once_and_runnable() -> None:
    names = [case.name for case in probe.MATRIX]
    assert len(set(names)) == len(names)
    for case in probe.MATRIX:
        probe.check_probeable(case.spec, probe.Runner(case.runner))
    with pytest.raises(SystemExit) as exited:
        probe.main([])  # --matrix is required
    assert exited.value.code == 2


def test_measure_runs_an_encoder_with_class_labels() -> None:
    spec = TrainingSpec(method=Method.FULL, batch_size=2, seq_len=16)
    case = ProbeCase(name="tiny-bert-full", model_id="tiny-bert", spec=spec)
    readings = FakeGpu(steps=[(3 * GIB, 4 * GIB)], end_used=5 * GIB)
    record = probe.measure(case, TINY_CONFIGS["tiny-bert"], base_used=GIB, readings=readings)
    assert "error" not in record, record.get("trace")
    assert (record["max_allocated"], record["max_reserved"]) == (3 * GIB, 4 * GIB)


def test_measure_runs_an_encoder_decoder_with_target_labels() -> None:
    tiny_t5 = {
        "model_type": "t5",
        "d_model": 32,
        "d_kv": 16,
        "d_ff": 64,
        "num_heads": 2,
        "num_layers": 1,
        "vocab_size": 64,
        "feed_forward_proj": "gated-gelu",
        "tie_word_embeddings": False,
        "decoder_start_token_id": 0,
        "pad_token_id": 0,
    }
    spec = TrainingSpec(method=Method.FULL, batch_size=2, seq_len=16, target_length=4)
    case = ProbeCase(name="tiny-t5-full", model_id="tiny-t5", spec=spec)
    readings = FakeGpu(steps=[(3 * GIB, 4 * GIB)], end_used=5 * GIB)
    record = probe.measure(case, tiny_t5, base_used=GIB, readings=readings)
    assert "error" not in record, record.get("trace")
    assert (record["max_allocated"], record["max_reserved"]) == (3 * GIB, 4 * GIB)


def test_an_encoder_decoder_probe_trains_on_target_length_labels() -> None:
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from service.trace.probe.steps import _labels

    model = SimpleNamespace(config=SimpleNamespace(model_type="t5"))
    ids = torch.arange(32).reshape(2, 16)
    spec = TrainingSpec(method=Method.FULL, batch_size=2, seq_len=16, target_length=4)
    assert tuple(_labels(model, ids, spec).shape) == (2, 4)
    no_target = TrainingSpec(method=Method.FULL, batch_size=2, seq_len=16)
    assert tuple(_labels(model, ids, no_target).shape) == (2, 16)
