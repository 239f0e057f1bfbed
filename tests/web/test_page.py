"""End-to-end: the web page in headless Chromium against the real service on loopback."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from tests.web.conftest import REPO_ROOT
from tests.web.pages import (
    DESKTOP,
    PHONE,
    Driver,
    assert_curves_shown,
    assert_estimate_shown,
    assert_fit_shown,
    assert_placement_shown,
    merged,
)

# The pictures docs/web.md shows; a test run writes them there only when asked
# (VRAMCAST_REFRESH_SCREENSHOTS=1), so a run leaves the checkout as it found it.
SCREENSHOTS = REPO_ROOT / "docs" / "screenshots"
REFRESH_SCREENSHOTS_ENV = "VRAMCAST_REFRESH_SCREENSHOTS"
CATALOG_MODELS = REPO_ROOT / "service" / "catalog" / "models"


def test_a_filled_spec_shows_the_apis_numbers(driver: Driver, api: httpx.Client) -> None:
    d = driver
    d.open()
    d.page.fill("#model-search", "qwen2.5 7b")
    d.page.select_option("#model", "Qwen/Qwen2.5-7B")
    d.page.select_option("#method", "qlora")
    d.page.fill("#lora_r", "16")
    d.page.fill("#lora_alpha", "32")
    d.page.fill("#target_modules", "all-linear")
    d.page.check("#double_quant")
    d.page.fill("#batch_size", "2")
    d.page.fill("#seq_len", "4096")
    d.page.fill("#gradient_accumulation_steps", "8")
    d.page.select_option("#optim", "paged_adamw_8bit")
    d.page.check("#gradient_checkpointing")
    d.page.check("#packing")
    d.page.select_option("#attn_implementation", "flash_attention_2")
    d.page.select_option("#loss", "fused")
    d.check_gpus(["T4", "L4", "A100-40GB"])
    d.price("L4", "0.80")
    d.price("A100-40GB", "1.21")
    d.wait_ready()

    job = {
        "model": "Qwen/Qwen2.5-7B",
        "method": "qlora",
        "dtype": "bf16",
        "optim": "paged_adamw_8bit",
        "batch_size": 2,
        "seq_len": 4096,
        "gradient_accumulation_steps": 8,
        "gradient_checkpointing": True,
        "attn_implementation": "flash_attention_2",
        "loss": "fused",
        "framework": "hf",
        "parallel": {"gpus": 1},
        "packing": True,
        "lora": {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"},
        "quantization": {
            "type": "nf4",
            "double_quant": True,
            "compute_dtype": None,
            "prepare_kbit": True,
        },
    }
    assert d.last_post("/v1/estimates") == job
    catalog_order = [g["name"] for g in api.get("/v1/gpus").json()["gpus"]]
    prices = {"L4": 0.8, "A100-40GB": 1.21}
    offers = [
        {"name": n, "price_per_hour": prices[n]} if n in prices else n
        for n in sorted(("T4", "L4", "A100-40GB"), key=catalog_order.index)
    ]
    assert d.last_post("/v1/fit-checks") == {"job": job, "gpus": offers}

    shown = d.shown()
    assert_estimate_shown(shown, api.post("/v1/estimates", json=job).json())
    fit = api.post("/v1/fit-checks", json={"job": job, "gpus": offers}).json()
    assert fit["cheapest"] is not None
    assert_fit_shown(shown, fit)
    assert_curves_shown(shown, api, job)


def test_a_new_batch_redraws_the_chart_and_the_fit_table(driver: Driver, api: httpx.Client) -> None:
    d = driver
    d.open("?model=meta-llama%2FLlama-3.1-8B&batch_size=2&gpu=RTX4090&gpu=A100-80GB")
    job = d.last_post("/v1/estimates")
    offers = ["RTX4090", "A100-80GB"]
    assert d.last_post("/v1/fit-checks")["gpus"] == offers
    before = d.shown()

    d.page.fill("#batch_size", "8")
    d.wait_ready()

    job = {**job, "batch_size": 8}
    assert d.last_post("/v1/estimates") == job
    shown = d.shown()
    fit = api.post("/v1/fit-checks", json={"job": job, "gpus": offers}).json()
    assert shown["fit"] != before["fit"]
    assert_fit_shown(shown, fit)
    assert_estimate_shown(shown, api.post("/v1/estimates", json=job).json())
    assert_curves_shown(shown, api, job)
    batch = shown["curves"]["batch"]
    assert batch["ownCx"] != before["curves"]["batch"]["ownCx"]
    best = {r["gpu"]["name"]: r["max_batch_size"] for r in fit["results"]}
    assert batch["keys"] == best
    assert batch["marks"] == {gpu: x for gpu, x in best.items() if x > 0}


def test_a_suggested_change_applies_in_one_click(driver: Driver, api: httpx.Client) -> None:
    d = driver
    d.open("?model=meta-llama%2FLlama-3.1-8B&batch_size=4&gpu=RTX4090")
    job = d.last_post("/v1/estimates")
    fit = api.post("/v1/fit-checks", json={"job": job, "gpus": ["RTX4090"]}).json()
    result = fit["results"][0]
    assert not result["fits"] and result["suggestions"]
    first = result["suggestions"][0]

    d.page.click('.suggestion-group[data-gpu="RTX4090"] li.suggestion[data-rank="0"] button')
    d.wait_ready()

    changed = merged(job, first["set"])
    assert d.last_post("/v1/estimates") == changed
    assert d.bytes_of("#peak-safe") == first["required_bytes"]
    row = d.page.locator('#fit-table tbody tr[data-gpu="RTX4090"]')
    assert row.get_attribute("data-fits") == str(first["fits"]).lower()
    for key, value in first["set"].items():
        if isinstance(value, bool):
            assert d.page.is_checked(f"#{key}") is value
        elif isinstance(value, str | int):
            assert d.page.input_value(f"#{key}") == str(value)
    query = urlsplit(d.page.url).query
    for key in first["set"]:
        if key not in ("lora", "quantization", "parallel"):
            assert f"{key}=" in query


def test_a_shared_link_opens_the_same_estimate(
    driver: Driver, open_page: Callable[[str], Driver], service_url: str
) -> None:
    d = driver
    d.open()
    d.page.fill("#model-search", "mistral")
    d.page.select_option("#model", "mistralai/Mistral-7B-v0.3")
    d.page.select_option("#method", "full")
    d.page.fill("#batch_size", "1")
    d.page.fill("#seq_len", "1024")
    d.page.select_option("#optim", "adamw_bnb_8bit")
    d.page.check("#gradient_checkpointing")
    d.check_gpus(["H100-SXM", "L40S"])
    d.price("H100-SXM", "2.49")
    d.wait_ready()
    link = d.page.input_value("#share-link")
    assert link == d.page.url
    fields = [
        "#method",
        "#batch_size",
        "#seq_len",
        "#optim",
        "#loss",
        "#attn_implementation",
        "#gpu_count",
    ]
    values = {f: d.page.input_value(f) for f in fields}
    shown = {s: d.text(s) for s in ("#summary", "#fit-table tbody", "#suggestions")}

    other = open_page(service_url)
    other.page.goto(link)
    other.wait_ready()
    assert other.last_post("/v1/estimates") == d.last_post("/v1/estimates")
    assert other.last_post("/v1/fit-checks") == d.last_post("/v1/fit-checks")
    assert {f: other.page.input_value(f) for f in fields} == values
    assert other.page.input_value("#model") == "mistralai/Mistral-7B-v0.3"
    assert other.page.is_checked("#gradient_checkpointing")
    assert other.page.input_value('.gpu-row:has(input[value="H100-SXM"]) .gpu-price') == "2.49"
    assert {s: other.text(s) for s in shown} == shown


def test_a_pasted_config_and_invalid_input(driver: Driver, api: httpx.Client) -> None:
    d = driver
    d.open("?gpu=")
    config = json.loads((CATALOG_MODELS / "Qwen--Qwen2.5-0.5B.json").read_text())["config"]
    d.page.check('input[name="model_source"][value="config"]')
    d.page.fill("#config", json.dumps(config, indent=2))
    d.wait_ready()
    job = d.last_post("/v1/estimates")
    assert job["model"] == {"hf_config": config}
    assert_estimate_shown(d.shown(), api.post("/v1/estimates", json=job).json())
    assert d.page.locator("#fit-section").is_hidden()

    d.page.fill("#config", "{ not json")
    d.page.wait_for_selector('#results[data-state="error"]')
    assert "not valid JSON" in d.text("#error")
    assert d.page.get_attribute("#config", "aria-invalid") == "true"

    d.page.fill("#config", json.dumps(config))
    d.wait_ready()
    assert d.page.locator("#error").is_hidden()
    d.page.fill("#batch_size", "0")
    d.page.wait_for_selector('#results[data-state="error"]')
    problem = api.post("/v1/estimates", json={**job, "batch_size": 0}).json()
    assert problem["title"] in d.text("#error")
    assert d.page.get_attribute("#batch_size", "aria-invalid") == "true"


CONTRAST_CHECK = """() => {
  const parse = (c) => {
    const p = c.match(/[\\d.]+/g).map(Number);
    return { r: p[0], g: p[1], b: p[2], a: p.length > 3 ? p[3] : 1 };
  };
  const lum = ({ r, g, b }) => {
    const f = (v) => ((v /= 255) <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4);
    return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b);
  };
  const background = (node) => {
    for (let n = node; n; n = n.parentElement) {
      const c = parse(getComputedStyle(n).backgroundColor);
      if (c.a > 0) return c;
    }
    return { r: 255, g: 255, b: 255, a: 1 };
  };
  const failures = [];
  const seen = new Set();
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  while (walker.nextNode()) {
    const node = walker.currentNode.parentElement;
    if (!walker.currentNode.textContent.trim() || seen.has(node)) continue;
    seen.add(node);
    const box = node.getBoundingClientRect();
    const style = getComputedStyle(node);
    if (!box.width || !box.height || style.visibility === "hidden") continue;
    const fg = lum(parse(node.closest("svg") ? style.fill : style.color));
    const bg = lum(background(node.closest("svg") || node));
    const ratio = (Math.max(fg, bg) + 0.05) / (Math.min(fg, bg) + 0.05);
    const size = parseFloat(style.fontSize);
    const large = size >= 24 || (Number(style.fontWeight) >= 700 && size >= 18.66);
    if (ratio < (large ? 3 : 4.5)) {
      failures.push(`${node.textContent.trim().slice(0, 40)}: ${ratio.toFixed(2)}`);
    }
  }
  return failures;
}"""

UNLABELLED = """() => [...document.querySelectorAll("input, select, textarea, button")]
  .filter((c) => c.type !== "hidden")
  .filter((c) => !((c.labels && [...c.labels].some((l) => l.textContent.trim()))
                   || (c.getAttribute("aria-label") || "").trim()
                   || (c.tagName === "BUTTON" && c.textContent.trim())))
  .map((c) => c.id || c.outerHTML.slice(0, 80))"""


def test_labels_keyboard_and_contrast(driver: Driver) -> None:
    d = driver
    d.open("?model=meta-llama%2FLlama-3.1-8B&gpu=RTX4090")
    assert d.page.evaluate(UNLABELLED) == []
    assert d.page.evaluate(CONTRAST_CHECK) == []

    d.page.focus("#model-search")
    d.page.keyboard.type("phi")
    d.page.keyboard.press("Tab")
    assert d.page.evaluate("document.activeElement.id") == "model"
    d.page.keyboard.press("ArrowDown")
    d.wait_ready()
    assert d.last_post("/v1/estimates")["model"].startswith("microsoft/")

    d.page.focus("#gradient_checkpointing")
    d.page.keyboard.press("Space")
    d.wait_ready()
    assert d.last_post("/v1/estimates")["gradient_checkpointing"] is True

    d.page.focus("#batch_size")
    d.page.keyboard.press("Control+A")
    d.page.keyboard.type("64")
    d.wait_ready()
    before = d.last_post("/v1/estimates")
    assert before["batch_size"] == 64
    apply = d.page.locator("li.suggestion button.apply").first
    changes = json.loads(d.page.locator("li.suggestion").first.get_attribute("data-set") or "{}")
    apply.focus()
    d.page.keyboard.press("Enter")
    d.wait_ready()
    assert d.last_post("/v1/estimates") == merged(before, changes)


@pytest.mark.parametrize(("name", "viewport"), [("desktop", DESKTOP), ("phone", PHONE)])
def test_screenshots(driver: Driver, name: str, viewport: dict[str, int], tmp_path: Path) -> None:
    d = driver
    d.page.set_viewport_size(viewport)
    d.open(
        "?model=meta-llama%2FLlama-3.1-8B&batch_size=2"
        "&gpu=RTX4090%400.69&gpu=A100-80GB%401.64&gpu=H100-SXM%402.49"
    )
    width = d.page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
    assert width[0] <= width[1], f"the page scrolls sideways at {viewport['width']} px"
    assert d.page.locator("#fit-table tbody tr.cheapest").count() == 1
    folder = SCREENSHOTS if os.environ.get(REFRESH_SCREENSHOTS_ENV) == "1" else tmp_path
    folder.mkdir(parents=True, exist_ok=True)
    # The link shows the default port, so the pictures do not change with the test's port.
    d.page.evaluate(
        "() => { const link = document.getElementById('share-link');"
        " link.value = link.value.replace(location.host, '127.0.0.1:8000'); }"
    )
    path: Path = folder / f"web-{name}.png"
    d.page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 10_000


def test_at_phone_width_the_results_come_before_the_form(driver: Driver) -> None:
    d = driver
    d.page.set_viewport_size(PHONE)
    d.open("?model=meta-llama%2FLlama-3.1-8B&gpu=RTX4090")
    results = d.page.locator("#results").bounding_box()
    form = d.page.locator("#spec-form").bounding_box()
    assert results is not None and form is not None
    assert results["y"] < form["y"]
    assert d.page.locator("#peak-safe").bounding_box()["y"] < PHONE["height"]  # type: ignore[index]
    # At desktop width the form stays on the left of the results.
    d.page.set_viewport_size(DESKTOP)
    results = d.page.locator("#results").bounding_box()
    form = d.page.locator("#spec-form").bounding_box()
    assert results is not None and form is not None
    assert form["x"] < results["x"]


def test_a_gpu_given_by_memory_is_labelled_as_matched_by_size(
    driver: Driver, api: httpx.Client
) -> None:
    d = driver
    d.open("?model=meta-llama%2FLlama-3.1-8B&gpu=RTX4090")
    d.page.fill("#gpu-memory", "24564")
    d.page.click("#add-gpu-memory")
    d.wait_ready()
    job = d.last_post("/v1/estimates")
    offers = [{"memory_mib": 24564}, "RTX4090"]
    assert d.last_post("/v1/fit-checks") == {"job": job, "gpus": offers}
    fit = api.post("/v1/fit-checks", json={"job": job, "gpus": offers}).json()
    by_size = fit["results"][0]
    assert by_size["gpu"]["matched_by"] == "memory_mib" and by_size["gpu"]["name"] == "RTXA5000"
    shown = d.shown()
    assert_fit_shown(shown, fit)
    labels = [row["label"] for row in shown["fit"]]
    assert labels == ["matched by size: 23.99 GiB → RTX A5000", "RTX4090"]
    # The other catalog GPUs of that size are named on the row.
    title = d.page.locator("#fit-table tbody tr").first.locator("th").get_attribute("title")
    assert title is not None and "RTX4090" in title
    assert "gpu=24564MiB" in urlsplit(d.page.url).query

    # A size no catalog GPU reports, priced, and a link that keeps both.
    d.page.fill("#gpu-memory", "12345")
    d.page.keyboard.press("Enter")
    d.wait_ready()
    d.price("12345MiB", "0.5")
    d.wait_ready()
    posted = d.last_post("/v1/fit-checks")["gpus"]
    assert posted == [
        {"memory_mib": 24564},
        {"memory_mib": 12345, "price_per_hour": 0.5},
        "RTX4090",
    ]
    shown = d.shown()
    assert shown["fit"][1]["label"] == "by size: 12.06 GiB (no catalog GPU of this size)"
    assert "gpu=12345MiB%400.5" in urlsplit(d.page.url).query

    # Unchecking a GPU given by size removes it; a size that is not a number is refused.
    d.page.locator('input.gpu-check[value="24564MiB"]').uncheck()
    d.wait_ready()
    assert d.last_post("/v1/fit-checks")["gpus"][0] == {"memory_mib": 12345, "price_per_hour": 0.5}
    assert "24564MiB" not in urlsplit(d.page.url).query
    d.page.fill("#gpu-memory", "0")
    d.page.click("#add-gpu-memory")
    assert d.page.get_attribute("#gpu-memory", "aria-invalid") == "true"
    assert "whole number of MiB" in d.text("#gpu-memory-hint")


def test_placing_the_job_on_several_gpus_shows_the_fewest_per_gpu_and_strategy(
    driver: Driver, api: httpx.Client
) -> None:
    d = driver
    d.open(
        "?model=meta-llama%2FLlama-3.1-70B&method=full&batch_size=1&seq_len=4096"
        "&gradient_checkpointing=1&gpu=A100-40GB%401.2&gpu=A100-80GB%401.8"
    )
    assert "placement" not in d.last_post("/v1/fit-checks")
    assert d.page.locator("#placement-section").is_hidden()
    assert d.page.locator("#placement-strategies").is_hidden()
    assert d.shown()["placement"] is None

    d.page.fill("#max_gpus", "32")
    d.wait_ready()
    body = d.last_post("/v1/fit-checks")
    assert body["placement"] == {
        "strategies": ["fsdp", "zero3"],
        "max_gpus": 32,
        "gpus_per_node": 8,
    }
    placed = api.post("/v1/fit-checks", json=body).json()["placement"]
    assert placed["cheapest"] is not None
    assert_placement_shown(d.shown(), placed)
    assert "max_gpus=32" in d.page.input_value("#share-link")
    d.page.set_viewport_size(PHONE)
    width = d.page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
    assert width[0] <= width[1], "the placement table scrolls the page sideways on a phone"
    d.page.set_viewport_size(DESKTOP)

    d.page.check('input[name="strategies"][value="ddp"]')
    d.page.uncheck('input[name="strategies"][value="fsdp"]')
    d.page.fill("#gpus_per_node", "4")
    d.wait_ready()
    body = d.last_post("/v1/fit-checks")
    assert body["placement"] == {"strategies": ["ddp", "zero3"], "max_gpus": 32, "gpus_per_node": 4}
    placed = api.post("/v1/fit-checks", json=body).json()["placement"]
    assert any(p["outcome"] == "does_not_fit" for p in placed["placements"])
    assert_placement_shown(d.shown(), placed)

    d.page.fill("#max_gpus", "5000")
    d.page.wait_for_selector('#results[data-state="error"]')
    assert d.page.get_attribute("#max_gpus", "aria-invalid") == "true"
    assert "/placement/max_gpus" in d.text("#error")
    for value in ("ddp", "zero3"):
        d.page.uncheck(f'input[name="strategies"][value="{value}"]')
    d.page.fill("#max_gpus", "16")
    d.page.wait_for_selector('#results[data-state="error"]')
    assert "pick a strategy" in d.text("#error")
    assert d.page.get_attribute("#placement-strategies", "aria-invalid") == "true"
    assert not d.errors


def test_a_sharded_job_sends_its_strategy_and_shows_the_apis_numbers(
    driver: Driver, api: httpx.Client
) -> None:
    d = driver
    d.open("?model=mistralai%2FMistral-7B-v0.1&method=full&batch_size=1&gpu=H100-SXM")
    d.page.fill("#gpu_count", "4")
    d.page.select_option("#strategy", "zero3")
    d.page.select_option("#offload", "optimizer")
    d.wait_ready()

    job = d.last_post("/v1/estimates")
    assert job["parallel"] == {"gpus": 4, "strategy": "zero3", "offload": "optimizer"}
    answer = api.post("/v1/estimates", json=job).json()
    assert answer["host_bytes"] > 0  # the offloaded optimizer state
    assert_estimate_shown(d.shown(), answer)


def test_prompt_tuning_sends_its_virtual_tokens_and_ia3_its_targets(
    driver: Driver, api: httpx.Client
) -> None:
    d = driver
    d.open("?model=Qwen%2FQwen2.5-0.5B&batch_size=2&seq_len=512&gpu=H100-SXM")
    d.page.select_option("#method", "prompt-tuning")
    assert d.page.is_hidden("#lora_r")
    d.page.fill("#num_virtual_tokens", "200")
    d.wait_ready()
    job = d.last_post("/v1/estimates")
    assert job["method"] == "prompt-tuning"
    assert job["prompt_tuning"] == {"num_virtual_tokens": 200}
    assert "lora" not in job
    answer = api.post("/v1/estimates", json=job).json()
    assert_estimate_shown(d.shown(), answer)

    d.page.select_option("#method", "prefix-tuning")
    assert d.page.is_hidden("#lora_r") and d.page.is_visible("#num_virtual_tokens")
    d.wait_ready()
    job = d.last_post("/v1/estimates")
    assert job["method"] == "prefix-tuning"
    assert job["prefix_tuning"] == {"num_virtual_tokens": 200}
    assert "prompt_tuning" not in job and "lora" not in job
    answer = api.post("/v1/estimates", json=job).json()
    assert_estimate_shown(d.shown(), answer)

    d.page.select_option("#method", "ia3")
    assert d.page.is_hidden("#lora_r") and d.page.is_visible("#target_modules")
    d.page.fill("#target_modules", "k_proj, v_proj, down_proj")
    d.wait_ready()
    job = d.last_post("/v1/estimates")
    assert job["ia3"] == {"target_modules": ["k_proj", "v_proj", "down_proj"]}
    assert_estimate_shown(d.shown(), api.post("/v1/estimates", json=job).json())


def test_a_dpo_job_sends_its_objective_and_shows_the_reference_model(
    driver: Driver, api: httpx.Client
) -> None:
    d = driver
    d.open("?model=Qwen%2FQwen2.5-0.5B&method=full&batch_size=2&seq_len=512&gpu=H100-SXM")
    assert d.page.is_hidden("#precompute_ref_log_probs")
    d.page.select_option("#objective", "dpo")
    d.page.fill("#max_completion_length", "256")
    d.wait_ready()
    job = d.last_post("/v1/estimates")
    assert job["objective"] == "dpo"
    assert job["dpo"] == {"precompute_ref_log_probs": False, "max_completion_length": 256}
    answer = api.post("/v1/estimates", json=job).json()
    assert answer["components"]["reference_model"] > 0  # full fine-tuning's frozen copy
    assert_estimate_shown(d.shown(), answer)
    assert "Reference model (DPO)" in d.page.inner_text("body")

    d.page.check("#precompute_ref_log_probs")
    d.wait_ready()
    job = d.last_post("/v1/estimates")
    assert job["dpo"]["precompute_ref_log_probs"] is True
    answer = api.post("/v1/estimates", json=job).json()
    assert "reference_model" not in answer["components"]
    assert_estimate_shown(d.shown(), answer)


@pytest.mark.parametrize("objective", ["reward", "orpo"])
def test_a_pairs_objective_job_sends_its_objective(
    driver: Driver, api: httpx.Client, objective: str
) -> None:
    """A reward model (no LM head) and ORPO (the whole logits, no reference model): each
    objective's hint shown alone, the objective sent without DPO's settings."""
    d = driver
    hint, other = f"#{objective}-hint", "#orpo-hint" if objective == "reward" else "#reward-hint"
    d.open("?model=Qwen%2FQwen2.5-0.5B&method=lora&batch_size=2&seq_len=512&gpu=H100-SXM")
    assert d.page.is_hidden(hint)
    d.page.select_option("#objective", objective)
    d.wait_ready()
    assert d.page.is_visible(hint) and d.page.is_hidden(other)
    assert d.page.is_hidden("#max_completion_length")
    job = d.last_post("/v1/estimates")
    assert job["objective"] == objective and "dpo" not in job
    answer = api.post("/v1/estimates", json=job).json()
    logits = answer["components"].get("logits_loss", 0)
    assert (logits > 0) if objective == "orpo" else not logits
    assert "reference_model" not in answer["components"]
    assert_estimate_shown(d.shown(), answer)


def test_a_gptq_base_sends_its_bits_and_group_size(driver: Driver, api: httpx.Client) -> None:
    d = driver
    d.open("?model=Qwen%2FQwen2.5-0.5B&batch_size=2&seq_len=512&gpu=H100-SXM&dtype=fp16")
    d.page.select_option("#method", "qlora")
    d.page.select_option("#quant_type", "gptq")
    d.page.fill("#quant_bits", "3")
    d.page.fill("#group_size", "64")
    d.wait_ready()
    job = d.last_post("/v1/estimates")
    assert job["quantization"] == {
        "type": "gptq",
        "prepare_kbit": True,
        "bits": 3,
        "group_size": 64,
    }
    answer = api.post("/v1/estimates", json=job).json()
    assert any("GPTQ base (3-bit, group 64)" in a for a in answer["assumptions"])
    assert_estimate_shown(d.shown(), answer)


def test_a_liger_job_sends_the_option_and_its_fused_loss(driver: Driver, api: httpx.Client) -> None:
    """The Liger Kernel box sends liger_kernel (and no loss of its own: Liger brings its
    fused one), and the page shows the API's smaller answer."""
    d = driver
    d.open("?model=Qwen%2FQwen2.5-0.5B&method=lora&batch_size=2&seq_len=512&gpu=H100-SXM")
    d.wait_ready()
    plain = d.last_post("/v1/estimates")
    assert "liger_kernel" not in plain
    d.page.select_option("#loss", "hf")
    d.page.check("#liger_kernel")
    d.wait_ready()
    job = d.last_post("/v1/estimates")
    assert job["liger_kernel"] is True and job["loss"] is None
    answer = api.post("/v1/estimates", json=job).json()
    assert (
        "logits_loss" not in answer["components"]
        or answer["components"]["logits_loss"]
        < (api.post("/v1/estimates", json=plain).json()["components"]["logits_loss"])
    )
    assert_estimate_shown(d.shown(), answer)
