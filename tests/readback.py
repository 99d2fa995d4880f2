"""Read back what each real sink wrote, from its own files, as ``{step: {key: value}}``."""

from __future__ import annotations

import json
import struct
import zlib
from collections import defaultdict
from pathlib import Path

_BLOCK = 32768
_HEADER = 7  # both the file header and each record header are 7 bytes
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def leveldb_log_records(path: Path, ident: bytes) -> list[bytes]:
    """Return the records of a LevelDB-log framed file (wandb ``.wandb``, SwanLab ``.swanlab``).

    Layout: a 7-byte file header (4-byte ident, 2-byte magic, 1-byte version),
    then 32 KiB blocks of records, each ``crc32 (4) | length (2) | type (1) | data``,
    with the CRC taken over the type byte and the data.
    """
    raw = path.read_bytes()
    assert raw[:4] == ident, f"{path} does not start with {ident!r}"
    pos, records, pending = _HEADER, [], b""
    while pos + _HEADER <= len(raw):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:
            pos += left  # block trailer padding
            continue
        crc, length, kind = struct.unpack("<IHB", raw[pos : pos + _HEADER])
        if length == 0 and kind == 0:
            pos += left  # zero padding up to the block end
            continue
        data = raw[pos + _HEADER : pos + _HEADER + length]
        if len(data) < length:
            break  # the file ends mid-record: where a killed writer stopped
        assert zlib.crc32(data, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == crc, "bad CRC"
        pos += _HEADER + length
        if kind == _FULL:
            records.append(data)
        elif kind == _FIRST:
            pending = data
        elif kind == _MIDDLE:
            pending += data
        elif kind == _LAST:
            records.append(pending + data)
    return records


def _one_run(paths: list[Path], what: str) -> None:
    """Every file must belong to one run: ``run-<id>.<ext>``, one id (one folder per
    incarnation is how offline wandb and SwanLab continue a run)."""
    ids = {p.name.split("-", 1)[1].rsplit(".", 1)[0] for p in paths}
    assert len(ids) == 1, f"{what}: expected one run, found ids {sorted(ids)} in {paths}"


def wandb_history(root: Path) -> dict[int, dict[str, float]]:
    """Return the history rows of the one offline wandb run under ``root`` (all of its
    transaction logs: one per incarnation); a step logged twice fails."""
    from wandb.proto import wandb_internal_pb2 as pb

    paths = sorted(root.rglob("run-*.wandb"))
    _one_run(paths, "wandb")
    out: dict[int, dict[str, float]] = {}
    for path in paths:
        for data in leveldb_log_records(path, b":W&B"):
            record = pb.Record()
            record.ParseFromString(data)
            if record.WhichOneof("record_type") != "history":
                continue
            row = {}
            for item in record.history.item:
                key = "/".join(item.nested_key) if item.nested_key else item.key
                row[key] = json.loads(item.value_json)
            step = int(row.pop("_step"))
            assert step not in out, f"wandb: step {step} logged twice ({path})"
            out[step] = {k: v for k, v in row.items() if not k.startswith("_")}
    return out


def swanlab_scalars(root: Path) -> dict[int, dict[str, float]]:
    """Return the scalars of the one SwanLab run under ``root`` (all of its folders); a
    (step, key) logged twice fails."""
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record

    paths = sorted(root.rglob("run-*.swanlab"))
    _one_run(paths, "swanlab")
    out: dict[int, dict[str, float]] = defaultdict(dict)
    for path in paths:
        for data in leveldb_log_records(path, b":SWL"):
            record = Record()
            record.ParseFromString(data)
            if record.WhichOneof("record_type") == "scalar":
                step, key = record.scalar.step, record.scalar.key
                assert key not in out[step], f"swanlab: {key} at step {step} logged twice"
                out[step][key] = record.scalar.value.number
    return dict(out)


def tensorboard_scalars(logdir: Path) -> dict[int, dict[str, float]]:
    """Return the scalars of the event files in ``logdir`` (tensorboard's EventAccumulator)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    out: dict[int, dict[str, float]] = defaultdict(dict)
    for tag in acc.Tags()["scalars"]:
        for event in acc.Scalars(tag):
            assert tag not in out[event.step], f"tensorboard: {tag} at {event.step} twice"
            out[event.step][tag] = event.value
    return dict(out)


def mlflow_metrics(tracking_uri: str) -> dict[int, dict[str, float]]:
    """Return every metric of the one run in the MLflow store."""
    import os

    import mlflow

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = mlflow.MlflowClient(tracking_uri=tracking_uri)
    (experiment,) = [e for e in client.search_experiments() if e.name != "Default"]
    (run,) = client.search_runs([experiment.experiment_id])
    out: dict[int, dict[str, float]] = defaultdict(dict)
    for key in run.data.metrics:
        for m in client.get_metric_history(run.info.run_id, key):
            assert m.key not in out[m.step], f"mlflow: {m.key} at step {m.step} twice"
            out[m.step][m.key] = m.value
    return dict(out)
