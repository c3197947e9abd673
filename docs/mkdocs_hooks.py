"""MkDocs hooks: the site's pages beside the repository's own documents.

MkDocs refuses a ``docs_dir`` that is the folder of its config file, and ``docs/`` must keep
its documents where code, tests and other documents link to them. So the site's own pages
live in ``docs/pages/``, and this hook adds the rest at build time: every file directly in
``docs/`` (``contract.md``, ``design.md``, the screenshots, ...) at the site's top, and the
README as the home page, its ``docs/`` links rewritten to the site's paths.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

DOCS = Path(__file__).resolve().parent
README = DOCS.parent / "README.md"

#: The files in ``docs/`` that are not pages: the site's config, its pages and this hook.
NOT_PAGES = {"mkdocs.yml", "mkdocs_hooks.py"}

#: A Markdown link target in the README that points into ``docs/`` (or ``docs/pages/``).
README_LINK = re.compile(r"\]\(docs/(?:pages/)?")


def on_files(files: Files, config: Any) -> Files:
    """Add ``docs/*`` and the README (as ``index.md``) to the pages of ``docs/pages/``."""
    for path in sorted(DOCS.iterdir()):
        if path.is_file() and path.name not in NOT_PAGES:
            files.append(File.generated(config, path.name, abs_src_path=str(path)))
    files.append(File.generated(config, "index.md", abs_src_path=str(README)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """The README's links into ``docs/`` as the site's own: ``docs/contract.md`` is
    ``contract.md`` here, ``docs/pages/tutorial.md`` is ``tutorial.md``."""
    if page.file.src_uri == "index.md":
        return README_LINK.sub("](", markdown)
    return markdown
