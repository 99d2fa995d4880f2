"""Where each min and max came from (``stat(ids=)`` -> ``meta["extremes"]``), against numpy's
``argmin`` / ``argmax`` on the ranks' data concatenated in rank order."""

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import ray
import torch

from metricsvc.client import MetricClient
from metricsvc.client.buffer import RecordBuffer
from metricsvc.client.device import _kernel_located
from metricsvc.client.tensors import accelerator_path_on_cpu
from metricsvc.core.records import COUNT, MAX, MIN
from metricsvc.core.records import unknown_sources as unknown
from metricsvc.core.reduce import ReduceType
from metricsvc.core.wire import Batch, decode, encode
from metricsvc.core.wire import check as check_batch
from metricsvc.errors import BatchRejected
from metricsvc.sinks.console import format_step
from tests.helpers import LocalService, located_of
from tests.synccount import HostTransferCounter

WORLD = 4
TOKEN_KEYS = ("actor/ppo_kl", "actor/entropy")


def _rank_calls(rank: int, rng: np.random.Generator) -> list[dict]:
    """One rank's recordings of a step: token-level values over two micro-batches (NaN,
    masks, ties), per-sequence values, a key only ranks 1 and 3 send, a numpy key."""
    calls = []
    first_id = 1000 * (rank + 1)
    for micro in range(2):
        b, t = 3 + rank + micro, 7 + 2 * rank  # unequal batches, and shapes per rank
        mask = rng.random((b, t)) < 0.7
        ids = np.arange(first_id, first_id + b)
        first_id += b
        values = {}
        for j, key in enumerate(TOKEN_KEYS):
            # Rounded to halves: ties within a call, across calls and across ranks.
            v = np.round(rng.normal(size=(b, t)) * 2) / 2 * (10.0 ** (6 * j))
            v[rng.random((b, t)) < 0.05] = np.nan
            values[key] = torch.tensor(v, dtype=torch.float32 if j == 0 else torch.float64)
        calls.append({"values": values, "mask": torch.tensor(mask), "ids": torch.tensor(ids)})
        per_seq = rng.integers(0, 4, size=b).astype(np.float64)  # many ties
        calls.append({"values": {"response/score": torch.tensor(per_seq)}, "mask": None,
                      "ids": torch.tensor(ids)})
        if rank in (1, 3):
            rare = rng.normal(size=b) * 1e-9
            calls.append({"values": {"actor/rare": torch.tensor(rare)}, "mask": None,
                          "ids": torch.tensor(ids), "reduce": ReduceType.MAX})
        lengths = rng.integers(10, 20, size=b)  # numpy values, numpy ids
        calls.append({"values": {"response/length": lengths}, "mask": None, "ids": ids,
                      "reduce": ReduceType.MIN})
    return calls


def _record(client, calls):
    for call in calls:
        client.stat(mask=call["mask"], ids=call["ids"],
                    reduce=call.get("reduce", ReduceType.AVG_MIN_MAX), **call["values"])


def _expected(data: dict[int, list[dict]]) -> dict[str, dict]:
    """Every exported min and max, from numpy on the concatenated data (rank order, then
    each rank's calls, then row-major positions): the first occurrence wins a tie."""
    found: dict[str, list] = {}
    for rank in sorted(data):
        seen: dict[str, int] = {}
        for call in data[rank]:
            for key, v in call["values"].items():
                kind = call.get("reduce", ReduceType.AVG_MIN_MAX)
                v = np.asarray(v, dtype=np.float64)
                v2 = v.reshape(v.shape[0], -1)
                mask = (np.ones(v2.shape, bool) if call["mask"] is None
                        else np.asarray(call["mask"]).reshape(v2.shape))
                use = mask & np.isfinite(v2)
                rows, cols = np.nonzero(use)
                ids = np.asarray(call["ids"])
                n = seen.get(key, 0)
                seen[key] = n + 1
                entry = found.setdefault(key, [kind, [], []])
                entry[1].append(v2[use])
                entry[2].extend({"rank": rank, "id": int(ids[r]), "row": int(r),
                                 "col": int(c), "call": n} for r, c in zip(rows, cols))
    out, keys = {}, {}
    for key, (kind, values, where) in found.items():
        values = np.concatenate(values)
        sides = {ReduceType.AVG_MIN_MAX: ("min", "max"), ReduceType.MIN: ("min",),
                 ReduceType.MAX: ("max",)}[kind]
        for side in sides:
            name = key if kind != ReduceType.AVG_MIN_MAX else f"{key}/{side}"
            out[name] = where[int(values.argmin() if side == "min" else values.argmax())]
            keys[name] = key
    return out, keys


def test_every_min_and_max_names_the_rank_and_sample_numpy_finds_in_both_arrival_orders(
        make_worker):
    handle, cfg = make_worker()
    rng = np.random.default_rng(41)
    data = {r: _rank_calls(r, rng) for r in range(WORLD)}
    expected, key_of = _expected(data)
    clients = [MetricClient(None, rank=r, world_size=WORLD, name=cfg.name) for r in range(WORLD)]
    for order in (range(WORLD), reversed(range(WORLD))):  # steps 0 and 1: the same data
        order = list(order)
        for r in order:
            _record(clients[r], data[r])
            # A plain siiRL key reduced as a max: its rank is named (the ranks tie: rank 0)
            clients[r].submit_metric({"perf/max_memory_allocated_gb": 7.0 if r % 2 else 8.0})
        for r in order:  # one at a time: batches arrive in exactly this order
            clients[r].wait_submit(timeout_s=60)
    for step in (0, 1):
        res = ray.get(handle.wait_final.remote(step=step, timeout_s=60))
        extremes = res["meta"]["extremes"]
        assert {k: extremes[k] for k in expected} == expected
        assert extremes["perf/max_memory_allocated_gb"] == {"rank": 0}
        for name, where in expected.items():  # and each names the exported value
            assert res["metrics"][name] == _value_at(data, key_of[name], where)
    ray.get(handle.close.remote())
    path = Path(cfg.run.root) / cfg.run.experiment / cfg.run.trial / "metrics.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0]["meta"]["extremes"] == lines[1]["meta"]["extremes"] == extremes
    # What a user reads: the console's table and ``metricsvc report --extremes``
    w = expected["actor/ppo_kl/max"]
    table = format_step(1, res["metrics"], res["meta"]).splitlines()
    row = next(line for line in table if line.startswith("actor/ppo_kl/max "))
    assert row.endswith(f"<- rank {w['rank']}, id {w['id']}")
    out = subprocess.run([sys.executable, "-m", "metricsvc.cli.main", "report", str(path),
                          "--keys", "actor/ppo_kl/*", "--extremes"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert (f"actor/ppo_kl/max   step 1: rank {w['rank']}, id {w['id']} (row {w['row']}, "
            f"col {w['col']}, call {w['call']})") in out.stdout


def _value_at(data, key, where):
    calls = [c for c in data[where["rank"]] if key in c["values"]]
    v = np.asarray(calls[where["call"]]["values"][key], dtype=np.float64)
    return float(v.reshape(v.shape[0], -1)[where["row"], where["col"]])


def test_without_ids_the_rank_is_named_and_a_kind_without_extremes_refuses_ids():
    service = LocalService()
    clients = service.clients(2)
    for r, c in enumerate(clients):
        c.stat(loss=torch.tensor([1.0, 5.0 - r, 2.0]))
        with pytest.raises(ValueError, match=r"ids=\) for key 'loss2'.*AVG exports neither"):
            c.stat(reduce="avg", ids=torch.arange(3), loss2=torch.ones(3))
        with pytest.raises(ValueError, match=r"ids for key 'loss3': 2 ids, one per row"):
            c.stat(ids=torch.arange(2), loss3=torch.ones(3))
        with pytest.raises(TypeError, match=r"ids for key 'loss4' must be numbers"):
            c.stat(ids=["a", "b", "c"], loss4=torch.ones(3))
    service.close(*clients)
    meta = service.final()["meta"]
    assert meta["extremes"]["loss/max"] == {"rank": 0}
    assert meta["extremes"]["loss/min"] == {"rank": 0}  # a tie (1.0 on both): rank 0


def test_sources_on_the_accelerator_path_match_the_host_and_read_nothing_back():
    g = torch.Generator().manual_seed(3)
    for shape in ((5, 9), (40, 300), (300,)):
        v = torch.round(torch.randn(*shape, generator=g) * 3)  # ties
        v[torch.rand(*shape, generator=g) < 0.05] = float("nan")
        mask = torch.rand(*shape, generator=g) < 0.6
        ids = torch.arange(100, 100 + shape[0])
        host_rows, host_src = located_of({"k": v}, mask, ids)
        with accelerator_path_on_cpu(), HostTransferCounter() as counter:
            dev_rows, dev_src = located_of({"k": v}, mask, ids)
        assert counter.calls == []
        np.testing.assert_array_equal(np.asarray(host_src["k"]), dev_src["k"].numpy())
        for field in (MIN, MAX, COUNT):  # the same values the sources point at
            assert host_rows["k"][field] == dev_rows["k"][field]
        rows, at = _kernel_located(v.reshape(1, -1), mask.reshape(1, -1))  # fused, eager
        flat = np.where(mask.numpy() & np.isfinite(v.numpy()), v.numpy(), np.inf).ravel()
        assert at.tolist()[0][0] == int(flat.argmin())
        assert rows[0][MIN] == flat.min()


def test_a_flush_with_sources_on_the_accelerator_path_is_still_one_host_copy():
    buf = RecordBuffer()
    g = torch.Generator().manual_seed(9)
    with accelerator_path_on_cpu(), HostTransferCounter() as counter:
        for micro in range(3):  # micro-batches merge their sources on the device
            buf.record({"kl": torch.randn(6, 40, generator=g)},
                       torch.rand(6, 40, generator=g) > 0.3 if micro else None,
                       ReduceType.AVG_MIN_MAX, torch.arange(6) + 10 * micro)
            buf.record({"len": torch.rand(6, generator=g)}, None, ReduceType.MAX,
                       torch.arange(6) + 10 * micro)
        recorded = counter.count
        batch = buf.take_batch(step=0, rank=0, world_size=1, seq=0, final=True)
    assert recorded == 0 and counter.count == 1 and buf.host_copies == 1, counter.calls
    assert batch.extreme_rows.tolist() == [0, 1] and not np.isnan(batch.extremes[:, :8]).any()
    assert np.isnan(batch.extremes[:, 8:]).all()  # no non-finite value: none located


def test_micro_batches_keep_the_first_extreme_and_count_calls_on_the_rank():
    buf = RecordBuffer()
    buf.record({"x": torch.tensor([3.0, 1.0])}, None, ReduceType.AVG_MIN_MAX)  # no ids
    buf.record({"x": torch.tensor([1.0, 9.0])}, None, ReduceType.AVG_MIN_MAX,
               torch.tensor([7, 8]))
    buf.record({"x": torch.tensor([9.0, 0.5])}, None, ReduceType.AVG_MIN_MAX,
               torch.tensor([5, 6]))
    batch = buf.take_batch(step=0, rank=0, world_size=1, seq=0, final=True)
    # min 0.5: call 2, row 1, id 6; max 9.0 first in call 1, row 1, id 8
    assert batch.extremes[:, :8].tolist() == [[6.0, 2.0, 1.0, 0.0, 8.0, 1.0, 1.0, 0.0]]
    back = check_batch(decode(encode(batch)))
    np.testing.assert_array_equal(back.extremes, batch.extremes)
    assert back.extreme_rows.tolist() == [0]


_NO_NONFINITE = [np.nan] * 5


@pytest.mark.parametrize("sources", [
    [1.0, 0.0, -1.0, 0.0, 1.0, 0.0, 0.0, 0.0, *_NO_NONFINITE],  # a negative row
    [1.0, 0.0, 0.5, 0.0, 1.0, 0.0, 0.0, 0.0, *_NO_NONFINITE],  # a fractional row
    [np.inf, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, *_NO_NONFINITE],  # an infinite id
    [1.0, np.nan, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, *_NO_NONFINITE],  # a position partly known
    [*[np.nan] * 8, 1.0, 0.0, 0.0, 2.5, np.nan],  # a fractional column of the first NaN
    [*[np.nan] * 8, 1.0, 0.0, 0.0, 2.0, 3.0],  # a first non-finite value that is finite
])
def test_a_malformed_source_is_refused_naming_the_key(sources):
    good = Batch.build(step=0, rank=0, world_size=1, seq=0, final=True, keys=("k",),
                       data=[[1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]], kinds=[1], expected=[0],
                       extremes={0: unknown(1)[0]})
    check_batch(good)
    bad = Batch.build(step=0, rank=0, world_size=1, seq=0, final=True, keys=("k",),
                      data=good.data, kinds=[1], expected=[0],
                      extremes={0: np.asarray(sources)})
    with pytest.raises(BatchRejected,
                       match=r"key 'k': where its min, max and first non-finite value came"):
        check_batch(bad)


def test_a_min_or_max_from_a_stream_names_the_stream(make_worker):
    handle, cfg = make_worker()
    ranks = [MetricClient(handle, rank=r, world_size=2) for r in range(2)]
    rec = ranks[0].stream("rollout", flush_every=10**9, flush_interval_s=1e9)
    rec.stat(ids=np.array([7, 8]), length=np.array([9.0, 0.5]))
    rec.flush()
    ranks[0].stat(ids=np.array([1, 2]), **{"rollout/length": np.array([1.0, 5.0])})
    ranks[0].wait_submit()
    ray.get(handle.export_stream.remote("rollout", 0))
    ranks[1].stat(**{"rollout/length": np.array([0.5, 3.0])})
    ranks[1].wait_submit()
    meta = ray.get(handle.wait_final.remote(0, 30))["meta"]
    assert meta["extremes"]["rollout/length/max"] == {"stream": "rollout"}
    # 0.5 ties between rank 1 and the stream: a rank comes before every stream
    assert meta["extremes"]["rollout/length/min"] == {"rank": 1}
    rec.close()


def test_a_call_number_counts_plain_recordings_merged_before_it():
    buf = RecordBuffer()
    for value in (3.0, 2.0):  # calls 0 and 1: plain numbers, merged as one matrix
        buf.record({"x": value, "y": 1.0}, None, ReduceType.AVG_MIN_MAX)
    buf.record({"x": torch.tensor([0.5, 9.0])}, None, ReduceType.AVG_MIN_MAX,
               torch.tensor([7, 8]))
    batch = buf.take_batch(step=0, rank=0, world_size=1, seq=0, final=True)
    x = list(batch.keys).index("x")
    assert batch.extreme_rows.tolist() == [x]
    # min 0.5 and max 9.0 both from the third recording (call 2), rows 0 and 1
    assert batch.extremes[:, :8].tolist() == [[7.0, 2.0, 0.0, 0.0, 8.0, 2.0, 1.0, 0.0]]


@pytest.mark.parametrize("accelerator", [False, True])
def test_a_later_recording_without_ids_that_wins_leaves_its_side_unknown_not_refused(
        accelerator):
    """A key recorded with ids, then again without (another micro-batch): where the later
    recording's max lies is not known, so that side says nothing of a position (the
    service names the rank), and the batch stays one the service takes."""
    buf = RecordBuffer()
    with accelerator_path_on_cpu() if accelerator else contextlib.nullcontext():
        buf.record({"x": torch.tensor([[3.0, 1.0], [2.0, 4.0]])}, None, ReduceType.AVG_MIN_MAX,
                   torch.tensor([70, 80]))
        buf.record({"x": torch.tensor([[9.0, 2.0]])}, None, ReduceType.AVG_MIN_MAX)  # no ids
        batch = buf.take_batch(step=0, rank=0, world_size=1, seq=0, final=True)
    src = batch.extremes.tolist()[0]
    assert src[:4] == [70.0, 0.0, 0.0, 1.0]  # min 1.0: call 0, row 0, col 1, id 70
    assert all(np.isnan(src[4:])), src  # max 9.0: from the recording without ids
    back = check_batch(decode(encode(batch)))  # what the service runs on every batch
    np.testing.assert_array_equal(back.extremes, batch.extremes)


def test_plain_lists_with_ids_name_their_samples_as_arrays_do():
    """Values given as nested lists (what a user types) are located as the same numpy
    array: the row and column of each min and max, and the sample's id."""
    kl = [[0.1, 0.2], [9.0, -3.0]]
    ids = [1002, 1003]
    _, as_lists = located_of({"kl": kl}, ids=ids)
    _, as_arrays = located_of({"kl": np.array(kl)}, ids=np.array(ids))
    np.testing.assert_array_equal(as_lists["kl"], as_arrays["kl"])
    from metricsvc.core.records import describe_source

    assert describe_source(as_lists["kl"], "max") == {"row": 1, "col": 0, "call": 0, "id": 1003}
    assert describe_source(as_lists["kl"], "min")["col"] == 1


def _nonfinite_calls(rank: int, rng: np.random.Generator) -> list[dict]:
    """One rank's two micro-batches of ``kl``: rare NaN, +inf and -inf (some masked out:
    they never count), unequal rows, float32 and float64 tensors and numpy, ids; and a
    call whose valid values are all NaN (a record with no value at all)."""
    calls = []
    for micro in range(2):
        b, t = 2 + rank + micro, 4 + rank
        v = rng.normal(size=(b, t)) * 10.0 ** rng.integers(-6, 7)
        for bad in (np.nan, np.inf, -np.inf):
            v[rng.random((b, t)) < 0.04] = bad
        value = (torch.tensor(v, dtype=torch.float32) if micro == 0
                 else torch.tensor(v) if rank % 2 else v)
        calls.append({"key": "kl", "value": value, "raw": v, "mask": rng.random((b, t)) < 0.6,
                      "ids": 100 * rank + 10 * micro + np.arange(b)})
    empty = np.full((2, 3), np.nan)
    calls.insert(1, {"key": "kl", "value": empty, "raw": empty,
                     "mask": rng.random((2, 3)) < 0.3, "ids": np.array([7, 8]) + 100 * rank})
    return calls


def _first_nonfinite_of(per_rank: list[list[dict]]) -> dict | None:
    """The first non-finite value at a valid position of the ranks' data concatenated in
    rank order, call order, row-major: numpy on the concatenation."""
    for rank, calls in enumerate(per_rank):
        for call, c in enumerate(calls):
            v = c["raw"].astype(np.float32) if c["value"].dtype == torch.float32 else c["raw"]
            bad = c["mask"] & ~np.isfinite(v)
            if bad.any():
                row, col = np.argwhere(bad)[0]
                x = v[row, col]
                return {"rank": rank, "row": int(row), "col": int(col), "call": call,
                        "id": int(c["ids"][row]),
                        "kind": "nan" if np.isnan(x) else "+inf" if x > 0 else "-inf"}
    return None


def test_the_first_nonfinite_value_of_a_step_names_its_rank_sample_position_and_kind(
        make_worker):
    """``meta["nonfinite_first"]`` equals the first non-finite value of the concatenated
    data over seeds (rank 2 on the accelerator path); a key recorded without ids names its
    rank; and it is journaled, on the console and in ``metricsvc report``."""
    world = 3
    handle, cfg = make_worker(world_size=world)
    clients = [MetricClient(None, rank=r, world_size=world, name=cfg.name) for r in range(world)]
    wanted = []
    for step, seed in enumerate((1, 2, 3, 4, 5, 6)):
        rng = np.random.default_rng(seed)
        per_rank = [_nonfinite_calls(r, rng) for r in range(world)]
        wanted.append(_first_nonfinite_of(per_rank))
        for rank, calls in enumerate(per_rank):
            with accelerator_path_on_cpu() if rank == 2 else contextlib.nullcontext():
                for c in calls:
                    clients[rank].stat(mask=c["mask"], ids=c["ids"], **{c["key"]: c["value"]})
            # no ids: the rank is known, not the sample
            clients[rank].stat(loss=torch.tensor([1.0, np.nan if rank else 2.0]))
            clients[rank].wait_submit(step=step, timeout_s=60)
    for step, want in enumerate(wanted):
        meta = ray.get(handle.wait_final.remote(step, 60))["meta"]
        first = meta["nonfinite_first"]
        assert first.get("kl") == want, (step, first)
        assert first["loss"] == {"rank": 1}
        assert set(first) == set(meta["nonfinite"])
    assert sum(w is not None for w in wanted) >= 4  # the seeds give origins to check
    health = ray.get(handle.close.remote(), timeout=120)
    path = Path(health["run_dir"]) / "metrics.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["meta"]["nonfinite_first"].get("kl") for line in lines] == wanted
    shown = format_step(0, lines[0]["metrics"], lines[0]["meta"])
    assert "first non-finite loss: at rank 1\n" in shown
    out = subprocess.run([sys.executable, "-m", "metricsvc", "report", str(path),
                          "--last", "6", "--nonfinite"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    step, w = next((s, w) for s, w in enumerate(wanted) if w)
    line = (f"step {step} kl: {w['kind']} at rank {w['rank']}, id {w['id']} (row {w['row']}, "
            f"col {w['col']}, call {w['call']})")
    assert line in out.stdout.splitlines()
    assert f"first non-finite {line.split(' ', 2)[2]}" in format_step(
        step, lines[step]["metrics"], lines[step]["meta"])


@pytest.mark.parametrize("accelerator", [False, True])
def test_a_step_keeps_the_first_nonfinite_call_and_position_on_the_rank(accelerator):
    """Across micro-batches the first call counting a non-finite value wins; within it, the
    first flat position; a key with no valid finite value still names it; one host copy."""
    buf = RecordBuffer()
    nan, inf = float("nan"), float("inf")
    with accelerator_path_on_cpu() if accelerator else contextlib.nullcontext(), \
            HostTransferCounter() as counter:
        buf.record({"x": torch.tensor([[3.0, 1.0], [2.0, 4.0]])}, None, ReduceType.AVG_MIN_MAX,
                   torch.tensor([70, 80]))
        buf.record({"x": torch.tensor([[nan, 2.0], [1.0, -inf]]),
                    "y": torch.tensor([[nan], [inf]])},
                   None,
                   ReduceType.AVG_MIN_MAX, torch.tensor([5, 6]))
        buf.record({"x": torch.tensor([[inf, 2.0]])}, None, ReduceType.AVG_MIN_MAX,
                   torch.tensor([9]))
        recorded = counter.count
        batch = buf.take_batch(step=0, rank=0, world_size=1, seq=0, final=True)
    if accelerator:
        assert recorded == 0 and counter.count == 1, counter.calls
    from metricsvc.core.records import describe_source

    src = dict(zip(np.asarray(batch.keys)[batch.extreme_rows], batch.extremes))
    assert describe_source(src["x"], "nonfinite") == {"row": 0, "col": 0, "call": 1,
                                                      "id": 5, "kind": "nan"}
    assert describe_source(src["y"], "nonfinite") == {"row": 0, "col": 0, "call": 0,
                                                      "id": 5, "kind": "nan"}
    np.testing.assert_array_equal(check_batch(decode(encode(batch))).extremes, batch.extremes)
