"""The fast path: a rank's per-step batch over a plain TCP connection, not a Ray call.

A Ray actor call costs about a millisecond of CPU spread over caller and actor
(task spec, gRPC, scheduling, the reply object); on a busy node that, not the
merge, bounds how many ranks one MetricWorker serves per step. A submit is small
and frequent, so the MetricWorker (and each combiner) also listens on a TCP port
in its own event loop, and a client that has been offered the port sends its
batches there: one length-prefixed frame out, one JSON ack back, the same
``submit`` code behind it.

The offer travels in the ack of a submit made over Ray (``ack["fast_path"]``), so
only callers who can already reach the actor learn the address and its token;
a connection must present the token before anything is read from it. The link is
not encrypted: where Ray itself runs with TLS (``RAY_USE_TLS``) it stays off. Whatever
goes wrong on the link (refused, reset, timed out, actor restarted) the client
drops it and sends that batch as a Ray call, which waits out restarts; the
``(step, rank, seq)`` dedup makes the second copy harmless.

Protocol (all integers big-endian):

    hello     client -> b"MSV1" + token (32 ASCII bytes); server -> b"OK"
    request   u32 length, then the wire bytes of one batch (metricsvc.wire)
    reply     u8 status (0 ack, 1 rejected, 2 error), u32 length, then UTF-8 JSON:
              the ack dict, or {"error": message}
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import secrets
import struct
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from metricsvc.validation import BatchRejected

log = logging.getLogger(__name__)

MAGIC = b"MSV1"
TOKEN_BYTES = 32
HELLO_OK = b"OK"
LENGTH = struct.Struct("!I")
REPLY = struct.Struct("!BI")
ACK, REJECTED, ERROR = 0, 1, 2
HELLO_TIMEOUT_S = 10.0

Submit = Callable[[bytes], Awaitable[dict[str, Any]]]


def ray_tls_enabled() -> bool:
    """Return True when Ray's own connections use TLS (``RAY_USE_TLS``): then the fast
    path, plain TCP with a token, stays off and batches go over Ray's encrypted calls."""
    return os.environ.get("RAY_USE_TLS", "0").strip().lower() in ("1", "true", "yes")


def wanted(enabled: bool, label: str) -> bool:
    """Return whether to serve the fast path, saying why not when TLS turns it off."""
    if enabled and ray_tls_enabled():
        log.info("%s: RAY_USE_TLS is set, so the fast path (plain TCP) is off", label)
        return False
    return enabled


def node_address() -> str:
    """Return this node's IP as Ray knows it (reachable from the cluster's other nodes)."""
    import ray

    return ray.util.get_node_ip_address()


class FastPathServer:
    """Serve ``submit(wire_bytes) -> ack`` on a TCP port, inside the running event loop.

    ``start`` is idempotent; ``offer`` is what a client needs to connect (address,
    token, largest frame). Every connection is authenticated by the token first;
    a frame larger than ``max_frame`` ends the connection (the client sends such a
    batch over Ray instead, where the same limit gives a clear rejection).
    """

    def __init__(self, submit: Submit, *, host: str | None, port: int, max_frame: int,
                 label: str) -> None:
        self._submit = submit
        self._host = host
        self._port = port
        self.max_frame = max_frame
        self.label = label
        self.token = secrets.token_hex(TOKEN_BYTES // 2)
        self._server: asyncio.base_events.Server | None = None
        self._starting: asyncio.Lock | None = None
        self._failed: str | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.counts: Counter[str] = Counter()
        self.address: tuple[str, int] | None = None

    async def start(self) -> dict[str, Any] | None:
        """Listen (once); return the offer, or None if the port could not be opened."""
        if self._server is None and self._failed is None:
            if self._starting is None:
                self._starting = asyncio.Lock()
            async with self._starting:
                if self._server is None and self._failed is None:
                    await self._listen()
        return self.offer()

    async def _listen(self) -> None:
        host = self._host or node_address()
        try:
            self._server = await asyncio.start_server(
                self._serve, host=host, port=self._port, limit=2**16)
        except OSError as err:  # taken port, unknown address: Ray calls still work
            self._failed = f"cannot listen on {host}:{self._port}: {err}"
            log.warning("%s: fast path off, submits use Ray calls (%s)", self.label, self._failed)
            return
        bound = self._server.sockets[0].getsockname()
        self.address = (host, int(bound[1]))
        log.info("%s: fast path listening on %s:%d", self.label, *self.address)

    def offer(self) -> dict[str, Any] | None:
        """Return what a client needs to use the link, or None when there is no link."""
        if self.address is None:
            return None
        return {"host": self.address[0], "port": self.address[1], "token": self.token,
                "max_frame": self.max_frame}

    def health(self) -> dict[str, Any]:
        """Return the link's state (never the token)."""
        address = None if self.address is None else f"{self.address[0]}:{self.address[1]}"
        return {"address": address,
                "error": self._failed, "open_connections": len(self._writers),
                **{k: self.counts[k] for k in ("connections", "refused", "frames", "rejected",
                                               "errors")}}

    async def close(self) -> None:
        """Stop listening and drop every connection."""
        if self._server is not None:
            self._server.close()
            for writer in list(self._writers):
                writer.close()
            self._server = None
            self.address = None

    # -- one connection ----------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            hello = await asyncio.wait_for(
                reader.readexactly(len(MAGIC) + TOKEN_BYTES), HELLO_TIMEOUT_S)
            if hello[:len(MAGIC)] != MAGIC or not hmac.compare_digest(
                    hello[len(MAGIC):], self.token.encode()):
                self.counts["refused"] += 1
                log.warning("%s: fast path refused a connection from %s (bad hello)",
                            self.label, writer.get_extra_info("peername"))
                return
            writer.write(HELLO_OK)
            self.counts["connections"] += 1
            self._writers.add(writer)
            while True:
                (length,) = LENGTH.unpack(await reader.readexactly(LENGTH.size))
                if length > self.max_frame:
                    self.counts["refused"] += 1
                    log.warning("%s: fast path frame of %d bytes over the %d limit; "
                                "connection closed", self.label, length, self.max_frame)
                    return
                payload = await reader.readexactly(length)
                writer.write(await self._reply(payload))
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError):
            pass  # the client went away or never said hello: nothing was half-merged
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _reply(self, payload: bytes) -> bytes:
        self.counts["frames"] += 1
        try:
            status, body = ACK, await self._submit(payload)
        except BatchRejected as err:
            self.counts["rejected"] += 1
            status, body = REJECTED, {"error": str(err)}
        except Exception as err:  # noqa: BLE001 - one bad frame must not end the service
            self.counts["errors"] += 1
            log.exception("%s: fast path submit failed", self.label)
            status, body = ERROR, {"error": f"{type(err).__name__}: {err}"}
        data = json.dumps(body).encode()
        return REPLY.pack(status, len(data)) + data
