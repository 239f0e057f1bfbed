"""`vramcast fit --format`: the resource request of each scheduler, from the real service on
loopback; docs/schedulers.md shows each format's output, kept in step by these tests.

Run `python -m tests.cli.test_fit_formats` to rewrite the outputs in the docs.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from service.cli.main import main
from service.cli.schedulers import K8S_GPU_MEMORY_LABEL, K8S_GPU_RESOURCE
from service.cli.server import EXIT_DOES_NOT_FIT, EXIT_FITS
from service.core.fit import DRIVER_RESERVED_BYTES
from service.core.units import GIB, MIB

DOC = Path(__file__).resolve().parents[2] / "docs" / "schedulers.md"
# A ```console block whose first line is a `vramcast fit ... --format` command; the rest of
# the block is what it prints.
BLOCK = re.compile(r"```console\n\$ (vramcast fit [^\n]*--format[^\n]*)\n(.*?)```", re.S)
JOB = ["Qwen/Qwen2.5-7B", "--method", "qlora", "-b", "4", "-s", "4096", "--gradient-checkpointing"]
SITE = ["--gpu", "L4", "--gpu", "L40S", "--gpu", "A100-80GB", "--gpu", "H100-SXM"]


def run_cli(argv: list[str], url: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([*argv, "--url", url])
    return code, out.getvalue(), err.getvalue()


def fit(url: str, *argv: str) -> tuple[int, str]:
    code, out, err = run_cli(["fit", *argv], url)
    assert code in (EXIT_FITS, EXIT_DOES_NOT_FIT), err
    return code, out


def request_json(url: str, *argv: str) -> dict[str, Any]:
    _code, out = fit(url, *argv, "--format", "json")
    document: dict[str, Any] = json.loads(out)
    return document


def test_json_is_the_safe_bound_plus_the_driver_reserve(live_url: str) -> None:
    _code, out = fit(live_url, *JOB, "--gpu", "L4", "--gpu", "A100-80GB", "--json")
    answer = json.loads(out)
    request = request_json(live_url, *JOB, "--gpu", "L4", "--gpu", "A100-80GB")
    bound = max(r["required_bytes"] for r in answer["results"])
    assert bound == answer["job"]["peak"]["device_bytes_upper"]
    assert request["required_bytes"] == bound
    assert request["driver_reserved_bytes"] == DRIVER_RESERVED_BYTES
    assert request["memory_bytes"] == bound + DRIVER_RESERVED_BYTES
    assert request["memory_mib"] == -(-request["memory_bytes"] // MIB)
    assert request["fits"] == [r["gpu"]["name"] for r in answer["results"] if r["fits"]]
    assert request["count"] == 1


def test_without_gpus_the_whole_catalog_is_checked(live_url: str) -> None:
    from service.catalog.gpus import default_gpu_catalog

    request = request_json(live_url, *JOB)
    least = request["memory_mib"]
    by_memory = [g.name for g in default_gpu_catalog().gpus() if g.memory_mib >= least]
    assert request["fits"] == by_memory
    code, _ = fit(
        live_url,
        "Qwen/Qwen2.5-7B",
        "--method",
        "full",
        "-b",
        "64",
        "-s",
        "8192",
        "--format",
        "json",
    )
    assert code == EXIT_DOES_NOT_FIT


def _k8s_pod_spec(text: str) -> dict[str, Any]:
    """The printed YAML, checked against the Kubernetes API's PodSpec model: every field is
    known (what the model drops on reading would be missing on writing) and well typed."""
    from kubernetes.client import ApiClient, V1PodSpec

    document = yaml.safe_load(text)
    spec = V1PodSpec.from_dict(document)  # raises on a missing or mistyped field
    assert ApiClient().sanitize_for_serialization(spec) == document  # none unknown
    assert isinstance(document, dict)
    return document


def test_k8s_is_a_pod_spec_with_a_gpu_memory_rule(live_url: str) -> None:
    request = request_json(live_url, *JOB, "--count", "2")
    _, out = fit(live_url, *JOB, "--count", "2", "--format", "k8s")
    spec = _k8s_pod_spec(out)
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    [expression] = terms["nodeSelectorTerms"][0]["matchExpressions"]
    assert expression == {
        "key": K8S_GPU_MEMORY_LABEL,
        "operator": "Gt",
        "values": [str(request["memory_mib"] - 1)],
    }
    assert spec["containers"][0]["resources"]["limits"] == {K8S_GPU_RESOURCE: "2"}


def test_slurm_asks_for_the_gpus_and_the_types_that_fit(live_url: str) -> None:
    request = request_json(live_url, *JOB, *SITE)
    _, out = fit(live_url, *JOB, *SITE, "--format", "slurm")
    directives = [line for line in out.splitlines() if not line.startswith("# ")]
    # sbatch reads `#SBATCH <option>` lines; each option as `--name=value`.
    assert all(re.fullmatch(r"#SBATCH --[a-z-]+=\S+", line) for line in directives), out
    options = dict(line.removeprefix("#SBATCH --").split("=", 1) for line in directives)
    assert options["gres"] == "gpu:1"
    assert options["constraint"].split("|") == request["fits"]
    assert "L4" not in request["fits"] and "H100-SXM" in request["fits"]
    _, wide = fit(live_url, *JOB, *SITE, "--count", "16", "--format", "slurm")
    assert "#SBATCH --gpus=16" in wide.splitlines()


def test_skypilot_lists_the_accelerators_that_fit(live_url: str) -> None:
    small = ["Qwen/Qwen2.5-7B", "--method", "qlora", "-b", "1", "-s", "1024", "--count", "2"]
    assert request_json(live_url, *small, *SITE)["fits"] == ["L40S", "A100-80GB", "H100-SXM"]
    _, out = fit(live_url, *small, *SITE, "--format", "skypilot")
    document = yaml.safe_load(out)
    assert list(document) == ["resources"]
    # SkyPilot's names: the SXM H100 is plain H100; a set of accelerators is "any of these".
    assert document["resources"]["accelerators"] == {"L40S": 2, "A100-80GB": 2, "H100": 2}


def test_dstack_gives_names_a_memory_range_and_a_count(live_url: str) -> None:
    request = request_json(live_url, *JOB, *SITE)
    _, out = fit(live_url, *JOB, *SITE, "--format", "dstack")
    gpu = yaml.safe_load(out)["resources"]["gpu"]
    assert request["fits"] == ["A100-80GB", "H100-SXM"]
    assert gpu["name"] == ["A100", "H100"]  # dstack's names: the memory is a filter of its own
    low, high = gpu["memory"].split("..")
    assert high == "" and low == f"{-(-request['memory_bytes'] // GIB)}GB"
    assert int(low.removesuffix("GB")) * GIB >= request["memory_bytes"]
    assert gpu["count"] == 1


def test_json_and_format_together_are_refused(live_url: str) -> None:
    code, _out, err = run_cli(["fit", *JOB, "--json", "--format", "k8s"], live_url)
    assert code == 2
    assert "--json: give --json or --format, not both" in err


def test_a_config_model_is_named_by_its_file(live_url: str, tmp_path: Path) -> None:
    from service.catalog.models import default_catalog

    config = tmp_path / "config.json"
    entry = default_catalog().resolve("Qwen/Qwen2.5-0.5B")
    config.write_text(json.dumps(entry.config, default=dict))
    request = request_json(live_url, "--config", str(config), "-b", "2", "-s", "512", *SITE)
    assert request["model"] == str(config)
    assert request["fits"] == ["L4", "L40S", "A100-80GB", "H100-SXM"]


# -- the docs ------------------------------------------------------------------------------


def doc_blocks() -> Iterator[tuple[str, str]]:
    for match in BLOCK.finditer(DOC.read_text()):
        yield match.group(1), match.group(2)


def output_of(command: str, url: str) -> str:
    code, out, err = run_cli(shlex.split(command)[1:], url)
    assert code in (EXIT_FITS, EXIT_DOES_NOT_FIT), err
    return out


def test_docs_show_every_format() -> None:
    shown = {shlex.split(command)[-1] for command, _ in doc_blocks()}
    assert shown == {"k8s", "slurm", "skypilot", "dstack", "json"}


def test_docs_show_the_real_output(live_url: str) -> None:
    for command, printed in doc_blocks():
        assert printed == output_of(command, live_url), (
            f"docs/schedulers.md is out of date for `{command}`: "
            "run python -m tests.cli.test_fit_formats"
        )


def _rewrite_docs() -> None:
    """Run each documented command against a service on loopback; write what it prints."""
    from tests.cli.conftest import serving

    with serving() as url:
        text = DOC.read_text()
        text = BLOCK.sub(
            lambda m: f"```console\n$ {m.group(1)}\n{output_of(m.group(1), url)}```", text
        )
        DOC.write_text(text)


if __name__ == "__main__":
    _rewrite_docs()
    sys.exit(0)
