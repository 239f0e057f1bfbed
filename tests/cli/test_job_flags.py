"""The job's flags come from the job schema: a field gets its flag, type, choices and help
from JobSpec's JSON schema, and a field the schema gains gets a flag with no other change."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

import pytest

from service.api.schemas.jobs import JobSpec
from service.cli import job_flags
from service.cli.main import build_parser
from service.cli.options import add_spec_options, spec_from_args


@pytest.fixture
def fresh_flags() -> Iterator[None]:
    job_flags.job_flags.cache_clear()
    job_flags.field_options.cache_clear()
    yield
    job_flags.job_flags.cache_clear()
    job_flags.field_options.cache_clear()


def _options() -> dict[str, argparse.Action]:
    """The job options, by option string."""
    parser = argparse.ArgumentParser()
    add_spec_options(parser)
    return {option: action for action in parser._actions for option in action.option_strings}


def test_every_plain_field_of_the_job_has_its_flag() -> None:
    schema = JobSpec.model_json_schema()
    options = _options()
    plain = {"boolean", "integer", "number", "string"}
    checked = []
    for field, node in schema["properties"].items():
        alternatives = [
            schema["$defs"][o["$ref"].rsplit("/", 1)[-1]] if "$ref" in o else o
            for o in node.get("anyOf", [node])
            if o.get("type") != "null"
        ]
        kinds = {o.get("type") for o in alternatives}
        if field in job_flags.TAKEN_ELSEWHERE or len(alternatives) != 1 or not kinds <= plain:
            continue
        negated = node.get("type") == "boolean" and node.get("default") is True
        option = ("--no-" if negated else "--") + field.replace("_", "-")
        assert option in options, field
        assert node["description"].replace("%", "%%") in (options[option].help or ""), field
        checked.append(field)
    assert len(checked) >= 20 and "torch_compile" in checked and "sdpa_kernel" in checked


def test_a_flag_takes_the_schemas_choices_and_bounds_its_values() -> None:
    options = _options()
    schema = JobSpec.model_json_schema()
    assert list(options["--sdpa-kernel"].choices or ()) == schema["$defs"]["SdpaKernel"]["enum"]
    assert options["--quant"].choices == schema["$defs"]["QuantType"]["enum"]
    assert options["--gpus"].type is int and options["--max-grad-norm"].type is float


def test_a_field_the_schema_gains_gets_a_flag(
    fresh_flags: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    schema = JobSpec.model_json_schema()
    schema["properties"]["sparse_gradients"] = {
        "default": False,
        "description": "Gradients kept sparse.",
        "type": "boolean",
    }
    parallel: dict[str, Any] = schema["$defs"]["ParallelIn"]["properties"]
    parallel["ring_size"] = {"default": 4, "description": "Ranks per ring.", "type": "integer"}
    monkeypatch.setattr(job_flags, "_job_schema", lambda: schema)
    parser = argparse.ArgumentParser()
    add_spec_options(parser)
    args = parser.parse_args(["-b", "2", "-s", "512", "--sparse-gradients", "--ring-size", "8"])
    given = job_flags.given_fields(args)
    assert given["sparse_gradients"] is True and given["parallel"] == {"ring_size": 8}
    assert "Ranks per ring. (default 4)" in parser.format_help()


def test_a_shared_flag_sets_the_field_of_the_objective_given() -> None:
    parse = build_parser().parse_args
    job = ["estimate", "Qwen/Qwen2.5-0.5B", "-b", "2", "-s", "512"]
    dpo = spec_from_args(parse([*job, "--objective", "dpo", "--max-completion-length", "64"]))
    assert dpo.dpo is not None and dpo.dpo.max_completion_length == 64
    grpo_flags = ["--objective", "grpo", "--max-completion-length", "64", "--num-generations", "2"]
    grpo = spec_from_args(parse([*job, *grpo_flags]))
    assert grpo.grpo is not None and grpo.grpo.max_completion_length == 64 and grpo.dpo is None
    kto = spec_from_args(parse([*job, "--objective", "kto", "--precompute-ref-log-probs"]))
    assert kto.kto is not None and kto.kto.precompute_ref_log_probs and kto.dpo is None
