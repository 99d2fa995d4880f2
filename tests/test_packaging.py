"""Layout promises: tiers that import downwards only, rooms that keep to themselves (no
private name imported across modules, no object writing another's fields), the engine
free of Ray, pydantic and threads, a front door that opens; the demo runs end to end."""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


# What ``import metricsvc.client`` may load of this package: the client, the core, the
# errors and how actors are called. Never the service, sinks, storage or config (nor
# pydantic): a training rank imports the client, not the service.
CLIENT_TIERS = ("metricsvc.client", "metricsvc.core")
CLIENT_MODULES = ("metricsvc", "metricsvc.transport", "metricsvc.errors")


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
    assert {"metricsvc.client.client", "metricsvc.core.records", "metricsvc.transport"} <= ours
    assert {m for m in ours if not (m in CLIENT_MODULES or m.startswith(CLIENT_TIERS))} == set()
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
    assert graph["metricsvc.core.limits"] == set() and graph["metricsvc.errors"] == set()
    for user in ("metricsvc.client.buffer", "metricsvc.sinks.base", "metricsvc.core.wire"):
        assert "metricsvc.core.keys" in graph[user], user


def test_every_module_imports_on_its_own():
    """No module works only when another was imported first (an empty ``__init__`` used
    to break ``import metricsvc.protocol`` with a partially initialised module)."""
    names = sorted(set(import_graph()) - {"metricsvc.__main__"})  # a script: it runs the CLI
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


def test_the_client_depends_on_the_core_and_the_transport_only():
    """The client package imports the core, the errors and how actors are called
    (``metricsvc.transport``, shared with the combiner): never the service, its config, the
    sinks or the storage."""
    graph = import_graph()
    client = {n for n in graph if n.startswith("metricsvc.client")}
    used = set().union(*(graph[n] for n in client)) - client - {"metricsvc"}
    assert {u for u in used if not u.startswith("metricsvc.core.")} == {
        "metricsvc.transport", "metricsvc.errors"}, used


def test_the_recording_layer_uses_no_private_method_of_the_buffer():
    """One public layer: MetricClient and StreamRecorder are Trackers; a Tracker records
    through the buffer's public methods (no `_record` forwarding chain)."""
    import re

    from metricsvc.client import MetricClient, StreamRecorder, Tracker

    assert issubclass(MetricClient, Tracker) and issubclass(StreamRecorder, Tracker)
    source = (ROOT / "metricsvc" / "client" / "client.py").read_text()
    assert not re.findall(r"\.buffer\._\w+", source)
    assert MetricClient.stat is Tracker.stat  # no forwarding layer in between


def _sources():
    for path in sorted((ROOT / "metricsvc").rglob("*.py")):
        yield path.relative_to(ROOT).as_posix(), __import__("ast").parse(path.read_text())


def test_no_module_imports_another_modules_private_name():
    """A name with a leading underscore is its module's own: another module that needs it
    needs a public name, or the code belongs where the name is."""
    import ast

    crossing = [f"{where}: from {node.module} import {alias.name}"
                for where, tree in _sources() for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("metricsvc")
                for alias in node.names
                if alias.name.startswith("_") and not alias.name.startswith("__")]
    assert not crossing, crossing


def _targets(node):
    """What an assignment statement assigns to (none for any other node)."""
    import ast

    if isinstance(node, ast.Assign):
        return node.targets
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target]
    return []


def test_every_memo_of_a_function_is_bounded():
    """A function whose results are kept by its arguments keeps a bounded number
    (``functools.lru_cache(maxsize=N)``): a memo keyed by what users name (a prefix, a
    metric's name) grows with every new name otherwise."""
    import ast

    found = []
    for where, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for deco in node.decorator_list:
                    text = ast.unparse(deco)
                    if text in ("functools.cache", "cache") or (
                            "lru_cache" in text and ("maxsize" not in text or "None" in text)):
                        found.append(f"{where}:{node.lineno}: @{text} {node.name}")
        # a memo by hand: a function that looks a module's dict up and fills it on a miss
        # (``_X.get(key)`` then ``_X[key] = ...``); a registry, filled by one call and read
        # by others, is not one
        empty = {target.id for node in tree.body for target in _targets(node)
                 if isinstance(target, ast.Name) and isinstance(node.value, ast.Dict)
                 and not node.value.keys}
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                read = {inner.func.value.id for inner in ast.walk(node)
                        if isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute)
                        and inner.func.attr == "get" and isinstance(inner.func.value, ast.Name)}
                for inner in ast.walk(node):
                    for target in getattr(inner, "targets", ()):
                        if (isinstance(target, ast.Subscript) and
                                isinstance(target.value, ast.Name) and
                                target.value.id in empty & read):
                            found.append(f"{where}:{inner.lineno}: {target.value.id}[...] = "
                                         f"in {node.name}, a memo without a bound")
    assert not found, found


def test_no_object_assigns_another_objects_attributes():
    """An object's fields are written by its own methods (``self.x = ...``) and nowhere
    else: a part that sets another part's fields (``agg.world.size = ...``,
    ``self.buffer.label = ...``) is a method of that other part, moved home."""
    import ast

    def flatten(target):
        if isinstance(target, (ast.Tuple, ast.List)):
            for item in target.elts:
                yield from flatten(item)
        else:
            yield target

    foreign = []
    for where, tree in _sources():
        for node in ast.walk(tree):
            for target in (t for raw in _targets(node) for t in flatten(raw)):
                if isinstance(target, ast.Attribute) and not target.attr.startswith("__") and not (
                        isinstance(target.value, ast.Name) and target.value.id in ("self", "cls")):
                    foreign.append(f"{where}:{node.lineno}: {ast.unparse(target)}")
    assert not foreign, foreign


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
# sinks and service: it imports the core, the errors and how actors are called only.
LAYERS = [
    {"metricsvc.errors"},                                 # the errors: a leaf every tier uses
    {"metricsvc.core*"},                                  # pure: numbers and rules
    {"metricsvc.transport"},                              # calling actors over Ray
    {"metricsvc.client*", "metricsvc.storage*"},
    {"metricsvc.sinks*"},
    {"metricsvc.config"},
    {"metricsvc.service*"},
    {"metricsvc.cli*", "metricsvc.__main__"},
]
TIERS = ["core", "storage", "sinks", "service", "client", "cli"]
CLIENT_MAY_IMPORT = ("metricsvc.client", "metricsvc.core", "metricsvc.transport",
                     "metricsvc.errors")


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
                    and not imported.startswith(CLIENT_MAY_IMPORT)):
                client_to_service.append(f"{module} -> {imported}")
    assert not upward, upward
    assert not client_to_service, client_to_service


ENGINE = ("metricsvc.service.engine", "metricsvc.service.steps", "metricsvc.service.output",
          "metricsvc.service.derive", "metricsvc.service.streams", "metricsvc.service.alerts")


def test_the_engine_is_pure_no_ray_no_pydantic_no_threads_no_files():
    """The step's life runs on decoded batches and a clock: importing it loads neither Ray
    nor pydantic, and none of its modules imports threading or opens a file."""
    import ast

    code = ("import sys, metricsvc.service.engine; "
            "print([m for m in ('ray', 'pydantic', 'threading') if m in sys.modules and m != "
            "'threading'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT / "tests")
    assert out.stdout.strip() == "[]"
    graph = import_graph()
    for module in ENGINE:
        path = ROOT / (module.replace(".", "/") + ".py")
        tree = ast.parse(path.read_text())
        names = {a.name.split(".")[0] for n in ast.walk(tree)
                 if isinstance(n, (ast.Import, ast.ImportFrom))
                 for a in (n.names if isinstance(n, ast.Import) else [ast.alias(n.module or "")])}
        assert not names & {"ray", "pydantic", "threading", "os", "pathlib"}, (module, names)
        assert not [n for n in ast.walk(tree) if isinstance(n, ast.Call)
                    and isinstance(n.func, ast.Name) and n.func.id == "open"], module
        assert {m for m in graph[module] if m.startswith("metricsvc.service")} <= set(ENGINE)


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
    assert top == ["__init__.py", "__main__.py", "config.py", "errors.py", "transport.py"], top
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


def test_the_front_door_opens():
    """Every name in ``__all__`` resolves, ``from metricsvc import *`` works,
    ``metricsvc.errors`` is there after ``import metricsvc``, and ``python -m metricsvc`` is
    the command line."""
    code = ("import metricsvc\n"
            "assert metricsvc.errors.Refused.__module__ == 'metricsvc.errors'\n"
            "missing = [n for n in metricsvc.__all__ if not hasattr(metricsvc, n)]\n"
            "assert not missing, missing\n"
            "namespace = {}\n"
            "exec('from metricsvc import *', namespace)\n"
            "assert set(metricsvc.__all__) <= set(namespace)\n"
            "try:\n"
            "    raise metricsvc.errors.BatchRejected('x')\n"
            "except metricsvc.errors.Refused:\n"
            "    pass\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT / "tests", timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    out = subprocess.run([sys.executable, "-m", "metricsvc", "--version"], capture_output=True,
                         text=True, cwd=ROOT / "tests", timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("metricsvc "), out.stderr


def test_make_test_ends_and_names_the_test_when_a_worker_dies(tmp_path):
    """``make test``'s own pytest options, on a suite whose test kills its worker process:
    the run ends (pytest-xdist 3.8 replaced the worker and waited forever under
    ``--dist loadfile``: a CI run hung so) and names the test it lost."""
    make = (ROOT / "Makefile").read_text()
    args = next(line.split("=", 1)[1].split() for line in make.splitlines()
                if line.startswith("PYTEST_ARGS ="))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_dies.py").write_text(
        "import os, signal\ndef test_killed():\n    os.kill(os.getpid(), signal.SIGKILL)\n"
        "def test_after():\n    pass\n")
    for name in "abc":
        (tmp_path / f"test_{name}.py").write_text(f"def test_{name}():\n    pass\n")
    out = subprocess.run([sys.executable, "-m", "pytest", *args, "-p", "no:cacheprovider"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stdout[-2000:]
    assert "crashed while running 'test_dies.py::test_killed'" in out.stdout, out.stdout[-2000:]
