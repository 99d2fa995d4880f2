"""AReaL's import style: ``from metricsvc.client import stats_tracker`` and AReaL's
module-level calls, bound to the process's ``MetricClient``.

AReaL code calls ``stats_tracker.stat(...)``, ``stats_tracker.get("rollout")``,
``stats_tracker.export_all(...)`` all over its trainer and workflows; with the import line
changed and one set-up call per process (``stats_tracker.init(rank=..., world_size=...)``,
or ``stats_tracker.use(client)`` for a client made elsewhere), the same calls record here:

    from metricsvc.client import stats_tracker

    stats_tracker.init(rank=rank, world_size=world_size, name="my_service")
    with stats_tracker.scope("ppo_actor"):
        stats_tracker.denominator(n_valid_tokens=loss_mask)
        stats_tracker.stat(loss=loss, denominator="n_valid_tokens")
    stats = stats_tracker.export_all()  # every rank's merged step, as AReaL's all-reduce

``export_all`` closes the step and returns the service's merged metrics of it: the same on
every rank, as AReaL's all-reduced export (it waits for every rank, as the all-reduce
does). Where nothing reads them on the rank, ``client().flush()`` closes the step without
waiting.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from metricsvc.client.client import MetricClient, Tracker
from metricsvc.core.reduce import ReduceType
from metricsvc.errors import NotSetUp

__all__ = ["ReduceType", "client", "denominator", "export", "export_all", "get", "init",
           "record_timing", "scalar", "scope", "scope_func_wrapper", "stat", "stat_compact",
           "use"]

_held: list[MetricClient] = []  # this process's client, once set up
_lock = threading.Lock()


def use(c: MetricClient) -> MetricClient:
    """Make ``c`` the client the module-level calls record on (once per process; a second
    call replaces it, e.g. in a test); return it."""
    if not isinstance(c, MetricClient):
        raise TypeError(f"stats_tracker.use expects a MetricClient, got {type(c).__name__}")
    with _lock:
        _held[:] = [c]
    return c


def init(**kwargs: Any) -> MetricClient:
    """Create this process's ``MetricClient(**kwargs)`` (``rank=``, ``world_size=``, the
    service's ``name=`` ...) and ``use`` it; return it."""
    return use(MetricClient(**kwargs))


def client() -> MetricClient:
    """This process's client.

    Raises:
        NotSetUp: neither ``init`` nor ``use`` was called in this process.
    """
    if not _held:
        raise NotSetUp("stats_tracker has no MetricClient in this process: call "
                       "metricsvc.client.stats_tracker.init(rank=..., world_size=...) once per "
                       "process first (or stats_tracker.use(client))")
    return _held[0]


def scalar(**values: Any) -> None:
    """AReaL's ``stats_tracker.scalar``: rank-identical numbers."""
    client().scalar(**values)


def denominator(**masks: Any) -> None:
    """AReaL's ``stats_tracker.denominator``: bool masks by name."""
    client().denominator(**masks)


def stat(denominator: Any = None, reduce_type: ReduceType | str | None = None,
         **values: Any) -> None:
    """AReaL's ``stats_tracker.stat(denominator, reduce_type=None, **values)``: masked
    summaries (AVG_MIN_MAX by default)."""
    client().stat(denominator, reduce_type or ReduceType.AVG_MIN_MAX, **values)


def stat_compact(mask: Any = None, reduce_type: ReduceType | str = ReduceType.AVG_MIN_MAX,
                 **values: Any) -> None:
    """AReaL's ``stats_tracker.stat_compact(mask, reduce_type, **values)``."""
    client().stat_compact(mask, reduce_type, **values)


def scope(name: str) -> AbstractContextManager[None]:
    """AReaL's ``stats_tracker.scope``: keys nested under ``name/`` (also a decorator)."""
    return client().scope(name)


def scope_func_wrapper(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """AReaL's decorator form of ``scope``."""
    return client().scope(name)


def record_timing(name: str, *, device: bool = False) -> AbstractContextManager[None]:
    """AReaL's ``stats_tracker.record_timing``: the block's seconds (``timeperf/<name>``
    under the ``areal`` preset); ``device=True``: measured on the CUDA device, read at the
    flush."""
    return client().record_timing(name, device=device)


def get(name: str = "") -> Tracker:
    """AReaL's ``stats_tracker.get(name)``: the named tracker (keys under ``name/``); the
    empty name is this process's client itself."""
    c = client()
    return c if not name else c.get(name)


def export_all(reduce_group: Any = None, reset: bool = True,
               timeout_s: float | None = None) -> dict[str, float]:
    """AReaL's ``stats_tracker.export_all``: close this rank's step and return every rank's
    merged metrics of it (the same on every rank, as AReaL's all-reduce; it waits for every
    rank). ``reduce_group`` is not needed (the service knows the run's ranks).

    Raises:
        ValueError: ``reset=False``: a closed step is sent, not kept to export again.
    """
    if not reset:
        raise ValueError("stats_tracker.export_all(reset=False): a step's records are sent "
                         "when it closes, not kept to export again; call export_all() once a "
                         "step")
    c = client()
    c.wait_submit()
    return c.wait_final_res(c.last_closed, timeout_s)


def export(key: str | None = None, reduce_group: Any = None, reset: bool = True,
           timeout_s: float | None = None) -> dict[str, float]:
    """AReaL's ``stats_tracker.export``: ``export_all``, or (``key``) the merged values of
    that key's names only."""
    metrics = export_all(reduce_group, reset, timeout_s)
    if key is None:
        return metrics
    full = client().full_key(key)
    return {k: v for k, v in metrics.items() if k == full or k.startswith(full + "/")}
