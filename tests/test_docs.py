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

from mkdocs_reference import EXAMPLES, examples, more_names, public_names  # noqa: E402

#: a raw Sphinx role as the site would show it (scripts/griffe_roles.py turns them into links)
RAW_ROLE = re.compile(r":(?:class|func|meth|attr|mod|data|exc|obj|const):(?:<code>|`)")
#: examples over a few seconds (the sampler's first compile, a tuning search): make test-slow
SLOW_EXAMPLES = {"chains.py", "tune.py"}


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
    missing += [n for n, path in more_names() if headings.get(path) != n]
    assert not missing, f"not in the API reference: {missing}"
    assert html.count('class="doc-signature') >= len(headings), "a name without its signature"
    raw = {p.name: RAW_ROLE.findall(p.read_text("utf-8")) for p in site.rglob("*.html")}
    assert not {page: found for page, found in raw.items() if found}, "raw Sphinx roles shown"
    for page in ("getting-started", "usage", "chains", "cli"):
        assert (site / page / "index.html").is_file()


def test_the_readme_links_to_pages_that_exist() -> None:
    """The landing page is outside the site's strict build: its links are checked here."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", readme)
    assert targets, "the README links to the guides"
    assert not [t for t in targets if not (REPO / t).is_file()]


def test_every_name_in_the_reference_has_an_example() -> None:
    """An example of ``examples/api/`` names it on its first line, or its docstring has one."""
    import importlib

    found = examples()
    lacking = []
    for public, _ in [(f"sgrld.{n}", p) for n, p in public_names()] + more_names():
        module, _, name = public.rpartition(".")
        doc = getattr(importlib.import_module(module), name).__doc__ or ""
        if public not in found and "Example" not in doc:
            lacking.append(public)
    assert not lacking, f"no example in examples/api/ nor in the docstring: {lacking}"


@pytest.mark.parametrize(
    "example",
    [
        pytest.param(p.name, marks=pytest.mark.slow) if p.name in SLOW_EXAMPLES else p.name
        for p in sorted(EXAMPLES.glob("*.py"))
    ],
)
def test_the_reference_examples_run(
    example: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each example of the API reference runs as shown (warnings are errors here)."""
    import runpy

    monkeypatch.chdir(tmp_path)
    runpy.run_path(str(EXAMPLES / example), run_name="__main__")
