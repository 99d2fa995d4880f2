"""Read back what each real sink wrote, from its own files, as ``{step: {key: value}}``."""

from __future__ import annotations

import json
import struct
import zlib
from collections import defaultdict
from collections.abc import Iterator
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
    if not raw:
        return []  # created, then killed before the backend wrote its header: holds nothing
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


def _wandb_row(record) -> dict:
    """A history record as ``{key: value}``; wandb stores a logged dict (a histogram) as
    one item per field, ``nested_key = [key, field]``: they are put back together."""
    row: dict = {}
    for item in record.history.item:
        value = json.loads(item.value_json)
        if len(item.nested_key) > 1:
            row.setdefault(item.nested_key[0], {})[item.nested_key[-1]] = value
        else:
            row[item.nested_key[0] if item.nested_key else item.key] = value
    return row


def _wandb_records(root: Path):
    """Yield ``(path, kind, record)`` for every record of the one offline wandb run under
    ``root`` (all of its transaction logs: one per incarnation), in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    paths = sorted(root.rglob("run-*.wandb"))
    _one_run(paths, "wandb")
    for path in paths:
        for data in leveldb_log_records(path, b":W&B"):
            record = pb.Record()
            record.ParseFromString(data)
            yield path, record.WhichOneof("record_type"), record


def _wandb_rows(root: Path):
    """Yield ``(path, row)`` for every history record of the one offline wandb run."""
    for path, kind, record in _wandb_records(root):
        if kind == "history":
            yield path, _wandb_row(record)


def wandb_history(root: Path) -> dict[int, dict[str, float]]:
    """Return the scalar history rows of the one offline wandb run under ``root``; a step
    logged twice fails."""
    out: dict[int, dict[str, float]] = {}
    for path, row in _wandb_rows(root):
        step = int(row.pop("_step"))
        assert step not in out, f"wandb: step {step} logged twice ({path})"
        out[step] = {k: v for k, v in row.items() if not k.startswith("_")
                     and not isinstance(v, dict)}  # histograms: wandb_histograms
    return out


def wandb_histograms(root: Path) -> dict[int, dict[str, tuple[list, list]]]:
    """Return ``{step: {key: (edges, counts)}}`` of the ``wandb.Histogram`` values of the one
    offline wandb run under ``root``."""
    out: dict[int, dict[str, tuple[list, list]]] = defaultdict(dict)
    for _, row in _wandb_rows(root):
        for key, value in row.items():
            if isinstance(value, dict) and value.get("_type") == "histogram":
                out[int(row["_step"])][key] = (value["bins"], value["values"])
    return dict(out)


def wandb_tables(root: Path) -> dict[int, dict[str, tuple[list, list]]]:
    """Return ``{step: {key: (columns, rows)}}`` of the ``wandb.Table`` values of the one
    offline wandb run under ``root``, read from the table files its history names."""
    out: dict[int, dict[str, tuple[list, list]]] = defaultdict(dict)
    for path, row in _wandb_rows(root):
        for key, value in row.items():
            if isinstance(value, dict) and value.get("_type") == "table-file":
                table = json.loads((path.parent / "files" / value["path"]).read_text())
                step = int(row["_step"])
                assert key not in out[step], f"wandb: table {key} at {step} twice"
                out[step][key] = (table["columns"], table["data"])
    return dict(out)


def tensorboard_histograms(logdir: Path) -> dict[int, dict[str, tuple[list, list]]]:
    """Return ``{step: {tag: (edges, counts)}}`` of the histograms in ``logdir``'s event files
    (EventAccumulator; a bucket's lower edge is the previous limit, the first one's the min)."""
    acc = _tensorboard(logdir)
    out: dict[int, dict[str, tuple[list, list]]] = defaultdict(dict)
    for tag in acc.Tags()["histograms"]:
        for event in acc.Histograms(tag):
            h = event.histogram_value
            assert tag not in out[event.step], f"tensorboard: histogram {tag} at {event.step} twice"
            out[event.step][tag] = ([h.min, *h.bucket_limit], list(h.bucket))
    return dict(out)


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


def trackio_points(folder: Path, project: str, run: str) -> list[tuple[int, dict[str, float]]]:
    """Return every logged point of run ``run`` of the Trackio project in ``folder``, in
    order, read by Trackio's own reader (``SQLiteStorage.get_logs``) in a process of its
    own: Trackio takes its folder from ``TRACKIO_DIR`` once per process."""
    import subprocess
    import sys

    script = ("import json, os, sys\nos.environ['TRACKIO_DIR'] = sys.argv[1]\n"
              "from trackio.sqlite_storage import SQLiteStorage\n"
              "print(json.dumps(SQLiteStorage.get_logs(sys.argv[2], sys.argv[3]), default=str))")
    out = subprocess.run([sys.executable, "-c", script, str(folder), project, run],
                         capture_output=True, text=True, timeout=120, check=True)
    logs = json.loads(out.stdout.strip().splitlines()[-1])
    return [(int(log.pop("step")), {k: v for k, v in log.items() if k != "timestamp"})
            for log in logs]


def trackio_scalars(folder: Path, project: str, run: str) -> dict[int, dict[str, float]]:
    """``trackio_points`` by step; a step logged twice fails."""
    out: dict[int, dict[str, float]] = {}
    for step, values in trackio_points(folder, project, run):
        assert step not in out, f"trackio: step {step} logged twice"
        out[step] = values
    return out


def _swanlab_charts(root: Path) -> Iterator[tuple[int, str, dict]]:
    """``(step, key, chart)`` of every ECharts media record of the one SwanLab run under
    ``root``, the chart read from the JSON file the record names."""
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record

    for path in sorted(root.rglob("run-*.swanlab")):
        for data in leveldb_log_records(path, b":SWL"):
            record = Record()
            record.ParseFromString(data)
            if record.WhichOneof("record_type") != "media":
                continue
            (item,) = record.media.value.items
            chart = json.loads((path.parent / "media" / "echarts" / item.filename).read_text())
            yield int(record.media.step), record.media.key, chart


def swanlab_histograms(root: Path) -> dict[int, dict[str, tuple[list, list]]]:
    """Return ``{step: {key: (edges, counts)}}`` of the histogram charts of the one SwanLab
    run under ``root``: bar charts, each bar with its edges."""
    out: dict[int, dict[str, tuple[list, list]]] = defaultdict(dict)
    for step, key, chart in _swanlab_charts(root):
        if chart.get("_swanLab") == "table":
            continue  # a table (swanlab_tables)
        bars = chart["series"][0]["data"]
        assert key not in out[step], f"swanlab: chart {key} at step {step} logged twice"
        out[step][key] = ([bars[0]["lo"], *(b["hi"] for b in bars)], [b["value"] for b in bars])
    return dict(out)


def swanlab_tables(root: Path) -> dict[int, dict[str, dict]]:
    """Return ``{step: {key: {"columns", "rows"}}}`` of the ECharts tables of the one SwanLab
    run under ``root``."""
    out: dict[int, dict[str, dict]] = defaultdict(dict)
    for step, key, chart in _swanlab_charts(root):
        if chart.get("_swanLab") != "table":
            continue
        columns = [c["field"] for c in chart["colDefs"]]
        assert key not in out[step], f"swanlab: table {key} at step {step} logged twice"
        out[step][key] = {"columns": columns,
                          "rows": [[row[c] for c in columns] for row in chart["rowData"]]}
    return dict(out)


def _tensorboard(logdir: Path):
    """Return tensorboard's own reader of the event files in ``logdir``, loaded."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()  # 0: keep every event
    return acc


def tensorboard_texts(logdir: Path) -> dict[int, dict[str, str]]:
    """Return ``{step: {tag: text}}`` of the text panels in ``logdir``'s event files."""
    acc = _tensorboard(logdir)
    out: dict[int, dict[str, str]] = defaultdict(dict)
    for tag in acc.Tags()["tensors"]:
        for event in acc.Tensors(tag):
            name = tag.removesuffix("/text_summary")
            assert name not in out[event.step], f"tensorboard: text {tag} at {event.step} twice"
            out[event.step][name] = event.tensor_proto.string_val[0].decode()
    return dict(out)


def tensorboard_scalars(logdir: Path) -> dict[int, dict[str, float]]:
    """Return the scalars of the event files in ``logdir`` (tensorboard's EventAccumulator)."""
    acc = _tensorboard(logdir)
    out: dict[int, dict[str, float]] = defaultdict(dict)
    for tag in acc.Tags()["scalars"]:
        for event in acc.Scalars(tag):
            assert tag not in out[event.step], f"tensorboard: {tag} at {event.step} twice"
            out[event.step][tag] = event.value
    return dict(out)


def _mlflow_run(tracking_uri: str):
    """Return ``(client, run)``: the one run in the MLflow store at ``tracking_uri``."""
    import os

    import mlflow

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = mlflow.MlflowClient(tracking_uri=tracking_uri)
    (experiment,) = [e for e in client.search_experiments() if e.name != "Default"]
    (run,) = client.search_runs([experiment.experiment_id])
    return client, run


def mlflow_metrics(tracking_uri: str) -> dict[int, dict[str, float]]:
    """Return every metric of the one run in the MLflow store."""
    client, run = _mlflow_run(tracking_uri)
    out: dict[int, dict[str, float]] = defaultdict(dict)
    for key in run.data.metrics:
        for m in client.get_metric_history(run.info.run_id, key):
            assert m.key not in out[m.step], f"mlflow: {m.key} at step {m.step} twice"
            out[m.step][m.key] = m.value
    return dict(out)


def mlflow_tables(tracking_uri: str) -> dict[int, dict[str, dict]]:
    """Return ``{step: {table: {"columns", "data"}}}`` of the table artifacts of the one run
    in the MLflow store (``tables/<name>/step_<step>.json``; a name's ``/`` are folders),
    through MLflow's client."""
    client, run = _mlflow_run(tracking_uri)
    out: dict[int, dict[str, dict]] = defaultdict(dict)
    folders = ["tables"]
    while folders:
        for item in client.list_artifacts(run.info.run_id, folders.pop()):
            if item.is_dir:
                folders.append(item.path)
                continue
            local = client.download_artifacts(run.info.run_id, item.path)
            path = Path(item.path)
            name = path.parent.relative_to("tables").as_posix()
            out[int(path.stem.removeprefix("step_"))][name] = json.loads(Path(local).read_text())
    return dict(out)


def tensorboard_descriptions(logdir: Path) -> dict[str, str]:
    """Return each scalar tag's description (its summary metadata) in ``logdir``."""
    acc = _tensorboard(logdir)
    found = {tag: acc.summary_metadata.get(tag) for tag in acc.Tags()["scalars"]}
    return {tag: m.summary_description for tag, m in found.items()
            if m is not None and m.summary_description}


def wandb_config(root: Path) -> dict[str, object]:
    """Return the config of the one offline wandb run under ``root``, as its transaction
    logs hold it (every update, in order)."""
    out: dict[str, object] = {}
    for _, kind, record in _wandb_records(root):
        items = (record.config.update if kind == "config" else
                 record.run.config.update if kind == "run" else [])
        for item in items:
            out[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out


def mlflow_tags(tracking_uri: str) -> dict[str, str]:
    """Return the tags of the one run in the MLflow store."""
    return dict(_mlflow_run(tracking_uri)[1].data.tags)
