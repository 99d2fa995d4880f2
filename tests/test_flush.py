"""flush(): closing a step costs the training loop a host copy, an encoding and the Ray
call made (the answer not waited for), never an actor round trip; acks are read
later, errors still reach the caller, in-flight flushes are bounded, and what a restarted
actor lost is resent (issue 15)."""

import os
import signal
import threading

import numpy as np
import pytest
import ray

from metricsvc.client import MetricClient
from metricsvc.errors import BatchRejected
from tests.helpers import Logged, sigkill, wait_for_new_incarnation


class Paused:
    """SIGSTOP the actor's process for the ``with`` block: it answers nothing meanwhile."""

    def __init__(self, handle):
        self.pid = ray.get(handle.health.remote(), timeout=30)["pid"]

    def __enter__(self):
        os.kill(self.pid, signal.SIGSTOP)
        return self

    def __exit__(self, *exc):
        os.kill(self.pid, signal.SIGCONT)


def calling_threads(client: MetricClient) -> list[threading.Thread]:
    """Record, from now on, the thread that makes each of ``client``'s actor calls."""
    callers, issue = [], client.service.issue

    def recording(*args):
        callers.append(threading.current_thread())
        return issue(*args)

    client.service.issue = recording
    return callers


def test_flush_returns_while_the_actor_answers_nothing_and_acks_come_later(make_worker):
    handle, cfg = make_worker(world_size=1)
    c = MetricClient(None, rank=0, world_size=1, name=cfg.name)
    c.submit_metric({"x": 1.0})
    c.wait_submit()  # the blocking meaning, siiRL's
    with Paused(handle):
        for step in (1, 2):
            c.submit_metric({"x": float(step + 1)})
            c.flush()  # returns though the actor is stopped
        assert c.in_flight == 2 and c.step == 3
        with pytest.raises(ray.exceptions.GetTimeoutError):
            c.wait_acks(timeout_s=0.3)
    acks = c.wait_acks(timeout_s=30)
    assert [a["step"] for a in acks] == [1, 2] and c.in_flight == 0 and c.rpc_count == 3
    assert [c.wait_final_res(s, 30)["x"] for s in (0, 1, 2)] == [1.0, 2.0, 3.0]


def test_a_refused_flush_raises_at_the_next_call_naming_its_step(make_worker):
    handle, cfg = make_worker(world_size=1, limits={"max_keys_per_batch": 3})
    c = MetricClient(None, rank=0, world_size=1, name=cfg.name)
    c.submit_metric({f"k{i}": 1.0 for i in range(5)})  # more keys than the service takes
    c.flush()
    c.submit_metric({"ok": 1.0})
    with pytest.raises(BatchRejected) as err:
        c.wait_acks(timeout_s=30)
    assert "max_keys_per_batch" in str(err.value) or "keys" in str(err.value)
    assert any("step 0" in note for note in err.value.__notes__)
    c.wait_submit()  # the next step still goes through; the actor is healthy
    assert ray.get(handle.wait_final_res.remote(1, 30)) == {"ok": 1.0}
    assert ray.get(handle.health.remote())["rejected_batches"] == 1


def test_in_flight_flushes_are_bounded(make_worker):
    handle, cfg = make_worker(world_size=1)
    c = MetricClient(None, rank=0, world_size=1, name=cfg.name, max_unacked=2)
    c.submit_metric({"x": 0.0})
    c.wait_submit()
    done = threading.Event()
    with Paused(handle):
        for step in (1, 2):
            c.submit_metric({"x": float(step)})
            c.flush()
        c.submit_metric({"x": 3.0})
        third = threading.Thread(target=lambda: (c.flush(), done.set()), daemon=True)
        third.start()
        assert not done.wait(0.5), "a third flush must wait for the oldest ack"
        assert c.in_flight == 2
    assert done.wait(30)
    c.wait_acks(30)
    assert ray.get(handle.wait_final_res.remote(3, 30)) == {"x": 3.0}


def test_flushes_the_actor_never_journaled_are_resent_to_its_next_incarnation(make_worker):
    handle, cfg = make_worker(world_size=1, sinks={"console": None, "jsonl": {}})
    c = MetricClient(None, rank=0, world_size=1, name=cfg.name)
    for step in range(2):
        c.submit_metric({"x": float(step)})
        c.flush()
    c.wait_acks(30)
    health = ray.get(handle.health.remote())
    with Paused(handle):
        for step in (2, 3, 4):
            c.submit_metric({"x": float(step)})
            c.flush()  # sent to a process that will never read them
        os.kill(health["pid"], signal.SIGKILL)
    wait_for_new_incarnation(handle, health["epoch"])
    c.submit_metric({"x": 5.0})
    c.flush()
    c.wait_acks(60)
    assert [ray.get(handle.wait_final_res.remote(s, 30))["x"] for s in range(6)] == \
        [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    after = ray.get(handle.health.remote())
    assert after["late_batches"] == 0 and after["calls"]["epoch_changed"] >= 1
    assert c.in_flight == 0


def test_a_flush_with_nothing_in_flight_makes_its_call_on_the_callers_thread(make_worker):
    """The caller makes the call of a flush whose predecessor is answered, its first
    included (Ray finds the actor and connects to it after a handle's first call returns:
    a rank actor ended right after the method that flushed its first step lost that step
    15 times of 15 when a sender thread made the call, 5 of 30 when the caller makes it).
    Handing each call to a sender thread cost the rank's process 76 us of CPU a step at
    W = 4, K = 30 and 160 us at W = 16 (a thread woken per step), for 0.5-2 ms less of the
    rank's wall in flush() on 2 cores shared by every rank."""
    handle, cfg = make_worker(world_size=1)
    c = MetricClient(None, rank=0, world_size=1, name=cfg.name)
    callers = calling_threads(c)
    for step in range(3):
        c.submit_metric({"x": float(step)})
        c.flush()
        c.wait_acks(timeout_s=30)  # answered before the next: each step a call of its own
    assert callers == [threading.current_thread()] * 3
    assert c.wait_final_res(2, 30) == {"x": 2.0}


def test_back_to_back_flushes_arrive_in_step_order(make_worker):
    """Ray does not promise to run an actor's calls in the order sent; flushes sent without
    waiting used to overtake each other, and with one rank a step was published before its
    predecessor arrived, which then counted as late (its data never merged)."""
    handle, cfg = make_worker(world_size=1, sinks={"console": None, "jsonl": {}})
    c = MetricClient(None, rank=0, world_size=1, name=cfg.name, max_unacked=8)
    rng = np.random.default_rng(0)
    steps = 40
    for step in range(steps):
        big = rng.normal(size=(64, 512))  # large enough for Ray's object store
        c.stat(x=big)
        c.submit_metric({f"k{i}": float(step) for i in range(2000)})
        c.flush()
    c.wait_acks(60)
    health = ray.get(handle.health.remote())
    assert health["late_batches"] == 0 and health["batches"] == steps
    for step in range(steps):
        assert ray.get(handle.wait_final_res.remote(step, 30))["k0"] == float(step)


def test_discard_after_a_timed_out_close_withdraws_nothing_sent_and_says_so(make_worker):
    """wait_submit timed out, then discard() said it dropped the record, yet the step was
    published with it (loss 501.5, 1000.0 included), and closing again was refused as
    'two clients with rank 0?'. A sent batch cannot be withdrawn: discard() now counts
    only what it withdrew, says the step may hold the batch, and the step agrees."""
    from metricsvc.client import ServiceNotice

    handle, cfg = make_worker(world_size=1)
    c = MetricClient(None, rank=0, world_size=1, name=cfg.name)
    c.stat(loss=np.array([3.0, 1000.0]))
    with Paused(handle), pytest.raises(ray.exceptions.GetTimeoutError):
        c.wait_submit(timeout_s=0.5, step=0)
    with pytest.warns(ServiceNotice, match="step 0's batch: wait_submit closed that step "
                                           ".* may have been merged"):
        assert c.discard() == 0  # nothing was withdrawn
    c.stat(loss=np.array([1.0]))
    c.wait_submit(step=1, timeout_s=30)  # the next step is not refused as a conflict
    c.wait_acks(timeout_s=30)
    first = ray.get(handle.wait_final.remote(step=0, timeout_s=30))
    assert first["metrics"]["loss/mean"] == 501.5 and first["meta"]["ranks"] == [0]
    assert ray.get(handle.wait_final_res.remote(1, 30))["loss/mean"] == 1.0


def test_a_refusal_raised_at_a_later_flush_never_costs_that_flush_its_step(make_worker):
    """flush(step=1) raised step 0's refusal before closing step 1: with the README's
    `except: discard()` step 1 was never published, and the error named only step 0."""
    handle, cfg = make_worker(world_size=1, limits={"max_keys_per_batch": 3})
    c = MetricClient(None, rank=0, world_size=1, name=cfg.name)
    c.submit_metric({f"k{i}": 1.0 for i in range(5)})  # more keys than the service takes
    c.flush(step=0)
    assert c.sender.wait_until(1, timeout_s=30)  # its answer is in before step 1 is closed
    c.submit_metric({"ok": 1.0})
    try:
        c.flush(step=1)
    except BatchRejected as err:
        notes = " ".join(err.__notes__)
        assert "step 0" in notes and "step 1 was handed over before" in notes
        assert c.discard() == 0  # the pattern a training loop uses: nothing left to drop
    else:
        raise AssertionError("step 0's refusal was not raised")
    c.wait_acks(timeout_s=30)
    assert ray.get(handle.wait_final_res.remote(1, 30)) == {"ok": 1.0}


def test_log_with_a_step_records_and_closes_it_as_wandb_and_verl_do(make_worker):
    """``log(metrics, step=)``: verl's ``Tracking.log(data, step)`` and ``wandb.log`` moved
    over as they are; ``commit=False`` builds one step over several calls."""
    from metricsvc.client import StepMismatch

    handle, cfg = make_worker(world_size=2)
    ranks = [MetricClient(None, rank=r, world_size=2, name=cfg.name) for r in range(2)]
    for step in (3, 4):  # steps named by the caller, as a resumed loop does
        for r, c in enumerate(ranks):
            c.log({"actor/pg_loss": float(step + r)}, step=step, commit=False)
            c.log({"response_length/max": float(10 * step + r)}, step=step)
    got = [ray.get(handle.wait_final_res.remote(s, 30)) for s in (3, 4)]
    assert [g["actor/pg_loss"] for g in got] == [3.5, 4.5]  # the mean over ranks
    assert [g["response_length/max"] for g in got] == [31.0, 41.0]  # a max by its name
    assert all(c.step == 5 and c.rpc_count == 2 for c in ranks)  # one message per step
    ranks[0].log({"x": 1.0}, step=5, commit=False)
    with pytest.raises(StepMismatch, match=r"log\(step=6\)"):
        ranks[0].log({"x": 2.0}, step=6)  # step 5's record was never closed
    with pytest.raises(TypeError, match="step must be an int"):
        ranks[0].log({"x": 2.0}, step=-1)


def with_idle_sender(make_worker) -> MetricClient:
    """A client of a fresh service whose sender thread delivered step 2 and is idle: step
    1's answer was not in at step 2's flush (the actor paused), so the thread took over."""
    handle, cfg = make_worker(world_size=1)
    c = MetricClient(None, rank=0, world_size=1, name=cfg.name)
    c.submit_metric({"x": 0.0})
    c.wait_submit()
    with Paused(handle):  # an answer not in at the next flush: the thread waits for it
        c.submit_metric({"x": 1.0})
        c.flush()
        c.submit_metric({"x": 2.0})
        c.flush()
    c.wait_acks(timeout_s=30)
    return c


def test_a_flush_wakes_no_thread_when_the_answer_before_it_is_in(make_worker):
    """A flush whose predecessor's answer is in by then reads it and makes its own call on
    the caller's thread: no thread wakes. Only an answer still out (the actor busy) hands
    the batch to the sender thread, which waits for it and delivers in step order."""
    c = with_idle_sender(make_worker)
    assert c.sender._thread is not None  # started for step 1's answer, idle now
    woken = c.sender.wakes
    callers = calling_threads(c)
    for step in range(3, 13):  # each answer in before the next flush: read by that flush
        c.submit_metric({"x": float(step)})
        c.flush()
        ray.wait([c.sender._pending[2]], timeout=30)
    c.wait_acks(timeout_s=30)
    assert c.sender.wakes == woken  # no thread woke
    assert callers == [threading.current_thread()] * 10
    assert c.rpc_count == 13
    assert [c.wait_final_res(s, 30)["x"] for s in (0, 3, 12)] == [0.0, 3.0, 12.0]


def test_an_answer_still_out_when_the_looker_looks_stays_for_the_callers_next_flush(
        make_worker):
    """The looker looks at an answer the caller has left unread for ``UNREAD_S``. One not
    in yet stays the caller's: the looker looks again later, and the next flush, the
    answer in by then, reads it and makes its own call. The sender thread took the batch
    over instead and waited for the answer itself: a flush that came before it had
    handled the answer was queued behind it, and on 2 cores with 1024 ranks' clients in 4
    processes (``bench_scale``) that doubled the latency from the last flush to the final
    result per node (320-370 ms before, 515-880 ms)."""
    import time

    handle, cfg = make_worker(world_size=1)
    c = MetricClient(None, rank=0, world_size=1, name=cfg.name)
    c.submit_metric({"x": 0.0})
    c.wait_submit()
    callers = calling_threads(c)
    sender = c.sender
    with Paused(handle):  # no answer while the looker looks
        c.submit_metric({"x": 1.0})
        c.flush()
        first = sender._pending_at
        deadline = time.monotonic() + 30
        while sender._pending is not None and sender._pending_at == first:  # its look
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert sender._pending is not None and not sender._queue  # still the caller's
    ray.wait([sender._pending[2]], timeout=30)  # the answer is in
    c.submit_metric({"x": 2.0})
    c.flush()
    assert not sender._queue  # read by the flush, which made its own call
    c.wait_acks(timeout_s=30)
    assert callers == [threading.current_thread()] * 2
    assert [c.wait_final_res(s, 30)["x"] for s in (0, 1, 2)] == [0.0, 1.0, 2.0]


def test_answers_many_clients_leave_unread_are_read_by_one_looker_not_a_thread_each(
        make_worker):
    """A process of many ranks' clients (a node's, or 256 simulated ranks in
    ``bench_scale``) whose callers leave their answers unread: one thread reads them all,
    looking once a second with one ``ray.wait``. Each client's own sender thread woke to
    look at its own: 1024 such threads on 2 cores made the time from the last flush to
    the final result 40-75 % longer (``bench_scale --worlds 1024``)."""
    import time

    handle, cfg = make_worker(world_size=8)
    clients = [MetricClient(None, rank=r, world_size=8, name=cfg.name) for r in range(8)]
    for r, c in enumerate(clients):
        c.submit_metric({"x": float(r)})
        c.flush()  # nobody reads the answer
    assert ray.get(handle.wait_final_res.remote(0, 30)) == {"x": 3.5}
    deadline = time.monotonic() + 30
    while any(c.in_flight for c in clients):  # read by the looker, within 2 s
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert [c.sender._thread for c in clients] == [None] * 8
    assert [t.name for t in threading.enumerate()].count("metricsvc-looker") == 1
    assert [a["status"] for c in clients for a in c.wait_acks(timeout_s=0)] == ["merged"] * 8


def test_a_process_forked_while_the_looker_runs_starts_a_looker_of_its_own(make_worker):
    """A child forked while the looker runs (a data loader's worker, say) has no such
    thread: had it kept the parent's word for it, its clients' unread answers would never
    be read, and a restarted actor's ``epoch_changed`` never acted on."""
    from metricsvc import transport

    handle, cfg = make_worker(world_size=1)
    c = MetricClient(None, rank=0, world_size=1, name=cfg.name)
    c.submit_metric({"x": 1.0})
    c.flush()  # its answer is left to the looker, started here
    assert transport._looker is not None and transport._looker.is_alive()
    pid = os.fork()
    if pid == 0:  # the child: no looker, and a lock no thread of the parent's holds
        os._exit(0 if transport._looker is None and transport._looker_lock.acquire(False)
                 else 1)
    assert os.waitpid(pid, 0)[1] == 0
    c.wait_acks(timeout_s=30)


def test_an_idle_sender_thread_holds_no_ray_reference_and_never_its_client(make_worker):
    """A Ray reference that a thread other than the one shutting Ray down frees while
    ``ray.shutdown()`` runs ends the process (Ray: "The core worker has already been
    shutdown ... The process will exit"; a test worker died so at its session's end). An
    idle sender thread holds none: not the last batch it delivered, and not its client,
    which is freed by whoever drops it, never later by the thread ending (30 s idle)."""
    import gc
    import sys
    import weakref

    c = with_idle_sender(make_worker)
    thread, sender = c.sender._thread, weakref.ref(c.sender)
    assert thread is not None and thread.is_alive()  # delivered step 2, idle now
    looker = next(t for t in threading.enumerate() if t.name == "metricsvc-looker")
    held = []  # the looker too, asleep between its looks
    for frame in (sys._current_frames()[thread.ident], sys._current_frames()[looker.ident]):
        while frame is not None:
            for value in frame.f_locals.values():
                for item in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(item, (ray.ObjectRef, ray.actor.ActorHandle, MetricClient,
                                         type(c.sender))):
                        held.append(f"{frame.f_code.co_name}: {type(item).__name__}")
            frame = frame.f_back
    assert held == []
    del c
    gc.collect()
    assert sender() is None and thread.is_alive()


def test_batches_handed_over_are_delivered_though_the_client_is_dropped_at_once(make_worker):
    """``flush()`` does not wait: a client dropped right after (a function's local that
    returns, say) still has every step it handed over delivered by its sender thread,
    which lets the client go once nothing is queued."""
    import gc

    handle, cfg = make_worker(world_size=1)
    c = MetricClient(None, rank=0, world_size=1, name=cfg.name)
    c.submit_metric({"x": 0.0})
    c.wait_submit()
    with Paused(handle):  # steps 2 and 3 wait in the sender thread's queue
        for step in (1, 2, 3):
            c.submit_metric({"x": float(step)})
            c.flush()
        del c
        gc.collect()
    assert ray.get(handle.wait_final_res.remote(3, 30)) == {"x": 3.0}


def two_ranks_past_step_0(make_worker):
    """A service of two ranks, and their clients, step 0 (x = 0.0) final and acked."""
    handle, cfg = make_worker(world_size=2)
    clients = [MetricClient(None, rank=r, world_size=2, name=cfg.name) for r in (0, 1)]
    for c in clients:
        c.submit_metric({"x": 0.0})
        c.flush()
    for c in clients:
        c.wait_acks(timeout_s=30)
    return handle, clients


def test_a_flush_a_restarted_actor_turned_away_is_delivered_though_the_rank_calls_no_more(
        make_worker):
    """The first flush after the actor restarted names the incarnation before: the new one
    merges nothing and answers ``epoch_changed``. That answer was read, and the batch
    resent, only at the rank's next call; a rank that made none (its client dropped, or a
    rank silent until its next step, an evaluation long) never delivered the step: "step 1
    not final after 30 s: no rank has submitted it yet" (the model of a run's history found
    it). The looker now reads an answer the caller has left unread for a while."""
    import gc

    handle, clients = two_ranks_past_step_0(make_worker)
    sigkill(handle)
    for r, c in enumerate(clients):
        c.submit_metric({"x": float(r)})
        c.flush()
    kept = clients[0]  # rank 0 keeps its client and calls no more; rank 1 drops its own
    del clients, c
    gc.collect()
    assert ray.get(handle.wait_final_res.remote(1, 30)) == {"x": 0.5}
    # the step is final once the resent batch is merged; its answer reaches the kept
    # client's thread a moment later (a wait on the answer, no call that reads one)
    assert kept.sender.wait_until(1, timeout_s=30) and kept.in_flight == 0


@pytest.mark.slow
def test_after_ray_shutdown_a_waiting_sender_neither_starts_ray_nor_ends_the_process(
        tmp_path, joined_env):
    """A driver shuts Ray down while a flush waits on a service that answers nothing: the
    client's sender thread touches Ray no more (Ray would start a new local cluster for
    it, or end the process: a test worker died so after its session's ray.shutdown()), and
    a later flush is refused in one line naming the shutdown."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import os, signal, time
        import ray
        import metricsvc
        from metricsvc.client import MetricClient
        from metricsvc.errors import ServiceUnavailable
        ray.init(log_to_driver=False)  # the session's cluster: only this driver shuts down
        w = metricsvc.start_metric_worker({{"name": "x", "world_size": 1,
            "sinks": {{"console": None}}, "run": {{"root": {str(tmp_path)!r}}}}})
        c = MetricClient(rank=0, world_size=1, name="x")
        c.scalar(loss=1.0)
        c.wait_submit(step=0)
        pid = ray.get(w.health.remote())["pid"]
        os.kill(pid, signal.SIGSTOP)  # it answers nothing: the sender thread waits
        for step in (1, 2):
            c.scalar(loss=2.0)
            c.flush(step=step)
        assert c.in_flight == 2
        ray.shutdown()
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        give_up = time.monotonic() + 60
        while c.in_flight and time.monotonic() < give_up:  # both answered, by the thread
            time.sleep(0.05)
        print("RAY", ray.is_initialized(), c.in_flight, flush=True)
        c.scalar(loss=3.0)
        try:
            c.wait_submit(step=3, timeout_s=10)
        except ServiceUnavailable as err:
            print("REFUSED", str(err).splitlines()[0], flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=180, cwd=tmp_path, env=joined_env())
    assert out.returncode == 0, out.stderr[-3000:]
    assert "RAY False 0" in out.stdout, out.stdout + out.stderr[-2000:]
    refused = next(line for line in out.stdout.splitlines() if line.startswith("REFUSED"))
    assert "ray.shutdown() was called" in refused


def test_a_refusal_nobody_reads_is_logged_once_its_client_is_dropped(make_worker):
    """A rank drops its client (a worker object replaced, say) after a flush the service
    refuses: the answer, read by the looker or not yet in, was raised to nobody and
    said nowhere (an answer nobody reads cannot raise). It is logged, naming the rank, the
    step and the refusal, as asyncio logs an exception no one retrieved: one dropped with the
    answer in at once, one dropped before it came when the looker reads it."""
    import gc

    handle, clients = two_ranks_past_step_0(make_worker)
    ray.get(handle.close.remote(), timeout=30)
    with Logged() as logged:
        for c in clients:
            c.submit_metric({"x": 2.0})
            c.flush()  # refused: the service is closed
        assert clients[0].sender.wait_until(1, timeout_s=30)  # its answer in, not read
        del clients[0], c
        gc.collect()
        said = logged.said
        assert len(said) == 1 and said[0].startswith("rank 0: the batch of step 1 was refused")
        logged.heard.clear()
        del clients[0]  # rank 1's, its answer not in yet
        gc.collect()
        assert logged.heard.wait(30), said
    assert [line.split(":")[0] for line in said] == ["rank 0", "rank 1"]
    for line in said:
        assert "the batch of step 1 was refused (ServiceClosed: " in line and line.endswith(
            "its client was dropped before reading it"), line


def test_a_notice_nobody_reads_is_logged_once_its_client_is_dropped(make_worker):
    """The same for a notice (a ``ServiceNotice`` its rank would be warned of): here, that
    TensorBoard's tag of two of its keys shows one of them. Dropped, the client's notice
    was said nowhere."""
    import gc

    handle, cfg = make_worker(world_size=1, sinks={"tensorboard": {}})
    c = MetricClient(None, rank=0, world_size=1, name=cfg.name)
    c.submit_metric({"acc rate": 1.0})  # the tag's key for the run
    c.wait_submit(step=0, timeout_s=30)
    with Logged() as logged:
        c.submit_metric({"acc_rate": 2.0})  # the tag shows the other: the rank hears it
        c.flush()
        assert c.sender.wait_until(1, timeout_s=30)  # its answer in, not read
        del c
        gc.collect()
    assert len(logged.said) == 1, logged.said
    said = logged.said[0]
    assert said.startswith("rank 0: the batch of step 1 came with a notice: ") and said.endswith(
        ", and its client was dropped before reading it"), said
    assert "'acc rate'" in said and "'acc_rate'" in said


def test_a_late_batch_nobody_reads_is_logged_once_its_client_is_dropped(make_worker):
    """The same for a batch that came after its step was published without it (the
    straggler timeout): its rank would hear ``LateBatch``; dropped, the log says it."""
    import gc

    handle, cfg = make_worker(world_size=2, straggler_timeout_s=0.3)
    early, late = (MetricClient(None, rank=r, world_size=2, name=cfg.name) for r in (0, 1))
    early.submit_metric({"x": 1.0})
    early.wait_submit(step=0, timeout_s=30)
    assert ray.get(handle.wait_final_res.remote(0, 30)) == {"x": 1.0}
    with Logged() as logged:
        late.submit_metric({"x": 2.0})
        late.flush()
        del late
        gc.collect()
        assert logged.heard.wait(30)
    assert logged.said == ["rank 1: the batch of step 0 was not merged: its step was published "
                           "without it, and its client was dropped before reading it"]
