"""MkDocs hooks: the site's pages beside the repository's own documents.

MkDocs refuses a ``docs_dir`` that is the folder of its config file, and ``docs/`` must keep
its documents where code, tests and other documents link to them. So the pages written for the
site live in ``docs/pages/`` (the ``docs_dir``), and this hook adds the rest at build time:
every file directly in ``docs/`` (``contract.md``, ``design.md``, the screenshots, ...) at the
site's top, and the README as the home page.

On the site all of them sit in one folder, while in the repository they sit in three. Each
file's links are written to work where it lives in the repository (so they work on a forge
and in an editor), and ``on_page_markdown`` rewrites them to the site's one folder.

The API reference reads the installed ``celery_ledger``. mkdocstrings (griffe) finds a package
by its folder's name, and ours has none of that name: ``celery_ledger`` is ``worker/``, and its
subpackages ``ledger/`` and ``recovery/`` sit beside it, not in it. A strict editable install
links them into one ``celery_ledger`` folder; the plain ``pip install -e`` that CI runs does not,
and griffe then cannot resolve ``celery_ledger.recovery``. So ``on_config`` links the folders
Python imports the package from into one ``celery_ledger`` folder, whatever the install, and
gives it to mkdocstrings as its search path.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

DOCS = Path(__file__).resolve().parent
README = DOCS.parent / "README.md"

#: The files in ``docs/`` that are not the site's: its config and this hook.
NOT_PAGES = {"mkdocs.yml", "mkdocs_hooks.py"}

#: What a link target starts with in the repository, per origin, that the site drops: the
#: README links to ``docs/X.md`` and ``docs/pages/X.md``, a document in ``docs/`` to
#: ``pages/X.md``, a page in ``docs/pages/`` to ``../X.md``.
README_LINK = re.compile(r"\]\(docs/(?:pages/)?")
DOCUMENT_LINK = re.compile(r"\]\(pages/")
PAGE_LINK = re.compile(r"\]\(\.\./")

PACKAGE = "celery_ledger"
#: The subpackages that ``pyproject.toml``'s ``package-dir`` maps outside ``worker/``.
OUTSIDE = ("ledger", "recovery")

#: The folders ``on_config`` made, removed by ``on_shutdown``.
_TREES: list[Path] = []


def _location(name: str) -> Path:
    """The folder Python imports the package ``name`` from."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"{name} is not installed: pip install -e '.[dev]' first")
    return Path(next(iter(spec.submodule_search_locations)))


def _package_tree() -> Path:
    """A folder holding ``celery_ledger/``: the installed package's files and subpackages,
    linked, with ``ledger/`` and ``recovery/`` inside it."""
    root = Path(tempfile.mkdtemp(prefix="celery-ledger-docs-"))
    _TREES.append(root)
    tree = root / PACKAGE
    tree.mkdir()
    for entry in _location(PACKAGE).iterdir():
        (tree / entry.name).symlink_to(entry)
    for name in OUTSIDE:
        if not (tree / name).exists():
            (tree / name).symlink_to(_location(f"{PACKAGE}.{name}"))
    return root


@event_priority(100)  # before mkdocstrings reads its handler's configuration
def on_config(config: MkDocsConfig) -> MkDocsConfig:
    """Search ``celery_ledger`` in a folder of that name (see the module's docstring)."""
    handlers = config.plugins["mkdocstrings"].config.handlers
    handlers.setdefault("python", {})["paths"] = [str(_package_tree())]
    return config


def on_shutdown() -> None:
    while _TREES:
        shutil.rmtree(_TREES.pop(), ignore_errors=True)


def on_files(files: Files, config: Any) -> Files:
    """Add ``docs/*`` and the README (as ``index.md``) to the pages of ``docs/pages/``."""
    for path in sorted(DOCS.iterdir()):
        if path.is_file() and path.name not in NOT_PAGES:
            files.append(File.generated(config, path.name, abs_src_path=str(path)))
    files.append(File.generated(config, "index.md", abs_src_path=str(README)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """The page's repository links as the site's: ``docs/contract.md`` in the README,
    ``pages/tutorial.md`` in a document and ``../contract.md`` in a page are all the site's
    ``contract.md`` and ``tutorial.md``."""
    source = Path(page.file.abs_src_path)
    if source == README:
        return README_LINK.sub("](", markdown)
    if source.parent == DOCS:
        return DOCUMENT_LINK.sub("](", markdown)
    return PAGE_LINK.sub("](", markdown)
