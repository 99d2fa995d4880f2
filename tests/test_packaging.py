"""Layout promises: the service never imports torch; the demo runs end to end."""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


# What ``import metricsvc.client`` may load of this package: the client, the core and the
# protocol module. Never the service, sinks, storage or config (nor pydantic): a training
# rank imports the client, not the service.
CLIENT_TIERS = ("metricsvc.client", "metricsvc.core")


def _loaded_by(statement: str) -> dict[str, list[str]]:
    code = (f"import json, sys; {statement}; "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('metricsvc', 'clients', 'pydantic', 'yaml', 'torch'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    import json

    return json.loads(out.stdout)


def test_importing_the_client_loads_no_service_module_and_no_pydantic():
    loaded = _loaded_by("import metricsvc.client")
    ours = {m for m in loaded if m.startswith("metricsvc")}
    assert {"metricsvc.client.client", "metricsvc.core.records", "metricsvc.protocol"} <= ours
    assert {m for m in ours if not (m in ("metricsvc", "metricsvc.protocol")
                                    or m.startswith(CLIENT_TIERS))} == set()
    assert not any(m.startswith(("pydantic", "torch")) for m in loaded)


def test_the_service_package_never_imports_torch_or_the_client():
    loaded = _loaded_by("import metricsvc; metricsvc.start_metric_worker, metricsvc.load_config")
    assert "metricsvc.service.worker" in loaded and "metricsvc.sinks" in loaded
    assert not any(m.startswith(("torch", "metricsvc.client", "clients")) for m in loaded)


def test_one_top_level_package_and_the_old_clients_name_is_gone():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert {p.split(".")[0] for p in project["tool"]["setuptools"]["packages"]} == {"metricsvc"}
    assert not (ROOT / "clients").exists()
    out = subprocess.run([sys.executable, "-c", "import clients"], capture_output=True,
                         text=True, cwd=ROOT / "tests")
    assert "No module named 'clients'" in out.stderr


def _imports_of(path: Path) -> set[str]:
    """The ``metricsvc`` modules a file imports, at any depth of its code."""
    import ast

    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {f"{node.module}.{a.name}" for a in node.names}  # where a is a module
            found.add(node.module)
    return {name for name in found if name.split(".")[0] == "metricsvc"}


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (``from a import b`` counts ``a.b`` where
    that is a module). Lazy imports in functions count too: a loop is a loop."""
    modules = {}
    for path in (ROOT / "metricsvc").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {name: {m for m in _imports_of(path) if m in modules and m != name}
             for name, path in modules.items()}
    for name, edges in graph.items():  # `from pkg import module` imports the module
        edges -= {m for m in set(edges) if any(e.startswith(m + ".") for e in edges)
                  and name.startswith(m + ".")}
    return graph


def test_no_import_loop_anywhere_in_the_package():
    graph = import_graph()
    state: dict[str, int] = {}
    loops = []

    def visit(node, trail):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if nxt == "metricsvc":  # the top level imports nothing (names load on first use)
                continue
            if state.get(nxt) == 1:
                loops.append(" -> ".join(trail[trail.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not loops, loops


def test_the_key_rules_live_in_one_leaf_module_both_sides_use():
    graph = import_graph()
    assert graph["metricsvc.core.keys"] == {"metricsvc.core.limits"}
    assert graph["metricsvc.core.limits"] == set()
    assert "metricsvc.core.keys" in graph["metricsvc.protocol"]
    assert "metricsvc.core.keys" in graph["metricsvc.sinks.names"]
    assert "metricsvc.core.keys" in graph["metricsvc.core.validation"]


def test_every_module_imports_on_its_own():
    """No module works only when another was imported first (an empty ``__init__`` used
    to break ``import metricsvc.protocol`` with a partially initialised module)."""
    names = sorted(import_graph())
    code = ("import sys\n"
            "for name in sys.argv[1:]:\n"
            "    for m in [m for m in sys.modules if m.split('.')[0] == 'metricsvc']:\n"
            "        del sys.modules[m]\n"
            "    try:\n"
            "        __import__(name)\n"
            "    except Exception as err:\n"
            "        print(f'{name}: {type(err).__name__}: {err}')\n")
    out = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True,
                         cwd=ROOT / "tests", timeout=120)
    assert out.returncode == 0 and out.stdout == "", out.stdout + out.stderr[-2000:]


def test_the_client_depends_on_the_service_only_through_its_protocol_module():
    """The client package imports one module of the service, ``metricsvc.protocol`` (which
    re-exports the record, the wire format and the key rules)."""
    graph = import_graph()
    client = {n for n in graph if n.startswith("metricsvc.client")}
    used = set().union(*(graph[n] for n in client)) - client - {"metricsvc"}
    assert used == {"metricsvc.protocol"}, used


def test_the_recording_layer_uses_no_private_method_of_the_buffer():
    """One public layer: MetricClient and StreamRecorder are Trackers; a Tracker records
    through the buffer's public methods (no `_record` forwarding chain)."""
    import re

    from metricsvc.client import MetricClient, StreamRecorder, Tracker

    assert issubclass(MetricClient, Tracker) and issubclass(StreamRecorder, Tracker)
    source = (ROOT / "metricsvc" / "client" / "tracker.py").read_text()
    assert not re.findall(r"self\.buffer\._\w+", source)
    assert MetricClient.stat is Tracker.stat  # no forwarding layer in between


@pytest.mark.slow
def test_example_driver_runs_and_writes_the_journal(tmp_path):
    """``make run`` where no cluster runs: the driver starts a local Ray of its own."""
    config = tmp_path / "demo.yaml"
    config.write_text(f"name: demo_worker\nrun:\n  root: {tmp_path}\n  experiment: demo\n"
                      "sinks:\n  console:\n    every: 1\n")
    # Its own Ray's files in a folder of this test's (short: Ray's socket paths are bounded)
    ray_tmp = Path(tempfile.mkdtemp(prefix="mt", dir="/tmp"))
    env = {**os.environ, "RAY_ADDRESS": "local", "RAY_TMPDIR": str(ray_tmp)}
    try:
        out = subprocess.run(
            [sys.executable, str(ROOT / "examples" / "ray_driver.py"), "--config", str(config),
             "--workers", "3", "--steps", "3"],
            capture_output=True, text=True, cwd=tmp_path, env=env, timeout=240,
        )
        logs = "".join(p.read_text(errors="replace")
                       for p in (ray_tmp / "ray").glob("session_*/logs/worker-*"))
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if " final: " in line]
    assert [line.split()[1] for line in lines] == ["0", "1", "2"]
    journal = next((tmp_path / "demo").glob("*/metrics.jsonl"))
    assert len(journal.read_text().splitlines()) == 3
    assert f"journal: {journal}" in out.stdout
    # The actor's lines carry its public name, not the implementation class's: Ray names
    # each actor in its log files, and prefixes the lines it forwards with that name. (It
    # forwards them asynchronously: a driver that ends right after its last step may exit
    # before some arrive, so the log files are what is read.)
    both = out.stdout + out.stderr + logs
    assert ":actor_name:MetricWorker\n" in logs and "MetricWorkerImpl" not in both
    assert "DeprecationWarning" not in both  # Ray's own, from a property it deprecated


# The package's tiers, lowest first (each tier's ``__init__`` says what it may import): a
# module imports from its own tier or lower ones, never from a higher one (the top-level
# ``metricsvc`` loads names lazily and is outside). The client stands beside the storage,
# sinks and service: it may import the core only, through ``metricsvc.protocol``.
LAYERS = [
    {"metricsvc.core*"},                                  # pure: numbers and rules
    {"metricsvc.protocol", "metricsvc.errors", "metricsvc.config_base"},
    {"metricsvc.client*", "metricsvc.storage*"},
    {"metricsvc.sinks*"},
    {"metricsvc.config"},
    {"metricsvc.service*"},
    {"metricsvc.cli*"},
]
TIERS = ["core", "storage", "sinks", "service", "client", "cli"]


def _layer(module: str) -> int:
    for level, names in enumerate(LAYERS):
        for name in names:
            if module == name or (name.endswith("*") and module.startswith(name[:-1])):
                return level
    raise AssertionError(f"{module} is in no layer: place it in LAYERS")


def test_no_module_imports_from_a_higher_layer_and_the_client_never_from_the_service():
    graph = import_graph()
    upward, client_to_service = [], []
    for module, imports in graph.items():
        if module == "metricsvc":
            continue
        for imported in imports - {"metricsvc"}:
            if _layer(imported) > _layer(module):
                upward.append(f"{module} -> {imported}")
            if (module.startswith("metricsvc.client")
                    and not imported.startswith(("metricsvc.client", "metricsvc.protocol"))):
                client_to_service.append(f"{module} -> {imported}")
    assert not upward, upward
    assert not client_to_service, client_to_service


def test_no_module_over_400_lines_and_no_class_over_250():
    import ast

    big = []
    for path in sorted((ROOT / "metricsvc").rglob("*.py")):
        text = path.read_text()
        if len(text.splitlines()) > 400:
            big.append(f"{path.relative_to(ROOT)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 250:
                big.append(f"{path.relative_to(ROOT)}: class {node.name}: "
                           f"{node.end_lineno - node.lineno + 1} lines")
    assert not big, big


def test_the_merge_loads_neither_ray_nor_pydantic():
    """The aggregator's docstring says so: the step state machine runs without either."""
    code = ("import sys, metricsvc.service.aggregator; "
            "print([m for m in ('ray', 'pydantic') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT / "tests")
    assert out.stdout.strip() == "[]"


def test_the_package_is_in_tiers_with_a_handful_of_modules_at_its_top():
    """The folder list shows the tiers; each tier's docstring says what it may import;
    the top keeps ``__init__`` and a handful of modules; every module is in a tier."""
    import ast

    package = ROOT / "metricsvc"
    folders = sorted(p.name for p in package.iterdir() if (p / "__init__.py").exists())
    assert folders == sorted(TIERS)
    for tier in TIERS:
        doc = ast.get_docstring(ast.parse((package / tier / "__init__.py").read_text()))
        assert doc and "import" in doc, tier
    top = sorted(p.name for p in package.glob("*.py"))
    assert len(top) <= 6, top
    for module in import_graph():
        if module != "metricsvc":
            _layer(module)


def test_the_wheel_lists_every_package_folder_and_carries_the_top_level_configs():
    """pyproject lists the packages by hand (the presets folder maps in from the top):
    the list is the package's folders exactly, and the presets exist once, at the top."""
    import tomllib

    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {".".join(p.parent.relative_to(ROOT).parts)
               for p in (ROOT / "metricsvc").rglob("__init__.py")}
    assert set(setup["packages"]) == folders | {"metricsvc.configs"}
    assert setup["package-dir"] == {"metricsvc.configs": "configs"}
    assert sorted(p.stem for p in (ROOT / "configs").glob("*.yaml")) == __import__(
        "metricsvc").presets()
    assert not list((ROOT / "metricsvc").rglob("*.yaml"))  # one copy of each


def test_no_class_is_assembled_from_mixins():
    """Parts of a class's job are components it holds, never ``*Methods`` base classes."""
    import ast

    mixed = []
    for path in sorted((ROOT / "metricsvc").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                if node.name.endswith(("Methods", "Mixin")):
                    mixed.append(f"{path.relative_to(ROOT)}: class {node.name}")
                for base in node.bases:
                    name = ast.unparse(base)
                    if name.endswith(("Methods", "Mixin")):
                        mixed.append(f"{path.relative_to(ROOT)}: {node.name}({name})")
    assert not mixed, mixed
