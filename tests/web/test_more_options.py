"""The page's More options: the job fields the form does not lay out, generated from the
API's schema (/openapi.json's JobSpec), sent only when set, and kept in the share link."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import httpx

from tests.web.conftest import REPO_ROOT
from tests.web.pages import Driver

SCRIPT = REPO_ROOT / "service" / "web" / "static" / "app.js"


def _hand_laid() -> list[str]:
    """The fields the form lays out by hand, as app.js lists them."""
    found = re.search(r"const HAND_LAID = new Set\(\[(.*?)\]\);", SCRIPT.read_text(), re.S)
    assert found is not None
    return re.findall(r'"([^"]+)"', found.group(1))


def _job_schema(document: dict[str, Any]) -> dict[str, Any]:
    job: dict[str, Any] = document["components"]["schemas"]["JobSpec"]
    return job


def _flags(api: httpx.Client) -> set[str]:
    """The job's top-level true/false fields in the served schema, but the form's own."""
    job = _job_schema(api.get("/openapi.json").json())
    return {
        name
        for name, node in job["properties"].items()
        if node.get("type") == "boolean" and name not in _hand_laid()
    }


def test_the_hand_laid_fields_are_fields_of_the_job() -> None:
    """Each field app.js keeps out of More options is one of the schema's (or a section's)."""
    document = json.loads((REPO_ROOT / "openapi" / "openapi.json").read_text())
    schemas = document["components"]["schemas"]
    properties = _job_schema(document)["properties"]
    for path in _hand_laid():
        section, _, field = path.rpartition(".")
        if not section:
            assert field in properties, path
            continue
        refs = [o.get("$ref", "") for o in properties[section].get("anyOf", [properties[section]])]
        objects = [schemas[r.rsplit("/", 1)[-1]] for r in refs if r]
        assert any(field in o.get("properties", {}) for o in objects), path


def test_every_other_flag_of_the_schema_is_offered(driver: Driver, api: httpx.Client) -> None:
    d = driver
    d.open("?model=Qwen%2FQwen2.5-0.5B&batch_size=2&seq_len=512&gpu=H100-SXM")
    assert d.page.is_visible("#more-options")
    assert d.page.locator("#more-options").get_attribute("open") is None
    offered = d.page.locator("#more-fields input[type=checkbox]").evaluate_all(
        "boxes => boxes.map((b) => b.name)"
    )
    assert _flags(api) <= set(offered)
    assert "torch_compile" in offered and "parallel.use_orig_params" in offered
    job = d.last_post("/v1/estimates")
    assert "torch_compile" not in job and job["parallel"] == {"gpus": 1}


def test_more_options_are_sent_and_kept_in_the_link(
    driver: Driver, open_page: Callable[[str], Driver], service_url: str
) -> None:
    d = driver
    d.open("?model=Qwen%2FQwen2.5-0.5B&batch_size=2&seq_len=512&gpu=H100-SXM")
    d.page.click("#more-options > summary")
    d.page.check("#more-torch_compile")
    d.wait_ready()
    d.page.fill("#more-max_grad_norm", "0.5")
    d.wait_ready()
    d.page.fill("#more-parallel-bucket_cap_mb", "50")
    d.wait_ready()
    d.page.uncheck("#more-parallel-use_orig_params")
    d.wait_ready()
    job = d.last_post("/v1/estimates")
    assert job["torch_compile"] is True and job["max_grad_norm"] == 0.5
    assert job["parallel"] == {"gpus": 1, "bucket_cap_mb": 50, "use_orig_params": False}
    link = d.page.input_value("#share-link")
    assert "torch_compile=1" in link and "parallel.bucket_cap_mb=50" in link

    other = open_page(service_url)
    other.page.goto(link)
    other.wait_ready()
    assert other.last_post("/v1/estimates") == job
    assert other.page.locator("#more-options").get_attribute("open") is not None
    assert other.page.is_checked("#more-torch_compile")
    assert not other.page.is_checked("#more-parallel-use_orig_params")
    assert other.page.input_value("#more-parallel-bucket_cap_mb") == "50"

    # Back to its default, a field leaves the request and the link.
    d.page.uncheck("#more-torch_compile")
    d.wait_ready()
    assert "torch_compile" not in d.last_post("/v1/estimates")
    assert "torch_compile" not in d.page.input_value("#share-link")
