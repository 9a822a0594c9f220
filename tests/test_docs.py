"""The documentation site (``make docs``): it builds strictly and documents every public name."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import sgrld

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from mkdocs_reference import public_names  # noqa: E402


def test_the_site_builds_strictly_and_documents_every_public_name(tmp_path: Path) -> None:
    """``mkdocs build --strict``: a broken link, a missing reference or an unreadable docstring
    fails it; the API reference then holds every name of ``sgrld.__all__`` under its own
    heading, whoever added it (the page is generated from ``__all__``)."""
    pytest.importorskip("mkdocstrings", reason="the docs extra: pip install -e '.[docs]'")
    site = tmp_path / "site"
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert build.returncode == 0, build.stderr[-3000:]
    html = (site / "reference" / "index.html").read_text(encoding="utf-8")
    headings = {
        anchor: re.sub(r"<[^>]+>|&para;", "", text).split()[0]
        for anchor, text in re.findall(r'<h2 id="([^"]+)"[^>]*>(.*?)</h2>', html, re.S)
    }
    names = dict(public_names())
    assert set(names) == set(sgrld.__all__)
    missing = [n for n, path in names.items() if headings.get(path) != f"sgrld.{n}"]
    assert not missing, f"not in the API reference: {missing}"
    for page in ("getting-started", "usage", "chains", "cli"):
        assert (site / page / "index.html").is_file()


def test_the_readme_links_to_pages_that_exist() -> None:
    """The landing page is outside the site's strict build: its links are checked here."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", readme)
    assert targets, "the README links to the guides"
    assert not [t for t in targets if not (REPO / t).is_file()]
