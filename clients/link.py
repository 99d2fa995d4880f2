"""A rank's end of the fast path (see ``metricsvc.fastpath``): batches over TCP.

The link is an optimisation and never the only way: ``submit`` returns None
whenever it cannot deliver (no offer yet, batch too large, connection refused,
reset or silent for ``ack_timeout_s``) and the caller sends that batch as a Ray
call instead. After a failure the same offer is tried again only after a
cool-down that doubles, so a firewalled port costs one connect timeout now and
then, not one per step.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from typing import Any

from ray.exceptions import GetTimeoutError

from metricsvc.fastpath import ACK, HELLO_OK, LENGTH, MAGIC, REJECTED, REPLY
from metricsvc.validation import BatchRejected

log = logging.getLogger(__name__)


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    parts, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("the fast path closed the connection")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


class FastLink:
    """Send wire batches to the actor that offered a port; thread-safe, one socket."""

    def __init__(self, *, connect_timeout_s: float = 5.0, ack_timeout_s: float = 30.0,
                 label: str = "MetricWorker") -> None:
        self.connect_timeout_s = connect_timeout_s
        self.ack_timeout_s = ack_timeout_s
        self.label = label
        self._offer: dict[str, Any] | None = None
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._retry_at = 0.0
        self._cooldown_s = 0.0
        self.sends = 0  # batches delivered over the link
        self.failures = 0  # times the link could not deliver and Ray took over
        self.last_error: str | None = None

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def accept(self, offer: dict[str, Any] | None) -> None:
        """Take the offer from a Ray ack (a new one replaces the old link)."""
        if offer == self._offer:
            return
        with self._lock:
            self._close()
            self._offer = offer
            self._retry_at, self._cooldown_s = 0.0, 0.0

    def submit(self, payload: bytes, timeout_s: float | None = None) -> dict[str, Any] | None:
        """Send one batch and return the ack, or None if the link cannot deliver it.

        Raises:
            BatchRejected: the service refused the batch (nothing was merged).
            GetTimeoutError: no ack within ``timeout_s`` (the batch may have been merged;
                resending it is harmless), as a Ray call would.
            RuntimeError: the service failed unexpectedly on this batch.
        """
        offer = self._offer
        if offer is None or len(payload) > offer["max_frame"] or time.monotonic() < self._retry_at:
            return None
        wait = self.ack_timeout_s if timeout_s is None else min(timeout_s, self.ack_timeout_s)
        with self._lock:
            sent = False
            try:
                sock = self._sock or self._connect(offer)
                sock.settimeout(wait)
                sock.sendall(LENGTH.pack(len(payload)) + payload)
                sent = True
                status, length = REPLY.unpack(_recv_exact(sock, REPLY.size))
                body = json.loads(_recv_exact(sock, length))
            except (OSError, ValueError) as err:  # socket.timeout is an OSError
                self._fail(err)
                if sent and isinstance(err, socket.timeout) and timeout_s is not None \
                        and timeout_s <= self.ack_timeout_s:
                    raise GetTimeoutError(f"{self.label}: no ack within {timeout_s} s") from None
                return None
        if status == ACK:
            self.sends += 1
            self._cooldown_s = 0.0
            return body
        if status == REJECTED:
            raise BatchRejected(body["error"])
        raise RuntimeError(f"{self.label} failed on this batch: {body['error']}")

    # -- internals -----------------------------------------------------------------------
    def _connect(self, offer: dict[str, Any]) -> socket.socket:
        sock = socket.create_connection((offer["host"], offer["port"]),
                                        timeout=self.connect_timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(MAGIC + offer["token"].encode())
            if _recv_exact(sock, len(HELLO_OK)) != HELLO_OK:
                raise ConnectionError("unexpected hello reply")
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        return sock

    def _fail(self, err: BaseException) -> None:
        self._close()
        self.failures += 1
        self.last_error = f"{type(err).__name__}: {err}"
        self._cooldown_s = min(600.0, max(10.0, 2 * self._cooldown_s))
        self._retry_at = time.monotonic() + self._cooldown_s
        log.warning("%s fast path: %s; sending over Ray (next try in %.0f s)",
                    self.label, self.last_error, self._cooldown_s)

    def _close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None
