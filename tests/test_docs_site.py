"""The manual (mkdocs.yml, docs/) builds with MkDocs in strict mode: every page in the nav, every
link and anchor found, no warning."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAV_PAGE = re.compile(r"^\s*- (?:[^:\n]+: )?(\S+)\.md\s*$", re.M)
# A strict build of the whole manual takes about a second; this leaves room for a slow machine.
BUILD_TIMEOUT_S = 300
# Material's notice about its successor, printed on every build; it says nothing of the manual.
QUIET = {"NO_MKDOCS_2_WARNING": "1"}


def test_the_manual_builds_strictly(tmp_path: Path) -> None:
    site = tmp_path / "site"
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet"]
    built = subprocess.run(
        [*command, "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(site)],
        cwd=ROOT,
        env={**os.environ, **QUIET},
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        check=False,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    assert "WARNING" not in built.stdout + built.stderr, built.stdout + built.stderr

    nav = NAV_PAGE.findall((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    on_disk = {page.stem for page in (ROOT / "docs").glob("*.md")}
    assert set(nav) == on_disk, "every docs/*.md page is in mkdocs.yml's nav, and only those"
    for page in nav:
        built_page = site / "index.html" if page == "index" else site / page / "index.html"
        assert built_page.is_file(), page
    settings = (site / "settings" / "index.html").read_text(encoding="utf-8")
    assert "VRAMCAST_MANUAL_DIR" in settings
    assert "vramcast estimate" in (site / "cli" / "index.html").read_text(encoding="utf-8")
    assert (site / "search" / "search_index.json").is_file()
