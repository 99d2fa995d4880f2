"""Starting, finding and stopping the service, from a Ray driver.

``start_metric_worker`` creates the named ``MetricWorker`` singleton (in the namespace
``metricsvc`` unless configured) and waits until it serves; a second call with the same
config returns it, another config or another job's live service is refused naming why.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from metricsvc.config import ConfigSource, ServiceConfig, load_config, new_trial
from metricsvc.core.keys import DEFAULT_NAME, default_namespace
from metricsvc.core.redaction import Redactor
from metricsvc.errors import ServiceNotice, ServiceUnavailable
from metricsvc.service.worker import actor_class
from metricsvc.sinks.base import check_libraries
from metricsvc.storage.run_folder import check_run_dir, probe_run_dir
from metricsvc.transport import ray_get

log = logging.getLogger(__name__)


def config_differences(asked: Mapping[str, Any], running: Mapping[str, Any],
                       prefix: str = "") -> list[str]:
    """Return the dotted names of the fields where two config dumps differ."""
    out = []
    for key in sorted(set(asked) | set(running)):
        a, b = asked.get(key), running.get(key)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out += config_differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}")
    return out


def start_metric_worker(
    config: ConfigSource = None,
    *,
    name: str | None = None,
    namespace: str | None = None,
    world_size: int | None = None,
    runtime_env: dict[str, Any] | None = None,
    resume_from_step: int | None = None,
    start_timeout_s: float = 300.0,
) -> Any:
    """Create (or return the existing) named MetricWorker singleton and wait until it serves.

    ``config`` is a YAML path, a dict, a ServiceConfig or None; ``name``, ``namespace``
    and ``world_size`` (the run's number of ranks: set it, and no confused rank can
    claim another) override the config's; ``runtime_env`` is passed to Ray. Never put
    API keys in ``runtime_env``: Ray writes runtime environments to its logs. Export
    them where the driver (or ``ray start``) runs instead. Calling it twice returns
    the same actor.

    ``resume_from_step=k``: continue the run in the configured folder (after a crash)
    from the checkpoint of step ``k``, in one operation: the service reloads the run,
    rewinds to ``k`` (journaled) before it takes any batch, and every step after ``k``
    is recorded afresh (``run: {resume: true, from_step: k}`` in the config says the
    same).

    A new service that does not answer within ``start_timeout_s`` (Ray never placed it: a
    ``num_cpus`` no free CPU of this node meets, say) is ended and refused naming why, with
    a warning after ``START_PATIENCE_S`` of waiting; it never hangs the driver.
    """
    cfg = load_config(config, name=name, namespace=namespace, world_size=world_size)
    if resume_from_step is not None:
        cfg = load_config({**cfg.model_dump(), "run": {
            **cfg.run.model_dump(), "resume": True, "from_step": resume_from_step}})
    check_libraries(cfg.sinks)  # here, in one line, not as retries in the actor
    if not Path(cfg.run.root).is_absolute():  # the driver's folder, not the cluster's cwd
        cfg = cfg.model_copy(update={"run": cfg.run.model_copy(
            update={"root": str(Path(cfg.run.root).resolve())})})
    running = _running(cfg, start_timeout_s)
    if running is not None:  # this job's: started here, so ``_services`` knows it
        return running
    if cfg.run.trial is not None:  # none runs: a new run, whose folder must be its own
        run_dir = cfg.run.run_dir().resolve()
        if not cfg.run.resume:
            check_run_dir(run_dir, cfg.journal(run_dir))
        # resuming after a crash: a holder on its way out (a killed actor's process) may
        # take a moment to let go
        _probe(run_dir, grace_s=2.0 if cfg.run.resume else 0.0)
    if cfg.run.trial is None:
        # Fixed here, not in the actor: a restarted actor must find the same run folder.
        cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"trial": new_trial()})})
    # On the starting driver's node: the run folder is then on the disk where the driver
    # resolved it, and a node that an autoscaler removes does not take the service with it
    # (left to itself, Ray spreads a zero-CPU actor over any node; a soft affinity too,
    # where the node is busy starting workers). The actor is the driver's: it ends with
    # the driver, so no restart ever needs another node.
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    handle = actor_class(cfg.max_readers).options(
        name=cfg.name,
        scheduling_strategy=here,
        namespace=cfg.namespace,
        get_if_exists=True,
        max_restarts=cfg.max_restarts,
        num_cpus=cfg.num_cpus,
        runtime_env=runtime_env,
    ).remote(cfg.model_dump())
    health = _wait_until_serving(handle, cfg, start_timeout_s)  # a failing __init__ raises
    gap = (health.get("resume") or {}).get("unjournaled")
    if gap:  # steps the crashed run may have finished unjournaled: said where it resumes
        warnings.warn(ServiceNotice(f"MetricWorker {cfg.name!r}: {gap['reason']}"),
                      stacklevel=2)
    if cfg.topology == "per_node":
        from metricsvc.service.combiner import start_node_combiners

        start_node_combiners(cfg, [n["NodeID"] for n in ray.nodes() if n.get("Alive")])
    # Registered after ray.init's own exit hook, so it runs first, while Ray still answers:
    # a driver that ends without close() must not lose what the sinks buffer. It waits for
    # the whole close: Ray ends the service once the driver has ended.
    atexit.register(_close_at_exit, handle)
    _services[handle] = (cfg.name, cfg.run.run_dir().resolve())
    return handle


# The services this driver started, and their run folders: a stop that hears nothing from
# one still knows whose combiners to end and which folder it lets go of
_services: dict[Any, tuple[str, Path]] = {}


START_PATIENCE_S = 10.0  # a new service silent this long: the driver hears why it may be


def _wait_until_serving(handle: Any, cfg: ServiceConfig,
                        timeout_s: float) -> dict[str, Any]:
    """Wait for a new service's first answer, its health, and return it (what its
    ``__init__`` raised, raised here); warn once after ``START_PATIENCE_S``; past
    ``timeout_s`` end it and raise naming what it asks of Ray (Ray waits for good for a
    CPU the training holds)."""
    answer = handle.health.remote()
    deadline = time.monotonic() + timeout_s
    warned = False
    while not ray.wait([answer], timeout=max(0.0, min(START_PATIENCE_S,
                                                      deadline - time.monotonic())))[0]:
        free = ray.available_resources().get("CPU", 0.0)
        why = (f"it asks Ray for num_cpus={cfg.num_cpus:g} and the cluster has {free:g} CPUs "
               f"free (the service runs on this driver's node): Ray places it only once "
               f"one is, and training holds its CPUs for the run; num_cpus: 0 (the "
               f"default) needs none" if cfg.num_cpus else "Ray has not started it (a "
               "busy node?)")
        if time.monotonic() >= deadline:
            ray.kill(handle, no_restart=True)
            raise ServiceUnavailable(f"MetricWorker {cfg.name!r} did not start within "
                                     f"{timeout_s:g} s and was ended: {why}")
        if not warned:
            log.warning("MetricWorker %r is not serving after %g s: %s", cfg.name,
                        START_PATIENCE_S, why)
            warned = True
    return ray_get(answer)


def _running(cfg: ServiceConfig, timeout_s: float, grace_s: float = 30.0) -> Any:
    """The service of ``cfg``'s name that runs ``cfg`` (``_same_service``), or None where
    none runs. A service that ended a moment ago (``stop_metric_worker``, a kill) may
    still hold its name while Ray lets it go: that is waited out, for ``grace_s``, and is
    no service (a start right after a stop raised Ray's ActorDiedError so)."""
    deadline = time.monotonic() + grace_s
    while True:
        try:
            handle = ray.get_actor(cfg.name, namespace=cfg.namespace)
        except ValueError:
            return None
        try:
            return _same_service(handle, cfg, timeout_s)
        except ray.exceptions.ActorDiedError:
            if time.monotonic() >= deadline:
                raise ValueError(f"the MetricWorker named {cfg.name!r} in namespace "
                                 f"{cfg.namespace!r} has ended, but Ray still holds its "
                                 f"name after {grace_s} s") from None
            time.sleep(0.05)


def _probe(run_dir: Path, grace_s: float) -> None:
    """Refuse a folder a live service holds, once a holder that is ending has had
    ``grace_s`` to let go."""
    deadline = time.monotonic() + grace_s
    while True:
        try:
            return probe_run_dir(run_dir)
        except ValueError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.1)


def _same_service(handle: Any, cfg: ServiceConfig, timeout_s: float) -> Any:
    """Return the running service if it runs ``cfg`` (an unset trial matches any), else
    raise naming the fields that differ, or that it does not answer within ``timeout_s``
    (another start of that name still waiting for Ray to place it, say)."""
    try:
        running, job = ray.get([handle.config_dump.remote(), handle.job_id.remote()],
                               timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise ServiceUnavailable(
            f"a MetricWorker named {cfg.name!r} in namespace {cfg.namespace!r} exists but "
            f"did not answer within {timeout_s:g} s (not started yet: is another start of "
            f"that name waiting for Ray to place it?)") from None
    if job != ray.get_runtime_context().get_job_id():
        raise ValueError(
            f"a MetricWorker named {cfg.name!r} already runs in namespace {cfg.namespace!r} "
            f"for another job ({job}): two runs would merge into one service; give this run "
            f"its own name (start_metric_worker(name=) and MetricClient(name=)) or namespace")
    asked = cfg.model_dump(mode="json")
    asked = Redactor(asked).value(asked)
    if cfg.run.trial is None:
        asked["run"]["trial"] = running["run"]["trial"]
    differ = config_differences(asked, running)
    if differ:
        raise ValueError(
            f"a MetricWorker named {cfg.name!r} already runs in namespace {cfg.namespace!r} "
            f"with another config: {', '.join(differ[:12])} differ; stop it first "
            f"(metricsvc.stop_metric_worker) or start this one under another name")
    return handle


def stop_metric_worker(handle: Any = None, *, name: str | None = None,
                       namespace: str | None = None,
                       timeout_s: float = 120.0) -> dict[str, Any]:
    """Close every sink (wandb finishes its run), then end the actor and the combiners this
    driver started for it; return its last health.

    The sinks get ``sinks.delivery.close_timeout_s``; a step a sink has not taken by then
    is dead-lettered, and the returned health says so per sink (``dead_lettered``,
    ``in_flight_at_close``, ``lost``). ``timeout_s`` only guards an actor that does not
    answer: a close it still answers through is waited for (``close_timeout_s`` bounds
    it). Call this (or ``worker.close.remote()``) before ``ray.shutdown()``: Ray ends an
    actor's child processes first, and wandb's writer is one of them.

    Raises:
        ServiceUnavailable: the service was silent for ``timeout_s`` (its process stopped,
            say) or had ended. It and its combiners are ended all the same, its sinks not
            closed, and its run folder is free when this raises (where this driver started
            the service).
    """
    handle = handle or get_metric_worker(name, namespace)
    name, folder = _services.get(handle, (name, None))
    try:
        health, why = _closed(handle, timeout_s), ""
    except ray.exceptions.GetTimeoutError:
        health, why = None, (f"was silent for {timeout_s:g} s while closing and was ended: "
                             f"its sinks were not closed")
    except ray.exceptions.ActorDiedError:
        health, why = None, ("had already ended (stopped, killed or out of restarts): "
                             "nothing was closed now")
    ray.kill(handle, no_restart=True)
    name = health["name"] if health else name
    if name:  # the combiners this driver started for it (per_node)
        from metricsvc.service.combiner import stop_combiners

        stop_combiners(name)
    if health:
        return health
    if folder is not None:  # a stopped process ends seconds after Ray lets its name go
        with contextlib.suppress(ValueError):
            _probe(folder, grace_s=30.0)
    who = f"MetricWorker {name!r}" if name else "the MetricWorker (given by handle)"
    raise ServiceUnavailable(f"{who} {why}")


# -- the driver's calls, raising metricsvc's own exceptions (never Ray's wrapper) ---------
def final_result(worker: Any, step: int | None = None, timeout_s: float | None = None, *,
                 meta: bool = False) -> dict[str, Any]:
    """Return the merged metrics of ``step`` once it is final (``step=None``: the newest
    step a rank closed); ``meta=True``: ``{"step", "metrics", "meta"}``. What
    ``ray.get(worker.wait_final_res.remote(step, timeout_s))`` returns, with errors raised
    as they are meant: ``StepNotFinal`` after ``timeout_s``, ``StepUnavailable``,
    ``ServiceClosed``, each one line."""
    method = worker.wait_final if meta else worker.wait_final_res
    return ray_get(method.remote(step, timeout_s))


def rewind(worker: Any, to_step: int) -> dict[str, Any]:
    """Resume the live service from the checkpoint of ``to_step``: every later step is
    recorded afresh (``MetricWorker.rewind``); returns ``{"to_step", "superseded"}``."""
    return ray_get(worker.rewind.remote(to_step=to_step))


def service_health(worker: Any, timeout_s: float | None = 60.0) -> dict[str, Any]:
    """Return the service's ``health()``."""
    return ray_get(worker.health.remote(), timeout=timeout_s)


ANSWER_S = 30.0  # how long a closing service may go without answering at the driver's exit


def _closed(handle: Any, answer_s: float) -> dict[str, Any]:
    """Close the service and return its last health, waiting as long as the close runs
    and the service answers (its sinks' ``close_timeout_s`` bounds the close). A service
    silent for ``answer_s`` raises ``GetTimeoutError`` (half of it for the close, then
    half for a health call)."""
    ref = handle.close.remote()
    while not ray.wait([ref], timeout=answer_s / 2)[0]:
        service_health(handle, answer_s / 2)  # still closing, and answering
    return ray_get(ref)


def _close_at_exit(handle: Any) -> None:
    if not ray.is_initialized():
        return
    try:
        _closed(handle, ANSWER_S)
    except Exception as err:  # already closed, killed or never started: nothing to save
        log.debug("closing the MetricWorker at exit: %s", err)


def get_metric_worker(name: str | None = None, namespace: str | None = None) -> Any:
    """Return the handle of a running MetricWorker by name (default: the config default)."""
    return ray.get_actor(name or DEFAULT_NAME, namespace=namespace or default_namespace())
