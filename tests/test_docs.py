"""The README and the documentation site: every ```python block on every page runs as
pasted, the site builds strictly, and the front page stays a front page.

Each block joins a running Ray cluster (the session's), as ``ray.init()`` does where one
runs, in a namespace of its own. ```py blocks show another framework's code (siiRL's,
verl's, AReaL's), which needs that framework: they are shown, not run.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import run_scripts

ROOT = Path(__file__).resolve().parent.parent
# docs/index.md is the README itself on the site (docs/hooks.py): counted once, as README
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md")
                                      if p.name != "index.md")]
BLOCKS = [(page.relative_to(ROOT).as_posix(), block) for page in PAGES
          for block in re.findall(r"^```python\n(.*?)^```", page.read_text(), re.S | re.M)]


@pytest.mark.slow
def test_every_python_block_of_every_page_runs_as_pasted(tmp_path, joined_env):
    assert len(BLOCKS) >= 8 and {page for page, _ in BLOCKS} >= {
        "README.md", "docs/migration/siirl.md", "docs/migration/verl.md",
        "docs/migration/areal.md"}
    commands = {}  # as from a checkout, each in its own folder under tmp_path
    for index, (_, block) in enumerate(BLOCKS):
        where = tmp_path / f"block_{index}"
        where.mkdir()
        (where / "block.py").write_text(block)
        commands[index] = ([sys.executable, "block.py"],
                           {"cwd": where, "env": joined_env(PYTHONPATH=str(ROOT))})
    done = run_scripts(commands, timeout_s=240)
    failed = [f"{page}:\n{block[:200]}...\n{done[index][2][-2000:]}"
              for index, (page, block) in enumerate(BLOCKS) if done[index][0] != 0]
    assert not failed, "\n\n".join(failed)


def test_the_site_builds_strictly(tmp_path):
    """What ``make docs`` runs: a broken link, a missing page or an API reference that does
    not resolve fails the build."""
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q",
                          "-d", str(tmp_path / "site")], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "Create (or return the existing) named MetricWorker" in api  # from a docstring
    home = (tmp_path / "site" / "index.html").read_text()
    assert "Why not what you use today" in home and 'href="concepts/"' in home


def test_the_readme_is_a_front_page_in_the_order_a_newcomer_reads():
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 200
    assert lines[2:6] and "make run" in lines[3] and "make test" in lines[5]
    heads = [line for line in lines if line.startswith("## ")]
    assert heads == ["## Why not what you use today", "## Install", "## Quickstart",
                     "## The two commands", "## Documentation"]
    for link in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (ROOT / link).is_file(), link


def test_benchmark_pages_show_results_not_work_tracking():
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    for word in ("issue", "target", "missed", "moonshot", "main ", "commit", "before this"):
        assert word not in text.lower(), word


def test_every_yaml_block_of_every_page_is_a_config_that_loads():
    import yaml

    from metricsvc.config import load_config

    blocks = [(page.relative_to(ROOT).as_posix(), block) for page in PAGES
              for block in re.findall(r"^```yaml\n(.*?)^```", page.read_text(), re.S | re.M)]
    assert len(blocks) >= 2
    for page, block in blocks:
        try:
            load_config(yaml.safe_load(block))
        except ValueError as err:
            raise AssertionError(f"{page}: {err}") from None


def test_every_install_extra_a_page_or_a_message_names_exists():
    """`pip install 'metricsvc[plot]'` was in an error message and in no install section."""
    import tomllib

    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
                 ["optional-dependencies"])
    sources = [*PAGES, *sorted((ROOT / "metricsvc").rglob("*.py"))]
    named = {(path.relative_to(ROOT).as_posix(), extra) for path in sources
             for group in re.findall(r"metricsvc\[([a-z_,\s]+)\]", path.read_text())
             for extra in re.split(r"[,\s]+", group.strip())}
    assert {"plot", "torch", "observe", "tensorboard"} <= {e for _, e in named}
    assert not [(where, e) for where, e in named if e not in extras]
    install = (ROOT / "README.md").read_text().split("## Install", 1)[1].split("## ", 1)[0]
    assert {e for e in extras if e not in ("dev", "docs")} <= set(
        re.findall(r"\[([a-z_]+)\]", install))  # `[wandb], [swanlab]` in a comment count
