"""What each exported metric means: the help text and unit of its declaration.

A client sends what its declared names mean once (``RecordBuffer.describe``: a built-in
family's ``Metric`` entries, a ``Derived`` metric's ``help`` and ``unit``). The service
keeps them for the run, journals each with the step it arrived in (``meta["about"]``,
read back after a restart), and gives the sinks, with the first step that exports a
described name, what that name means (``meta["descriptions"]``): TensorBoard's summary
description, wandb's run config, MLflow's tags, and the journal itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from metricsvc.core.declare import key_pattern


class Descriptions:
    """The run's descriptions, by declared name or key pattern (``timing_s/<stage>``)."""

    def __init__(self) -> None:
        self.about: dict[str, tuple[str, str]] = {}
        self._patterns: list[str] = []  # the names with ``<...>`` segments
        # Exported names given to the sinks (never again) and descriptions journaled, each
        # with the step whose meta holds it: a rewind before that step gives it again
        self._shown: dict[str, int] = {}
        self._journaled: dict[str, int] = {}
        self._unjournaled: set[str] = set()
        self._unknown: set[str] = set()  # exported names no description covered (yet)

    def learn(self, about: Mapping[str, Any], step: int) -> dict[str, list[str]]:
        """Keep what ``about`` says; return the entries to journal with ``step``: the new
        ones, and those a rewind took out of the latest segment."""
        new = {name: [str(text[0]), str(text[1])] for name, text in about.items()
               if tuple(text) != self.about.get(name)}
        if new:
            for name, (help_, unit) in new.items():
                self.about[name] = (help_, unit)
            self._patterns = [n for n in self.about if "<" in n]
            self._unknown.clear()  # names without a description may have one now
        for name in self._unjournaled:
            new.setdefault(name, list(self.about[name]))
        self._unjournaled.clear()
        self._journaled.update(dict.fromkeys(new, step))
        return new

    def restore(self, meta: Mapping[str, Any], step: int) -> None:
        """Continue from journaled ``step``'s ``meta`` (after a restart)."""
        about = meta.get("about")
        if isinstance(about, dict):
            self.learn({k: v for k, v in about.items()
                        if isinstance(v, list) and len(v) == 2}, step)
        shown = meta.get("descriptions")
        if isinstance(shown, dict):
            self._shown.update(dict.fromkeys(shown, step))

    def forget_after(self, step: int) -> None:
        """A rewind to ``step``: what later steps journaled or showed is given again."""
        self._unjournaled.update(n for n, at in self._journaled.items() if at > step)
        self._journaled = {n: at for n, at in self._journaled.items() if at <= step}
        self._shown = {n: at for n, at in self._shown.items() if at <= step}

    def of(self, names: Iterable[str], step: int) -> dict[str, dict[str, str]]:
        """Return ``{name: {"help", "unit"}}`` for each of ``names`` not given to the sinks
        before that a description covers: the name itself, or the key it exports
        (``key/mean``)."""
        out = {}
        for name in names:
            if name in self._shown or name in self._unknown:
                continue
            text = self._find(name)
            if text is None and "/" in name:
                text = self._find(name.rsplit("/", 1)[0])  # key/mean, key/p90, ...
            if text is None:
                self._unknown.add(name)
            else:
                self._shown[name] = step
                out[name] = {"help": text[0], "unit": text[1]}
        return out

    def _find(self, key: str) -> tuple[str, str] | None:
        text = self.about.get(key)
        if text is None:
            for pattern in self._patterns:
                if key_pattern(pattern).match(key) is not None:
                    return self.about[pattern]
        return text
