"""Installed, not cloned: the wheel without extras, in a fresh venv, outside the checkout.

The fresh venv sees only what ``pip install metricsvc`` would bring: the wheel itself and
the closure of its declared dependencies, taken from this environment (no network, no
torch, no sink library). Its tests run the README's quickstart, the demo and the CLI there.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement

pytestmark = pytest.mark.slow  # a wheel build and a Ray of its own

ROOT = Path(__file__).resolve().parent.parent


def dependency_closure(requirements: list[str]) -> set[str]:
    """Return the installed distributions ``requirements`` need, transitively (no extras)."""
    env = default_environment()
    seen: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({**env, "extra": ""}):
            continue
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        if name in seen:
            continue
        seen.add(name)
        todo += [Requirement(r) for r in metadata.distribution(req.name).requires or []]
    return seen


def expose(distributions: set[str], into: Path) -> None:
    """Symlink each distribution's top-level files (packages, modules, metadata) into
    ``into``: a site folder that holds these and nothing else."""
    into.mkdir()
    for name in distributions:
        dist = metadata.distribution(name)
        base = Path(dist.locate_file(""))
        tops = {f.parts[0] for f in dist.files or [] if f.parts[0] != ".."}
        for top in tops:
            target = into / top
            if not target.exists() and (base / top).exists():
                target.symlink_to(base / top)


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """``(python, bin, workdir)`` of a fresh venv holding the wheel and its base deps."""
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    for rel in files:
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).write_bytes((ROOT / rel).read_bytes())
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    wheel = next((tmp / "dist").glob("metricsvc-*.whl"))
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()"
                                "['purelib'])"], capture_output=True, text=True,
                               check=True).stdout.strip())
    import zipfile

    meta = zipfile.ZipFile(wheel).read(
        next(n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".dist-info/METADATA")))
    requires = [line.split(":", 1)[1].strip() for line in meta.decode().splitlines()
                if line.startswith("Requires-Dist:") and "extra ==" not in line]
    expose(dependency_closure(requires), tmp / "deps")
    (site / "base_deps.pth").write_text(str(tmp / "deps") + "\n")
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
         "--no-index", "-q", str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr[-3000:]
    work = tmp / "elsewhere"
    work.mkdir()
    return python, venv / "bin", work


def run(fresh, *args, timeout=240):
    python, bindir, work = fresh
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(PATH=f"{bindir}:{env.get('PATH', '')}", RAY_ADDRESS="local")
    return subprocess.run(list(map(str, args)), capture_output=True, text=True, cwd=work,
                          env=env, timeout=timeout)


def test_the_wheel_is_one_package_with_its_presets_and_no_extras(fresh):
    python, _, _ = fresh
    code = ("import metricsvc, metricsvc.client, importlib.util as u; "
            "print(metricsvc.__file__); print(metricsvc.presets()); "
            "print([m for m in ('clients', 'torch', 'tensorboardX', 'wandb') if u.find_spec(m)])")
    out = run(fresh, python, "-c", code)
    assert out.returncode == 0, out.stderr[-2000:]
    where, presets, found = out.stdout.splitlines()
    assert str(ROOT) not in where and "site-packages" in where
    assert {"default", "siirl", "areal", "all"} <= set(eval(presets))
    assert found == "[]"
    out = run(fresh, python, "-m", "pip", "check")  # (pip itself comes from the deps)
    assert "metricsvc" not in out.stdout or out.returncode == 0, out.stdout


def test_the_cli_runs_and_refuses_a_sink_whose_library_is_missing_in_one_line(fresh):
    out = run(fresh, "metricsvc", "--version")
    assert out.returncode == 0 and out.stdout.startswith("metricsvc ")
    out = run(fresh, "metricsvc", "validate-config", "siirl")
    assert out.returncode == 0, out.stderr
    out = run(fresh, "metricsvc", "validate-config", "all")
    assert out.returncode == 2
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "pip install 'metricsvc[tensorboard]'" in out.stderr
    assert "pip install 'metricsvc[wandb]'" in out.stderr


def test_the_plain_number_quickstart_and_the_demo_run_from_a_base_install(fresh):
    """The README's quickstart as pasted, outside the checkout, beside ``metricsvc demo``
    (which records its fake batches without torch) and a service refused at start for a
    sink whose library is missing."""
    python, _, work = fresh
    readme = (ROOT / "README.md").read_text()
    quickstart = re.findall(r"```python\n(.*?)```", readme, re.S)[0]
    (work / "quickstart.py").write_text(quickstart)
    refused = ("import ray, metricsvc\nray.init()\ntry:\n"
               "    metricsvc.start_metric_worker('all')\nexcept ValueError as err:\n"
               "    print('REFUSED', err)\n"
               "w = metricsvc.start_metric_worker({'name': 'base', 'sinks': {'console': None}})\n"
               "print('EXPORT', metricsvc.service_health(w)['metrics_export']['export'])\n")
    (work / "refused.py").write_text(refused)
    env_runs = [(python, "quickstart.py"), ("metricsvc", "demo", "--steps", "3"),
                (python, "refused.py")]
    _, bindir, _ = fresh
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(PATH=f"{bindir}:{env.get('PATH', '')}", RAY_ADDRESS="local")
    procs = [subprocess.Popen(list(map(str, a)), cwd=work, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for a in env_runs]
    outs = [p.communicate(timeout=300) + (p.returncode,) for p in procs]
    (q_out, q_err, q_rc), (d_out, d_err, d_rc), (r_out, r_err, r_rc) = outs
    assert q_rc == 0, q_err[-3000:]
    assert "'tokens/total': 2048.0" in q_out and "run folder: " + str(work) in q_out
    assert d_rc == 0, d_err[-3000:]
    assert "3 steps final" in d_out and "ModuleNotFoundError" not in d_err
    assert r_rc == 0, r_err[-3000:]
    assert "REFUSED" in r_out and "pip install 'metricsvc[tensorboard]'" in r_out
    refusal, export = r_out.strip().splitlines()  # one line each
    assert export.startswith("EXPORT off: Ray's metrics agent needs ray[default]")  # base
    assert "pip install 'metricsvc[observe]'" in export
