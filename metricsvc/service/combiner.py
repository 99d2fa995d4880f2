"""Node-level pre-aggregation: one Combiner actor per node gathers its local ranks' batches
and forwards each step to the MetricWorker in one call.

The combiner forwards the batches themselves (``submit_many``), not a pre-merged
sum: the MetricWorker still merges every rank's contribution in rank order, so
results are bit-for-bit those of the flat topology, and every step-protocol rule
(final flags, duplicates, late batches, straggler timeouts) applies unchanged. What
shrinks is the number of calls the singleton serves: one per node per step.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import ray

from metricsvc.config import ConfigSource, ServiceConfig, load_config
from metricsvc.core.keys import combiner_name
from metricsvc.core.limits import RETRY_S
from metricsvc.core.wire import Batch, encode, receive
from metricsvc.errors import ServiceUnavailable
from metricsvc.service.observe import CombinerMetrics
from metricsvc.transport import ACTOR_ERRORS, Outbox, backoff, is_stale, next_pause

log = logging.getLogger(__name__)

@dataclass
class _Gathering:
    opened: float
    batches: list[bytes] = field(default_factory=list)  # as they came: wire bytes
    waiters: list[asyncio.Future] = field(default_factory=list)  # each batch's answer
    closed: set[int] = field(default_factory=set)


class CombinerImpl:
    """Actor body of a combiner; start one with ``start_combiner``."""

    def __init__(self, config: ConfigSource = None, label: str = "0") -> None:
        self.config: ServiceConfig = load_config(config)
        self.label = label
        self.epoch = uuid.uuid4().hex
        self.node = ray.get_runtime_context().get_node_id()
        self.local_ranks: set[int] = set()
        self._gathering: dict[int, _Gathering] = {}
        self._forwarded_through: int | None = None
        # Forwarded but not yet journaled, and the MetricWorker incarnation last heard
        # from: the restart protocol, shared with the client.
        self._outbox = Outbox(label=f"combiner {label!r}")
        self.journal_through: int | None = None
        self.rewinds: list[int] | None = None  # the run's, as the MetricWorker last said
        self.last_final_step: int | None = None
        self.calls = {"submit": 0, "forward": 0, "rejected_upstream": 0}
        self.forwarded_batches = 0
        self.last_error: str | None = None
        self.waiting = 0  # ranks' submits waiting for their batch's answer
        self._ticker: asyncio.Task[None] | None = None
        self._lock: asyncio.Lock | None = None
        self.metrics = CombinerMetrics(self.config.name, label, self.node,
                                       self.config.metrics.enabled)  # Ray's metrics

    # -- ranks -------------------------------------------------------------------------
    async def register(self, rank: int) -> None:
        """Count ``rank`` among this node's ranks (clients call it when they start)."""
        self.local_ranks.add(int(rank))

    async def submit(self, item: Batch | bytes, epoch: str | None = None) -> dict[str, Any]:
        """Take a local rank's batch; forward the step once every local rank closed it;
        answer what the MetricWorker answered for this batch: its status and notice, or
        the very refusal it raised (the flat topology's, word for word).

        Like the MetricWorker's: a client that last heard from another incarnation
        (``epoch``) is told ``epoch_changed`` and nothing is taken, so it resends its
        older batches first."""
        if is_stale(epoch, self.epoch):
            self.calls["epoch_changed"] = self.calls.get("epoch_changed", 0) + 1
            return self._ack("epoch_changed")
        return await self._submit(item)

    async def _submit(self, item: Batch | bytes) -> dict[str, Any]:
        self.calls["submit"] += 1
        batch = receive(item, self.config.limits.to_limits())
        blob = item if isinstance(item, bytes) else encode(batch)
        self._ensure_ticker()
        self.local_ranks.add(batch.rank)
        step = batch.step
        waiter = asyncio.get_running_loop().create_future()
        if self._forwarded_through is not None and step <= self._forwarded_through \
                and step not in self._gathering:
            await self._forward(step, [blob], [waiter])  # late or resent: upstream decides
        else:
            g = self._gathering.setdefault(step, _Gathering(time.monotonic()))
            g.batches.append(blob)
            g.waiters.append(waiter)
            if batch.final:
                g.closed.add(batch.rank)
            if self.local_ranks <= g.closed:
                await self._forward_gathered(step)
        self.waiting += 1
        try:
            answer = await waiter
        finally:
            self.waiting -= 1
        if isinstance(answer, BaseException):
            raise answer  # the MetricWorker's refusal, as the flat topology raises it
        return self._ack(**answer)

    def _ack(self, status: str, **extra: Any) -> dict[str, Any]:
        return {"status": status, "epoch": self.epoch, "rewinds": self.rewinds,
                "journal_through": self.journal_through,
                "last_final_step": self.last_final_step, **extra}

    # -- upstream ----------------------------------------------------------------------
    def _upstream(self) -> Any:
        try:
            return ray.get_actor(self.config.name, namespace=self.config.namespace)
        except ValueError:  # no such actor (a restarting one keeps its name): gone for good
            raise ServiceUnavailable(
                f"MetricWorker {self.config.name!r} (submit_many): it is dead for good (no "
                f"actor of that name in namespace {self.config.namespace!r}: stopped, or out "
                f"of restarts)") from None

    async def _call_upstream(self, batches: list[bytes]) -> dict[str, Any]:
        pauses = backoff(RETRY_S)
        while True:
            upstream = self._upstream()
            try:
                return await upstream.submit_many.remote(batches, self._outbox.epoch,
                                                         self._report())
            except ACTOR_ERRORS as err:  # the one retry rule (dead for good: at once)
                await asyncio.sleep(next_pause(err, "submit_many", pauses, RETRY_S,
                                               f"MetricWorker {self.config.name!r}"))

    async def _forward_gathered(self, step: int) -> None:
        gathered = self._gathering.pop(step)
        await self._forward(step, gathered.batches, gathered.waiters)

    async def _forward(self, step: int, batches: list[bytes],
                       waiters: list[asyncio.Future]) -> None:
        try:
            answers = await self._deliver(step, batches)
        except Exception as err:  # every rank waiting on this forward hears it
            self.last_error = f"{type(err).__name__}: {err}"
            answers = [err] * len(batches)
        for waiter, answer in zip(waiters, answers):
            if not waiter.done():
                waiter.set_result(answer)

    async def _deliver(self, step: int, batches: list[bytes]) -> list[Any]:
        """Forward ``batches`` (of ``step``) through the restart protocol; return the
        MetricWorker's answer to each."""
        # Marked before the first await: a batch of this step arriving while the forward is
        # in flight is forwarded too, never gathered again to wait for ranks already sent.
        if self._forwarded_through is None or step > self._forwarded_through:
            self._forwarded_through = step
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:  # one forward at a time keeps steps in order upstream
            self._outbox.sent(step, batches)
            exchange = self._outbox.exchange(batches)
            payload = next(exchange)
            while True:
                ack = await self._call_upstream(payload)
                if ack["status"] != "epoch_changed":
                    self._note_rejections(ack)
                try:
                    payload = exchange.send(ack)
                except StopIteration as done:
                    ack = done.value
                    break
            self.calls["forward"] += 1
            self.forwarded_batches += len(batches)
            self.journal_through = ack.get("journal_through")
            self.rewinds = ack.get("rewinds")
            self.last_final_step = ack.get("last_final_step")
            self.metrics.report({**self._report(),
                                 "rejected_upstream": self.calls["rejected_upstream"]})
        return list(ack.get("answers", ()))

    def _note_rejections(self, ack: dict[str, Any]) -> None:
        for answer in ack.get("answers", ()):
            if isinstance(answer, BaseException):
                self.calls["rejected_upstream"] += 1
                self.last_error = f"{type(answer).__name__}: {answer}"
                log.warning("combiner %s: the MetricWorker refused a batch: %s", self.label,
                            answer)

    # -- time --------------------------------------------------------------------------
    def _ensure_ticker(self) -> None:
        if self._ticker is None:
            self._ticker = asyncio.get_running_loop().create_task(self._tick())

    async def _tick(self) -> None:
        timeout = self.config.combiner_timeout_s
        while True:
            await asyncio.sleep(min(1.0, timeout / 4))
            now = time.monotonic()
            for step in sorted(self._gathering):
                if now - self._gathering[step].opened >= timeout:
                    # A local straggler: forward what is here; the MetricWorker's own
                    # straggler timeout decides whether the step ends partial.
                    await self._forward_gathered(step)

    async def flush(self) -> int:
        """Forward every step still gathering; return how many were forwarded."""
        steps = sorted(self._gathering)
        for step in steps:
            await self._forward_gathered(step)
        return len(steps)

    def _report(self) -> dict[str, Any]:
        """What the MetricWorker shows of this combiner (``health()["combiners"]``)."""
        return {"label": self.label, "node": self.node, "ranks": sorted(self.local_ranks),
                "batches_forwarded": self.forwarded_batches, "in_flight": len(self._outbox),
                "waiting": self.waiting, "last_error": self.last_error}

    def health(self) -> dict[str, Any]:
        """Return this combiner's state."""
        return {**self._report(), "epoch": self.epoch, "local_ranks": sorted(self.local_ranks),
                "gathering": {s: sorted(g.closed) for s, g in sorted(self._gathering.items())},
                "forwarded_through": self._forwarded_through,
                "journal_through": self.journal_through, "inflight": len(self._outbox),
                "calls": {**self.calls, "resent": self._outbox.resent,
                          "superseded": self._outbox.superseded},
                "metrics_export": "on" if self.metrics.off is None else self.metrics.off}


Combiner = ray.remote(num_cpus=0, max_restarts=3, max_concurrency=1088)(
    type("Combiner", (CombinerImpl,), {"__doc__": CombinerImpl.__doc__}))
# (Named Combiner so that Ray's log lines read "(Combiner pid=...)", as the MetricWorker's.)

# Ray ends an actor once no handle refers to it; the combiners a driver starts live as
# long as the driver does.
_started: dict[str, Any] = {}


def start_combiner(config: ConfigSource, label: str, *, node_id: str | None = None) -> Any:
    """Create (or return) the combiner ``label`` of the service ``config`` names.

    With ``node_id`` the combiner is pinned to that node; ranks there find it by
    their node id. Without, it is a logical group: ranks name it with ``via=label``.
    A ``node_id`` that is not (or no longer) an alive node is refused naming it.
    """
    cfg = load_config(config)
    handle = _create(cfg, label, node_id)
    if not _placed(handle, node_id):
        raise ValueError(
            f"combiner {label!r}: node {node_id} is not alive (removed from the cluster?); "
            f"start combiners on the nodes ray.nodes() lists alive")
    _started[combiner_name(cfg.name, label)] = handle
    return handle


def stop_combiners(service: str) -> int:
    """End the combiners this driver started for service ``service`` (its per-node ones and
    those of ``start_combiner``); return how many. Held here, each would outlive its run
    as a process forwarding to nothing, and a new service of the same name would find it
    (by name) with the old run's config."""
    prefix = combiner_name(service, "")
    mine = [name for name in _started if name.startswith(prefix)]
    for name in mine:
        try:
            ray.kill(_started.pop(name), no_restart=True)
        except Exception as err:  # noqa: BLE001  gone already (its node removed, say)
            log.debug("combiner %s: %s", name, err)
    return len(mine)


def start_node_combiners(cfg: ServiceConfig, node_ids: list[str]) -> dict[str, Any]:
    """Start a combiner on each of ``node_ids`` (all created at once, then waited for) and
    return them by node id. A node that is gone by the time its combiner is placed (an
    autoscaler removed it after the listing was read) runs no rank: it is left out."""
    handles = {node: _create(cfg, node, node) for node in node_ids}
    started = {}
    for node, handle in handles.items():
        if _placed(handle, node):
            started[node] = _started[combiner_name(cfg.name, node)] = handle
        else:
            ray.kill(handle)
    return started


def _placed(handle: Any, node_id: str | None) -> bool:
    """Wait for a created combiner to answer: True once it does, False where its node is
    gone (it can never be placed); anything else raises."""
    try:
        ray.get(handle.health.remote())
    except (ray.exceptions.ActorUnschedulableError, ray.exceptions.RayActorError):
        if node_id is None or _alive(node_id):
            raise
        return False
    return True


def _create(cfg: ServiceConfig, label: str, node_id: str | None) -> Any:
    options: dict[str, Any] = {}
    if node_id is not None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
    return Combiner.options(  # type: ignore[attr-defined]
        name=combiner_name(cfg.name, label), namespace=cfg.namespace, get_if_exists=True,
        **options,
    ).remote(cfg.model_dump(), label)


def _alive(node_id: str) -> bool:
    return any(n["NodeID"] == node_id and n.get("Alive") for n in ray.nodes())
