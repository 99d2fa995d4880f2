"""MkDocs hooks: the site's home page is the README, with its links to ``docs/...`` pages
made relative to the site; the benchmarks page shows the plot the benchmark writes
(``benchmarks/results/``): one source for each, no copy under ``docs/``; and a reference
marker (``<!-- reference: metricsvc.x.Y -->``, hidden where GitHub shows the page) becomes
the docstrings' reference on the site (mkdocstrings' ``::: metricsvc.x.Y``)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "results"
PLOTS = ("scale.png",)  # benchmark figures the pages show


def on_files(files, config):
    from mkdocs.structure.files import File

    for name in PLOTS:
        files.append(File(name, str(RESULTS), config["site_dir"],
                          config["use_directory_urls"]))
    return files


_REFERENCE = re.compile(r"^<!-- reference: (\S+) -->$", re.M)


def on_page_markdown(markdown, page, config, files):  # noqa: ARG001 (MkDocs' signature)
    return _REFERENCE.sub(r"::: \1", markdown)


def on_page_read_source(page, config):  # noqa: ARG001 (MkDocs' hook signature)
    if page.file.src_uri != "index.md":
        return None
    text = README.read_text(encoding="utf-8")
    return re.sub(r"\]\(docs/", "](", text)
