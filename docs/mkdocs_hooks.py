"""MkDocs hooks: the site's pages beside the repository's own documents.

MkDocs refuses a ``docs_dir`` that is the folder of its config file, and ``docs/`` must keep
its documents where code, tests and other documents link to them. So the pages written for the
site live in ``docs/pages/`` (the ``docs_dir``), and this hook adds the rest at build time:
every file directly in ``docs/`` (``contract.md``, ``design.md``, the screenshots, ...) at the
site's top, and the README as the home page.

On the site all of them sit in one folder, while in the repository they sit in three. Each
file's links are written to work where it lives in the repository (so they work on a forge
and in an editor), and ``on_page_markdown`` rewrites them to the site's one folder.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

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
