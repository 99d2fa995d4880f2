"""The fast path: per-step batches over TCP to the actor, with Ray calls as the fallback.

Real actors on a real local Ray; the misbehaving peers are raw sockets."""

import json
import socket
import threading
from pathlib import Path

import numpy as np
import pytest
import ray
from ray.exceptions import GetTimeoutError

from clients import MetricClient
from clients.link import FastLink
from metricsvc.fastpath import ACK, HELLO_OK, LENGTH, MAGIC, REJECTED, REPLY, wanted
from metricsvc.wire import encode
from tests.helpers import wait_for_new_incarnation


def client(cfg, rank=0, world=1, **kwargs):
    return MetricClient(None, rank=rank, world_size=world, name=cfg.name, **kwargs)


def step(c, **metrics):
    c.submit_metric(metrics)
    return c.wait_submit()


def recv_all(sock, n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def hello(offer, token=None):
    sock = socket.create_connection((offer["host"], offer["port"]), timeout=10)
    sock.sendall(MAGIC + (token or offer["token"]).encode())
    return sock


def test_batches_after_the_first_go_over_tcp_and_merge_exactly_as_over_ray(make_worker):
    fast, fast_cfg = make_worker()
    slow, slow_cfg = make_worker(fast_path={"enabled": False})
    rng = np.random.default_rng(7)
    world, steps = 3, 4
    data = [[{f"k/{i}/mean": float(x) for i, x in enumerate(rng.normal(size=3 + 2 * r))}
             for r in range(world)] for _ in range(steps)]  # unequal key sets per rank
    for cfg in (fast_cfg, slow_cfg):
        clients = [client(cfg, r, world) for r in range(world)]
        for s in range(steps):
            for r, c in enumerate(clients):
                ack = step(c, **data[s][r])
                assert ack["status"] == "merged" and "fast_path" not in ack  # no token leaks
        assert all(c.link.sends == (steps - 1 if cfg is fast_cfg else 0) for c in clients)
    for s in range(steps):
        got = ray.get(fast.wait_final.remote(s, 10))
        assert got["metrics"] == ray.get(slow.wait_final.remote(s, 10))["metrics"]  # bit for bit
        assert got["meta"]["ranks"] == [0, 1, 2] and not got["meta"]["partial"]
    health = ray.get(fast.health.remote())
    assert health["calls"]["submit"] == world * steps
    assert health["fast_path"]["frames"] == world * (steps - 1)
    assert health["fast_path"]["connections"] == world and health["fast_path"]["refused"] == 0
    assert ray.get(slow.health.remote())["fast_path"] is None


def test_a_rejection_over_tcp_names_the_key_and_the_rule_and_nothing_else_is_lost(make_worker):
    handle, cfg = make_worker()
    a, b = client(cfg, 0, 2), client(cfg, 1, 2)
    step(a, x=1.0)
    step(b, x=3.0)
    step(a, x=2.0)  # step 1, over TCP
    b.stat(x=np.array([5.0, 7.0]))  # the same key as another reduce kind: refused
    with pytest.raises(ValueError, match=r"key 'x': recorded as AUTO, but rank 1 .* AVG_MIN_MAX"):
        b.wait_submit()
    assert b.link.connected and b.link.failures == 0  # a refusal is an answer, not a failure
    step(b, x=4.0)
    assert ray.get(handle.wait_final_res.remote(1, 10)) == {"x": 3.0}
    health = ray.get(handle.health.remote())
    assert health["rejected_batches"] == 1 and health["fast_path"]["rejected"] == 1
    assert health["pending_steps"] == {}


def test_connections_without_the_token_or_with_oversized_frames_are_dropped(make_worker):
    handle, cfg = make_worker()
    c = client(cfg)
    step(c, x=1.0)
    offer = c.link._offer
    with hello(offer, token="0" * 32) as sock:  # wrong token: closed, nothing read or merged
        sock.sendall(LENGTH.pack(4) + b"junk")
        assert recv_all(sock, 16) == b""
    with hello(offer) as sock:
        assert recv_all(sock, len(HELLO_OK)) == HELLO_OK
        sock.sendall(LENGTH.pack(5) + b"junk!")  # the token, but not a batch: a rejection
        status, length = REPLY.unpack(recv_all(sock, REPLY.size))
        assert status == REJECTED
        assert "malformed wire batch" in json.loads(recv_all(sock, length))["error"]
        sock.sendall(LENGTH.pack(offer["max_frame"] + 1))  # too large: closed unread
        assert recv_all(sock, 16) == b""
    step(c, x=2.0)  # the service went on; the client's own link is untouched
    assert ray.get(handle.wait_final_res.remote(1, 10)) == {"x": 2.0}
    health = ray.get(handle.health.remote())
    assert health["fast_path"]["refused"] == 2 and health["fast_path"]["rejected"] == 1
    assert c.link.sends == 1 and c.link.failures == 0
    assert offer["token"] not in json.dumps(health, default=str)  # never shown


def test_an_unreachable_link_falls_back_to_ray_and_a_new_offer_restores_it(make_worker):
    handle, cfg = make_worker()
    c = client(cfg)
    step(c, x=1.0)
    closed = socket.socket()
    closed.bind((c.link._offer["host"], 0))
    port = closed.getsockname()[1]
    closed.close()  # nobody listens there now
    c.link.accept({**c.link._offer, "port": port})
    step(c, x=2.0)  # refused -> sent as a Ray call; its ack carries the real offer again
    assert c.link.failures == 1 and c.link.sends == 0
    step(c, x=3.0)
    assert c.link.sends == 1 and c.rpc_count == 3
    assert [ray.get(handle.wait_final_res.remote(s, 10))["x"] for s in range(3)] == [1, 2, 3]


def test_a_restarted_actor_gets_the_batch_over_ray_and_offers_a_new_link(make_worker):
    handle, cfg = make_worker(sinks={"console": None, "jsonl": {}})
    c = client(cfg)
    for s in range(3):
        step(c, x=float(s))
    old = dict(c.link._offer)
    epoch = ray.get(handle.health.remote())["epoch"]
    assert ray.get(handle.flush.remote())  # the journal holds steps 0-2
    ray.kill(handle, no_restart=False)
    wait_for_new_incarnation(handle, epoch)  # so no batch can reach the dying one
    step(c, x=3.0)  # the old connection is dead: sent as a Ray call, whose ack re-offers
    step(c, x=4.0)
    assert c.link.failures == 1  # the dead connection, once; then the new offer
    assert c.link._offer["token"] != old["token"] and c.link.connected
    assert [ray.get(handle.wait_final_res.remote(s, 30))["x"] for s in (3, 4)] == [3.0, 4.0]
    health = ray.get(handle.health.remote())
    assert health["restored_steps"] == 3 and health["fast_path"]["frames"] == 1


class SilentServer:
    """Says hello, reads one frame, never answers: a hung actor as the link sees it."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.offer = {"host": "127.0.0.1", "port": self.sock.getsockname()[1],
                      "token": "t" * 32, "max_frame": 1 << 20}
        self.conns = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            recv_all(conn, len(MAGIC) + 32)
            conn.sendall(HELLO_OK)

    def close(self):
        self.sock.close()
        for conn in self.conns:
            conn.close()


def test_a_silent_peer_never_hangs_the_client():
    server = SilentServer()
    try:
        link = FastLink(ack_timeout_s=0.5)
        link.accept(server.offer)
        with pytest.raises(GetTimeoutError):  # the caller's own timeout, as a Ray call
            link.submit(b"batch", timeout_s=0.2)
        assert link.submit(b"batch") is None  # within the cool-down: Ray at once
        link._retry_at = 0.0
        assert link.submit(b"batch") is None  # no ack within ack_timeout_s: Ray takes over
        assert link.failures == 2 and not link.connected
    finally:
        server.close()


def test_a_batch_larger_than_the_offered_frame_goes_over_ray():
    link = FastLink()
    link.accept({"host": "127.0.0.1", "port": 9, "token": "t" * 32, "max_frame": 8})
    assert link.submit(b"123456789") is None and link.failures == 0  # not even tried


def test_the_ack_reply_format_round_trips(make_worker):
    handle, cfg = make_worker()
    c = client(cfg)
    step(c, x=1.0)
    c.submit_metric({"x": 2.0})
    batch = c.buffer.take_batch(step=1, rank=0, world_size=1, seq=99, final=True)
    with hello(c.link._offer) as sock:
        assert recv_all(sock, 2) == HELLO_OK
        blob = encode(batch)
        for _ in range(2):  # the second copy is a duplicate, answered, not merged again
            sock.sendall(LENGTH.pack(len(blob)) + blob)
            status, length = REPLY.unpack(recv_all(sock, REPLY.size))
            assert status == ACK
            ack = json.loads(recv_all(sock, length))
        assert ack["status"] == "duplicate" and ack["step"] == 1 and ack["seq"] == 99
    assert ray.get(handle.wait_final_res.remote(1, 10)) == {"x": 2.0}


@pytest.mark.parametrize("value, serve", [("1", False), ("true", False), ("0", True), ("", True)])
def test_where_ray_uses_tls_the_plain_tcp_link_stays_off(monkeypatch, value, serve):
    monkeypatch.setenv("RAY_USE_TLS", value)
    assert wanted(True, "MetricWorker 't'") is serve
    assert wanted(False, "MetricWorker 't'") is False


def test_after_a_restart_an_owed_older_step_is_resent_before_the_new_one(make_worker):
    # One rank, so the new step would finish at once: the older step the journal lost must
    # reach the new incarnation first, or it could only arrive late.
    handle, cfg = make_worker(sinks={"console": None, "jsonl": {}})
    c = client(cfg)
    for s in range(3):
        step(c, x=float(s))
    owed = [b.step for b in c._inflight]  # sent, not yet acked as journaled
    assert 2 in owed, f"precondition: step 2 not yet acked as durable, got {owed}"
    epoch = ray.get(handle.health.remote())["epoch"]
    run_dir = Path(ray.get(handle.health.remote())["run_dir"])
    assert ray.get(handle.flush.remote())
    journal = run_dir / "metrics.jsonl"
    lines = journal.read_text().splitlines(keepends=True)
    journal.write_text("".join(lines[:2]))  # as if the actor died before writing step 2
    ray.kill(handle, no_restart=False)
    wait_for_new_incarnation(handle, epoch)
    step(c, x=3.0)
    # The new incarnation reloaded steps 0 and 1: only what its journal lacks is resent
    # (how many steps were owed before depends on how far the journal writer had got).
    assert c.resent == len([s for s in owed if s > 1])
    assert [ray.get(handle.wait_final_res.remote(s, 30))["x"] for s in (2, 3)] == [2.0, 3.0]
    health = ray.get(handle.health.remote())
    assert health["calls"]["epoch_changed"] == 1 and health["late_batches"] == 0
