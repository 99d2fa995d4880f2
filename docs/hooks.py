"""MkDocs hook: the site's home page is the README (one source), with its links to
``docs/...`` pages made relative to the site."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def on_page_read_source(page, config):  # noqa: ARG001 (MkDocs' hook signature)
    if page.file.src_uri != "index.md":
        return None
    text = README.read_text(encoding="utf-8")
    return re.sub(r"\]\(docs/", "](", text)
