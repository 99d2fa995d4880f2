"""The samples alerts named (``<run folder>/flagged_samples.jsonl``): one line per sample
with an id, written by the journal's writer before the step that names it, and read back as
the ids a resumed run can leave out (``flagged_samples``)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

FLAGGED_FILE = "flagged_samples.jsonl"


def flagged_lines(alerts: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One line per sample a step's alerts (``meta["alerts"]``) name with its id: step,
    key (the exported name whose min or max it is), rule, rank, id, value."""
    return [{"step": a["step"], "key": s["name"], "rule": a["rule"], "rank": s.get("rank"),
             "id": s["id"], "value": s.get("value")}
            for a in alerts for s in a.get("samples", ()) if "id" in s]


def read_flagged(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every line of the run folder's flagged samples, each once (a step written again
    after a restart writes its lines again), in the order written; none: empty."""
    path = Path(run_dir) / FLAGGED_FILE
    out, seen = [], set()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line a kill cut short
            continue
        mark = json.dumps(record, sort_keys=True)
        if mark not in seen:
            seen.add(mark)
            out.append(record)
    return out


def flagged_samples(run_dir: str | Path) -> list[Any]:
    """The ids of every sample an alert of the run named (each once, in the order first
    flagged): what a resumed run's data loader can leave out."""
    return list(dict.fromkeys(r["id"] for r in read_flagged(run_dir)))
