"""The samples behind a number (``stat(top=k)`` -> ``meta["top"]``): the k smallest and
largest samples of a step across every rank, against a sort of the ranks' data
concatenated in rank order, call order, row and column."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import ray
import torch

from metricsvc.client import MetricClient
from metricsvc.core.wire import decode, encode

WORLD = 3


def _calls(rank: int, rng: np.random.Generator) -> list[dict]:
    """One rank's recordings of a step: two micro-batches of token values (unequal rows,
    masks, NaN and inf, ties rounded to halves, float32 and float64 tensors and numpy),
    each row a sample with an id."""
    calls, first = [], 1000 * (rank + 1)
    for micro in range(2):
        rows, cols = 2 + rank + micro, 5 + rank
        v = np.round(rng.normal(size=(rows, cols)) * 2) / 2 * 10.0 ** (3 * micro - 1)
        v[rng.random((rows, cols)) < 0.05] = np.nan
        v[rng.random((rows, cols)) < 0.03] = np.inf
        mask = rng.random((rows, cols)) < 0.7
        ids = np.arange(first, first + rows)
        first += rows
        value = (torch.tensor(v, dtype=torch.float32) if (rank + micro) % 3 == 0 else
                 torch.tensor(v) if (rank + micro) % 3 == 1 else v)
        # each row's payload: a string, a dict of fields, or none (rank 2's second call)
        said = [f"rank {rank} call {micro} row {r} " + "é" * (r * 300) for r in range(rows)]
        text = (said if micro == 0 else None if rank == 2 else
                {"prompt": [f"p{r}" for r in range(rows)], "response": said})
        calls.append({"kl": value, "mask": mask, "ids": ids, "raw": v, "text": text})
    return calls


def _payload(text, row: int) -> tuple:
    """What a sample's payload is: its row's text cut to 1024 UTF-8 bytes (a 2-byte
    character the cut splits left out), and the bytes left out."""
    if text is None:
        return (None, None)
    fields = text if isinstance(text, dict) else {"": text}
    room, out, cut = 1024, {}, 0
    for name, strings in fields.items():
        raw = strings[row].encode()
        keep = raw[:room].decode(errors="ignore").encode()
        out[name], cut, room = keep.decode(), cut + len(raw) - len(keep), room - len(keep)
    return (out[""] if "" in out else out, cut or None)


def _expected(per_rank: list[list[dict]], k: int) -> dict[str, list[tuple]]:
    every = []
    for rank, calls in enumerate(per_rank):
        for call, c in enumerate(calls):
            v = np.asarray(torch.as_tensor(c["kl"]).double()) if torch.is_tensor(c["kl"]) \
                else c["raw"]
            for row, col in zip(*np.nonzero(c["mask"] & np.isfinite(v))):
                every.append((float(v[row, col]), rank, call, int(row), int(col),
                              int(c["ids"][row]), *_payload(c["text"], row)))
    largest = sorted(every, key=lambda s: (-s[0], s[1], s[2], s[3], s[4]))[:k]
    smallest = sorted(every, key=lambda s: (s[0], s[1], s[2], s[3], s[4]))[:k]
    return {"kl/max": largest, "kl/min": smallest}


@pytest.mark.parametrize("k, topology", [(1, "flat"), (4, "flat"), (64, "flat"),
                                         (4, "per_node")])
def test_top_k_equals_a_sort_of_the_concatenated_data_across_ranks_and_calls(make_worker, k,
                                                                             topology):
    """Through a node's combiner (``per_node``) as straight to the service."""
    import metricsvc

    handle, cfg = make_worker(world_size=WORLD, topology=topology)
    via = None
    if topology == "per_node":
        metricsvc.start_combiner(cfg, "top")
        via = "top"
    rng = np.random.default_rng(k)
    per_rank = [_calls(r, rng) for r in range(WORLD)]
    for rank, calls in enumerate(per_rank):
        c = MetricClient(None, rank=rank, world_size=WORLD, name=cfg.name, via=via)
        for call in calls:
            c.stat(mask=call["mask"], ids=call["ids"], top=k, kl=call["kl"], text=call["text"])
        c.wait_submit(step=0, timeout_s=30)
    got = ray.get(handle.wait_final.remote(0, 30))
    for name, want in _expected(per_rank, k).items():
        shown = [(s["value"], s["rank"], s["call"], s["row"], s["col"], s["id"], s.get("text"),
                  s.get("text_cut")) for s in got["meta"]["top"][name]]
        assert shown == want, name
        assert shown[0][0] == got["metrics"][name]  # the first is the min or max itself
        table = got["meta"]["tables"][f"top/{name}"]
        assert [row[0] for row in table["rows"]] == [s[0] for s in shown]
        assert any(s[7] for s in shown) or k < 64  # k = 64 keeps a cut payload


def test_a_step_of_top_samples_crosses_the_wire_whole_and_a_bad_one_is_refused():
    c = MetricClient(None, rank=0, world_size=1)
    c.stat(top=2, kl=torch.tensor([[3.0, 1.0], [2.0, 5.0]]))
    batch = c.buffer.take_batch(step=0, rank=0, world_size=1, seq=1, final=True)
    back = decode(encode(batch))
    np.testing.assert_array_equal(back.top, batch.top)
    assert back.top[:, 1].tolist() == [1.0, 2.0, 5.0, 3.0]  # smallest two, largest two


@pytest.mark.parametrize("top, said", [(0, "from 1 to 64"), (65, "from 1 to 64"),
                                       ("3", "an int"), (2.0, "an int")])
def test_a_bad_top_is_refused_in_one_line_naming_the_key(top, said):
    c = MetricClient(None, rank=0, world_size=1)
    with pytest.raises(ValueError, match=said) as err:
        c.stat(top=top, kl=np.ones(3))
    assert "'kl'" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="exports neither"):
        c.stat(top=3, reduce="sum", kl=np.ones(3))
    assert not c.buffer.tops and not c.buffer.kinds


def test_the_top_samples_reach_wandb_as_a_table_name_an_alert_and_survive_a_kill(make_worker):
    """The k largest kl of two ranks: an alert on kl/max names all k (flagged for a
    resumed run), a SIGKILL's next incarnation reads the step's top back from the journal,
    and wandb holds them as one table a step."""
    from pathlib import Path

    import metricsvc
    from tests import readback
    from tests.helpers import sigkill

    handle, cfg = make_worker(world_size=2, alerts=[{"key": "kl/max", "above": 5.0}],
                              sinks={"jsonl": {}, "wandb": {"mode": "offline"},
                                     "tensorboard": {},
                                     "delivery": {"close_timeout_s": 150}})
    for rank in range(2):
        c = MetricClient(None, rank=rank, world_size=2, name=cfg.name)
        kl = torch.full((3, 4), 0.5)
        kl[1, 2] = 9.0 if rank else 7.0
        kl[2, 3] = float("-inf") if rank else 0.5  # where a non-finite value came from
        c.stat(ids=torch.arange(10 * rank, 10 * rank + 3), top=3, kl=kl,
               text=[f"answer {rank}.{row} | x" for row in range(3)])
        c.wait_submit(step=0, timeout_s=30)
    first = ray.get(handle.wait_final.remote(0, 60))["meta"]
    want = [(9.0, 1, 11, "answer 1.1 | x"), (7.0, 0, 1, "answer 0.1 | x"),
            (0.5, 0, 0, "answer 0.0 | x")]
    assert [(s["value"], s["rank"], s["id"], s["text"]) for s in first["top"]["kl/max"]] == want
    (alert,) = first["alerts"]
    assert [(s["id"], s["text"]) for s in alert["samples"]] == [(w[2], w[3]) for w in want]
    assert ray.get(handle.flush.remote(120), timeout=150)  # journaled: the ranks forget it
    assert first["nonfinite_first"] == {"kl": {"rank": 1, "row": 2, "col": 3, "call": 0,
                                               "kind": "-inf", "id": 12}}
    sigkill(handle)
    again = ray.get(handle.wait_final.remote(0, 60))["meta"]
    assert again["top"] == first["top"]
    assert again["nonfinite_first"] == first["nonfinite_first"]
    health = ray.get(handle.close.remote(), timeout=200)
    run = Path(health["run_dir"])
    assert metricsvc.flagged_samples(run) == [11, 1, 0]
    columns, rows = readback.wandb_tables(run)[0]["top/kl/max"]
    assert columns[:3] == ["value", "rank", "id"] and columns[-1] == "text"
    assert [(*r[:3], r[-1]) for r in rows] == want
    panel = readback.tensorboard_texts(run / "tensorboard")[0]["top/kl/max"]
    assert "| 9 | 1 | 11 | 1 | 2 | 0 | answer 1.1 \\| x |" in panel.splitlines(), panel


def test_the_console_and_report_show_the_top_samples(tmp_path):
    import subprocess
    import sys

    from metricsvc.sinks.console import format_step
    from metricsvc.sinks.jsonl import JsonlSink

    meta = {"top": {"kl/max": [{"value": 9.0, "rank": 1, "id": 11, "row": 1, "col": 2,
                                "call": 0, "text": {"prompt": "2+2?", "response": "5\nno"}},
                               {"value": 7.0, "rank": 0, "row": 1, "col": 2, "call": 0,
                                "text": "y" * 150}]}}
    assert "top kl/max: 9 (rank 1, id 11); 7 (rank 0)" in format_step(0, {"kl/max": 9.0}, meta)
    sink = JsonlSink()
    sink.open(tmp_path)
    sink.write(0, {"kl/max": 9.0, "loss": 1.0}, meta)
    sink.close()
    out = subprocess.run([sys.executable, "-m", "metricsvc", "report", str(tmp_path), "--top",
                          "--keys", "kl/*"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "step 0 kl/max: 9 (rank 1, id 11); 7 (rank 0)" in out.stdout
    # each sample's payload on a line of its own, cut at 100 characters
    assert '    9: {"prompt": "2+2?", "response": "5\\nno"}\n' in out.stdout
    assert f"    7: {'y' * 100}…\n" in out.stdout


def test_the_accelerator_path_finds_the_same_samples_and_reads_nothing_back_until_the_flush():
    """On the accelerator path (the CPU standing in for a device) the samples are found
    with a stable sort where the values are, read back with the step's one copy, and
    equal the host path's: ties to the lower position included."""
    from metricsvc.client.buffer import RecordBuffer
    from metricsvc.client.tensors import accelerator_path_on_cpu
    from metricsvc.core.reduce import ReduceType
    from tests.synccount import HostTransferCounter

    g = torch.Generator().manual_seed(5)
    calls = []
    for micro in range(3):
        v = torch.round(torch.randn(6, 40, generator=g) * 3)  # many ties
        v[torch.rand(6, 40, generator=g) < 0.05] = float("nan")
        calls.append((v, torch.rand(6, 40, generator=g) > 0.3, torch.arange(6) + 10 * micro))
    batches = []
    texts = [[f"sample {i}" for i in ids.tolist()] for _, _, ids in calls]
    for on_device in (False, True):
        buf = RecordBuffer()
        with (accelerator_path_on_cpu() if on_device else contextlib.nullcontext()), \
                HostTransferCounter() as counter:
            for (v, mask, ids), text in zip(calls, texts):
                buf.record({"kl": v}, mask, ReduceType.AVG_MIN_MAX, ids, top=5, text=text)
            recorded = counter.count
            batches.append(buf.take_batch(step=0, rank=0, world_size=1, seq=0, final=True))
        if on_device:
            assert recorded == 0 and counter.count == 1 and buf.host_copies == 1, counter.calls
    np.testing.assert_array_equal(batches[0].top, batches[1].top)
    assert len(batches[0].top) == 10
    assert batches[0].top_text == batches[1].top_text  # each winner's own row's text
    assert [t[0] for t in batches[1].top_text] == [f"sample {int(i)}"
                                                   for i in batches[1].top[:, 2]]


def test_a_rank_merges_its_calls_top_samples_whatever_k_each_call_asked_for():
    """Several calls of one key, each with its own k (the key keeps the largest; each call
    gives its own k best), next to a key of one call and one of a single value, against a
    sort of each call's k best: by side, best first, ties to the earlier call, row and
    column; taken twice, the second step keeps nothing of the first."""
    from metricsvc.core.records import Top

    rng = np.random.default_rng(3)
    c = MetricClient(None, rank=0, world_size=1)
    for step in range(2):
        want = {"kl": [], "loss": [], "one": []}
        for call, k in enumerate((2, 5, 3)):
            v = np.round(rng.normal(size=(4, 6)) * 2)  # ties
            mask = rng.random((4, 6)) < 0.8
            c.stat(mask=mask, ids=np.arange(4) + 10 * call, top=k, kl=v)
            rows, cols = np.nonzero(mask)
            got = [(float(v[r, q]), call, int(r), int(q)) for r, q in zip(rows, cols)]
            want["kl"] += _best_first(got, k)
        loss = rng.normal(size=7)
        c.stat(top=4, loss=loss, one=np.array([2.5]))
        for side, order in ((0, np.argsort(loss, kind="stable")),
                            (1, np.argsort(-loss, kind="stable"))):
            want["loss"] += [(side, float(loss[i]), 0, int(i), 0) for i in order[:4]]
            want["one"].append((side, 2.5, 0, 0, 0))
        batch = c.buffer.take_batch(step=step, rank=0, world_size=1, seq=step, final=True)
        keys = list(batch.keys)
        for key, samples in want.items():
            k = 5 if key == "kl" else 4
            expect = []
            for side in (0, 1):
                expect += sorted((x for x in samples if x[0] == side),
                                 key=lambda x: ((1 - 2 * side) * x[1], *x[2:]))[:k]
            got = batch.top[batch.top_rows == keys.index(key)]
            assert [(int(t[Top.SIDE]), t[Top.VALUE], int(t[Top.CALL]), int(t[Top.ROW]),
                     int(t[Top.COL])) for t in got] == expect, (step, key)
            assert set(got[:, Top.K]) == {k}


def test_large_values_of_a_call_are_searched_together_and_equal_a_sort():
    """Values of thousands of valid positions take the grouped search, all of a call at
    once: float32, float64 and int64 tensors under a mask, a ``Difference``, one tensor
    under two keys, a value with a NaN (searched alone), a numpy array, over two calls with
    other masks and ids, against a sort of each key's valid finite values in call, row,
    column order."""
    from metricsvc.client.tensors import Difference
    from metricsvc.core.records import Top

    rng = np.random.default_rng(11)
    c = MetricClient(None, rank=0, world_size=1)
    every: dict[str, list] = {}
    for call in range(2):
        rows, cols = 32 + 8 * call, 500 + 37 * call
        mask = torch.tensor(rng.random((rows, cols)) < 0.6)
        a = torch.tensor(np.round(rng.normal(size=(rows, cols)) * 1e3) / 1e3, dtype=torch.float32)
        b = torch.tensor(rng.normal(size=(rows, cols)) * 1e-30)
        n = torch.tensor(rng.integers(-10**6, 10**6, size=(rows, cols)))
        bad = torch.tensor(rng.normal(size=(rows, cols)))
        bad[3, 7] = float("nan")  # searched alone
        values = {"a": a, "b": b, "n": n, "a_again": a, "bad": bad,
                  "gap": Difference(a, b.to(torch.float32)), "arr": 2.0 * b.numpy()}
        ids = torch.arange(rows) + 1000 * call
        c.stat(mask=mask, ids=ids, top=8, **values)
        for key, v in values.items():
            x = (v.a.double() - v.b.double() if isinstance(v, Difference)
                 else torch.as_tensor(v)).double()
            r, q = np.nonzero((mask & torch.isfinite(x)).numpy())
            every.setdefault(key, []).extend(
                (float(x[i, j]), call, int(i), int(j), int(ids[i])) for i, j in zip(r, q))
    batch = c.buffer.take_batch(step=0, rank=0, world_size=1, seq=0, final=True)
    keys = list(batch.keys)
    for key, samples in every.items():
        want = _best_first(samples, 8)
        got = batch.top[batch.top_rows == keys.index(key)]
        assert [(int(t[Top.SIDE]), t[Top.VALUE], int(t[Top.CALL]), int(t[Top.ROW]),
                 int(t[Top.COL]), int(t[Top.ID])) for t in got] == want, key
        merged = batch.data[keys.index(key)]
        from metricsvc.core.records import MAX, MIN
        assert merged[MIN] == want[0][1] and merged[MAX] == want[8][1], key


def _best_first(samples: list[tuple], k: int) -> list[tuple]:
    """The ``k`` smallest, then the ``k`` largest of ``samples`` (tuples, the value first;
    ties to the lower rest of the tuple), each with its side (0, 1) in front."""
    return [(side, *s) for side, sign in ((0, 1.0), (1, -1.0))
            for s in sorted(samples, key=lambda s: (sign * s[0], *s[1:]))[:k]]


@pytest.mark.parametrize("text, said", [
    (["a", "b"], "pass top= too"),
    ("ab", "one string per row"),
    (["a", 3, "c"], r"text\[1\] is a int, not a string"),
    (["a", "b"], "2 strings, one per row, but the value has shape \\(3,\\)"),
    ({f"f{i}": ["a"] * 3 for i in range(17)}, "at most 16 fields"),
    ({"": ["a"] * 3}, "at most 16 fields"),
    ({"response": np.array(["a"] * 3)}, r"text\['response'\] for key 'kl': one string per row"),
])
def test_a_bad_text_is_refused_in_one_line_naming_the_key_and_nothing_is_kept(text, said):
    c = MetricClient(None, rank=0, world_size=1)
    top = None if said == "pass top= too" else 2
    with pytest.raises((TypeError, ValueError), match=said) as err:
        c.stat(top=top, text=text, kl=np.ones(3))
    assert "'kl'" in str(err.value) and "\n" not in str(err.value)
    assert not c.buffer.tops and not c.buffer.kinds


def test_the_service_refuses_a_payload_past_the_bound_or_of_another_shape():
    from metricsvc.core.wire import check
    from metricsvc.errors import BatchRejected

    c = MetricClient(None, rank=0, world_size=1)
    c.stat(top=1, text=["x" * 5000], kl=torch.tensor([[3.0, 1.0]]))
    batch = c.buffer.take_batch(step=0, rank=0, world_size=1, seq=1, final=True)
    assert [len(t[0]) for t in batch.top_text] == [1024, 1024]  # cut by the rank, marked
    assert [t[1] for t in batch.top_text] == [3976, 3976]
    check(decode(encode(batch)))
    from dataclasses import replace

    for bad in ([["x" * 1025, 0]] * 2, [["x", -1]] * 2, [["x", 0]], [[{"a": 3}, 0]] * 2,
                [[{"b" * 65: "x"}, 0]] * 2, [["\ud800", 0]] * 2):
        with pytest.raises(BatchRejected, match="payload") as err:
            check(replace(batch, top_text=tuple(bad)))  # as a hostile sender's bytes decode
        assert "\n" not in str(err.value)
    with pytest.raises(BatchRejected, match="payloads must be a tuple"):
        check(replace(batch, top_text=5))  # a hand-built batch object
    # more samples on a side than its k, or two k for one key: refused, naming the key
    more = np.concatenate([batch.top, batch.top[-1:]])
    with pytest.raises(BatchRejected, match=r"key 'kl': 2 top samples on one side for "
                                            r"k=\[1.0, 1.0\]"):
        check(replace(batch, top=more, top_rows=np.zeros(3, np.int32), top_text=()))
    mixed = batch.top.copy()
    mixed[1, 6] = 2.0  # the largest side says k=2, the smallest k=1: each side its own
    check(replace(batch, top=mixed, top_text=()))
    mixed = np.concatenate([batch.top, batch.top[-1:]])
    mixed[1, 6], mixed[2, 6] = 1.0, 2.0
    with pytest.raises(BatchRejected, match=r"2 top samples on one side for k=\[1.0, 2.0\]"):
        check(replace(batch, top=mixed, top_rows=np.zeros(3, np.int32), top_text=()))


def _sorted_top(x: np.ndarray, k: int) -> np.ndarray:
    """The ``[2, k, 3]`` top samples of flat ``x`` by a sort of its finite values."""
    finite = np.flatnonzero(np.isfinite(x)) if x.dtype.kind == "f" else np.arange(x.size)
    v = x[finite].astype(np.float64)
    want = np.full((2, k, 3), np.nan)
    for side, order in ((0, np.lexsort((finite, v))), (1, np.lexsort((finite, -v)))):
        at = finite[order][:k]
        want[side, : at.size, 0], want[side, : at.size, 1] = x[at], at
    return want


def _drawn(rng: np.random.Generator, n: int, kind: int, holes: bool) -> np.ndarray:
    x = (rng.normal(size=n) if kind == 0 else np.round(rng.normal(size=n) * 2) / 2
         if kind == 1 else rng.integers(0, 3, size=n) if kind == 2
         else np.full(n, 1.5, np.float32) if kind == 3
         else (rng.normal(size=n) * 1e30).astype(np.float32))
    if x.dtype.kind == "f" and holes:
        x[rng.random(n) < rng.choice([0.001, 0.3])] = rng.choice([np.nan, np.inf, -np.inf])
    return x


def test_the_host_search_equals_a_sort_of_every_finite_value():
    """``smallest_largest`` (a few values: every one a candidate; many: groups' min and
    max bound where the k lie), ``GroupSearch`` (several values' groups searched at once)
    and ``stacked_smallest_largest`` (rows of a few values at once) against a sort of the
    finite values, ties to the lower position: sizes on both
    sides of each threshold, k from 1 to 64, ties, constants, ints, float32 past 1e30, NaN
    and inf, a tail past the groups' last whole row with and without a winner in it."""
    from metricsvc.client.host import GroupSearch, smallest_largest, stacked_smallest_largest

    rng = np.random.default_rng(71)
    for trial in range(300):
        n = int(rng.choice([1, 3, 100, 4096, 4097, 8192, 30000, 300001]))
        k = int(rng.integers(1, 65))
        x = _drawn(rng, n, trial % 5, trial % 3 == 0)
        if trial % 7 == 1 and x.dtype.kind == "f" and n % 256:  # a winner in the tail
            x[-1] = x[np.isfinite(x)].max() + 1 if np.isfinite(x).any() else 1.0
        np.testing.assert_array_equal(smallest_largest(x, k), _sorted_top(x, k),
                                      err_msg=f"{trial}")
    for trial in range(100):  # several values searched together, each its own n and dtype
        k = int(rng.integers(1, 65))
        search, want = GroupSearch(k), {}
        for key in range(int(rng.integers(1, 7))):
            x = _drawn(rng, int(rng.choice([4096, 8192, 30000, 65536])), trial % 5,
                       trial % 4 == 0)
            if search.add(str(key), x) is not None:
                want[str(key)] = _sorted_top(x, k)
        got = search.found()
        assert got.keys() == want.keys()
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"{trial} {key}")
    for trial in range(200):
        n, rows = int(rng.choice([0, 1, 2, 7, 64, 256])), int(rng.integers(1, 9))
        k = int(rng.integers(1, 65))
        x = np.stack([_drawn(rng, n, trial % 5, trial % 2 == 0).astype(np.float64)
                      for _ in range(rows)])
        want = np.stack([_sorted_top(row, k) for row in x])
        np.testing.assert_array_equal(stacked_smallest_largest(x, k), want, err_msg=f"{trial}")


def test_a_stream_refuses_top_samples_in_one_line_and_keeps_nothing_of_the_call():
    """A stream's window names the stream, never samples: ``top=`` / ``text=`` there would
    be dropped unseen, so the call is refused before anything is kept."""
    c = MetricClient(None, rank=0, world_size=1)
    rec = c.stream("rollout", flush_every=10**9, flush_interval_s=1e9)
    for bad in ({"top": 2}, {"top": 2, "text": ["a", "b"]}, {"text": ["a", "b"]}):
        with pytest.raises(ValueError, match="stream 'rollout': .* keeps no samples") as err:
            rec.stat(ids=[1, 2], kl=np.array([0.5, 9.0]), **bad)
        assert "\n" not in str(err.value)
    assert len(rec.buffer) == 0
    rec.stat(ids=[1, 2], kl=np.array([0.5, 9.0]))  # without them: recorded
    assert len(rec.buffer) == 1
    rec.buffer.discard()  # no service here to send it to
