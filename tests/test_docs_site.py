"""The documentation site (``docs/mkdocs.yml``) builds with ``mkdocs build --strict``.

Strict turns every warning into a failure: a link to a page or an anchor that does not exist, a
nav entry without its file, a docstring mkdocstrings cannot render. So the README's test
command, which CI runs, builds the site the way a release would, and the site cannot rot
quietly while the documents it is built from change.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
CONFIG = DOCS / "mkdocs.yml"
README = REPO / "README.md"


def _build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        cwd=config.parent,
        capture_output=True,
        text=True,
        timeout=150,
        # Material's banner about MkDocs 2.0, printed on every build, says nothing about ours.
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )


def _nav_pages(nav: list[Any]) -> list[str]:
    """The Markdown files the nav names, depth first."""
    pages: list[str] = []
    for item in nav:
        for value in item.values() if isinstance(item, dict) else [item]:
            pages.extend(_nav_pages(value) if isinstance(value, list) else [value])
    return pages


def _built_path(page: str) -> str:
    """Where MkDocs writes a page with directory URLs: ``x.md`` -> ``x/index.html``."""
    return "index.html" if page == "index.md" else page.removesuffix(".md") + "/index.html"


def _nav() -> list[str]:
    return _nav_pages(yaml.safe_load(CONFIG.read_text(encoding="utf-8"))["nav"])


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    built = _build(CONFIG, out)
    assert built.returncode == 0, built.stdout + built.stderr
    return out


def test_the_site_builds_strict_with_every_nav_page(site: Path) -> None:
    missing = [page for page in _nav() if not (site / _built_path(page)).is_file()]
    assert missing == []
    # The home page is the README, its links into docs/ rewritten to the site's.
    home = (site / "index.html").read_text(encoding="utf-8")
    assert "celery-ledger demo" in home and 'href="contract/"' in home


def test_the_api_reference_is_rendered_from_the_docstrings(site: Path) -> None:
    api = (site / "api" / "index.html").read_text(encoding="utf-8")
    for name in (
        "celery_ledger.LedgerTask.step",
        "celery_ledger.create_app",
        "celery_ledger.Reconciled",
        "celery_ledger.KeyConflict",
        "celery_ledger.LedgerSettings",
        "celery_ledger.ledger.LedgerStore.claim",
    ):
        assert f'id="{name}"' in api, name


def test_every_document_and_page_is_in_the_nav() -> None:
    """A page MkDocs builds but the nav leaves out is only an INFO line under --strict."""
    nav = set(_nav())
    written = {p.name for p in (DOCS / "pages").glob("*.md")}
    written |= {p.name for p in DOCS.glob("*.md")}
    assert written - nav == set()


def test_the_readme_is_a_landing_page() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) < 150
    assert "pip install -e . && celery-ledger demo" in text
    assert 'pip install -e ".[dev]" && python -m pytest -n 3 --dist loadgroup' in text


@pytest.mark.parametrize(
    ("where", "planted"),
    [
        ("README.md", "\nSee [the missing page](docs/pages/nowhere.md).\n"),
        ("docs/contract.md", "\nSee [a missing section](design.md#no-such-heading).\n"),
        ("docs/pages/steps.md", "\nSee [the missing document](../nowhere.md).\n"),
    ],
)
def test_a_broken_link_fails_the_build(tmp_path: Path, where: str, planted: str) -> None:
    shutil.copytree(DOCS, tmp_path / "docs", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(README, tmp_path / "README.md")
    with (tmp_path / where).open("a", encoding="utf-8") as f:
        f.write(planted)
    built = _build(tmp_path / "docs" / "mkdocs.yml", tmp_path / "site")
    assert built.returncode != 0
    assert "nowhere.md" in built.stderr or "no-such-heading" in built.stderr, built.stderr
