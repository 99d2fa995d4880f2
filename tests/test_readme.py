"""Every Python block of the README runs as pasted: each joins a running Ray cluster (the
session's), as ``ray.init()`` does where one runs, in a namespace of its own."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # subprocesses

ROOT = Path(__file__).resolve().parent.parent
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_every_readme_python_block_runs_as_pasted(tmp_path, joined_env):
    assert len(BLOCKS) >= 5
    # As from a checkout, each in its own folder under tmp_path, all at once.
    running = []
    for index, block in enumerate(BLOCKS):
        where = tmp_path / f"block_{index}"
        where.mkdir()
        (where / "block.py").write_text(block)
        running.append(subprocess.Popen([sys.executable, "block.py"], cwd=where,
                                        env=joined_env(PYTHONPATH=str(ROOT)),
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True))
    failed = []
    for index, proc in enumerate(running):
        try:
            _, err = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            err += "\n(timed out after 240 s)"
        if proc.returncode != 0:
            failed.append(f"block {index}:\n{BLOCKS[index][:200]}...\n{err[-2000:]}")
    assert not failed, "\n\n".join(failed)
