"""A third-party sink, used by dotted path: every finished step also lands in a CSV file.

    python examples/custom_sink.py        (from the repository root; joins a running
                                           Ray cluster if there is one)

Packaged code would declare it as an entry point instead:
    [project.entry-points."metricsvc.sinks"]
    csv = "mypkg.sinks:CsvSink"
and configure `custom: [{target: csv}]`.
"""

from __future__ import annotations

import csv
from pathlib import Path


class CsvSink:
    """Rows of (step, key, value); the MetricWorker calls it on a thread of its own."""

    name = "csv"
    supports_nan = False  # the service drops NaN/inf before write()

    def __init__(self, options: dict) -> None:
        self.filename = options.get("filename", "metrics.csv")

    def open(self, run_dir: Path) -> None:
        self.fh = open(Path(run_dir) / self.filename, "a", newline="")
        self.out = csv.writer(self.fh)

    def write(self, step: int, metrics: dict, meta: dict) -> None:
        self.out.writerows((step, key, value) for key, value in sorted(metrics.items()))
        self.fh.flush()

    def close(self) -> None:
        self.fh.close()


def main() -> Path:
    import ray

    import metricsvc
    from metricsvc.client import MetricClient

    # Joins a running cluster if there is one. The actor imports the sink where it runs,
    # which on a running cluster is not this folder: the module travels with the job
    # (an installed package needs nothing).
    ray.init(include_dashboard=False, log_to_driver=False,
             runtime_env={"py_modules": [str(Path(__file__).resolve().parent)]})
    worker = metricsvc.start_metric_worker({
        "name": "custom_sink_demo",
        "run": {"root": "runs", "experiment": "custom_sink"},
        "sinks": {"console": None, "custom": [
            {"target": "examples.custom_sink:CsvSink", "options": {"filename": "steps.csv"}},
        ]},
    })
    client = MetricClient(worker, rank=0, world_size=1)
    for step in range(3):
        client.submit_metric({"loss": 1.0 / (step + 1), "tokens/total": 100 * (step + 1)})
        client.wait_submit()
    health = metricsvc.stop_metric_worker(worker)
    ray.shutdown()
    path = Path(health["run_dir"]) / "steps.csv"
    print(f"csv sink wrote {path}:")
    print(path.read_text(), end="")
    return path


if __name__ == "__main__":
    main()
