"""What a sink keeps in the run folder so that a restarted service continues it.

One small JSON file per sink, ``<run folder>/sinks/<name>.json``, replaced atomically:
the dispatcher keeps the sink's watermark there (``durable_through``: the newest step
the backend has made durable), and a sink may keep what it needs to continue the same
backend run (wandb's run id, MLflow's run id).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from metricsvc.files import write_atomic
from metricsvc.keys import safe_file_name


class SinkState:
    """The durable record of sink ``name`` in ``run_dir``; read and written by its thread."""

    def __init__(self, run_dir: Path, name: str) -> None:
        self.path = Path(run_dir) / "sinks" / f"{safe_file_name(name)}.json"

    def load(self) -> dict[str, Any]:
        """Return the record ({} when none was written or it cannot be read)."""
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def update(self, **values: Any) -> None:
        """Merge ``values`` into the record and replace the file whole."""
        data = {**self.load(), **values}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(self.path, json.dumps(data))
